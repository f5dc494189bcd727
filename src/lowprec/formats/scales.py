"""How each block-scaled format turns the amaxes of its blocks into scales, as Transformer Engine's kernels do.

Every rule's ``scales(amax, has_nan)`` takes each block's amax and whether the block holds a NaN, and
returns ``BlockScales``: the scales as stored (their dequantized value multiplies the
stored elements), the multiplier that maps each block into the element format's range before the
cast, and, for NVFP4, the per-tensor decode scale. Block amaxes ignore NaN (the kernels' ``fmaxf``
does): a NaN element becomes the element format's NaN (NVFP4, whose elements have none, gets a NaN
block scale instead) while the rest of its block is scaled as usual.

- MX (OCP Microscaling v1.0: MXFP8, MXFP6, MXFP4; E8M0 scales), two rules by name:
  ``"nvidia"`` (Transformer Engine's MXFP8, the default for FP8 elements):
  ``e = ceil(log2(amax * fp32(1 / elem_max)))``; Transformer Engine rounds up (``cvt.rp`` to ue8m0),
  so no value saturates. In fp32's normal range it equals ``ceil(log2(amax / elem_max))`` (torchao's
  RCEIL). ``"ocp"`` (the specification's, the default for FP6 and FP4 elements):
  ``e = floor(log2(amax)) - emax_elem`` with ``emax_elem = floor(log2(elem_max))`` (8 for E4M3, 15
  for E5M2, 4 for E3M2, 2 for E2M3 and E2M1), which can push a block's largest value up to
  ``2**(emax_elem+1)`` and saturate it (torchao's FLOOR). Either way ``e`` is clamped to [-127, 127],
  stored as the byte ``e + 127``, and the block is multiplied by ``2**-e`` (exactly, also for
  ``e = -127``: 2**127). An amax of 0 gives byte 0 (scale 2**-127); an infinite one byte 254 (the
  clamped exponent of an infinite amax). A block holding a NaN gets the NaN scale byte 0xFF under the
  OCP rule, and under the NVIDIA rule when its elements have no NaN (FP6, FP4); with FP8 elements the
  NVIDIA rule keeps the scale of the other values and the NaN element, as Transformer Engine does.
- FP8 block scaling: ``scale = fp8_max / amax`` in fp32 (fp32 max if that overflows, 1 for an amax of
  0 or inf), truncated to a power of two unless ``power_2=False``; stored as ``1 / scale``.
- NVFP4 (two levels): ``S_enc = 448 * 6 / tensor_amax`` (fp32 max if that overflows, 1 for an amax
  of 0 or inf) and ``S_dec = 1 / S_enc``; each block's E4M3 scale is
  ``e4m3(block_amax * (S_enc * fp32(1/6)))`` (round to nearest even, saturating at 448) and its values
  are multiplied by ``1 / (scale * S_dec)`` (fp32 max if that overflows). A value is
  ``e2m1 * scale * S_dec``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowprec.errors import LowprecValueError
from lowprec.formats.elements import E2M1, E4M3, ElementFormat, FP8Format

FP32_MAX = torch.finfo(torch.float32).max
MX_BLOCK, FLOAT8_BLOCK, NVFP4_BLOCK = 32, 128, 16
"""Values per block along the GEMM's inner dimension: MXFP8, FP8 block scaling (1 x 128 or 128 x 128), NVFP4."""
E8M0_BIAS = 127


def scale_from_amax(amax: torch.Tensor, fmt: FP8Format, margin: int = 0, fallback: torch.Tensor | float = 1.0) -> torch.Tensor:
    """``fp8_max / amax / 2**margin`` in fp32, fp32 max if that overflows; ``fallback`` where amax is
    0 or not finite."""
    amax = amax.float()
    usable = torch.isfinite(amax) & (amax > 0)
    scale = fmt.max / torch.where(usable, amax, 1.0) / (2.0**margin)
    scale = torch.where(torch.isinf(scale), FP32_MAX, scale)
    return torch.where(usable, scale, fallback)


@dataclass
class BlockScales:
    """``stored``: one scale per block, in its storage dtype (``.float()`` is its value); ``multiplier``:
    fp32, what each block is multiplied by before the element cast; ``tensor_scale_inv``: NVFP4's
    per-tensor decode scale (a 0-dim fp32 tensor), None for the single-level formats."""

    stored: torch.Tensor
    multiplier: torch.Tensor
    tensor_scale_inv: torch.Tensor | None = None


