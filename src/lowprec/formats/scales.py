"""How each block-scaled format turns the amaxes of its blocks into scales, as Transformer Engine's kernels do.

Every rule's ``scales(amax, input_dtype)`` takes each block's amax and the dtype of the tensor cast, and
returns ``BlockScales``: the scales as stored (their dequantized value multiplies the
stored elements), the multiplier that maps each block into the element format's range before the
cast, and, for NVFP4, the per-tensor decode scale. Block amaxes ignore NaN (the kernels' ``fmaxf``
does): a NaN element becomes the element format's NaN (NVFP4's E2M1 has none: code 0) while its
block is scaled by the amax of its other elements.

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
- FP8 block scaling: ``scale = fp8_max / amax`` in fp32, correctly rounded; where that overflows, the
  largest finite value of the INPUT's dtype (bf16's for bf16 input, as Transformer Engine's
  ``compute_scale_from_types<IType>`` in ``recipe_common.cuh``); 1 for an amax of 0 or inf; truncated to a
  power of two unless ``power_2=False``; stored as ``1 / scale``.
- NVFP4 (two levels, ``cast/nvfp4/core_nvfp4.cuh`` and ``quantize_transpose_nvfp4.cuh``): ``S_enc = 448 * 6 /
  tensor_amax`` (fp32 max if that overflows, 1 for an amax of 0 or inf); each block's E4M3 scale is
  ``e4m3(block_amax * (S_enc * fp32(1/6)))`` (round to nearest even, saturating at 448) and its values are
  multiplied by ``1 / (scale * (1 / S_enc))`` (fp32 max if that overflows). A value decodes as
  ``e2m1 * scale * S_dec`` with the global decode scale ``S_dec = tensor_amax / (448 * 6)``, correctly
  rounded (TE's NVFP4 documentation; ``1 / S_enc`` differs from it by an ulp for about a quarter of amaxes).
  An all-zero tensor has ``S_enc = 1`` and ``S_dec = 0``, as TE's kernels have (its Python reference
  quantizer gives ``S_enc`` = fp32 max instead).

Every division here is correctly rounded: torch evaluates ``python_float / tensor`` as ``reciprocal(tensor) *
python_float``, two roundings, so the numerator is always a tensor (``torch.div(tensor, tensor)``).
"""

from __future__ import annotations

import functools
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
    """``(fp8_max * 2**-margin) / amax`` in fp32, correctly rounded, fp32 max if that overflows; ``fallback``
    where amax is 0 or not finite: Transformer Engine's ``compute_scale_from_amax`` (``recipe_common.cuh``,
    current scaling) and ``scaled_max / amax`` (``delayed_scaling.cu``)."""
    amax = amax.float()
    usable = torch.isfinite(amax) & (amax > 0)
    scale = divide(fmt.max * 2.0**-margin, torch.where(usable, amax, 1.0)).clamp_(max=FP32_MAX)
    return torch.where(usable, scale, fallback)


