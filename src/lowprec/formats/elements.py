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
it to +0. Under NVFP4 the block's scale comes from its other elements (block amaxes ignore NaN, as in
Transformer Engine); under the MX rules a block holding a NaN gets the NaN scale byte (``formats/scales.py``).

FP6 E3M2 and E2M3 (OCP MX v1.0) work the same way (``MiniFloatFormat``, of which ``FP4Format`` is the
E2M1 case): no inf or NaN, codes one per ``uint8`` with the sign in bit 5, round to nearest even,
saturation at their largest magnitude (28 and 7.5): the OCP conversion clamps scaled values to the
element's largest normal, as torchao's casts do.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
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

    def cast(self, scaled: torch.Tensor, *, overwrite: bool = False) -> torch.Tensor:
        """Codes of ``scaled``; ``overwrite``: ``scaled`` is the caller's temporary, which the cast may overwrite
        (a fresh 16 MiB tensor costs a CPU more in page faults than the arithmetic on it)."""
        ...

    def decode(self, data: torch.Tensor) -> torch.Tensor:
        """The float32 values of stored ``data``: a new tensor, which the caller may scale in place."""
        ...

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

    def cast(self, scaled: torch.Tensor, *, overwrite: bool = False) -> torch.Tensor:
        """Round ``scaled`` (already multiplied by the scale) to this format, saturating at ``±max``;
        NaN becomes the positive NaN byte 0x7F (see the module docstring). ``overwrite``: clamp an fp32
        ``scaled`` in place (see ``ElementFormat.cast``)."""
        x = scaled.float()
        x = x.clamp_(-self.max, self.max) if overwrite else x.clamp(-self.max, self.max)
        return x.nan_to_num_(nan=math.nan).to(self.dtype)

    def decode(self, data: torch.Tensor) -> torch.Tensor:
        """The float32 values of FP8 ``data`` (as ``FP4Format.decode`` for E2M1 codes); on a CPU looked up in the
        table of every byte's ``.float()``, 3.5x faster than torch's conversion there, element by element."""
        if data.device.type != "cpu":
            return data.float()
        table = _fp8_values(data.dtype, data.device)
        return table.index_select(0, data.reshape(-1).view(torch.uint8).long()).reshape(data.shape)

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


@dataclass(frozen=True)
class MiniFloatFormat:
    """A floating-point element format of at most 7 bits with neither inf nor NaN (OCP MX v1.0's FP6 and
    FP4): ``exponent_bits`` and ``mantissa_bits`` below a sign bit, exponent bias ``2**(exponent_bits-1) - 1``,
    subnormals at exponent field 0, and every exponent field, the largest included, holding normal values.
    Values are stored as codes, one per ``uint8``: the bit pattern, sign in bit ``exponent_bits +
    mantissa_bits``. Casts round to nearest, ties to even, and saturate at ``±max`` (inf too); NaN gets
    code +0 and leaves marking the block to the caller (see the module docstring)."""

    name: str
    exponent_bits: int
    mantissa_bits: int

    def __post_init__(self) -> None:
        bits = (self.exponent_bits, self.mantissa_bits)
        integers = all(isinstance(b, int) and not isinstance(b, bool) for b in bits)
        if not integers or self.exponent_bits < 1 or self.mantissa_bits < 0:
            raise LowprecValueError(f"{self.name}: exponent_bits >= 1 and mantissa_bits >= 0 must be integers, got {bits}")
        if sum(bits) > 7:
            raise LowprecValueError(f"{self.name}: a sign, {bits[0]} exponent and {bits[1]} mantissa bits exceed a uint8 code")

    @functools.cached_property
    def magnitudes(self) -> tuple[float, ...]:
        """Every non-negative value, indexed by its code: the code of a positive value is its bit pattern."""
        bias = 2 ** (self.exponent_bits - 1) - 1
        steps = 2**self.mantissa_bits
        return tuple(
            math.ldexp(mantissa / steps if field == 0 else 1 + mantissa / steps, max(field, 1) - bias)
            for field in range(2**self.exponent_bits)
            for mantissa in range(steps)
        )

    @property
    def max(self) -> float:
        return self.magnitudes[-1]

    @property
    def sign_bit(self) -> int:
        return 1 << (self.exponent_bits + self.mantissa_bits)

    has_nan = False

    def cast(self, scaled: torch.Tensor, *, overwrite: bool = False) -> torch.Tensor:
        """Codes of ``scaled`` (already multiplied by its scale), rounded to nearest even, saturating
        (``overwrite``: see ``ElementFormat.cast``).

        Arithmetic on the fp32 bits, not a search of the grid (3.4x faster than ``bucketize``): within
        the binade ``E`` of a magnitude (subnormals in the first normal binade, ``e0``) the grid steps by
        ``2**(E - mantissa_bits)``, so ``k = round(m / step)`` (ties to even) counts steps, and the code is
        ``k + (E - e0) * 2**mantissa_bits``: a ``k`` that rounds up to the next binade lands on its first code.
        """
        return self._codes(scaled, torch.Tensor.round_, overwrite)

    def _codes(self, scaled: torch.Tensor, rounded: Callable[[torch.Tensor], torch.Tensor], overwrite: bool) -> torch.Tensor:
        """Codes of ``scaled`` with ``rounded`` (in place allowed) making a whole number of each exact count of steps.
        Two int32 tensors besides ``scaled``'s copy, each reused in place: on a CPU a new tensor costs more than an
        operation on one (page faults)."""
        bits = self.mantissa_bits
        x = scaled.float()
        x = x.nan_to_num_(nan=0.0) if overwrite else x.nan_to_num(nan=0.0)  # x is this cast's own: in place from here
        code = torch.bitwise_right_shift(x.view(torch.int32), 31 - self.exponent_bits - bits).bitwise_and_(self.sign_bit)
        first = 2 - 2 ** (self.exponent_bits - 1)  # the exponent of the first normal binade
        magnitude = x.abs_().clamp_(max=self.max)
        exponent = magnitude.clamp(min=2.0**first).view(torch.int32).bitwise_and_(0x7F800000)  # (E + 127) << 23
        step_inverse = exponent.neg_().add_((bits + 254) << 23)  # the bits of 2**(mantissa_bits - E)
        steps = rounded(magnitude.mul_(step_inverse.view(torch.float32)))  # exact until the rounding
        # the sign bit plus (E - e0) * 2**m, (E + 127) * 2**m read back from step_inverse: (m + 254) * 2**m - bits >> (23 - m)
        code.add_((bits + 127 - first) << bits).sub_(step_inverse.bitwise_right_shift_(23 - bits))
        return code.add_(step_inverse.copy_(steps)).to(torch.uint8)  # plus k, the steps (whole: a truncation is exact)

    def count_nonzero(self, data: torch.Tensor) -> torch.Tensor:
        """Zero is the code +0 or -0 (the sign bit alone): the bits below the sign."""
        return torch.count_nonzero(data & (self.sign_bit - 1))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """The float32 values of ``codes``, looked up in the table of every code's value (``index_select``:
        4x faster than indexing on a CPU; int64 indices, 20% faster there than int32)."""
        return _values(self.magnitudes, codes.device).index_select(0, codes.reshape(-1).long()).reshape(codes.shape)


