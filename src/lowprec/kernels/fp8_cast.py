"""Fused FP8 casts for CUDA tensors: Triton kernels that quantize in as few passes as the recipe allows.

``cast_fp8`` reads a 2-D tensor once and writes its FP8 bytes, optionally also the bytes of its
transpose (``torch._scaled_mm`` wants its second operand column-major, so dgrad and wgrad need the
other layout), and optionally records the tensor's amax: with delayed scaling the scale is known
before the cast, so that and one tiny kernel that updates the amax history and the scales
(``fp8_scales.delayed_scaling_update``) are the whole quantization. With current scaling
``fp8_scales.current_scaling`` reads the tensor once more first for its amax and scale.

Amax partials are fp32 of shape ``(2, P)``: row 0 one NaN-ignoring partial amax per program (their max is
the amax), row 1 per program 1.0 where it read a NaN or an infinity, else 0.0. The flags cost no read of
their own, so the scale kernels turn them into a probe (0, or NaN where the tensor held a non-finite
value) that a NaN/inf guard can check instead of reading the tensor again.

The bytes, amaxes and scales equal the CPU emulation's exactly: each value is first rounded to the
format's grid (round to nearest even, the format's subnormals included) with float arithmetic, so
the hardware conversion that follows only re-encodes an exactly representable value; every NaN
becomes the positive NaN byte 0x7F, as in ``FP8Format.cast`` (a GPU's ``x * scale`` already drops
the sign of NaN); scales round as ``formats.scales.scale_from_amax`` does. With ``TRITON_INTERPRET=1``
the kernels run on CPU tensors, which is how the tests check them without a GPU.

Loops are ``while`` loops: Triton 3.6's interpreter turns a tensor loop bound of ``range`` (a kernel
argument or ``program_id``) into an int by ``int()`` of a 1-element array, which NumPy refuses since
the deprecation of 1.25 expired; a ``while`` condition goes through ``bool()``, which works. Both
compile to the same GPU code.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from lowprec.formats.elements import E4M3, FP8Format
from lowprec.formats.scales import FP32_MAX
from nvdlfw_inspect.stats.kernels.triton import round_to_grid


def fp32(value: float) -> float:
    """``value`` rounded to the nearest fp32, on the host: a constant for a kernel that must equal the fp32
    arithmetic of the emulation (a tensor made for this would be a host-to-device copy inside the step)."""
    return struct.unpack("f", struct.pack("f", value))[0]


TILE = 64
AMAX_BLOCK = 4096
AMAX_PROGRAMS = 1024
OPTIONS = {"enable_fp_fusion": False}  # no contracted multiply-adds: every rounding as written
FP32_MAX_CONSTEXPR = tl.constexpr(FP32_MAX)  # what the kernels clamp infinite scales to
NAN_BYTE = tl.constexpr(0x7F)  # the canonical positive NaN of E4M3 and E5M2


# The sizes and the row stride are never specialized as multiples of 16: on an H200 (Triton 3.6) a tile whose
# sizes were (256 x 384, say) compiled to misaligned 16-byte reads once the amax and the transpose shared the
# tile; the element-wise code compiled for other sizes (1000 x 777) ran correctly, so every size takes that code.
@triton.jit(do_not_specialize=["rows", "cols", "stride_row"])
def _cast_tile(
    x_ptr,
    scale_ptr,
    out_ptr,
    out_t_ptr,
    amax_ptr,
    rows,
    cols,
    stride_row,
    stride_col,
    FP8_MAX: tl.constexpr,
    MIN_NORMAL_EXP: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    IS_E4M3: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    RECORD_AMAX: tl.constexpr,
    TILE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    col = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)
    inside = (row[:, None] < rows) & (col[None, :] < cols)
    x = tl.load(x_ptr + row[:, None] * stride_row + col[None, :] * stride_col, mask=inside, other=0.0).to(tl.float32)
    encoded = fp8_bytes(x * tl.load(scale_ptr), FP8_MAX, MIN_NORMAL_EXP, MANTISSA_BITS, IS_E4M3)
    tl.store(out_ptr + row[:, None] * cols + col[None, :], encoded, mask=inside)
    if TRANSPOSE:
        tl.store(out_t_ptr + col[:, None] * rows + row[None, :], tl.trans(encoded), mask=tl.trans(inside))
    if RECORD_AMAX:
        program = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        tl.store(amax_ptr + program, _masked_amax(x, inside))
        tiles = tl.num_programs(0) * tl.num_programs(1)
        tl.store(amax_ptr + tiles + program, tl.max(nonfinite(x)))  # row 1 of the (2, tiles) partials


@triton.jit
def fp8_bytes(v, FP8_MAX: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, MANTISSA_BITS: tl.constexpr, IS_E4M3: tl.constexpr):
    """The FP8 bytes of fp32 ``v`` as ``FP8Format.cast`` writes them: saturated, rounded to the grid
    first (so the hardware conversion is exact), every NaN the byte 0x7F."""
    v = tl.where(v > FP8_MAX, FP8_MAX, tl.where(v < -FP8_MAX, -FP8_MAX, v))  # saturate; NaN stays NaN
    exact = round_to_grid(v, MIN_NORMAL_EXP, MANTISSA_BITS)
    if IS_E4M3:
        encoded = exact.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        encoded = exact.to(tl.float8e5).to(tl.uint8, bitcast=True)
    return tl.where(v != v, NAN_BYTE, encoded)  # whatever NaN the conversion made


@triton.jit
def _masked_amax(x, inside):
    """``max |x|`` over the valid elements, NaN ignored."""
    return nan_ignoring_max(tl.where(inside, tl.abs(x), 0.0))


@triton.jit
def nonfinite(x):
    """1.0 where ``x`` is NaN or +-inf, else 0.0 (``|x| < inf`` is False for both); the padding, loaded
    as 0, never counts."""
    return tl.where(tl.abs(x) < float("inf"), 0.0, 1.0)


@triton.jit
def nan_ignoring_max(values):
    """The largest of non-negative ``values``, NaN ignored as TE's ``fmaxf`` ignores it (0 if all are NaN)."""
    return tl.max(tl.where(values == values, values, 0.0))


