"""Statistics of each block of a block-scaled cast, read from the cast itself (its values and block scales; no
second quantization), reduced so that they stay exact over micro-batches and ranks.

A block is one scale's elements in the cast's own orientation (MXFP8 1 x 32, NVFP4 1 x 16 or 16 x 16, FP8 block
scaling 1 x 128 or 128 x 128; with ``_columnwise`` the blocks of the transposed copy, i.e. 32 x 1 ... of the
tensor), padding included (zeros, which change nothing). A cast through the Hadamard transform (NVFP4's columnwise
copy) is judged where it quantizes: the transformed values against their codes.

- ``underflow_blocks%``: the blocks in which more than ``T`` % of the non-zero (non-NaN) inputs are represented
  by zero (a zero code, or a block scale that itself flushed to zero), in % of all the blocks. ``T`` is the
  feature's ``block_underflow_threshold`` (default ``DEFAULT_UNDERFLOW_THRESHOLD`` = 50; 0: any flush). An
  outlier channel shows here: its blocks' scale follows it and its neighbours flush.
- ``saturated_blocks%``: the blocks holding a saturated element (an input, infinities included, whose magnitude
  exceeds the largest value its block represents: the element's max times the block scale, as the cast stored
  them), in % of all the blocks. Under NVIDIA's rule for MX scales (``mxfp8_``, ``mxfp6_*_nvidia_``,
  ``mxfp4_nvidia_``: the E8M0 scale rounded up) and FP8 block scaling (scale ``max / amax``) no element
  saturates but an infinite one; under the OCP rule (``mxfp8_ocp_``, ``mxfp6_e3m2_``, ``mxfp6_e2m3_``,
  ``mxfp4_``: the scale rounded down) the largest values of a block can, and under NVFP4 too where the E4M3
  block scale rounds down.
- ``worst_block_rel_err``: the largest relative error of a block, ``||q - x||_2 / ||x||_2`` over its elements
  (computed in float64, rounded to float32; 0 for a block of zeros; NaN if some block's is).
- ``worst_block_row``, ``worst_block_col``: where the block of ``worst_block_rel_err`` is, as block indices in
  the tensor's orientation (the tensor seen as 2-D ``[-1, last_dim]``; the row index counts blocks down the rows,
  the column index blocks along them), whichever orientation was cast: an outlier channel shows as a column.
  The row is the block row within the micro-batch (and rank) that held the block; a NaN block ranks first.
- ``worst_block_flushed%``: the largest share of a block's non-zero (non-NaN) inputs that its cast represents by
  zero (the count ``underflow_blocks%`` compares with ``T``), in % (float32; 0 for a block of zeros).
- ``worst_flushed_row``, ``worst_flushed_col``: where the block of ``worst_block_flushed%`` is, as the worst
  block's. The error is relative to a block's norm, which an outlier dominates, so the worst block is rarely an
  outlier's; the block that flushes most is, and its column block is the outlier channel's.

Reduction: the percentages are sums of block counts (the ``underflows`` and ``overflows`` fields of a request
whose ``count`` is the number of blocks), the worst error and the largest flushed share maxima (``max``, each its
own request). A location is a maximum with its argmax carried in one float64 (``location_keys``): the float64 whose
bits are the float32 value's bits (a non-negative float's bits sort as its value) above the 32-bit index, offset
so that every key is a normal float64; the largest key is the largest value, and its low bits its index, however
the maxima are taken. A row and a column are two such keys (two requests, each its own maximum), so where the
value is tied exactly (in float32) between blocks of different feeds or ranks, the row is the largest of the tied
blocks' rows and the column the largest of their columns. Within one cast a tie goes to the last block in
row-major order (a tensor flushing nothing: its last block).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
import torch.nn.functional as F

from lowprec.debug.quantized_stats import Quantized
from lowprec.formats import hadamard
from lowprec.quant.block import as_2d
from nvdlfw_inspect.stats.buffers import STATS_BUFFERS
from nvdlfw_inspect.stats.catalog import LOCATION_BIAS, stats_of
from nvdlfw_inspect.stats.fields import empty_partials, set_fields

BLOCK_STATS = stats_of("block")
UNDERFLOW_BLOCKS, SATURATED_BLOCKS, WORST_ERR, WORST_ROW, WORST_COL, WORST_FLUSHED, FLUSHED_ROW, FLUSHED_COL = BLOCK_STATS
DEFAULT_UNDERFLOW_THRESHOLD = 50.0
THRESHOLD_KEY = "block_underflow_threshold"
_LOW = (1 << 32) - 1


def parse_threshold(config: dict, location: Any) -> float:
    """The feature's ``block_underflow_threshold``: a percentage in [0, 100)."""
    value = config.get(THRESHOLD_KEY, DEFAULT_UNDERFLOW_THRESHOLD)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 100:
        raise location.child(THRESHOLD_KEY).error("must be a percentage in [0, 100)", value, [DEFAULT_UNDERFLOW_THRESHOLD])
    return float(value)