E3M2 = MiniFloatFormat("FP6E3M2", 3, 2)
"""OCP MX v1.0 FP6 E3M2: magnitudes up to 28, smallest subnormal 0.0625."""
E2M3 = MiniFloatFormat("FP6E2M3", 2, 3)
"""OCP MX v1.0 FP6 E2M3: magnitudes up to 7.5, smallest subnormal 0.125."""


@dataclass(frozen=True)
class FP4Format(MiniFloatFormat):
    """The E2M1 grid (see the module docstring), the one mini-float cast that also rounds stochastically."""

    name: str = "FP4E2M1"
    exponent_bits: int = 2
    mantissa_bits: int = 1

    def cast(self, scaled: torch.Tensor, noise: torch.Tensor | None = None, *, overwrite: bool = False) -> torch.Tensor:
        """E2M1 codes of ``scaled`` (already multiplied by its scale): round to nearest even, or
        stochastically with ``noise`` (uniform in [0, 1), fp32 multiples of 2**-24 as ``noise.uniform`` and
        ``torch.rand`` draw, ``scaled``'s shape); ``overwrite``: see ``ElementFormat.cast``."""
        if noise is None:
            return super().cast(scaled, overwrite=overwrite)

        def stochastic(steps: torch.Tensor) -> torch.Tensor:
            """``floor(steps + noise)`` in fp32, exactly: the fraction and ``1 - noise`` (a multiple of 2**-24) are exact."""
            whole = steps.floor()
            threshold = 1 - noise
            return whole.add_(torch.ge(steps.sub_(whole), threshold, out=threshold))  # 1.0 or 0.0: a bool adds 5x slower

        return self._codes(scaled, stochastic, overwrite)


@functools.cache
def _fp8_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The float32 value of each byte of FP8 ``dtype`` on ``device``, by its own conversion (NaN bytes included)."""
    return torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8).view(dtype).float()


@functools.cache
def _values(magnitudes: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """The value of each code on ``device``: ``magnitudes``, then their negatives (-0.0 first)."""
    return torch.tensor(magnitudes + tuple(-m for m in magnitudes), dtype=torch.float32, device=device)


def decode_table(element: FP8Format | MiniFloatFormat, device: torch.device) -> torch.Tensor:
    """The fp32 value of every code of ``element`` on ``device``, indexed by code: what ``decode`` gathers from."""
    return _fp8_values(element.dtype, device) if isinstance(element, FP8Format) else _values(element.magnitudes, device)


E2M1 = FP4Format()
MAGNITUDES = E2M1.magnitudes  # 0, 0.5, 1, 1.5, 2, 3, 4, 6
SIGN_BIT = E2M1.sign_bit
MX_ELEMENTS: dict[str, FP8Format | MiniFloatFormat] = {"e4m3": E4M3, "e5m2": E5M2, "e3m2": E3M2, "e2m3": E2M3, "e2m1": E2M1}
"""The OCP MX element formats by the names recipes and configs give them."""
