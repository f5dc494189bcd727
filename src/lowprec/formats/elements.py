"""Element formats: the numbers a low-precision tensor stores, in plain torch.

Every format here has a ``name``, a largest finite magnitude ``max``, ``cast`` (round to nearest even,
saturating) and ``decode`` (the float32 values of stored elements): the ``ElementFormat`` protocol.

FP8 (E4M3, E5M2) have torch dtypes. ``torch``'s own ``.to(float8)`` does not saturate the same way everywhere (NaN on CUDA eager,
saturation on the CPU), so every cast here clamps to the format's range first.

Every NaN, whatever its sign or payload, becomes the canonical positive NaN byte 0x7F (E4M3
S.1111.111, E5M2 0.11111.11): NVIDIA GPUs return a positive canonical NaN from any fp32 multiply
with a NaN operand, so the sign of ``x * scale`` is already gone there (in torch's CUDA cast, the
fused Triton cast and Transformer Engine alike) while x86 keeps it; canonicalising makes every path
write the same byte.

FP4 E2M1 is the element format of NVFP4: 1 sign bit, 2 exponent bits, 1 mantissa bit, no inf or NaN.

Its magnitudes are 0, 0.5, 1, 1.5, 2, 3, 4 and 6. There is no torch dtype to compute with, so values
are kept as 4-bit codes, one per ``uint8`` (bit 3 the sign, bits 0-2 the index of the magnitude in
``MAGNITUDES``): the code of a value is its bit pattern, as in a packed hardware tensor.

Casts saturate at ±6 and round to nearest, ties to even (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4), or,
given uniform noise in [0, 1), stochastically: up with probability equal to the distance from the
lower neighbour in units of the step, so the expected value is the input. NaN has no code; casts map
it to +0; the block's scale comes from its other elements (block amaxes ignore NaN, as in Transformer Engine).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from lowprec.errors import LowprecValueError


class ElementFormat(Protocol):
    """What quantization and its statistics need of an element format (FP8, FP4 E2M1, ...). ``has_nan``: whether
    the format encodes NaN (without, a NaN input gets a zero code)."""

    name: str
    max: float
    has_nan: bool

    def cast(self, scaled: torch.Tensor) -> torch.Tensor: ...

    def decode(self, data: torch.Tensor) -> torch.Tensor: ...

    def count_nonzero(self, data: torch.Tensor) -> torch.Tensor:
        """How many stored elements are not a zero code (+0 or -0), as a 0-dim device tensor."""
        ...


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

    has_nan = True

    def count_nonzero(self, data: torch.Tensor) -> torch.Tensor:
        """Zero is the byte 0x00 or 0x80 (-0): the bits below the sign."""
        return torch.count_nonzero(data.view(torch.uint8) & 0x7F)

    def count_overflows(self, scaled: torch.Tensor) -> torch.Tensor:
        """How many elements of ``scaled`` lie beyond ``±max`` (and so saturate): a 0-dim device tensor."""
        return (scaled.float().abs() > self.max).sum()


E4M3 = FP8Format("FP8E4M3", torch.float8_e4m3fn, 448.0, -6, 3)
E5M2 = FP8Format("FP8E5M2", torch.float8_e5m2, 57344.0, -14, 2)

FP8_FORMATS = {fmt.name: fmt for fmt in (E4M3, E5M2)}


def fp8_format(name: str) -> FP8Format:
    """The format called ``name`` (``FP8E4M3`` or ``FP8E5M2``)."""
    try:
        return FP8_FORMATS[name]
    except KeyError:
        raise LowprecValueError(f"unknown FP8 format {name!r}; known: {sorted(FP8_FORMATS)}") from None


MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
VALUES = MAGNITUDES + tuple(-magnitude for magnitude in MAGNITUDES)  # indexed by code: bit 3 is the sign
SIGN_BIT = 8


@dataclass(frozen=True)
class FP4Format:
    """The E2M1 grid (see the module docstring): its name in messages and its largest magnitude."""

    name: str = "FP4E2M1"
    max: float = 6.0

    def cast(self, scaled: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        """E2M1 codes of ``scaled`` (already multiplied by its scale): round to nearest even, or
        stochastically with ``noise`` (uniform in [0, 1), ``scaled``'s shape)."""
        x = scaled.float()
        sign = SIGN_BIT * (x.signbit() & ~x.isnan()).to(torch.uint8)
        magnitude = x.abs().nan_to_num(nan=0.0)
        if noise is None:  # the code is the number of rounding boundaries below the magnitude
            return torch.bucketize(magnitude.contiguous(), _rounding_boundaries(x.device)).to(torch.uint8) + sign
        magnitude = magnitude.clamp(max=self.max)
        # binade 0 (below 2, subnormals included) has steps of 0.5, binade 1 ([2, 4)) of 1, binade 2 ([4, 6]) of 2
        binade = (magnitude >= 2).to(torch.uint8) + (magnitude >= 4).to(torch.uint8)
        units = magnitude / (torch.exp2(binade.float()) * 0.5)  # exact: a power-of-two division
        units = torch.floor(units.double() + noise.double()).float()  # float64: the sum is exact
        # a binade's first value has code 2 * binade (0, 2 or 4 steps into it: 0, 1.0 (2 half steps), ...)
        return units.to(torch.uint8) + 2 * binade + sign

    has_nan = False

    def count_nonzero(self, data: torch.Tensor) -> torch.Tensor:
        """Zero is the code 0 or 8 (-0): the bits below the sign."""
        return torch.count_nonzero(data & (SIGN_BIT - 1))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """The float32 values of E2M1 ``codes``, looked up in the 16-entry table of ``VALUES`` (one gather)."""
        return _values(codes.device)[codes.int()]


@functools.cache
def _rounding_boundaries(device: torch.device) -> torch.Tensor:
    """The 7 magnitudes at which round-to-nearest-even moves to the next code (``bucketize`` puts a value
    equal to a boundary below it). Each is the midpoint between neighbours, where the tie goes to the
    even code (mantissa bit 0): down from an even code, so the midpoint itself; up from an odd one, so
    the float just below the midpoint (0.75 -> 1.0, 1.75 -> 2.0, 3.5 -> 4.0)."""
    midpoints = torch.tensor([(a + b) / 2 for a, b in zip(MAGNITUDES, MAGNITUDES[1:], strict=False)])
    from_odd_code = torch.arange(len(midpoints)) % 2 == 1
    return torch.where(from_odd_code, torch.nextafter(midpoints, torch.zeros(())), midpoints).to(device)


@functools.cache
def _values(device: torch.device) -> torch.Tensor:
    """The value of each of the 16 codes on ``device``: ``MAGNITUDES``, then their negatives (-0.0 first)."""
    return torch.tensor(VALUES, dtype=torch.float32, device=device)


E2M1 = FP4Format()
