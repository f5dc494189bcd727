"""benchmarks/plan_search.py: its synthetic calibrations are what it says, and its table runs (small sizes here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import plan_search  # noqa: E402
import pytest  # noqa: E402

from lowprec.plan.search import GEMMS, search  # noqa: E402


def test_synthetic_calibrations_have_every_format_for_every_gemm():
    units = plan_search.synthetic(7, seed=3)
    assert len(units) == 7 * len(GEMMS)
    assert all([option.format for option in options] == list(plan_search.FORMATS) for options in units.values())
    assert sum(options[0].cost for options in units.values()) == pytest.approx(3.0)  # bf16 everywhere: 1 per GEMM direction
    assert all(options[0].damage == 0 for options in units.values())
    assert units == plan_search.synthetic(7, seed=3)  # deterministic
    result = search(units, budget=0.0)
    assert result.within_budget and set(result.formats()["layers.0"].values()) == {"bf16"}


def test_the_table_prints_a_row_per_size():
    table = subprocess.run(
        [sys.executable, str(BENCHMARKS / "plan_search.py"), "--layers", "3,20", "--repeats", "1"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert table[2].startswith("| layers | GEMMs |") and table[4].startswith("| 3 | 9 |") and table[5].startswith("| 20 | 60 |")
