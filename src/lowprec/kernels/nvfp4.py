"""Fused quantization to NVFP4 (E2M1 elements, E4M3 block scales under an fp32 per-tensor scale) for CUDA
tensors, in 1 x 16 or 16 x 16 blocks. A small reduction reads the tensor once for its amax (which the
per-tensor scale needs before any block is cast); one Triton kernel then reads it once more and writes its
rowwise E2M1 codes and E4M3 scales (blocks along the rows) and, when asked, the columnwise ones (blocks
down the columns, stored transposed), instead of the torch emulation's many passes. No Hadamard
transform: for that case the caller passes the transformed transpose and takes the rowwise part.

Codes and scales equal ``BlockQuantizer``'s bit for bit. The amax pass writes one NaN-ignoring partial
``max |x|`` per tile; ``.amax()`` of the partials is the tensor amax (a device tensor, no host sync), and
the encode and decode scales follow from it with ``scales.nvfp4_tensor_scales``. Each
program of the cast holds one tile, whole 16-element blocks of both orientations; elements beyond the
tensor read as zeros (the emulation's padding, which 16 x 16 blocks store). As in ``block_scales``: a
block's scale is ``e4m3(amax * (S_enc * fp32(1/6)))`` (``fp8_cast.fp8_bytes``: round to nearest even,
saturated at 448; block amaxes ignore NaN, as TE's ``fmaxf``), its values are multiplied by the IEEE
reciprocal of ``scale * (1 / S_enc)`` (fp32 max if that overflows); a NaN element becomes code 0. E2M1
codes (one per ``uint8``, bit 3 the sign) round to nearest even, or stochastically:
``floor(units + noise)`` is computed exactly in fp32 as ``whole + (frac >= 1 - noise)``
(``units`` is below 4, so ``whole`` and ``frac`` are exact, and ``1 - noise`` is exact for noise a multiple
of 2**-24), with ``noise.uniform``'s counter-based hash of the element's row-major index in that
orientation's padded shape, in uint32 arithmetic (wrapping as the torch version's ``& MASK32`` does).
With ``TRITON_INTERPRET=1`` the kernels run on CPU tensors.

The amax pass, which reads every element, also writes one non-finite flag per tile (0.0, or NaN where it read
a NaN or an infinity; the padding never counts), as ``block_fp8``'s cast does: ``flags.amax()`` is the probe a
NaN/inf guard checks instead of reading the tensor again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowprec.errors import LowprecValueError
from lowprec.formats.elements import E2M1, E4M3
from lowprec.formats.noise import HASH_MULTIPLIERS, MASK32, NOISE_BITS
from lowprec.formats.scales import NVFP4_BLOCK, nvfp4_tensor_scales
from lowprec.kernels.block_fp8 import tile_flag
from lowprec.kernels.fp8_cast import FP32_MAX_CONSTEXPR, OPTIONS, fp8_bytes, load_tile
from nvdlfw_inspect.stats.kernels.triton import round_to_grid

TILE = 64  # the cast's tiles: TILE x TILE elements, whole blocks of both orientations
AMAX_TILE_ROWS, AMAX_TILE_COLS = 64, 128  # the amax pass's tiles, one partial each
BLOCK_HEIGHTS = (1, NVFP4_BLOCK)  # 1 x 16 or 16 x 16 blocks
HASH_MULTIPLIER_0 = tl.constexpr(HASH_MULTIPLIERS[0])
HASH_MULTIPLIER_1 = tl.constexpr(HASH_MULTIPLIERS[1])
NOISE_SHIFT = tl.constexpr(32 - NOISE_BITS)
NOISE_UNIT = tl.constexpr(2.0**-NOISE_BITS)
LOW_MASK = tl.constexpr(MASK32)


@triton.jit
def _hash32(x):
    """``noise.hash32`` of uint32 ``x``: uint32 products wrap, shifts are logical."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, HASH_MULTIPLIER_0, tl.uint32)
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, HASH_MULTIPLIER_1, tl.uint32)
    return x ^ (x >> 15)


