"""``torch.ops.nvdlfw_inspect.tensor_stats``: the one operator a statistics feature runs per tensor.

It reads the tensor once and merges its statistics straight into rows of a per-step table on the
tensor's device: the tensor fields (count, mean, M2, min, max, sum and smallest non-zero of |x|) and,
per quantization grid ("variant": a scale tensor and an FP8-like grid ``(max, exponent of the
smallest normal, mantissa bits)``), the values that underflow to zero, overflow the range, the
squared error of the dequantized values and the scale_inv. Each table row takes the tensor fields and
the fields of at most one variant (``row_variants``, -1 for none).

CUDA tensors take the Triton kernel (``triton_partials``), CPU tensors the C kernel (``cpu_native``);
without them, and for dtypes they do not read (float64, integers, bool, FP8), torch reductions compute
the same in float64. Finite float32, bfloat16, float16 and integer values of any magnitude, subnormals
included, give finite statistics within 1e-6 of the exact ones (no square or sum of them
overflows or underflows); float64 values do while their squares fit in float64 (1e-154 < |x| < 1e154),
as M2 is a float64 field. Tensors the operator cannot read (meta, sparse, complex, quantized, nested,
subclasses with their own dispatch, other devices) are named by ``unreadable_reason``.

Being a registered operator, it is seen (and counted) by dispatch modes and profilers like any aten
op, and ``torch.compile`` treats it as one opaque call; when none of them is active, ``tensor_stats``
calls the device implementation directly (see ``_observed``).
"""

from __future__ import annotations

import functools
import logging
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from nvdlfw_inspect.stats.cpu_native import DTYPE_CODES, native_kernel
from nvdlfw_inspect.stats.partials import FIELDS, INDEX, identity_partials, merge_partials
from nvdlfw_inspect.utils import SingleMessageLogger

Grid = tuple[float, int, int]  # (largest value, exponent of the smallest normal, mantissa bits)
DEVICES = ("cpu", "cuda")
_INTEGERS = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64}
_PACKED = {torch.float4_e2m1fn_x2}  # two values per byte: no conversion to float exists
_PIECE = 1 << 22  # elements the torch reductions convert to float64 at a time: bounded memory for any tensor

_LIBRARY = torch.library.Library("nvdlfw_inspect", "DEF")
_LIBRARY.define(
    "tensor_stats(Tensor x, Tensor(a!) table, int[] rows, int[] row_variants, Tensor[] scales, float[] grid_max, "
    "int[] grid_min_exp, int[] grid_mantissa, bool want_abs_min, Tensor(b!)? call_out=None, Tensor(c!)? amax_out=None) -> ()"
)


_COMMON = frozenset({torch.float32, torch.bfloat16, torch.float16, torch.float64})


def unreadable_reason(x: object) -> str | None:
    """Why the operator cannot read ``x`` (None when it can): callers skip such a tensor with this as the reason."""
    usual = type(x) is torch.Tensor and x.dtype in _COMMON and (x.is_cpu or x.is_cuda) and x.layout == torch.strided
    if usual and not x.is_nested:
        return None  # decided with the fewest checks: this runs for every inspected tensor
    if not isinstance(x, torch.Tensor):
        return f"it is a {type(x).__name__}, not a torch.Tensor"
    if type(x).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        return f"it is a {type(x).__name__}, a tensor subclass with its own dispatch; pass its plain values"
    if x.is_nested:
        return "it is a nested tensor; pass its components or a padded tensor"
    if x.layout != torch.strided:
        return f"its layout is {x.layout}; pass x.to_dense()"
    if x.is_quantized:
        return f"it is quantized ({x.dtype}); pass x.dequantize()"
    if x.dtype.is_complex:
        return f"its dtype {x.dtype} is complex; pass x.abs() or torch.view_as_real(x)"
    if (not x.dtype.is_floating_point and x.dtype not in _INTEGERS) or x.dtype in _PACKED:
        return f"its dtype {x.dtype} has no conversion to float"
    if x.device.type == "meta":
        return "it is on the meta device, which holds no values"
    if x.device.type not in DEVICES:
        return f"it is on {x.device}; the statistics kernels run on {' and '.join(DEVICES)} tensors only"
    return None


