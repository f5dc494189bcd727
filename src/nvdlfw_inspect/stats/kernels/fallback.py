"""The statistics operator in torch reductions: for devices and dtypes the kernels do not read (float64,
integers, bool, FP8) and where no kernel can load. It computes what the kernels compute, in float64
pieces of at most ``PIECE`` elements (bounded memory for any tensor), taking several torch kernels
where the kernels take one."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from nvdlfw_inspect.stats.fields import INDEX, identity_partials, merge_partials

Grid = tuple[float, int, int]  # (largest value, exponent of the smallest normal, mantissa bits)
PIECE = 1 << 22


def _span(names: Sequence[str]) -> slice:
    """The slice of the layout that holds ``names``, which must be consecutive there in this order (one
    copy writes them all)."""
    start = INDEX[names[0]]
    if [INDEX[name] for name in names] != list(range(start, start + len(names))):
        raise ValueError(f"the torch reductions write the fields {list(names)} as one slice: keep them together in fields.py")
    return slice(start, start + len(names))


_MOMENTS = _span(("mean", "m2", "min", "max", "abs_sum"))
_GRID = _span(("underflows", "overflows", "sq_err"))  # as _grid_counts returns them
_SCALE = _span(("scale_inv_min", "scale_inv_max"))
_HIGHER = _span(("m3", "m4"))


def round_to_grid(v: torch.Tensor, grid: Grid) -> torch.Tensor:
    """``v`` (float32, within the grid's range) rounded to the grid, ties to even: the arithmetic of
    the kernels (``triton.round_to_grid``) in torch ops."""
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


def _tensor_fields(piece: torch.Tensor, want_abs_min: bool, want_moments: bool = False) -> torch.Tensor:
    """The tensor fields of a non-empty ``piece`` as a partial, computed in float64, where no square
    or sum of the values of any narrower dtype overflows or underflows; ``want_moments``: M3 and M4 too."""
    v = piece.to(torch.float64)
    own = identity_partials(v.device).clone()
    mean = v.mean()
    low, high = torch.aminmax(v)
    magnitude = v.abs()
    deviation = v - mean
    squares = deviation.square()
    own[INDEX["count"] : INDEX["count"] + 1].fill_(v.numel())  # a fill: no host data copied to the device
    own[_MOMENTS] = torch.stack([mean, squares.sum(), low, high, magnitude.sum()])
    if want_abs_min:
        own[INDEX["abs_min_nonzero"]] = magnitude.masked_fill(magnitude == 0, math.inf).min()  # NaN stays NaN
    if want_moments:
        own[_HIGHER] = torch.stack([(squares * deviation).sum(), squares.square().sum()])
    return own


def tensor_partials(x: torch.Tensor, want_abs_min: bool, want_moments: bool = False) -> torch.Tensor:
    """The tensor fields of ``x`` as one partial on its device, in float64 pieces of at most ``PIECE`` elements."""
    flat = x.detach().reshape(-1)
    parts = [_tensor_fields(piece, want_abs_min, want_moments) for piece in flat.split(PIECE)] if flat.numel() else []
    if not parts:
        return identity_partials(x.device).clone()
    return parts[0] if len(parts) == 1 else merge_partials(torch.stack(parts))


def torch_tensor_stats(
    x: torch.Tensor,
    table: torch.Tensor,
    rows: Sequence[int],
    row_variants: Sequence[int],
    scales: Sequence[torch.Tensor],
    grid_max: Sequence[float],
    grid_min_exp: Sequence[int],
    grid_mantissa: Sequence[int],
    want_abs_min: bool,
    call_out: torch.Tensor | None = None,
    amax_out: torch.Tensor | None = None,
    want_moments: bool = False,
) -> None:
    """``kernels.tensor_stats`` (the operator's arguments, as the C kernel takes them) in torch reductions."""
    flat = x.detach().reshape(-1)
    pieces = flat.split(PIECE) if flat.numel() > 0 else ()
    own = tensor_partials(x, want_abs_min, want_moments)
    if call_out is not None:
        call_out.copy_(own)
    if amax_out is not None:  # NaN ignored, as an FP8 recipe's amax (0 when no element is a number)
        magnitude = flat.abs()
        amax_out.copy_(torch.where(magnitude.isnan(), 0.0, magnitude).amax() if flat.numel() else 0.0)
    variants = []
    for scale, grid in zip(scales, zip(grid_max, grid_min_exp, grid_mantissa, strict=True), strict=True):
        variant = own.clone()
        if pieces:
            variant[_GRID] = torch.stack([_grid_counts(piece.float(), scale, grid) for piece in pieces]).sum(0)
        variant[_SCALE] = scale.reshape(()).float().reciprocal().double()
        variants.append(variant)
    for row, variant in zip(rows, row_variants, strict=True):
        table[row] = merge_partials(torch.stack([table[row], variants[variant] if variant >= 0 else own]))