@triton.jit
def _uniform(index, key_lo, key_hi):
    """``noise.uniform``'s noise of int64 element ``index`` under the key whose 32-bit halves are the
    uint32 ``key_lo`` and ``key_hi``: fp32 multiples of 2**-24 in [0, 1)."""
    index_lo = (index & LOW_MASK).to(tl.uint32)
    index_hi = (index >> 32).to(tl.uint32)
    mixed = _hash32(index_lo ^ key_lo)
    mixed = _hash32(mixed ^ index_hi ^ key_hi)
    return (mixed >> NOISE_SHIFT).to(tl.float32) * NOISE_UNIT


@triton.jit
def _e2m1_codes(v, noise, STOCHASTIC: tl.constexpr):
    """``E2M1.cast`` of fp32 ``v``: the code (uint8) of ``|v|`` saturated at 6, rounded to nearest even or,
    with ``STOCHASTIC``, to ``floor(units + noise)``; NaN becomes +0."""
    magnitude = tl.where(v == v, tl.abs(v), 0.0)
    magnitude = tl.where(magnitude > 6.0, 6.0, magnitude)
    binade = (magnitude >= 2.0).to(tl.int32) + (magnitude >= 4.0).to(tl.int32)
    units = magnitude * tl.where(binade == 2, 0.5, tl.where(binade == 1, 1.0, 2.0))  # a power of two: exact
    whole = units.to(tl.int32)  # truncation: floor of units in [0, 4]
    fraction = units - whole.to(tl.float32)  # exact: whole and units are multiples of units' ulp
    if STOCHASTIC:
        up = fraction >= 1.0 - noise  # floor(units + noise) > whole; 1 - noise is exact
    else:
        up = (fraction > 0.5) | ((fraction == 0.5) & ((whole & 1) == 1))  # half to even
    index = whole + up.to(tl.int32) + 2 * binade
    negative = (v.to(tl.int32, bitcast=True) < 0) & (v == v)
    return (index + 8 * negative.to(tl.int32)).to(tl.uint8)


