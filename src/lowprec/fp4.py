"""FP4 E2M1, the element format of NVFP4: 1 sign bit, 2 exponent bits, 1 mantissa bit, no inf or NaN.

Its magnitudes are 0, 0.5, 1, 1.5, 2, 3, 4 and 6. There is no torch dtype to compute with, so values
are kept as 4-bit codes, one per ``uint8`` (bit 3 the sign, bits 0-2 the index of the magnitude in
``MAGNITUDES``): the code of a value is its bit pattern, as in a packed hardware tensor.

Casts saturate at ±6 and round to nearest, ties to even (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4), or,
given uniform noise in [0, 1), stochastically: up with probability equal to the distance from the
lower neighbour in units of the step, so the expected value is the input. NaN has no code; casts map
it to +0 and leave marking the block to the caller (NVFP4 gives such a block a NaN scale).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

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
