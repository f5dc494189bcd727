"""``torch.ops.nvdlfw_inspect.tensor_stats``: the one operator a statistics feature runs per tensor.

It reads the tensor once and merges its statistics straight into rows of a per-step table on the
tensor's device: the tensor fields (count, mean, M2, min, max, sum and smallest non-zero of |x|; with
``want_moments`` M3 and M4 too, for kurtosis) and, per quantization grid ("variant": a scale tensor and
an FP8-like grid ``(max, exponent of the smallest normal, mantissa bits)``), the values that underflow
to zero, overflow the range, the squared error of the dequantized values and the scale_inv. Each table
row takes the tensor fields and the fields of at most one variant (``row_variants``, -1 for none).

CUDA tensors take the Triton kernel (``triton``), CPU tensors the C kernel (``cpu``); without them, and
for dtypes they do not read (float64, integers, bool, FP8), torch reductions (``fallback``) compute the
same in float64. Every implementation takes the partials layout from ``stats.fields``.

Finite float32, bfloat16, float16 and integer values of any magnitude, subnormals included, give finite
statistics within 1e-6 of the exact ones (no square or sum of them overflows or underflows); float64
values do while their squares fit in float64 (1e-154 < |x| < 1e154), as M2 is a float64 field. Tensors the
operator cannot read (meta, sparse, complex, quantized, nested, subclasses with their own dispatch, other
devices) are named by ``unreadable_reason``.

Being a registered operator, it is seen (and counted) by dispatch modes and profilers like any aten
op, and ``torch.compile`` treats it as one opaque call; when none of them is active, ``tensor_stats``
calls the device implementation directly (see ``_observed``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from nvdlfw_inspect.logging import say_once
from nvdlfw_inspect.stats.fields import FIELDS, empty_partials
from nvdlfw_inspect.stats.kernels.cpu import DTYPE_CODES, column_amax_kernel, native_kernel
from nvdlfw_inspect.stats.kernels.fallback import Grid, torch_tensor_stats

DEVICES = ("cpu", "cuda")
_INTEGERS = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64}
_PACKED = {torch.float4_e2m1fn_x2}  # two values per byte: no conversion to float exists

_LIBRARY = torch.library.Library("nvdlfw_inspect", "DEF")
_LIBRARY.define(
    "tensor_stats(Tensor x, Tensor(a!) table, int[] rows, int[] row_variants, Tensor[] scales, float[] grid_max, "
    "int[] grid_min_exp, int[] grid_mantissa, bool want_abs_min, Tensor(b!)? call_out=None, Tensor(c!)? amax_out=None, "
    "bool want_moments=False) -> ()"
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
    say_once(message, layer_name, warning=RuntimeWarning, call_site=__name__)


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
    want_moments: bool = False,
) -> None:
    """Merge the statistics of ``x`` into ``table[rows]`` (see the module docstring). ``call_out``
    (a float64 row) receives this call's tensor fields, ``amax_out`` (float32, 0-dim) its max |x|, NaN ignored;
    ``want_moments``: M3 and M4 too (kurtosis)."""
    reason = unreadable_reason(x)
    if reason is not None:
        raise TypeError(f"tensor_stats cannot read this tensor: {reason}")
    grid_max, grid_min_exp, grid_mantissa = ([g[i] for g in grids] for i in range(3)) if grids else ([], [], [])
    args = (list(rows), list(row_variants) or [-1] * len(rows), list(scales), grid_max, grid_min_exp, grid_mantissa)
    if _observed():
        torch.ops.nvdlfw_inspect.tensor_stats(x, table, *args, want_abs_min, call_out, amax_out, want_moments)
    else:
        _IMPLEMENTATIONS[x.device.type](x, table, *args, want_abs_min, call_out, amax_out, want_moments)


def _observed() -> bool:
    """Whether something watches the dispatcher (a dispatch mode such as FakeTensor's or an op counter,
    ``torch.compile`` tracing, the profiler): then the call goes through it as the registered operator.
    Otherwise the device implementation is called directly: the dispatcher's round trip to a Python
    kernel costs about 20 us of host time, and this runs once per inspected tensor."""
    return torch._C._len_torch_dispatch_stack() > 0 or torch.compiler.is_compiling() or torch.autograd._profiler_enabled()


def kernel_column_amax(x: torch.Tensor) -> torch.Tensor | None:
    """``catalog.column_amax`` of the non-empty 2-D ``x`` in one read by a kernel: the C one for a CPU tensor, the
    Triton one for a CUDA tensor, of a dtype they read and with no dispatch mode watching (which would see no torch
    op); else None (torch ops then)."""
    if x.dtype not in DTYPE_CODES or _observed():
        return None
    if x.device.type == "cpu":
        amax = column_amax_kernel()
        return amax(_dense(x)) if amax is not None else None
    if x.device.type == "cuda" and _triton_kernel() is not None:
        from nvdlfw_inspect.stats.kernels.triton import triton_column_amax

        return triton_column_amax(_dense(x))
    return None


def _dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its elements one after another in memory, as the kernels read them (a copy only if needed)."""
    return x if x.is_contiguous() else x.contiguous()


def _cpu(x: torch.Tensor, table: torch.Tensor, *args: Any) -> None:
    kernel = native_kernel() if x.dtype in DTYPE_CODES else None
    if kernel is None:
        return torch_tensor_stats(x, table, *args)
    kernel(_dense(x), table, *args)


@functools.cache
def _triton_kernel() -> Callable | None:
    """The Triton kernel for CUDA tensors, or None (with a warning, once) when Triton cannot load."""
    try:
        from nvdlfw_inspect.stats.kernels.triton import triton_tensor_stats
    except ImportError as error:
        warnings.warn(f"Triton is unavailable ({error}): statistics of CUDA tensors use several torch kernels", stacklevel=3)
        return None
    return triton_tensor_stats


def _cuda(
    x: torch.Tensor,
    table: torch.Tensor,
    rows: list[int],
    row_variants: list[int],
    scales: list[torch.Tensor],
    grid_max: list[float],
    grid_min_exp: list[int],
    grid_mantissa: list[int],
    want_abs_min: bool,
    call_out: torch.Tensor | None = None,
    amax_out: torch.Tensor | None = None,
    want_moments: bool = False,
) -> None:
    kernel = _triton_kernel() if x.dtype in DTYPE_CODES else None
    if kernel is None or x.numel() == 0:
        args = (rows, row_variants, scales, grid_max, grid_min_exp, grid_mantissa, want_abs_min, call_out, amax_out)
        return torch_tensor_stats(x, table, *args, want_moments)
    grids = list(zip(grid_max, grid_min_exp, grid_mantissa, strict=True))
    kernel(_dense(x).reshape(-1), table, rows, row_variants, scales, grids, call_out, amax_out, want_moments)


_IMPLEMENTATIONS = {"cpu": _cpu, "cuda": _cuda}
for _device, _implementation in _IMPLEMENTATIONS.items():
    _LIBRARY.impl("tensor_stats", _implementation, _device.upper())


def compute_partials(tensor: torch.Tensor, fields: Iterable[str] = ()) -> torch.Tensor:
    """Partials of ``tensor`` (any dtype, any shape) as one row. Optional fields (``fields.OPTIONAL_FIELDS``) and
    the higher moments (``m3``, ``m4``) are computed only when named."""
    row = empty_partials(tensor.device)
    named = set(fields)
    tensor_stats(
        tensor.detach(), row.view(1, -1), [0], want_abs_min="abs_min_nonzero" in named, want_moments=bool(named & {"m3", "m4"})
    )
    return row