@triton.jit
def _cast_blocks(
    x, encode_block, decode, key_lo, key_hi, noise_index, BH: tl.constexpr, BW: tl.constexpr, STOCHASTIC: tl.constexpr
):
    """``(codes, scale bytes)`` of fp32 tile ``x`` (TILE x TILE) in blocks of ``BH`` x ``BW`` elements:
    codes in the tile's shape, one E4M3 byte per block (shape TILE/BH x TILE/BW)."""
    ROWS: tl.constexpr = x.shape[0]
    COLS: tl.constexpr = x.shape[1]
    blocks = tl.reshape(x, (ROWS // BH, BH, COLS // BW, BW))
    magnitude = tl.abs(blocks)
    amax = tl.max(tl.max(tl.where(magnitude == magnitude, magnitude, 0.0), axis=3), axis=1)  # NaN ignored
    per_block = amax * encode_block
    stored = fp8_bytes(per_block, 448.0, -6, 3, True)
    scale = round_to_grid(tl.where(per_block > 448.0, 448.0, per_block), -6, 3)  # the stored scale's value
    multiplier = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale * decode)
    multiplier = tl.where(multiplier > FP32_MAX_CONSTEXPR, FP32_MAX_CONSTEXPR, multiplier)
    scaled = tl.reshape(blocks * multiplier[:, None, :, None], (ROWS, COLS))
    if STOCHASTIC:
        noise = _uniform(noise_index, key_lo, key_hi)
    else:
        noise = scaled
    return _e2m1_codes(scaled, noise, STOCHASTIC), stored


@triton.jit
def _amax_tile(
    x_ptr, partials_ptr, flags_ptr, rows, cols, stride_row, stride_col, TILE_ROWS: tl.constexpr, TILE_COLS: tl.constexpr
):
    """One partial ``max |x|`` per tile, NaN ignored (as the emulation's block amaxes), and its non-finite flag."""
    _, _, x = load_tile(x_ptr, rows, cols, stride_row, stride_col, TILE_ROWS, TILE_COLS)
    partial = tl.max(tl.max(tl.where(x == x, tl.abs(x), 0.0), axis=1), axis=0)
    program = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.store(partials_ptr + program, partial)
    tl.store(flags_ptr + program, tile_flag(x))


@triton.jit(do_not_specialize=["key_lo", "key_hi", "key_t_lo", "key_t_hi"])
def _nvfp4_tile(
    x_ptr,
    factors_ptr,
    out_ptr,
    scales_ptr,
    out_t_ptr,
    scales_t_ptr,
    rows,
    cols,
    stride_row,
    stride_col,
    key_lo,
    key_hi,
    key_t_lo,
    key_t_hi,
    BLOCK_HEIGHT: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    TILE: tl.constexpr,
):
    row, col, x = load_tile(x_ptr, rows, cols, stride_row, stride_col, TILE, TILE)
    encode_block, decode = tl.load(factors_ptr), tl.load(factors_ptr + 1)  # S_enc * fp32(1/6), 1 / S_enc
    padded_rows = tl.cdiv(rows, 16) * 16  # rows padded to whole 16-row blocks (columnwise blocks, 16 x 16 ones)
    padded_cols = tl.cdiv(cols, 16) * 16
    stored_rows = padded_rows if BLOCK_HEIGHT == 16 else rows  # the rowwise data's rows

    codes, stored = _cast_blocks(
        x,
        encode_block,
        decode,
        key_lo.to(tl.uint32),
        key_hi.to(tl.uint32),
        row[:, None] * padded_cols + col[None, :],
        BLOCK_HEIGHT,
        16,
        STOCHASTIC,
    )
    block_row = tl.program_id(0).to(tl.int64) * (TILE // BLOCK_HEIGHT) + tl.arange(0, TILE // BLOCK_HEIGHT)
    block_col = tl.program_id(1).to(tl.int64) * (TILE // 16) + tl.arange(0, TILE // 16)
    stored_block_rows = stored_rows // BLOCK_HEIGHT
    tl.store(
        out_ptr + row[:, None] * padded_cols + col[None, :],
        codes,
        mask=(row[:, None] < stored_rows) & (col[None, :] < padded_cols),
    )
    tl.store(
        scales_ptr + block_row[:, None] * (padded_cols // 16) + block_col[None, :],
        stored,
        mask=(block_row[:, None] < stored_block_rows) & (block_col[None, :] < padded_cols // 16),
    )
    if COLUMNWISE:  # blocks down the columns, stored transposed: element (r, c) at (c, r)
        stored_cols = padded_cols if BLOCK_HEIGHT == 16 else cols  # the columnwise data's rows
        if BLOCK_HEIGHT == 16 and not STOCHASTIC:  # the same blocks, scales and codes
            codes_t, stored_t = codes, stored
        else:
            codes_t, stored_t = _cast_blocks(
                x,
                encode_block,
                decode,
                key_t_lo.to(tl.uint32),
                key_t_hi.to(tl.uint32),
                col[None, :] * padded_rows + row[:, None],
                16,
                BLOCK_HEIGHT,
                STOCHASTIC,
            )
        block_col_t = tl.program_id(1).to(tl.int64) * (TILE // BLOCK_HEIGHT) + tl.arange(0, TILE // BLOCK_HEIGHT)
        block_row_t = tl.program_id(0).to(tl.int64) * (TILE // 16) + tl.arange(0, TILE // 16)
        tl.store(
            out_t_ptr + col[:, None] * padded_rows + row[None, :],
            tl.trans(codes_t),
            mask=(col[:, None] < stored_cols) & (row[None, :] < padded_rows),
        )
        tl.store(
            scales_t_ptr + block_col_t[:, None] * (padded_rows // 16) + block_row_t[None, :],
            tl.trans(stored_t),
            mask=(block_col_t[:, None] < stored_cols // BLOCK_HEIGHT) & (block_row_t[None, :] < padded_rows // 16),
        )


def amax_and_flags(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(amax, flags)`` of a 2-D tensor from one read, no host sync: ``max |tensor|`` ignoring NaN (fp32,
    0-dim, on its device; 0 when empty), torch's ``amax`` of one partial per tile, and the tiles' non-finite
    flags (fp32, one per tile in row-major order, a single 0 when empty; see the module docstring)."""
    rows, cols, device = *tensor.shape, tensor.device
    if tensor.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=device), torch.zeros(1, dtype=torch.float32, device=device)
    grid = (triton.cdiv(rows, AMAX_TILE_ROWS), triton.cdiv(cols, AMAX_TILE_COLS))
    partials, flags = torch.empty((2, grid[0] * grid[1]), dtype=torch.float32, device=device)
    _amax_tile[grid](
        tensor,
        partials,
        flags,
        rows,
        cols,
        tensor.stride(0),
        tensor.stride(1),
        TILE_ROWS=AMAX_TILE_ROWS,
        TILE_COLS=AMAX_TILE_COLS,
        **OPTIONS,
    )
    return partials.amax(), flags


def tensor_amax(tensor: torch.Tensor) -> torch.Tensor:
    """``max |tensor|`` of a 2-D tensor ignoring NaN (fp32, 0-dim, on its device; 0 when empty), from one read."""
    return amax_and_flags(tensor)[0]


def quantize_nvfp4(
    tensor: torch.Tensor, block_height: int, columnwise: bool, keys: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """``(data, scales, tensor_scale_inv, data_t, scales_t, tensor_scale_inv_t, flags)`` of a 2-D tensor (any float
    dtype and strides) cast to NVFP4 in blocks of ``block_height`` (1 or 16) x 16, as
    ``BlockQuantizer(NVFP4ScaleRule(), E2M1, (block_height, 16), E4M3)`` stores its ``rowwise`` and, with
    ``columnwise``, its ``columnwise`` quantization (else the three ``_t`` are None), without a Hadamard
    transform: E2M1 codes (``uint8``, padded as the emulation pads), E4M3 block scales
    (``float8_e4m3fn``) and the 0-dim fp32 per-tensor decode scale. ``keys``: None for round to nearest
    even, else ``(rowwise_key, columnwise_key)`` (``RoundingStream.key(offset, "rowwise")`` and
    ``key(offset, "columnwise")``) for stochastic rounding with that cast's noise. ``flags``: the amax pass's
    non-finite flags of ``tensor`` (see :func:`amax_and_flags`)."""
    if tensor.dim() != 2:
        raise LowprecValueError(f"quantize_nvfp4 takes a 2-D tensor, got shape {tuple(tensor.shape)}")
    if block_height not in BLOCK_HEIGHTS:
        raise LowprecValueError(f"NVFP4 blocks are 1 x 16 or 16 x 16, got block height {block_height}")
    rows, cols = tensor.shape
    device = tensor.device
    padded_rows, padded_cols = triton.cdiv(rows, 16) * 16, triton.cdiv(cols, 16) * 16
    square = block_height == NVFP4_BLOCK
    data = torch.empty((padded_rows if square else rows, padded_cols), dtype=torch.uint8, device=device)
    scales = torch.empty((data.shape[0] // block_height, padded_cols // 16), dtype=torch.uint8, device=device)
    data_t = scales_t = None
    if columnwise:
        data_t = torch.empty((padded_cols if square else cols, padded_rows), dtype=torch.uint8, device=device)
        scales_t = torch.empty((data_t.shape[0] // block_height, padded_rows // 16), dtype=torch.uint8, device=device)
    amax, flags = amax_and_flags(tensor)
    encode, decode = nvfp4_tensor_scales(amax)
    if tensor.numel():
        factors = torch.stack([encode * (1.0 / E2M1.max), encode.reciprocal()])  # fp32(1/6) and 1 / S_enc, as the rule
        key, key_t = keys if keys is not None else (0, 0)
        _nvfp4_tile[(triton.cdiv(rows, TILE), triton.cdiv(cols, TILE))](
            tensor,
            factors,
            data,
            scales,
            data_t if columnwise else data,
            scales_t if columnwise else scales,
            rows,
            cols,
            tensor.stride(0),
            tensor.stride(1),
            key & MASK32,
            key >> 32,
            key_t & MASK32,
            key_t >> 32,
            BLOCK_HEIGHT=block_height,
            COLUMNWISE=columnwise,
            STOCHASTIC=keys is not None,
            TILE=TILE,
            num_warps=4,
            **OPTIONS,
        )
    scales = scales.view(E4M3.dtype)
    if not columnwise:
        return data, scales, decode, None, None, None, flags
    return data, scales, decode, data_t, scales_t.view(E4M3.dtype), decode.clone(), flags
