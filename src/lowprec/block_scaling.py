"""Block-scaled FP8, emulated: one scale per block instead of one per tensor.

- MXFP8: blocks of 32 consecutive elements of a row (of a column for the columnwise copy), each
  with a power-of-two scale stored as an E8M0 byte ``e`` (the block's values are ``data * 2**(e-127)``),
  ``e = 127 + ceil(log2(amax / fp8_max))``.
- FP8 block scaling: 128 x 128 tiles, each with an fp32 power-of-two scale
  ``2**floor(log2(fp8_max / amax))``.

Both pad the tensor with zeros to whole blocks; zeros quantize to zero, so padding changes no
statistic of the values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lowprec.formats import FP8Format

MX_BLOCK = 32
TILE = 128
E8M0_BIAS = 127
E8M0_MAX = 254  # 255 encodes NaN


@dataclass
class BlockQuantized:
    """FP8 ``data`` (padded, blocks along the last dimension), one ``scale_inv`` per block (MXFP8: the
    raw E8M0 byte as a float; block scaling: fp32 ``1/scale``) and the ``dequantized`` fp32 values in
    the input's 2-D shape."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    dequantized: torch.Tensor


def as_2d(tensor: torch.Tensor) -> torch.Tensor:
    """``[-1, last_dim]``, the view every GEMM operand has."""
    return tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() > 1 else tensor.reshape(1, -1)


def _pad(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return F.pad(x, (0, -x.shape[1] % cols, 0, -x.shape[0] % rows))


def _floor_log2(x: torch.Tensor) -> torch.Tensor:
    """``floor(log2(x))`` exactly, for positive finite x (``frexp``: x = m * 2**e with m in [0.5, 1))."""
    _, exponent = torch.frexp(x)
    return exponent - 1


def mxfp8_quantize(tensor: torch.Tensor, fmt: FP8Format, columnwise: bool = False) -> BlockQuantized:
    """MXFP8 of ``tensor`` viewed as 2-D; ``columnwise`` takes blocks down the columns."""
    x = as_2d(tensor.detach()).float()
    x = x.t() if columnwise else x
    rows, cols = x.shape
    blocks = _pad(x, 1, MX_BLOCK).reshape(rows, -1, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    ratio = amax / fmt.max
    mantissa, exponent = torch.frexp(ratio)
    ceil_log2 = torch.where(mantissa == 0.5, exponent - 1, exponent)  # exact powers of two stay
    biased = (ceil_log2 + E8M0_BIAS).clamp(0, E8M0_MAX)
    biased = torch.where(amax > 0, biased, 0)
    biased = torch.where(amax.isfinite(), biased, E8M0_MAX)
    data = fmt.cast(torch.ldexp(blocks, (E8M0_BIAS - biased).float()))
    dequantized = torch.ldexp(data.float(), (biased - E8M0_BIAS).float()).reshape(rows, -1)[:, :cols]
    dequantized = dequantized.t() if columnwise else dequantized
    return BlockQuantized(data.reshape(rows, -1), biased.reshape(-1).float(), dequantized)


def block_scaling_quantize(tensor: torch.Tensor, fmt: FP8Format) -> BlockQuantized:
    """128 x 128-tile FP8 of ``tensor`` viewed as 2-D (its transpose has the same tiles and values)."""
    x = as_2d(tensor.detach()).float()
    rows, cols = x.shape
    padded = _pad(x, TILE, TILE)
    tile_rows, tile_cols = padded.shape[0] // TILE, padded.shape[1] // TILE
    tiles = padded.reshape(tile_rows, TILE, tile_cols, TILE)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    ratio = fmt.max / amax
    usable = (amax > 0) & ratio.isfinite()
    exponent = torch.where(usable, _floor_log2(torch.where(usable, ratio, 1.0)), 0)
    exponent = torch.where(amax.isfinite() & (amax > 0) & ~ratio.isfinite(), E8M0_BIAS, exponent)
    scale = torch.ldexp(torch.ones_like(amax), exponent.float())
    data = fmt.cast(tiles * scale)
    dequantized = (data.float() / scale).reshape(padded.shape)[:rows, :cols]
    return BlockQuantized(data.reshape(padded.shape), scale.reciprocal().reshape(-1), dequantized)
