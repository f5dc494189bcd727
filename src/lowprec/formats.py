"""Low-precision number formats: their torch dtypes, largest finite values, and saturating casts.

``torch``'s own ``.to(float8)`` does not saturate the same way everywhere (NaN on CUDA eager,
saturation on the CPU), so every cast here clamps to the format's range first.

Every NaN, whatever its sign or payload, becomes the canonical positive NaN byte 0x7F (E4M3
S.1111.111, E5M2 0.11111.11): NVIDIA GPUs return a positive canonical NaN from any fp32 multiply
with a NaN operand, so the sign of ``x * scale`` is already gone there (in torch's CUDA cast, the
fused Triton cast and Transformer Engine alike) while x86 keeps it; canonicalising makes every path
write the same byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FP8Format:
    """One FP8 encoding: its name in configs, its torch dtype, its largest finite magnitude, the
    exponent of its smallest normal value and its mantissa bits."""

    name: str
    dtype: torch.dtype
    max: float
    min_normal_exp: int
    mantissa_bits: int

    @property
    def grid(self) -> tuple[float, int, int]:
        """``(max, min_normal_exp, mantissa_bits)``: the grid the statistics kernels round to."""
        return self.max, self.min_normal_exp, self.mantissa_bits

    def cast(self, scaled: torch.Tensor) -> torch.Tensor:
        """Round ``scaled`` (already multiplied by the scale) to this format, saturating at ``±max``;
        NaN becomes the positive NaN byte 0x7F (see the module docstring)."""
        return scaled.float().clamp(-self.max, self.max).nan_to_num_(nan=math.nan).to(self.dtype)

    def decode(self, data: torch.Tensor) -> torch.Tensor:
        """The float32 values of FP8 ``data`` (as ``FP4Format.decode`` for E2M1 codes)."""
        return data.float()

    def count_overflows(self, scaled: torch.Tensor) -> torch.Tensor:
        """How many elements of ``scaled`` lie beyond ``±max`` (and so saturate): a 0-dim device tensor."""
        return (scaled.float().abs() > self.max).sum()


E4M3 = FP8Format("FP8E4M3", torch.float8_e4m3fn, 448.0, -6, 3)
E5M2 = FP8Format("FP8E5M2", torch.float8_e5m2, 57344.0, -14, 2)

FP8_FORMATS = {fmt.name: fmt for fmt in (E4M3, E5M2)}
BY_DTYPE = {fmt.dtype: fmt for fmt in (E4M3, E5M2)}


def fp8_format(name: str) -> FP8Format:
    """The format called ``name`` (``FP8E4M3`` or ``FP8E5M2``)."""
    try:
        return FP8_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown FP8 format {name!r}; known: {sorted(FP8_FORMATS)}") from None