def divide(numerator: float, denominator: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator`` in fp32, correctly rounded (IEEE division, as CUDA's ``__fdiv_rn``): a tensor
    numerator, since torch turns ``python_float / tensor`` into ``reciprocal(tensor) * python_float``."""
    return torch.div(torch.full_like(denominator, numerator, dtype=torch.float32), denominator.float())


def overflow_scale(dtype: torch.dtype) -> float:
    """The scale FP8 block scaling takes where ``fp8_max / amax`` overflows: the largest finite value of the
    input's dtype (bf16 and fp16 have their own; every other dtype is cast from fp32)."""
    return torch.finfo(dtype).max if dtype in (torch.bfloat16, torch.float16) else FP32_MAX


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

    @property
    def marks_nan(self) -> bool:
        """Whether a block holding a NaN gets the NaN scale byte (see ``scales``), so the caster must find those blocks."""
        return self.convention == OCP or not self.element.has_nan

    def scales(
        self, amax: torch.Tensor, input_dtype: torch.dtype = torch.float32, has_nan: torch.Tensor | None = None
    ) -> BlockScales:
        """The scales of block ``amax`` (NaN ignored); ``has_nan`` marks the blocks that hold a NaN (None: none
        does). ``input_dtype``: unused, the rules share one signature."""
        stored = (_nvidia_bytes if self.convention == NVIDIA else _ocp_bytes)(amax.float(), self.element.max)
        multiplier = _e8m0_multipliers(stored.device).index_select(0, stored.reshape(-1)).reshape(stored.shape)
        if has_nan is not None and self.marks_nan:  # the block's NaN is its scale's
            stored = torch.where(has_nan, E8M0_NAN, stored)
        return BlockScales(stored.to(torch.uint8).view(torch.float8_e8m0fnu), multiplier)


def _nvidia_bytes(amax: torch.Tensor, element_max: float) -> torch.Tensor:
    """The NVIDIA rule's int32 scale bytes ``clamp(ceil(log2(y)) + 127, 0, 254)`` of ``y = amax * fp32(1 / element_max)``
    (0 where y is 0), from y's bits (fewer operations than ``frexp``): a normal y's biased exponent, plus one
    when its mantissa bits are not all zero; inf gives 255, clamped. A subnormal y (below 2**-126) has byte 1 above
    2**-127 (bits 0x400000) and 0 up to it."""
    bits = (amax * (1.0 / element_max)).view(torch.int32)  # a Python float: multiplied as fp32(1 / element max)
    rounded_up = torch.add(bits, 0x7FFFFF).bitwise_right_shift_(23)
    return rounded_up.mul_(bits > 0x400000).clamp_(0, 2 * E8M0_BIAS)  # a NaN's bits overflow: byte 0


def _ocp_bytes(amax: torch.Tensor, element_max: float) -> torch.Tensor:
    """The OCP rule's int32 scale bytes ``clamp(floor(log2(amax)) - emax_elem + 127, 0, 254)`` from amax's bits (its
    biased exponent; 0 for zero and subnormals, clamped); an infinite amax gives 254, a NaN 0."""
    emax = math.frexp(element_max)[1] - 1
    bits = amax.view(torch.int32)
    exponents = torch.bitwise_right_shift(bits, 23).sub_(emax).masked_fill_(bits > 0x7F800000, -emax)
    return torch.where(bits == 0x7F800000, 2 * E8M0_BIAS, exponents).clamp_(0, 2 * E8M0_BIAS)


@functools.cache
def _e8m0_multipliers(device: torch.device) -> torch.Tensor:
    """``2**(127 - byte)`` in fp32 for every finite E8M0 byte: what a block of that scale byte is multiplied by (a
    table: a dozen fewer operations on every cast than ``power_of_two``), made on the device (no host data: the first
    cast may run inside a step that must not wait for a copy)."""
    return power_of_two(E8M0_BIAS - torch.arange(2 * E8M0_BIAS + 1, device=device))


@dataclass(frozen=True)
class Float8BlockScaleRule:
    """FP8 block scaling: one fp32 scale per block, a power of two unless ``power_2`` is off."""

    element: FP8Format
    power_2: bool = True
    marks_nan = False  # a block's NaN changes nothing of its scale

    def scales(
        self, amax: torch.Tensor, input_dtype: torch.dtype = torch.float32, has_nan: torch.Tensor | None = None
    ) -> BlockScales:
        """The scales of block ``amax`` (NaN ignored) of a tensor of ``input_dtype`` (which bounds an overflowing
        scale); a block's NaN changes nothing of its scale, so ``has_nan`` is unused."""
        amax = amax.float()
        usable = (amax > 0) & amax.isfinite()
        scale = divide(self.element.max, torch.where(usable, amax, 1.0))
        scale = torch.where(scale.isinf(), overflow_scale(input_dtype), scale)
        if self.power_2:  # 2**floor(log2(scale)): the mantissa bits cleared, for fp8_max / (an fp32 amax) is normal
            scale = scale.view(torch.int32).bitwise_and_(0x7F800000).view(torch.float32)
        scale = torch.where(usable, scale, 1.0)
        return BlockScales(scale.reciprocal(), scale)


class NVFP4ScaleRule:
    """NVFP4: an E4M3 scale per block under an fp32 per-tensor scale from the tensor's amax."""

    marks_nan = False  # a block's NaN changes nothing of its scale

    def scales(
        self, amax: torch.Tensor, input_dtype: torch.dtype = torch.float32, has_nan: torch.Tensor | None = None
    ) -> BlockScales:
        """The scales of block ``amax`` (NaN ignored: a block keeps the scale of its other values, as in Transformer
        Engine, so ``has_nan`` is unused; so is ``input_dtype``)."""
        amax = amax.float()
        tensor_amax = amax.amax() if amax.numel() else torch.zeros((), device=amax.device)
        encode, decode = nvfp4_tensor_scales(tensor_amax)
        per_block = amax * (encode * (1.0 / E2M1.max))  # a Python float: multiplied as fp32(1 / 6)
        stored = E4M3.cast(per_block)  # saturates at 448
        multiplier = (stored.float() * encode.reciprocal()).reciprocal().clamp(max=FP32_MAX)
        return BlockScales(stored, multiplier, decode)


def nvfp4_tensor_scales(tensor_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S_enc, S_dec)`` of a 0-dim fp32 NaN-free tensor amax (see the module docstring): the encode scale of
    ``compute_global_encode_scaling_factor_FP4`` and the decode scale ``amax / (448 * 6)``."""
    encode = divide(E4M3.max * E2M1.max, tensor_amax).clamp(max=FP32_MAX)
    encode = torch.where((tensor_amax == 0) | (encode == 0), 1.0, encode)
    decode = torch.div(tensor_amax, torch.full_like(tensor_amax, E4M3.max * E2M1.max))
    return encode, decode


ScaleRule = MXScaleRule | Float8BlockScaleRule | NVFP4ScaleRule
