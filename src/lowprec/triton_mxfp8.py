"""Fused MXFP8 quantization for CUDA tensors: one Triton kernel reads a 2-D tensor once and writes its
rowwise MXFP8 bytes (blocks of 32 along the rows) with their E8M0 scales and, when asked, the
columnwise ones (blocks of 32 down the columns, stored transposed), instead of the torch emulation's
many passes.

Bytes and scales equal ``BlockQuantizer``'s with ``MXScaleRule`` bit for bit: each program holds one
32 x 32 tile, which is 32 rowwise blocks and 32 columnwise blocks at once; elements beyond the tensor
read as zeros (the emulation's padding); block amaxes ignore NaN; the E8M0 exponent is
``ceil(log2(amax * fp32(1 / fp8_max)))`` read off the fp32 bits, clamped to [-127, 127]; the cast is
``triton_cast.fp8_bytes`` of ``x * 2**-e``. With ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowprec.formats import E4M3, FP8Format
from lowprec.triton_cast import OPTIONS, fp8_bytes, widen

BLOCK = 32  # MXFP8's block: a tile of BLOCK x BLOCK is one program's work


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
def _mxfp8_tile(
    x_ptr,
    out_ptr,
    scales_ptr,
    out_t_ptr,
    scales_t_ptr,
    rows,
    cols,
    stride_row,
    stride_col,
    INV_FP8_MAX: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_NORMAL_EXP: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    IS_E4M3: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    col = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    padded_rows = tl.cdiv(rows, BLOCK) * BLOCK
    padded_cols = tl.cdiv(cols, BLOCK) * BLOCK
    inside = (row[:, None] < rows) & (col[None, :] < cols)
    x = widen(tl.load(x_ptr + row[:, None] * stride_row + col[None, :] * stride_col, mask=inside, other=0.0))
    magnitude = tl.where(x == x, tl.abs(x), 0.0)  # block amaxes ignore NaN

    exponent = _e8m0_exponent(tl.max(magnitude, axis=1), INV_FP8_MAX)
    encoded = fp8_bytes(x * _power_of_two(-exponent)[:, None], FP8_MAX, MIN_NORMAL_EXP, MANTISSA_BITS, IS_E4M3)
    tl.store(out_ptr + row[:, None] * padded_cols + col[None, :], encoded, mask=row[:, None] < rows)
    tl.store(scales_ptr + row * tl.cdiv(cols, BLOCK) + tl.program_id(1), (exponent + 127).to(tl.uint8), mask=row < rows)
    if COLUMNWISE:
        exponent_t = _e8m0_exponent(tl.max(magnitude, axis=0), INV_FP8_MAX)
        encoded_t = fp8_bytes(x * _power_of_two(-exponent_t)[None, :], FP8_MAX, MIN_NORMAL_EXP, MANTISSA_BITS, IS_E4M3)
        tl.store(out_t_ptr + col[:, None] * padded_rows + row[None, :], tl.trans(encoded_t), mask=col[:, None] < cols)
        scale_at = scales_t_ptr + col * tl.cdiv(rows, BLOCK) + tl.program_id(0)
        tl.store(scale_at, (exponent_t + 127).to(tl.uint8), mask=col < cols)


def quantize_mxfp8(
    tensor: torch.Tensor, fmt: FP8Format, columnwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(data, scales, data_t, scales_t)`` of a 2-D tensor (any float dtype and strides): the rowwise
    MXFP8 bytes (``fmt.dtype``, columns padded to whole blocks) and E8M0 scales (``float8_e8m0fnu``),
    and with ``columnwise`` those of the transpose (its columns, the tensor's rows, padded), else None."""
    rows, cols = tensor.shape
    blocks_r, blocks_c = triton.cdiv(rows, BLOCK), triton.cdiv(cols, BLOCK)
    device = tensor.device
    data = torch.empty((rows, blocks_c * BLOCK), dtype=torch.uint8, device=device)
    scales = torch.empty((rows, blocks_c), dtype=torch.uint8, device=device)
    data_t = torch.empty((cols, blocks_r * BLOCK), dtype=torch.uint8, device=device) if columnwise else None
    scales_t = torch.empty((cols, blocks_r), dtype=torch.uint8, device=device) if columnwise else None
    if tensor.numel():
        _mxfp8_tile[(blocks_r, blocks_c)](
            tensor,
            data,
            scales,
            data_t if columnwise else data,
            scales_t if columnwise else scales,
            rows,
            cols,
            tensor.stride(0),
            tensor.stride(1),
            INV_FP8_MAX=torch.tensor(1.0 / fmt.max, dtype=torch.float32).item(),  # exactly fp32(1 / fp8_max)
            FP8_MAX=fmt.max,
            MIN_NORMAL_EXP=fmt.min_normal_exp,
            MANTISSA_BITS=fmt.mantissa_bits,
            IS_E4M3=fmt is E4M3,
            COLUMNWISE=columnwise,
            BLOCK=BLOCK,
            **OPTIONS,
        )
    e8m0 = torch.float8_e8m0fnu
    if not columnwise:
        return data.view(fmt.dtype), scales.view(e8m0), None, None
    return data.view(fmt.dtype), scales.view(e8m0), data_t.view(fmt.dtype), scales_t.view(e8m0)
