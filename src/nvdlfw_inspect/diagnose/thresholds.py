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

# Per block (``per_block_stats``, at its default ``block_underflow_threshold`` of 50), measured by the same script on
# the same samples for the block formats, and recorded in the same file.
#: per block format label, the largest underflow_blocks% (blocks that flush more than half their non-zero values)
CALIBRATED_UNDERFLOW_BLOCKS_PCT = {
    "fp8_block_scaling": 0.0,
    "mxfp8": 0.0,
    "mxfp8_ocp": 0.0,
    "mxfp6_e3m2": 0.0,
    "mxfp6_e2m3": 0.043,
    "mxfp4": 1.697,
    "mxfp4_nvidia": 3.8,
    "nvfp4": 0.64,
}
#: the least underflow_blocks% threshold: fewer flushing blocks than this are no finding
BLOCK_UNDERFLOW_FLOOR = 1.0
#: per block format label, its underflow_blocks% threshold: ``CALIBRATION_MARGIN`` x the calibrated share, rounded up
#: to 0.1, at least ``BLOCK_UNDERFLOW_FLOOR``
FORMAT_UNDERFLOW_BLOCKS_PCT = {
    "fp8_block_scaling": 1.0,
    "mxfp8": 1.0,
    "mxfp8_ocp": 1.0,
    "mxfp6_e3m2": 1.0,
    "mxfp6_e2m3": 1.0,
    "mxfp4": 3.4,
    "mxfp4_nvidia": 7.6,
    "nvfp4": 1.3,
}
#: per block format label whose scales round down, the largest saturated_blocks% of well-behaved data: the OCP rule
#: rounds E8M0 scales down, so a block whose largest value's significand is past the element's saturates it; NVFP4's
#: E4M3 block scale rounds to nearest, down for about half the blocks. Under NVIDIA's rule and FP8 block scaling
#: only an infinite value saturates (a NaN or inf finding): no saturation check.
CALIBRATED_SATURATED_BLOCKS_PCT = {
    "mxfp8_ocp": 20.954,
    "mxfp6_e3m2": 20.954,
    "mxfp6_e2m3": 10.181,
    "mxfp4": 43.494,
    "nvfp4": 52.637,
}
#: their saturated_blocks% thresholds: where the blocks that do not saturate are ``CALIBRATION_MARGIN`` times fewer
#: than on well-behaved data (``100 - (100 - calibrated) / margin``, rounded up to 0.1; a multiple of a share near
#: half would pass 100%)
FORMAT_SATURATED_BLOCKS_PCT = {
    "mxfp8_ocp": 60.5,
    "mxfp6_e3m2": 60.5,
    "mxfp6_e2m3": 55.1,
    "mxfp4": 71.8,
    "nvfp4": 76.4,
}
#: per block format label, the largest worst_block_rel_err (the relative error of the worst block) of well-behaved data
CALIBRATED_WORST_BLOCK_ERR = {
    "fp8_block_scaling": 0.054,
    "mxfp8": 0.057,
    "mxfp8_ocp": 0.123,
    "mxfp6_e3m2": 0.123,
    "mxfp6_e2m3": 0.076,
    "mxfp4": 0.264,
    "mxfp4_nvidia": 0.28,
    "nvfp4": 0.36,
}
#: their worst_block_rel_err thresholds: ``CALIBRATION_MARGIN`` x the calibrated error, rounded up to 0.01
FORMAT_WORST_BLOCK_ERR = {
    "fp8_block_scaling": 0.11,
    "mxfp8": 0.12,
    "mxfp8_ocp": 0.25,
    "mxfp6_e3m2": 0.25,
    "mxfp6_e2m3": 0.16,
    "mxfp4": 0.53,
    "mxfp4_nvidia": 0.56,
    "nvfp4": 0.72,
}
#: per-block check -> (its statistic, its field of ``Thresholds``, the calibrated values, the thresholds)
BLOCK_CHECKS = {
    "underflow_blocks%": ("block_underflow_pct", CALIBRATED_UNDERFLOW_BLOCKS_PCT, FORMAT_UNDERFLOW_BLOCKS_PCT),
    "saturated_blocks%": ("block_saturation_pct", CALIBRATED_SATURATED_BLOCKS_PCT, FORMAT_SATURATED_BLOCKS_PCT),
    "worst_block_rel_err": ("worst_block_err", CALIBRATED_WORST_BLOCK_ERR, FORMAT_WORST_BLOCK_ERR),
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
    Per block of a block format (``per_block_stats``), each None by default: every format's calibrated threshold
    (``BLOCK_CHECKS``), else one for all the block formats: ``block_underflow_pct``, % of the blocks that flush
    more than the feature's ``block_underflow_threshold`` of their values (``underflow_blocks%``);
    ``block_saturation_pct``, % of the blocks with a saturated value (``saturated_blocks%``), checked only under the
    scale rules that round down (``FORMAT_SATURATED_BLOCKS_PCT``); ``worst_block_err``, the relative error of the
    worst block (``worst_block_rel_err``), a fraction.
    Growth over the run (``trends``), judged against a baseline: the median of the first ``trend_baseline`` logged
    values after warm-up (default 3). A statistic grows from the first later iteration that starts ``trend_steps``
    (default 3) consecutive logged values over ``factor`` x its baseline, if from there on it is over in at least
    ``persistence`` of the logged iterations. The factors: ``kurtosis_growth`` (``kurtosis``, default 3:
    at 2 an attention head that learns well under Adam was flagged, its key output's kurtosis doubling as it sharpens),
    ``outlier_growth`` (``outlier_channel_ratio``, default 2), ``scale_drift`` (the scale, ``scale_inv_max``, else the
    amax ``cur_amax``, default 8: three binades).
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
    block_underflow_pct: float | None = None
    block_saturation_pct: float | None = None
    worst_block_err: float | None = None
    trend_baseline: int = 3
    trend_steps: int = 3
    kurtosis_growth: float = 3.0
    outlier_growth: float = 2.0
    scale_drift: float = 8.0

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
        for name in ("peer_ratio", "kurtosis_growth", "outlier_growth", "scale_drift"):
            if number(name) <= 1:
                raise ValueError(f"threshold {name} is a factor greater than 1, got {getattr(self, name)}")
        for name in ("trend_baseline", "trend_steps"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(
                    f"threshold {name} is a number of logged iterations (an integer >= 1), got {getattr(self, name)!r}"
                )
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
        for name, bound in (("block_underflow_pct", 100), ("block_saturation_pct", 100), ("worst_block_err", math.inf)):
            value = getattr(self, name)
            if value is not None and (not is_number(value) or not 0 <= value < bound):
                allowed = "a percentage in [0, 100)" if bound == 100 else "a relative error >= 0"
                raise ValueError(f"threshold {name} must be {allowed} or None (each format's calibrated one), got {value!r}")
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

    def block_threshold(self, stat: str, label: str) -> float | None:
        """The threshold of per-block statistic ``stat`` (a key of ``BLOCK_CHECKS``) for block format ``label``: the
        user's for every block format, else the format's calibrated one; None where the check does not apply (a
        saturation under a rule that does not round down, a format not calibrated)."""
        name, _, table = BLOCK_CHECKS[stat]
        if label not in table:
            return None
        given = getattr(self, name)
        return table[label] if given is None else given

    def block_source(self, stat: str, label: str) -> str:
        """Where ``block_threshold(stat, label)`` comes from, in words."""
        name, measured, _ = BLOCK_CHECKS[stat]
        if getattr(self, name) is not None:
            return f"given ({name})"
        if stat == "saturated_blocks%":
            return (
                f"calibrated: well-behaved data saturates up to {measured[label]:.3g}% of the blocks under this rule; "
                f"over the threshold, {CALIBRATION_MARGIN:g} times fewer blocks stay unsaturated"
            )
        unit = "%" if stat.endswith("%") else ""
        return f"calibrated: well-behaved data gives up to {measured[label]:.3g}{unit}, x{CALIBRATION_MARGIN:g}"

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