def _blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``[rows, cols]`` as ``[row blocks, col blocks, height * width]``."""
    (rows, cols), (height, width) = x.shape, block
    return x.reshape(rows // height, height, cols // width, width).transpose(1, 2).reshape(rows // height, cols // width, -1)


def block_values(tensor: torch.Tensor, q: Quantized) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs and the represented values of ``q``'s orientation, padded to whole blocks, in the domain the cast
    quantized (Hadamard-transformed if it was), both fp32 ``[row blocks, col blocks, elements]``."""
    part = q.part
    x = as_2d(tensor.detach()).float()
    x = x.t() if q.columnwise else x
    padded_rows, padded_cols = part.data.shape
    x = F.pad(x, (0, padded_cols - x.shape[1], 0, padded_rows - x.shape[0]))
    if part.layout.hadamard_seed is not None:
        x = hadamard.transform(x, part.layout.hadamard_seed, tensor.dtype)
        values = part.values()
    else:  # the cast's dequantized values, padded back (the padding represents zeros)
        values = q.dequantized.t() if q.columnwise else q.dequantized
        values = F.pad(values, (0, padded_cols - values.shape[1], 0, padded_rows - values.shape[0]))
    return _blocks(x, part.layout.block), _blocks(values, part.layout.block)


def block_partials(tensor: torch.Tensor, q: Quantized, threshold: float) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The fields of one cast's block request (``count``: blocks, ``underflows``, ``overflows``: blocks, ``max``:
    the worst error) and, per statistic with a request of its own, its ``max`` (the largest flushed share, the
    location keys), all on its device."""
    part = q.part
    x, v = block_values(tensor, q)
    nonzero = (x != 0) & ~x.isnan()
    flushed = (nonzero & (v == 0)).sum(-1, dtype=torch.float64)
    inputs = nonzero.sum(-1, dtype=torch.float64)
    underflow_blocks = flushed * 100 > threshold * inputs
    share = (flushed * 100 / inputs.clamp(min=1)).float()
    # the largest magnitude each block represents, computed as ``BlockScaledData.values`` computes its values
    largest = torch.full_like(part.scales, part.layout.element.max, dtype=torch.float32) * part.scales.float()
    if part.tensor_scale_inv is not None:
        largest = largest * part.tensor_scale_inv
    saturated = ((x.abs() > v.abs()) & (v.abs() == largest.unsqueeze(-1))).any(-1)
    x64 = x.double()
    err = (v.double() - x64).square().sum(-1)
    norm = x64.square().sum(-1)
    rel = torch.where(norm > 0, (err / norm.where(norm > 0, 1.0)).sqrt(), torch.where(err > 0, torch.inf, 0.0)).float()
    rel = torch.where(x.isnan().any(-1), torch.nan, rel)
    fields = {"count": rel.numel(), "underflows": underflow_blocks.sum(), "overflows": saturated.sum(), "max": rel.amax()}
    row, col = location_keys(rel, q.columnwise)
    flushed_row, flushed_col = location_keys(share, q.columnwise)
    maxima = {WORST_ROW: row, WORST_COL: col, WORST_FLUSHED: share.amax(), FLUSHED_ROW: flushed_row, FLUSHED_COL: flushed_col}
    return fields, maxima


def location_keys(values: torch.Tensor, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The row and column keys of the largest of float32 ``values`` ``[row blocks, col blocks]`` (NaN first, ties to
    the last in row-major order): its bits above its block row or column, in the tensor's orientation."""
    bits = values.nan_to_num(nan=torch.inf).view(torch.int32).long() + LOCATION_BIAS
    index = torch.arange(values.numel(), device=values.device).reshape(values.shape)
    worst = ((bits << 32) | index).amax()
    row, col = (worst & _LOW) // values.shape[1], (worst & _LOW) % values.shape[1]
    if columnwise:  # the blocks of the transposed copy: its rows are the tensor's columns
        row, col = col, row
    high = worst >> 32 << 32
    return (high | row).view(torch.float64), (high | col).view(torch.float64)


def feed_block_stats(
    key: Hashable,
    tensor: torch.Tensor,
    q: Quantized,
    stats: list[tuple[str, str]],
    threshold: float,
    **request: Any,
) -> None:
    """Feed ``stats`` (``(written, name)``, name in ``BLOCK_STATS``) of one cast: the percentages and the worst
    error share one request, the largest flushed share and each location have one each (their maxima are separate)."""
    fields, maxima = block_partials(tensor, q, threshold)
    device = tensor.device
    plain = [stat for stat in stats if stat[1] not in maxima]
    if plain:
        STATS_BUFFERS.feed((key, threshold), stats=plain, partials=set_fields(empty_partials(device), fields), **request)
    for name, value in maxima.items():
        wanted = [stat for stat in stats if stat[1] == name]
        if wanted:
            partials = set_fields(empty_partials(device), {"count": fields["count"], "max": value})
            STATS_BUFFERS.feed((key, threshold, name), stats=wanted, partials=partials, **request)