def power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """``2**exponent`` in fp32, exact for every integer exponent in [-149, 127]."""
    return torch.ldexp(torch.ones_like(exponent, dtype=torch.float64), exponent.double()).float()


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(x))`` exactly, for positive finite x (``frexp``: x = m * 2**e with m in [0.5, 1))."""
    mantissa, exponent = torch.frexp(x)
    return torch.where(mantissa == 0.5, exponent - 1, exponent)


def floor_log2(x: torch.Tensor) -> torch.Tensor:
    """``floor(log2(x))`` exactly, for positive finite x."""
    return torch.frexp(x)[1] - 1


NVIDIA, OCP = "nvidia", "ocp"
MX_SCALE_RULES = (NVIDIA, OCP)
"""The E8M0 scale rules by name: Transformer Engine's (rounded up) and the OCP MX v1.0 specification's (floor)."""
E8M0_NAN = 0xFF


def default_mx_scale_rule(element: ElementFormat) -> str:
    """Transformer Engine's rule where it has the format (FP8 elements: MXFP8), else the specification's,
    the only definition of MXFP6 and MXFP4 scales."""
    return NVIDIA if isinstance(element, FP8Format) else OCP


@dataclass(frozen=True)
class MXScaleRule:
    """One E8M0 power of two per block (see the module docstring) under ``convention`` ``"nvidia"`` (rounded up,
    the default: Transformer Engine's MXFP8) or ``"ocp"`` (the specification's floor)."""

    element: ElementFormat
    convention: str = NVIDIA

    def __post_init__(self) -> None:
        if self.convention not in MX_SCALE_RULES:
            raise LowprecValueError(f"MX scale rule must be one of {list(MX_SCALE_RULES)}, got {self.convention!r}")

    def scales(self, amax: torch.Tensor, has_nan: torch.Tensor) -> BlockScales:
        amax = amax.float()
        if self.convention == NVIDIA:
            amax = amax * (1.0 / self.element.max)  # a Python float: multiplied as fp32(1 / element max)
        positive = amax > 0
        log2 = ceil_log2 if self.convention == NVIDIA else floor_log2
        exponent = torch.where(positive & amax.isfinite(), log2(torch.where(positive, amax, 1.0)), E8M0_BIAS)
        if self.convention == OCP:
            exponent = torch.where(amax.isfinite(), exponent - (math.frexp(self.element.max)[1] - 1), exponent)  # - emax_elem
        exponent = torch.where(positive, exponent, -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)
        stored = exponent + E8M0_BIAS
        if self.convention == OCP or not self.element.has_nan:  # the block's NaN is its scale's (see the module docstring)
            stored = torch.where(has_nan, E8M0_NAN, stored)
        return BlockScales(stored.to(torch.uint8).view(torch.float8_e8m0fnu), power_of_two(-exponent))


@dataclass(frozen=True)
class Float8BlockScaleRule:
    """FP8 block scaling: one fp32 scale per block, a power of two unless ``power_2`` is off."""

    element: FP8Format
    power_2: bool = True

    def scales(self, amax: torch.Tensor, has_nan: torch.Tensor) -> BlockScales:
        amax = amax.float()
        usable = (amax > 0) & amax.isfinite()
        # a tensor numerator: torch computes ``float / tensor`` as ``float * (1 / tensor)``, rounding twice
        scale = torch.full_like(amax, self.element.max) / torch.where(usable, amax, 1.0)
        scale = torch.where(scale.isinf(), FP32_MAX, scale)
        if self.power_2:
            scale = power_of_two(floor_log2(scale))
        scale = torch.where(usable, scale, 1.0)
        return BlockScales(scale.reciprocal(), scale)


class NVFP4ScaleRule:
    """NVFP4: an E4M3 scale per block under an fp32 per-tensor scale from the tensor's amax."""

    def scales(self, amax: torch.Tensor, has_nan: torch.Tensor) -> BlockScales:
        amax = amax.float()
        tensor_amax = amax.amax() if amax.numel() else torch.zeros((), device=amax.device)
        encode = (torch.full_like(tensor_amax, E4M3.max * E2M1.max) / tensor_amax).clamp(max=FP32_MAX)
        encode = torch.where((tensor_amax == 0) | (encode == 0), 1.0, encode)
        decode = encode.reciprocal()
        per_block = amax * (encode * (1.0 / E2M1.max))
        stored = E4M3.cast(torch.where(has_nan, float("nan"), per_block))  # saturates at 448; NaN: byte 0x7F
        multiplier = (stored.float() * decode).reciprocal().clamp(max=FP32_MAX)
        return BlockScales(stored, multiplier, decode)


ScaleRule = MXScaleRule | Float8BlockScaleRule | NVFP4ScaleRule
