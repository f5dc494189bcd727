"""``torch.ops.nvdlfw_inspect.tensor_stats``: the one operator a statistics feature runs per tensor.

It reads the tensor once and merges its statistics straight into rows of a per-step table on the
tensor's device: the tensor fields (count, mean, M2, min, max, sum and smallest non-zero of |x|) and,
per quantization grid ("variant": a scale tensor and an FP8-like grid ``(max, exponent of the
smallest normal, mantissa bits)``), the values that underflow to zero, overflow the range, the
squared error of the dequantized values and the scale_inv. Each table row takes the tensor fields and
the fields of at most one variant (``row_variants``, -1 for none).

CUDA tensors take the Triton kernel (``triton_partials``), CPU tensors the C kernel (``cpu_native``);
without them, torch reductions compute the same. Being a registered operator, it is seen (and counted)
by dispatch modes and profilers like any aten op, and ``torch.compile`` treats it as one opaque call.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from nvdlfw_inspect.stats.cpu_native import DTYPE_CODES, native_kernel
from nvdlfw_inspect.stats.partials import INDEX, identity_partials, merge_partials

Grid = tuple[float, int, int]  # (largest value, exponent of the smallest normal, mantissa bits)

_LIBRARY = torch.library.Library("nvdlfw_inspect", "DEF")
_LIBRARY.define(
    "tensor_stats(Tensor x, Tensor(a!) table, int[] rows, int[] row_variants, Tensor[] scales, float[] grid_max, "
    "int[] grid_min_exp, int[] grid_mantissa, bool want_abs_min, Tensor(b!)? call_out=None, Tensor(c!)? amax_out=None) -> ()"
)


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
    torch.ops.nvdlfw_inspect.tensor_stats(
        x,
        table,
        list(rows),
        list(row_variants) or [-1] * len(rows),
        list(scales),
        [g[0] for g in grids],
        [g[1] for g in grids],
        [g[2] for g in grids],
        want_abs_min,
        call_out,
        amax_out,
    )


def _flat(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1)
    return x if x.is_contiguous() else x.contiguous()


class _Request(NamedTuple):
    """The operator's arguments after ``x`` and ``table`` (the dispatcher leaves out defaults)."""

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
    request = _Request(*args)
    kernel = native_kernel() if x.dtype in DTYPE_CODES else None
    if kernel is None:
        return _torch_tensor_stats(x, table, request)
    kernel(
        _flat(x),
        table,
        request.rows,
        request.row_variants,
        request.scales,
        request.grids,
        request.want_abs_min,
        request.call_out,
        request.amax_out,
    )


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
    kernel = _triton_kernel()
    if kernel is None or x.numel() == 0:
        return _torch_tensor_stats(x, table, request)
    kernel(_flat(x), table, request.rows, request.row_variants, request.scales, request.grids, request.call_out, request.amax_out)


_LIBRARY.impl("tensor_stats", _cpu, "CPU")
_LIBRARY.impl("tensor_stats", _cuda, "CUDA")


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


def _grid_fields(x: torch.Tensor, scale: torch.Tensor, grid: Grid) -> list[torch.Tensor]:
    """underflows, overflows, squared error and scale_inv (twice) of ``x`` cast on ``grid``."""
    scale = scale.reshape(()).float()
    scale_inv = scale.reciprocal()
    scaled = x * scale
    overflows = (scaled.abs() > grid[0]).sum()
    q = round_to_grid(scaled.clamp(-grid[0], grid[0]), grid)
    underflows = ((x != 0) & (q == 0)).sum()
    sq_err = (x - q * scale_inv).square().sum()
    return [underflows, overflows, sq_err, scale_inv, scale_inv]


def _torch_tensor_stats(x: torch.Tensor, table: torch.Tensor, request: _Request) -> None:
    """The same as the kernels with torch reductions (float32 sums; float64 for float64 input)."""
    flat = x.detach().reshape(-1)
    flat = flat if flat.dtype in (torch.float32, torch.float64) else flat.float()
    own = identity_partials(table.device).clone()
    if flat.numel() > 0:
        mean = flat.mean()
        low, high = torch.aminmax(flat)
        core = [mean, (flat - mean).square().sum(), low, high, flat.abs().sum()]
        own[INDEX["count"]].fill_(flat.numel())
        own[INDEX["mean"] : INDEX["abs_sum"] + 1] = torch.stack(core).to(torch.float64)
        if request.want_abs_min:
            magnitude = flat.abs()
            smallest = magnitude.masked_fill(magnitude == 0, math.inf).min()
            own[INDEX["abs_min_nonzero"]] = torch.where(flat.isnan().any(), math.nan, smallest).to(torch.float64)
    if request.call_out is not None:
        request.call_out.copy_(own)
    if request.amax_out is not None:
        amax = torch.maximum(own[INDEX["min"]].abs(), own[INDEX["max"]].abs())
        request.amax_out.copy_(torch.where(own[INDEX["count"]] > 0, amax, 0.0))
    variants = []
    for scale, grid in zip(request.scales, request.grids, strict=True):
        variant = own.clone()
        fields = _grid_fields(flat.float(), scale, grid)
        variant[INDEX["underflows"] : INDEX["scale_inv_max"] + 1] = torch.stack(fields).to(torch.float64)
        variants.append(variant)
    for row, variant in zip(request.rows, request.row_variants, strict=True):
        table[row] = merge_partials(torch.stack([table[row], variants[variant] if variant >= 0 else own]))
