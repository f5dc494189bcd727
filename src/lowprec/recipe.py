"""Scaling recipes: how a layer picks the scale that maps a tensor into an FP8 format's range."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from lowprec import formats
from lowprec.formats import FP8Format


class Format(Enum):
    """Which FP8 format the forward tensors (activations, weights) and the gradients use."""

    E4M3 = (formats.E4M3, formats.E4M3)
    E5M2 = (formats.E5M2, formats.E5M2)
    HYBRID = (formats.E4M3, formats.E5M2)

    @property
    def forward(self) -> FP8Format:
        return self.value[0]

    @property
    def backward(self) -> FP8Format:
        return self.value[1]


_AMAX_ALGOS = ("max", "most_recent")


@dataclass(frozen=True)
class DelayedScaling:
    """Scale from the amax of earlier casts: the largest of the last ``amax_history_len`` (``"max"``)
    or the latest one (``"most_recent"``). The first cast of a tensor uses scale 1.

    ``scale = fp8_max / amax / 2**margin``.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"

    def __post_init__(self) -> None:
        _check_format(self.fp8_format)
        _check_margin(self.margin)
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"DelayedScaling.amax_history_len must be a positive integer, got {self.amax_history_len!r}")
        if self.amax_compute_algo not in _AMAX_ALGOS:
            raise ValueError(
                f"DelayedScaling.amax_compute_algo must be one of {list(_AMAX_ALGOS)}, got {self.amax_compute_algo!r}"
            )


@dataclass(frozen=True)
class Float8CurrentScaling:
    """One scale per tensor from its own amax at the time of the cast: ``scale = fp8_max / amax``."""

    fp8_format: Format = Format.HYBRID

    def __post_init__(self) -> None:
        _check_format(self.fp8_format)


Recipe = DelayedScaling | Float8CurrentScaling


def _check_format(fmt: object) -> None:
    if not isinstance(fmt, Format):
        raise ValueError(f"fp8_format must be a lowprec.Format ({', '.join(f.name for f in Format)}), got {fmt!r}")


def _check_margin(margin: object) -> None:
    if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
        raise ValueError(f"margin must be a non-negative integer, got {margin!r}")