def unreadable_partials_reason(partials: object) -> str | None:
    """Why ``partials`` cannot be merged into a statistics table (None when it can)."""
    reason = unreadable_reason(partials)
    if reason is None and (partials.dtype != torch.float64 or partials.shape != (len(FIELDS),)):
        reason = f"partials must be float64 of shape ({len(FIELDS)},), got {partials.dtype} of shape {tuple(partials.shape)}"
    return None if reason is None else f"its partials cannot be merged: {reason}"


def warn_skipped(layer_name: str, tensor_name: str, reason: str) -> None:
    """Say once per layer, tensor and reason (in the debug log, and as a Python warning for the console)
    that a tensor's statistics are skipped: the run goes on, and the user learns why they are missing."""
    message = f"statistics of tensor '{tensor_name}' of layer '{layer_name}' are skipped: {reason}"
    try:
        first = SingleMessageLogger.log_message_once(message, layer_name, logging.WARNING, call_site=__name__)
    except RuntimeError:  # no debug session to log to: the warning alone (Python shows each text once)
        first = True
    if first:
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def tensor_stats(
    x: torch.Tensor,
    table: torch.Tensor,
    rows: Sequence[int],
    row_variants: Sequence[int] = (),
    scales: Sequence[torch.Tensor] = (),
    grids: Sequence[Grid] = (),
    want_abs_min: bool = True,
    call_out: torch.Tensor | None = None,
    amax_out: torch.Tensor | None = None,
) -> None:
    """Merge the statistics of ``x`` into ``table[rows]`` (see the module docstring). ``call_out``
    (a float64 row) receives this call's tensor fields, ``amax_out`` (float32, 0-dim) its max |x|."""
    reason = unreadable_reason(x)
    if reason is not None:
        raise TypeError(f"tensor_stats cannot read this tensor: {reason}")
    grid_max, grid_min_exp, grid_mantissa = ([g[i] for g in grids] for i in range(3)) if grids else ([], [], [])
    args = (list(rows), list(row_variants) or [-1] * len(rows), list(scales), grid_max, grid_min_exp, grid_mantissa)
    if _observed():
        torch.ops.nvdlfw_inspect.tensor_stats(x, table, *args, want_abs_min, call_out, amax_out)
    else:
        _IMPLEMENTATIONS[x.device.type](x, table, *args, want_abs_min, call_out, amax_out)


def _observed() -> bool:
    """Whether something watches the dispatcher (a dispatch mode such as FakeTensor's or an op counter,
    ``torch.compile`` tracing, the profiler): then the call goes through it as the registered operator.
    Otherwise the device implementation is called directly: the dispatcher's round trip to a Python
    kernel costs about 20 us of host time, and this runs once per inspected tensor."""
    return torch._C._len_torch_dispatch_stack() > 0 or torch.compiler.is_compiling() or torch.autograd._profiler_enabled()


def _dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its elements one after another in memory, as the kernels read them (a copy only if needed)."""
    return x if x.is_contiguous() else x.contiguous()


class _Request(NamedTuple):
    """The operator's arguments after ``x`` and ``table``."""

    rows: list[int]
    row_variants: list[int]
    scales: list[torch.Tensor]
    grid_max: list[float]
    grid_min_exp: list[int]
    grid_mantissa: list[int]
    want_abs_min: bool
    call_out: torch.Tensor | None = None
    amax_out: torch.Tensor | None = None

    @property
    def grids(self) -> list[Grid]:
        return list(zip(self.grid_max, self.grid_min_exp, self.grid_mantissa, strict=True))


def _cpu(x: torch.Tensor, table: torch.Tensor, *args: Any) -> None:
    kernel = native_kernel() if x.dtype in DTYPE_CODES else None
    if kernel is None:
        return _torch_tensor_stats(x, table, _Request(*args))
    kernel(_dense(x), table, *args)


@functools.cache
def _triton_kernel() -> Callable | None:
    """The Triton kernel for CUDA tensors, or None (with a warning, once) when Triton cannot load."""
    try:
        from nvdlfw_inspect.stats.triton_partials import triton_tensor_stats
    except ImportError as error:
        warnings.warn(f"Triton is unavailable ({error}): statistics of CUDA tensors use several torch kernels", stacklevel=3)
        return None
    return triton_tensor_stats


