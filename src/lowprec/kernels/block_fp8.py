"""Fused quantization to the FP8 block formats for CUDA tensors: MXFP8 (E8M0 scales, blocks of 32) and
FP8 block scaling (fp32 scales, blocks of 128), each with 1 x B or B x B blocks. One Triton kernel
reads a 2-D tensor once and writes its rowwise bytes and scales (blocks along the rows) and, when
asked, the columnwise ones (blocks down the columns, stored transposed), instead of the torch
emulation's many passes.

Bytes and scales equal ``BlockQuantizer``'s bit for bit: each program holds one B x B tile, which is B
rowwise and B columnwise 1 x B blocks at once (or one B x B block); elements beyond the tensor read as
zeros (the emulation's padding, which B x B blocks store); block amaxes ignore NaN. Scales follow
``block_scales``: ``MXScaleRule``'s exponent ``ceil(log2(amax * fp32(1 / fp8_max)))`` read off the fp32
bits, clamped to [-127, 127]; ``Float8BlockScaleRule``'s ``fp8_max / amax`` (IEEE division), the input
dtype's largest finite value for an overflow (``scales.overflow_scale``), 1 for an amax of 0 or inf,
truncated to a power of two by clearing its mantissa, stored as its IEEE reciprocal. The cast is
``fp8_cast.fp8_bytes`` of ``x * multiplier``. With ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors.

Each program also writes one non-finite flag of its tile: 0.0, or NaN where it read a NaN or an infinity
(the padding, read as zeros, never counts). The flags cost no read of their own, and ``flags.amax()`` (which
propagates NaN) is the probe a NaN/inf guard checks instead of reading the tensor again, as with
``fp8_cast``'s flag row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowprec.errors import LowprecValueError
from lowprec.formats.elements import E4M3, E5M2, ElementFormat, FP8Format
from lowprec.formats.scales import NVIDIA, Float8BlockScaleRule, MXScaleRule, ScaleRule, overflow_scale
from lowprec.kernels.fp8_cast import OPTIONS, fp8_bytes, fp32, load_tile, nonfinite

E8M0, FP32_POWER_OF_2, FP32 = 0, 1, 2  # the kernel's SCALE_KIND: how block amaxes become scales
BLOCK_WIDTHS = (32, 64, 128)  # tiles the kernel handles (BLOCK x BLOCK, a power of two)


@triton.jit
def _e8m0_exponent(amax, INV_FP8_MAX: tl.constexpr):
    """``MXScaleRule``'s exponent of a NaN-free ``amax`` >= 0 (int32): ceil(log2) from the fp32 bits of
    the ratio, -127 for ratios up to 2**-127 (0 too), 127 for inf; a finite ratio is below 2**120,
    so the clamp at 127 never acts on one."""
    bits = (amax * INV_FP8_MAX).to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    normal = biased - 127 + (mantissa != 0).to(tl.int32)
    subnormal = tl.where(mantissa > 0x400000, -126, -127)  # ratio > 2**-127: ceil is -126; 0 too gives -127
    return tl.where(biased == 0, subnormal, tl.where(biased == 255, 127, normal))


@triton.jit
def _power_of_two(exponent):
    """``2**exponent`` in fp32 for an int32 exponent in [-127, 127] (2**-127 is subnormal)."""
    return tl.where(exponent == -127, 0x400000, (exponent + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _scales(amax, FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr, SCALE_KIND: tl.constexpr, OVERFLOW_SCALE: tl.constexpr):
    """``(multiplier, stored)`` of NaN-free block amaxes: what the block is multiplied by before the cast,
    and the scale as stored (E8M0 byte, or the fp32 inverse scale); ``OVERFLOW_SCALE`` replaces an infinite
    ``fp8_max / amax``."""
    if SCALE_KIND == 0:
        exponent = _e8m0_exponent(amax, INV_FP8_MAX)
        multiplier = _power_of_two(-exponent)
        stored = (exponent + 127).to(tl.uint8)
    else:
        usable = (amax > 0) & (amax < float("inf"))
        scale = tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), tl.where(usable, amax, 1.0))
        scale = tl.where(scale == float("inf"), OVERFLOW_SCALE, scale)
        if SCALE_KIND == 1:  # every such scale is a normal number: clearing the mantissa floors it to a power of two
            scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        multiplier = tl.where(usable, scale, 1.0)
        stored = tl.math.div_rn(tl.full(multiplier.shape, 1.0, tl.float32), multiplier)
    return multiplier, stored


@triton.jit
def tile_flag(x):
    """NaN if the 2-D tile ``x`` holds a NaN or an infinity, else 0.0 (its 0/1 flags reduced first: a
    GPU's ``max`` drops NaN)."""
    return tl.where(tl.max(tl.max(nonfinite(x), axis=1), axis=0) > 0.0, float("nan"), 0.0)


@triton.jit
def _block_fp8_tile(
    x_ptr,
    out_ptr,
    scales_ptr,
    out_t_ptr,
    scales_t_ptr,
    flags_ptr,
    rows,
    cols,
    stride_row,
    stride_col,
    INV_FP8_MAX: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_NORMAL_EXP: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    IS_E4M3: tl.constexpr,
    SCALE_KIND: tl.constexpr,
    OVERFLOW_SCALE: tl.constexpr,
    SQUARE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row, col, x = load_tile(x_ptr, rows, cols, stride_row, stride_col, BLOCK, BLOCK)
    blocks_r, blocks_c = tl.cdiv(rows, BLOCK), tl.cdiv(cols, BLOCK)
    magnitude = tl.where(x == x, tl.abs(x), 0.0)  # block amaxes ignore NaN
    tl.store(flags_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tile_flag(x))

    if SQUARE:  # one scale for the tile, whose padded rows are stored too
        multiplier, stored = _scales(tl.max(tl.max(magnitude, axis=1), axis=0), FP8_MAX, INV_FP8_MAX, SCALE_KIND, OVERFLOW_SCALE)
        encoded = fp8_bytes(x * multiplier, FP8_MAX, MIN_NORMAL_EXP, MANTISSA_BITS, IS_E4M3)
        tl.store(out_ptr + row[:, None] * blocks_c * BLOCK + col[None, :], encoded)
        tl.store(scales_ptr + tl.program_id(0) * blocks_c + tl.program_id(1), stored)
        if COLUMNWISE:
            tl.store(out_t_ptr + col[:, None] * blocks_r * BLOCK + row[None, :], tl.trans(encoded))
            tl.store(scales_t_ptr + tl.program_id(1) * blocks_r + tl.program_id(0), stored)
    else:
        multiplier, stored = _scales(tl.max(magnitude, axis=1), FP8_MAX, INV_FP8_MAX, SCALE_KIND, OVERFLOW_SCALE)
        encoded = fp8_bytes(x * multiplier[:, None], FP8_MAX, MIN_NORMAL_EXP, MANTISSA_BITS, IS_E4M3)
        tl.store(out_ptr + row[:, None] * blocks_c * BLOCK + col[None, :], encoded, mask=row[:, None] < rows)
        tl.store(scales_ptr + row * blocks_c + tl.program_id(1), stored, mask=row < rows)
        if COLUMNWISE:
            multiplier_t, stored_t = _scales(tl.max(magnitude, axis=0), FP8_MAX, INV_FP8_MAX, SCALE_KIND, OVERFLOW_SCALE)
            encoded_t = fp8_bytes(x * multiplier_t[None, :], FP8_MAX, MIN_NORMAL_EXP, MANTISSA_BITS, IS_E4M3)
            tl.store(out_t_ptr + col[:, None] * blocks_r * BLOCK + row[None, :], tl.trans(encoded_t), mask=col[:, None] < cols)
            tl.store(scales_t_ptr + col * blocks_r + tl.program_id(0), stored_t, mask=col < cols)


def scale_kind(rule: ScaleRule) -> int | None:
    """The kernel's SCALE_KIND for ``rule``, None for a rule it does not implement (NVFP4's, MX's OCP floor)."""
    if isinstance(rule, MXScaleRule):
        return E8M0 if rule.convention == NVIDIA else None
    if isinstance(rule, Float8BlockScaleRule):
        return FP32_POWER_OF_2 if rule.power_2 else FP32
    return None


def supports(rule: ScaleRule, element: ElementFormat, block: tuple[int, int]) -> bool:
    """Whether the kernel casts ``element`` values in blocks of ``block`` (height, width) under ``rule``: E4M3
    or E5M2 elements, the rule's own format (the kernel writes ``rule.element``'s bytes), 1 x B or B x B blocks
    with B in ``BLOCK_WIDTHS``, MXFP8 or FP8 block-scaling scales."""
    height, width = block
    if scale_kind(rule) is None or element not in (E4M3, E5M2) or element != rule.element:
        return False
    return width in BLOCK_WIDTHS and height in (1, width)


def quantize_block_fp8(
    tensor: torch.Tensor, rule: MXScaleRule | Float8BlockScaleRule, block: tuple[int, int], columnwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """``(data, scales, data_t, scales_t, flags)`` of a 2-D tensor (any float dtype and strides) cast with
    ``rule`` in ``block``s (see :func:`supports`): the rowwise bytes (``rule.element.dtype``, padded as
    the emulation pads) and scales (E8M0 ``float8_e8m0fnu`` or fp32 inverse scales), and with
    ``columnwise`` those of the transpose, else None. ``tensor``'s dtype bounds an overflowing FP8 block scale.
    ``flags``: fp32, one per tile in row-major order (a single 0 when empty), see the module docstring."""
    if not supports(rule, rule.element, block):
        raise LowprecValueError(
            f"the fused block kernel casts 1 x B or B x B blocks, B in {BLOCK_WIDTHS}, got {block} with {rule}"
        )
    fmt: FP8Format = rule.element
    kind, square, width = scale_kind(rule), block[0] > 1, block[1]
    rows, cols = tensor.shape
    blocks_r, blocks_c = triton.cdiv(rows, width), triton.cdiv(cols, width)
    device = tensor.device
    scale_dtype = torch.uint8 if kind == E8M0 else torch.float32
    data = torch.empty((blocks_r * width if square else rows, blocks_c * width), dtype=torch.uint8, device=device)
    scales = torch.empty((blocks_r if square else rows, blocks_c), dtype=scale_dtype, device=device)
    data_t = scales_t = None
    if columnwise:
        data_t = torch.empty((blocks_c * width if square else cols, blocks_r * width), dtype=torch.uint8, device=device)
        scales_t = torch.empty((blocks_c if square else cols, blocks_r), dtype=scale_dtype, device=device)
    if tensor.numel() == 0:
        flags = torch.zeros(1, dtype=torch.float32, device=device)
    else:
        flags = torch.empty(blocks_r * blocks_c, dtype=torch.float32, device=device)
        _block_fp8_tile[(blocks_r, blocks_c)](
            tensor,
            data,
            scales,
            data_t if columnwise else data,
            scales_t if columnwise else scales,
            flags,
            rows,
            cols,
            tensor.stride(0),
            tensor.stride(1),
            INV_FP8_MAX=fp32(1.0 / fmt.max),
            FP8_MAX=fmt.max,
            MIN_NORMAL_EXP=fmt.min_normal_exp,
            MANTISSA_BITS=fmt.mantissa_bits,
            IS_E4M3=fmt is E4M3,
            SCALE_KIND=kind,
            OVERFLOW_SCALE=overflow_scale(tensor.dtype),
            SQUARE=square,
            COLUMNWISE=columnwise,
            BLOCK=width,
            num_warps=8 if width == 128 else 4,
            **OPTIONS,
        )
    stored_dtype = torch.float8_e8m0fnu if kind == E8M0 else torch.float32
    if not columnwise:
        return data.view(fmt.dtype), scales.view(stored_dtype), None, None, flags
    return data.view(fmt.dtype), scales.view(stored_dtype), data_t.view(fmt.dtype), scales_t.view(stored_dtype), flags
