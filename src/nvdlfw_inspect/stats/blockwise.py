"""Largest dynamic range within one block of a tensor: what a block-scaled format (one scale per block)
must cover, as opposed to the dynamic range of the whole tensor."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad a 2-D tensor to multiples of ``rows`` x ``cols`` (zeros do not change any block's range)."""
    return F.pad(x, (0, -x.shape[1] % cols, 0, -x.shape[0] % rows))


def _max_block_range(x: torch.Tensor, block_size: int, dims: int) -> torch.Tensor:
    magnitude = x.abs().float()
    if dims == 1:
        blocks = _pad_to(magnitude, 1, block_size).reshape(-1, block_size)
    else:
        padded = _pad_to(magnitude, block_size, block_size)
        rows, cols = padded.shape[0] // block_size, padded.shape[1] // block_size
        blocks = padded.reshape(rows, block_size, cols, block_size).transpose(1, 2).reshape(-1, block_size * block_size)
    largest = blocks.amax(dim=1)
    smallest = blocks.masked_fill(blocks == 0, math.inf).amin(dim=1)
    ranges = torch.where(largest > 0, largest.log2() - smallest.log2(), 0.0)
    return ranges.amax()


def max_blockwise_dynamic_range(
    tensor: torch.Tensor, block_size: int = 32, dims: int = 1, both_orientations: bool = False
) -> torch.Tensor:
    """``max over blocks of log2(max |x|) - log2(min non-zero |x|)`` as a 0-dim float32 tensor.

    The tensor is viewed as 2-D ``[-1, last_dim]``. ``dims=1``: blocks of ``block_size`` consecutive
    elements of a row; ``dims=2``: ``block_size x block_size`` tiles. A trailing partial block is a
    block of its own; an all-zero block has range 0. ``both_orientations`` also takes the blocks of
    the transposed tensor (the columnwise copy that the backward GEMMs read) and returns the larger.
    """
    x = tensor.detach()
    x = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    result = _max_block_range(x, block_size, dims)
    if both_orientations:
        result = torch.maximum(result, _max_block_range(x.t(), block_size, dims))
    return result
