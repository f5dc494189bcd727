"""``nvdlfw-inspect plan``: the cheapest per-layer precision plan that still trains like BF16, searched from a
calibration run (``calibrate``), its damage predicted (``predict``) and the search itself in ``lowprec.plan.search``."""
