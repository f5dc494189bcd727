"""Block-scaled FP8 as the what-if statistics see it: the training recipes' own quantization.

- MXFP8: blocks of 32 consecutive elements of a row (of a column for the columnwise copy), each with
  an E8M0 scale byte ``e`` (the block's values are ``data * 2**(e-127)``), ``e = 127 +
  ceil(log2(amax * fp32(1/fp8_max)))`` (``MXFP8BlockScaling``'s rule, ``block_scales.py``).
- FP8 block scaling: 128 x 128 tiles, each with an fp32 power-of-two scale
  ``2**floor(log2(fp8_max / amax))`` (``Float8BlockScaling``'s weight rule).

Both pad the tensor with zeros to whole blocks; zeros quantize to zero, so padding changes no
statistic of the values. Block amaxes ignore NaN, as in training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowprec.block_quantization import FLOAT8_BLOCK, MX_BLOCK, BlockQuantizer
from lowprec.block_scales import Float8BlockScaleRule, MXScaleRule
from lowprec.formats import FP8Format


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


def mxfp8_quantizer(fmt: FP8Format) -> BlockQuantizer:
    """What-if MXFP8: blocks of 32 along the rows (``transpose``: also down the columns)."""
    return BlockQuantizer(MXScaleRule(fmt), fmt, (1, MX_BLOCK), fmt)


def block_scaling_quantizer(fmt: FP8Format) -> BlockQuantizer:
    """What-if FP8 block scaling: 128 x 128 tiles with power-of-two scales."""
    return BlockQuantizer(Float8BlockScaleRule(fmt), fmt, (FLOAT8_BLOCK, FLOAT8_BLOCK), fmt)


def mxfp8_quantize(tensor: torch.Tensor, fmt: FP8Format, columnwise: bool = False) -> BlockQuantized:
    """MXFP8 of ``tensor`` viewed as 2-D; ``columnwise`` takes blocks down the columns."""
    quantizer = mxfp8_quantizer(fmt)
    x = as_2d(tensor.detach())
    part = quantizer.quantize(x.t() if columnwise else x).rowwise
    dequantized = part.dequantize()
    scale_bytes = part.scales.view(torch.uint8).reshape(-1).float()
    return BlockQuantized(part.data, scale_bytes, dequantized.t() if columnwise else dequantized)


def block_scaling_quantize(tensor: torch.Tensor, fmt: FP8Format) -> BlockQuantized:
    """128 x 128-tile FP8 of ``tensor`` viewed as 2-D (its transpose has the same tiles and values)."""
    part = block_scaling_quantizer(fmt).quantize(as_2d(tensor.detach())).rowwise
    return BlockQuantized(part.data, part.scales.reshape(-1), part.dequantize())
