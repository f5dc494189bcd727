"""What counts as a problem: the thresholds of ``diagnose`` and the ranges of the FP8 formats.

The defaults are documented here and in the README; every one can be overridden by an argument of
``diagnose`` or a flag of ``nvdlfw-inspect diagnose``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from nvdlfw_inspect.errors import is_int, is_number

#: log2(largest finite / smallest subnormal): how many binades a per-tensor scaled tensor may span
#: before its smallest values flush to zero (E4M3: 448 and 2**-9; E5M2: 57344 and 2**-16).
FORMAT_RANGE_BITS = {"FP8E4M3": math.log2(448.0) + 9, "FP8E5M2": math.log2(57344.0) + 16}
#: the recipe's format of the forward operands (activation, weight) and of the gradient
RECIPE_FORMATS = {"HYBRID": ("FP8E4M3", "FP8E5M2"), "E4M3": ("FP8E4M3", "FP8E4M3"), "E5M2": ("FP8E5M2", "FP8E5M2")}
FORWARD_OPERANDS = ("activation", "weight")


@dataclass(frozen=True)
class Thresholds:
    """When a statistic is a problem.

    ``underflow_pct``: % of the values, zeros included, that were non-zero and flush to zero (``underflows%``),
    default 1.
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
        if self.fp8_format not in RECIPE_FORMATS:
            raise ValueError(f"fp8_format must be one of {list(RECIPE_FORMATS)}, got {self.fp8_format!r}")

    def format_of(self, tensor: str) -> str | None:
        """The FP8 format the recipe casts ``tensor`` to; None for GEMM outputs, which stay in high precision."""
        forward, backward = RECIPE_FORMATS[self.fp8_format]
        return forward if tensor in FORWARD_OPERANDS else backward if tensor == "gradient" else None

    def range_limit(self, tensor: str) -> float | None:
        """The ``dynamic_range`` beyond which ``tensor`` is a problem: its format's range plus the margin."""
        fmt = self.format_of(tensor)
        return None if fmt is None else FORMAT_RANGE_BITS[fmt] + self.range_margin_bits

    def as_dict(self) -> dict[str, float | int | str]:
        return {field.name: getattr(self, field.name) for field in fields(self)}
