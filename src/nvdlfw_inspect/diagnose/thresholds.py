"""What counts as a problem: the thresholds of ``diagnose`` and the ranges of the FP8 formats.

The defaults are documented here and in the README; every one can be overridden by an argument of
``diagnose`` or a flag of ``nvdlfw-inspect diagnose``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from nvdlfw_inspect.errors import is_int, is_number

#: log2(largest finite / smallest subnormal): how many binades a per-tensor scaled tensor may span
#: before its smallest values flush to zero (E4M3: 448 and 2**-9; E5M2: 57344 and 2**-16).
FORMAT_RANGE_BITS = {"FP8E4M3": math.log2(448.0) + 9, "FP8E5M2": math.log2(57344.0) + 16}
#: the recipe's format of the forward operands (activation, weight) and of the gradient
RECIPE_FORMATS = {"HYBRID": ("FP8E4M3", "FP8E5M2"), "E4M3": ("FP8E4M3", "FP8E4M3"), "E5M2": ("FP8E5M2", "FP8E5M2")}
FORWARD_OPERANDS = ("activation", "weight")

# The underflow each format makes on well-behaved data, and the thresholds calibrated from it: measured by
# ``benchmarks/calibrate_formats.py`` (the quantizers training uses, on N(0, 1) and Student-t(3) activations,
# N(0, 0.02) weights, N(0, 1e-12) and Laplace gradients, 1024 x 1024 and 4096 x 256, 3 seeds), recorded in
# ``benchmarks/results/format-calibration-cpu-2026-11-27.md``. ``nvdlfw_inspect`` does not import ``lowprec``,
# so the numbers are kept here as data; ``tests/nvdlfw_inspect/diagnose/test_format_thresholds.py`` checks that
# the script still measures no more than they allow.
#: per format label, the largest underflows% (% of all the values) any well-behaved sample gave
CALIBRATED_UNDERFLOW_PCT = {
    "fp8_delayed_scaling": 0.058,
    "fp8_current_scaling": 0.058,
    "fp8_block_scaling": 0.003,
    "mxfp8": 0.002,
    "mxfp8_ocp": 0.002,
    "mxfp6_e3m2": 0.574,
    "mxfp6_e2m3": 4.436,
    "mxfp4": 16.931,
    "mxfp4_nvidia": 22.093,
    "nvfp4": 12.502,
}
#: the margin over the calibrated underflow that a format's threshold allows
CALIBRATION_MARGIN = 2.0
#: per format label whose elements flush values of well-behaved data to zero (its narrow range: MXFP6, MXFP4,
#: NVFP4), its underflows% threshold: ``CALIBRATION_MARGIN`` x its calibrated underflow, rounded up to 0.1. The
#: formats with FP8 elements flush (almost) nothing of well-behaved data: they keep ``Thresholds.underflow_pct``.
FORMAT_UNDERFLOW_PCT = {
    "mxfp6_e3m2": 1.2,
    "mxfp6_e2m3": 8.9,
    "mxfp4": 33.9,
    "mxfp4_nvidia": 44.2,
    "nvfp4": 25.1,
}


@dataclass(frozen=True)
class Thresholds:
    """When a statistic is a problem.

    ``underflow_pct``: % of the values, zeros included, that were non-zero and flush to zero (``underflows%``),
    default 1: the threshold of the formats with FP8 elements (per-tensor FP8, FP8 block scaling, MXFP8) and of
    the tensors whose routing records name no format. The narrow formats (MXFP6, MXFP4, NVFP4) flush part of
    well-behaved data to zero and have thresholds of their own, calibrated (``FORMAT_UNDERFLOW_PCT``).
    ``format_underflow_pct``: per format label, a threshold over its calibrated one, or over ``underflow_pct``
    for a format with FP8 elements (``{"nvfp4": 30}``).
    ``overflow_pct``: % of values saturated under delayed scaling (``overflows%``), default 0.1.
    ``persistence``: a value over its threshold is a problem when the median of the last ``tail`` of
    the iterations after warm-up is over it, or it is over it in at least this fraction of them
    (default 0.5). ``tail``: that last fraction of the run, default 0.25.
    ``warmup``: iterations at the start of the run whose values are transients (default 1: delayed
    scaling's first cast uses scale 1). ``scale_change``: a scale (``scale_inv_max``, else the amax
    ``cur_amax``) that changes by more than this factor between logged iterations, default 4.
    ``range_margin_bits``: bits a ``dynamic_range`` may exceed its format's range, default 0.
    ``peer_ratio``: the factor by which a tensor's magnitude may differ from the median of the same tensor
    in its peers (the layers whose names differ only in their indices: ``layers.3.mlp.fc1`` and
    ``layers.7.mlp.fc1``, or experts ``gemm_0``, ``gemm_5``) before it is an outlier, default 100.
    ``fp8_format``: the recipe's formats, ``HYBRID`` (E4M3 forward, E5M2 gradients; default), ``E4M3``
    or ``E5M2``.
    """

    underflow_pct: float = 1.0
    overflow_pct: float = 0.1
    persistence: float = 0.5
    tail: float = 0.25
    warmup: int = 1
    scale_change: float = 4.0
    range_margin_bits: float = 0.0
    peer_ratio: float = 100.0
    fp8_format: str = "HYBRID"
    format_underflow_pct: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def number(name: str) -> float:
            value = getattr(self, name)
            if not is_number(value) or not math.isfinite(value):
                raise ValueError(f"threshold {name} must be a finite number, got {value!r}")
            return value

        if not 0 <= number("underflow_pct") < 100 or not 0 <= number("overflow_pct") < 100:
            raise ValueError(
                f"underflow_pct and overflow_pct are percentages in [0, 100), got {self.underflow_pct}, {self.overflow_pct}"
            )
        for name in ("persistence", "tail"):
            if not 0 < number(name) <= 1:
                raise ValueError(f"threshold {name} is a fraction of the iterations in (0, 1], got {getattr(self, name)}")
        if not is_int(self.warmup) or self.warmup < 0:
            raise ValueError(f"threshold warmup is a number of iterations (an integer >= 0), got {self.warmup!r}")
        if number("scale_change") <= 1:
            raise ValueError(f"threshold scale_change is a factor greater than 1, got {self.scale_change}")
        if number("peer_ratio") <= 1:
            raise ValueError(f"threshold peer_ratio is a factor greater than 1, got {self.peer_ratio}")
        if number("range_margin_bits") < 0:
            raise ValueError(f"threshold range_margin_bits must be >= 0, got {self.range_margin_bits}")
        if not isinstance(self.format_underflow_pct, Mapping):
            raise ValueError(f"format_underflow_pct maps format labels to percentages, got {self.format_underflow_pct!r}")
        for label, pct in self.format_underflow_pct.items():
            if label not in CALIBRATED_UNDERFLOW_PCT:
                raise ValueError(f"format_underflow_pct: unknown format {label!r}; known: {', '.join(CALIBRATED_UNDERFLOW_PCT)}")
            if not is_number(pct) or not 0 <= pct < 100:
                raise ValueError(f"format_underflow_pct: the threshold of {label} is a percentage in [0, 100), got {pct!r}")
        object.__setattr__(self, "format_underflow_pct", dict(self.format_underflow_pct))
        if self.fp8_format not in RECIPE_FORMATS:
            raise ValueError(f"fp8_format must be one of {list(RECIPE_FORMATS)}, got {self.fp8_format!r}")

    def underflow_threshold(self, label: str | None) -> float:
        """The underflows% beyond which a tensor read in format ``label`` is a problem: the user's for that format
        (``format_underflow_pct``), else its calibrated one (``FORMAT_UNDERFLOW_PCT``), else ``underflow_pct`` (the
        formats with FP8 elements; None: high precision, or a format the records do not name)."""
        if label in self.format_underflow_pct:
            return self.format_underflow_pct[label]
        return FORMAT_UNDERFLOW_PCT.get(label, self.underflow_pct) if label is not None else self.underflow_pct

    def underflow_source(self, label: str | None) -> str:
        """Where ``underflow_threshold(label)`` comes from, in words."""
        if label in self.format_underflow_pct:
            return "given for the format (format_underflow_pct)"
        calibrated = CALIBRATED_UNDERFLOW_PCT.get(label) if label is not None else None
        if label in FORMAT_UNDERFLOW_PCT and calibrated is not None:
            return f"calibrated: well-behaved data gives up to {calibrated:.3g}%, x{CALIBRATION_MARGIN:g}"
        if calibrated is not None:
            return f"underflow_pct; well-behaved data gives up to {calibrated:.3g}%"
        return "underflow_pct"

    def format_of(self, tensor: str) -> str | None:
        """The FP8 format the recipe casts ``tensor`` to; None for GEMM outputs, which stay in high precision."""
        forward, backward = RECIPE_FORMATS[self.fp8_format]
        return forward if tensor in FORWARD_OPERANDS else backward if tensor == "gradient" else None

    def range_limit(self, tensor: str) -> float | None:
        """The ``dynamic_range`` beyond which ``tensor`` is a problem: its format's range plus the margin."""
        fmt = self.format_of(tensor)
        return None if fmt is None else FORMAT_RANGE_BITS[fmt] + self.range_margin_bits

    def __hash__(self) -> int:  # the mapping of format thresholds hashed as its sorted items
        values = self.as_dict()
        return hash(tuple((name, tuple(sorted(v.items())) if isinstance(v, dict) else v) for name, v in values.items()))

    def as_dict(self) -> dict[str, Any]:
        return {f.name: dict(v) if isinstance(v := getattr(self, f.name), Mapping) else v for f in fields(self)}
