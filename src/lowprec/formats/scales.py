"""How each block-scaled format turns the amaxes of its blocks into scales, as Transformer Engine's kernels do.

Every rule's ``scales(amax, input_dtype)`` takes each block's amax and the dtype of the tensor cast, and
returns ``BlockScales``: the scales as stored (their dequantized value multiplies the
stored elements), the multiplier that maps each block into the element format's range before the
cast, and, for NVFP4, the per-tensor decode scale. Block amaxes ignore NaN (the kernels' ``fmaxf``
does): a NaN element becomes the element format's NaN (NVFP4's E2M1 has none: code 0) while its
block is scaled by the amax of its other elements.

- MXFP8 (OCP Microscaling v1.0 E8M0 scale): ``e = ceil(log2(amax * fp32(1 / fp8_max)))`` clamped to
  [-127, 127], stored as the byte ``e + 127``; the block is multiplied by ``2**-e``. The OCP
  specification suggests ``floor(log2(amax)) - emax_elem``, which can push the largest value of a
  block up to 2**(emax_elem+1) and saturate it; Transformer Engine rounds up instead (``cvt.rp`` to
  ue8m0), so no value saturates. Rounding up is implemented (what GPUs running TE produce). In fp32's
  normal range it equals ``ceil(log2(amax / fp8_max))``, the rule of the earlier what-if statistics.
  An amax of 0 gives byte 0 (scale 2**-127); an infinite one byte 254.
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

from dataclasses import dataclass

import torch

from lowprec.formats.elements import E2M1, E4M3, FP8Format

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
    scale = divide(fmt.max * 2.0**-margin, torch.where(usable, amax, 1.0))
    scale = torch.where(torch.isinf(scale), FP32_MAX, scale)
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


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(x))`` exactly, for positive finite x (``frexp``: x = m * 2**e with m in [0.5, 1))."""
    mantissa, exponent = torch.frexp(x)
    return torch.where(mantissa == 0.5, exponent - 1, exponent)


def floor_log2(x: torch.Tensor) -> torch.Tensor:
    """``floor(log2(x))`` exactly, for positive finite x."""
    return torch.frexp(x)[1] - 1


@dataclass(frozen=True)
class MXScaleRule:
    """MXFP8: one E8M0 power of two per block (see the module docstring)."""

    element: FP8Format

    def scales(self, amax: torch.Tensor, input_dtype: torch.dtype = torch.float32) -> BlockScales:
        """The scales of NaN-free block ``amax`` (``input_dtype``: unused, the rules share one signature)."""
        ratio = amax.float() * (1.0 / self.element.max)  # a Python float: multiplied as fp32(1 / fp8_max)
        positive = ratio > 0
        exponent = torch.where(positive & ratio.isfinite(), ceil_log2(torch.where(positive, ratio, 1.0)), E8M0_BIAS)
        exponent = torch.where(positive, exponent, -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)
        stored = (exponent + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)
        return BlockScales(stored, power_of_two(-exponent))


@dataclass(frozen=True)
class Float8BlockScaleRule:
    """FP8 block scaling: one fp32 scale per block, a power of two unless ``power_2`` is off."""

    element: FP8Format
    power_2: bool = True

    def scales(self, amax: torch.Tensor, input_dtype: torch.dtype = torch.float32) -> BlockScales:
        """The scales of NaN-free block ``amax`` of a tensor of ``input_dtype`` (which bounds an overflowing scale)."""
        amax = amax.float()
        usable = (amax > 0) & amax.isfinite()
        scale = divide(self.element.max, torch.where(usable, amax, 1.0))
        scale = torch.where(scale.isinf(), overflow_scale(input_dtype), scale)
        if self.power_2:
            scale = power_of_two(floor_log2(scale))
        scale = torch.where(usable, scale, 1.0)
        return BlockScales(scale.reciprocal(), scale)


class NVFP4ScaleRule:
    """NVFP4: an E4M3 scale per block under an fp32 per-tensor scale from the tensor's amax."""

    def scales(self, amax: torch.Tensor, input_dtype: torch.dtype = torch.float32) -> BlockScales:
        """The scales of NaN-free block ``amax`` (``input_dtype``: unused, the rules share one signature)."""
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