def _cuda(x: torch.Tensor, table: torch.Tensor, *args: Any) -> None:
    request = _Request(*args)
    kernel = _triton_kernel() if x.dtype in DTYPE_CODES else None
    if kernel is None or x.numel() == 0:
        return _torch_tensor_stats(x, table, request)
    kernel(
        _dense(x).reshape(-1),
        table,
        request.rows,
        request.row_variants,
        request.scales,
        request.grids,
        request.call_out,
        request.amax_out,
    )


_IMPLEMENTATIONS = {"cpu": _cpu, "cuda": _cuda}
for _device, _implementation in _IMPLEMENTATIONS.items():
    _LIBRARY.impl("tensor_stats", _implementation, _device.upper())


def round_to_grid(v: torch.Tensor, grid: Grid) -> torch.Tensor:
    """``v`` (float32, within the grid's range) rounded to the grid, ties to even: the arithmetic of
    the kernels (``triton_partials.round_to_grid``) in torch ops."""
    _, min_normal_exp, mantissa_bits = grid
    exponent = (v.view(torch.int32) >> 23) & 0xFF
    spacing_exponent = exponent.clamp(min=127 + min_normal_exp) - mantissa_bits
    spacing = (spacing_exponent << 23).view(torch.float32)
    inverse = ((254 - spacing_exponent) << 23).view(torch.float32)
    rounded = ((v * inverse + 12582912.0) - 12582912.0) * spacing
    return torch.where(rounded == 0, v * 0.0, rounded)


def _grid_counts(x: torch.Tensor, scale: torch.Tensor, grid: Grid) -> torch.Tensor:
    """Underflows, overflows and squared error (squared in float64, where no FP8 error of a float32
    value overflows) of ``x`` (float32) cast on ``grid``."""
    scale = scale.reshape(()).float()
    scaled = x * scale
    overflows = (scaled.abs() > grid[0]).sum()
    q = round_to_grid(scaled.clamp(-grid[0], grid[0]), grid)
    underflows = ((x != 0) & (q == 0)).sum()
    sq_err = (x - q * scale.reciprocal()).double().square().sum()
    return torch.stack([underflows.double(), overflows.double(), sq_err])


def _tensor_fields(piece: torch.Tensor, want_abs_min: bool) -> torch.Tensor:
    """The tensor fields of a non-empty ``piece`` as a partial, computed in float64, where no square
    or sum of the values of any narrower dtype overflows or underflows."""
    v = piece.to(torch.float64)
    own = identity_partials(v.device).clone()
    mean = v.mean()
    low, high = torch.aminmax(v)
    magnitude = v.abs()
    own[INDEX["count"]] = v.numel()
    own[INDEX["mean"] : INDEX["abs_sum"] + 1] = torch.stack([mean, (v - mean).square().sum(), low, high, magnitude.sum()])
    if want_abs_min:
        own[INDEX["abs_min_nonzero"]] = magnitude.masked_fill(magnitude == 0, math.inf).min()  # NaN stays NaN
    return own


def _torch_tensor_stats(x: torch.Tensor, table: torch.Tensor, request: _Request) -> None:
    """The same as the kernels with torch reductions, in float64 pieces of at most ``_PIECE`` elements."""
    flat = x.detach().reshape(-1)
    pieces = flat.split(_PIECE) if flat.numel() > 0 else ()
    rows = [_tensor_fields(piece, request.want_abs_min) for piece in pieces]
    own = (rows[0] if len(rows) == 1 else merge_partials(torch.stack(rows))) if rows else identity_partials(table.device).clone()
    if request.call_out is not None:
        request.call_out.copy_(own)
    if request.amax_out is not None:
        amax = torch.maximum(own[INDEX["min"]].abs(), own[INDEX["max"]].abs())
        request.amax_out.copy_(torch.where(own[INDEX["count"]] > 0, amax, 0.0))
    variants = []
    for scale, grid in zip(request.scales, request.grids, strict=True):
        variant = own.clone()
        if pieces:
            counts = [_grid_counts(piece.float(), scale, grid) for piece in pieces]
            variant[INDEX["underflows"] : INDEX["sq_err"] + 1] = torch.stack(counts).sum(0)
        variant[INDEX["scale_inv_min"] : INDEX["scale_inv_max"] + 1] = scale.reshape(()).float().reciprocal().double()
        variants.append(variant)
    for row, variant in zip(request.rows, request.row_variants, strict=True):
        table[row] = merge_partials(torch.stack([table[row], variants[variant] if variant >= 0 else own]))