@triton.jit
def _amax_blocks(x_ptr, amax_ptr, n, BLOCK: tl.constexpr):
    """Each program folds every ``num_programs``-th block into one partial amax and one non-finite
    flag (few programs, so the partials stay few and no atomics contend)."""
    block_start = tl.program_id(0).to(tl.int64) * BLOCK
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    running = tl.zeros((BLOCK,), dtype=tl.float32)
    flagged = tl.zeros((BLOCK,), dtype=tl.float32)
    while block_start < n:  # not ``for``: see the module docstring
        offsets = block_start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0).to(tl.float32)
        magnitude = tl.abs(x)
        running = tl.where(magnitude > running, magnitude, running)  # False for NaN: ignored
        flagged = tl.where(magnitude < float("inf"), flagged, 1.0)  # False for NaN and inf: flagged
        block_start += step
    tl.store(amax_ptr + tl.program_id(0), tl.max(running))
    tl.store(amax_ptr + tl.num_programs(0) + tl.program_id(0), tl.max(flagged))  # row 1 of the (2, P) partials


def amax_partials(tensor: torch.Tensor) -> torch.Tensor:
    """Amax partials of ``tensor`` (fp32, shape ``(2, P)``, ``P`` at most ``AMAX_PROGRAMS``) in one read:
    row 0 partial ``max |tensor|`` values, NaN ignored, whose max is the amax; row 1 each program's
    non-finite flag (see the module docstring)."""
    x = tensor.detach().reshape(-1)
    if not x.is_contiguous():
        x = x.contiguous()
    if x.numel() == 0:
        return torch.zeros((2, 1), dtype=torch.float32, device=x.device)
    programs = min(triton.cdiv(x.numel(), AMAX_BLOCK), AMAX_PROGRAMS)
    partials = torch.empty((2, programs), dtype=torch.float32, device=x.device)
    _amax_blocks[(programs,)](x, partials, x.numel(), BLOCK=AMAX_BLOCK, **OPTIONS)
    return partials


def amax_of(tensor: torch.Tensor) -> torch.Tensor:
    """``per_tensor.amax_of(tensor)`` (NaN ignored) as a 0-dim fp32 tensor, in one read."""
    return amax_partials(tensor)[0].amax()


def cast_fp8(
    tensor: torch.Tensor, scale: torch.Tensor, fmt: FP8Format, transpose: bool, record_amax: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(bytes, transposed bytes, amax partials)``: the FP8 bytes of ``tensor * scale`` (a 2-D
    tensor, any strides), those of its transpose (contiguous) if ``transpose``, and if
    ``record_amax`` the amax partials of shape ``(2, tiles)``, one column per tile (see the module
    docstring), read from the same tile as the cast; what is not asked for is None."""
    rows, cols = tensor.shape
    out = torch.empty((rows, cols), dtype=fmt.dtype, device=tensor.device)
    out_t = torch.empty((cols, rows), dtype=fmt.dtype, device=tensor.device) if transpose else None
    if tensor.numel() == 0:
        partials = torch.zeros((2, 1), dtype=torch.float32, device=tensor.device) if record_amax else None
        return out, out_t, partials
    grid = (triton.cdiv(rows, TILE), triton.cdiv(cols, TILE))
    partials = torch.empty((2, grid[0] * grid[1]), dtype=torch.float32, device=tensor.device) if record_amax else None
    _cast_tile[grid](
        tensor,
        scale.reshape(1).float(),
        out.view(torch.uint8),
        (out_t if out_t is not None else out).view(torch.uint8),
        partials if partials is not None else out,
        rows,
        cols,
        tensor.stride(0),
        tensor.stride(1),
        FP8_MAX=fmt.max,
        MIN_NORMAL_EXP=fmt.min_normal_exp,
        MANTISSA_BITS=fmt.mantissa_bits,
        IS_E4M3=fmt is E4M3,
        TRANSPOSE=transpose,
        RECORD_AMAX=record_amax,
        TILE=TILE,
        **OPTIONS,
    )
    return out, out_t, partials


@triton.jit
def widen(x):
    """``x`` as fp32, bf16 by its bits: what the GPU's conversion does, and exact in Triton's interpreter
    too, whose bf16 conversion gets subnormals wrong."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def load_tile(x_ptr, rows, cols, stride_row, stride_col, TILE_ROWS: tl.constexpr, TILE_COLS: tl.constexpr):
    """``(row, col, x)``: this program's tile of a 2-D tensor (int64 indices, fp32 values by ``widen``),
    elements beyond the tensor read as zeros (the block formats' padding)."""
    row = tl.program_id(0).to(tl.int64) * TILE_ROWS + tl.arange(0, TILE_ROWS)
    col = tl.program_id(1).to(tl.int64) * TILE_COLS + tl.arange(0, TILE_COLS)
    inside = (row[:, None] < rows) & (col[None, :] < cols)
    return row, col, widen(tl.load(x_ptr + row[:, None] * stride_row + col[None, :] * stride_col, mask=inside, other=0.0))
