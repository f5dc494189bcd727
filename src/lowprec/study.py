"""``lowprec.quantize``: a tensor cast by a recipe, as plain bytes and scales a user can study.

Training keeps quantized tensors in the layout its GEMMs want (padded blocks, FP8 dtypes, one
orientation at a time). Someone studying a format on their own tensors wants something simpler: for
each orientation one uint8 code per element in the logical shape, the decode scales as the format
stores them, and the dequantized values. ``quantize`` gives that, computed by the very quantizers
the layers train with (so the numbers are the training numbers, bit for bit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowprec.errors import LowprecTypeError, LowprecValueError
from lowprec.quant.per_tensor import DelayedScalingQuantizer, amax_of
from lowprec.quant.protocol import BlockScaledData, Float8Tensor, QuantizedTensor
from lowprec.recipe import RECIPES, Recipe

TENSOR_NAMES = ("activation", "weight", "gradient")
QUANTIZE_LAYER = "lowprec.quantize"
"""The layer name ``quantize`` casts under: it keys NVFP4's stochastic-rounding noise."""


@dataclass(frozen=True)
class Orientation:
    """One orientation of a cast. ``codes``: uint8, one per element, in this orientation's logical shape
    (FP8 bytes; E2M1 codes: bit 3 the sign, bits 0-2 the index into 0, 0.5, 1, 1.5, 2, 3, 4, 6; FP6 E3M2
    and E2M3 codes: the 6-bit pattern, bit 5 the sign);
    ``scale_inv``: the decode scales as the format stores them, one per block (rows of blocks x blocks
    per row; E8M0 or E4M3 bytes as uint8, fp32 for FP8 block scaling) or one per tensor (fp32, 0-dim);
    ``global_scale_inv``: NVFP4's per-tensor decode scale (fp32, 0-dim), None for other formats;
    ``block``: (height, width) of a block, None per tensor."""

    codes: torch.Tensor
    scale_inv: torch.Tensor
    global_scale_inv: torch.Tensor | None
    block: tuple[int, int] | None


class QuantizedView:
    """``tensor`` as ``recipe`` casts it: ``rowwise`` (blocks along the last dimension, how a GEMM reads
    its left operand) and ``columnwise`` (the transpose, blocked along its rows), None for an orientation a block
    cast was made without; ``dequantize(dtype)`` gives the values the cast represents, in the input's shape."""

    def __init__(self, quantized: QuantizedTensor, shape: torch.Size):
        self.quantized = quantized
        self.shape = shape
        if isinstance(quantized, Float8Tensor):
            self.rowwise = _per_tensor(quantized.data, quantized.scale_inv)
            self.columnwise = _per_tensor(quantized.column_major().t(), quantized.scale_inv)
        else:  # a BlockScaledTensor
            self.rowwise = None if quantized.rowwise is None else _block(quantized.rowwise)
            self.columnwise = None if quantized.columnwise is None else _block(quantized.columnwise)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.quantized.dequantize(dtype).reshape(self.shape)

    def __repr__(self) -> str:
        return f"QuantizedView({self.quantized!r})"


def _per_tensor(data: torch.Tensor, scale_inv: torch.Tensor) -> Orientation:
    return Orientation(data.contiguous().view(torch.uint8), scale_inv.reshape(()), None, None)


def _block(part: BlockScaledData) -> Orientation:
    rows, cols = part.layout.shape
    scales = part.scales
    if scales.dtype in (torch.float8_e8m0fnu, torch.float8_e4m3fn):
        scales = scales.view(torch.uint8)
    codes = part.data[:rows, :cols]
    if codes.dtype != torch.uint8:
        codes = codes.contiguous().view(torch.uint8)
    return Orientation(codes.contiguous(), scales, part.tensor_scale_inv, part.layout.block)


def quantize(tensor: torch.Tensor, recipe: Recipe, tensor_name: str = "activation") -> QuantizedView:
    """Cast ``tensor`` as ``recipe`` casts a layer's ``tensor_name`` (``"activation"``, ``"weight"`` or
    ``"gradient"``: each has its own format, block shape and options, e.g. NVFP4's 16 x 16 weight blocks
    and stochastically rounded gradients). Tensors of more than two dimensions are viewed as
    ``[-1, last_dim]``, as a GEMM reads them. Delayed scaling casts with the scale the tensor's own amax
    gives (as if its amax history held it), not with the scale 1 of a fresh layer's first cast."""
    if not isinstance(recipe, RECIPES):
        allowed = ", ".join(f"lowprec.{cls.__name__}" for cls in RECIPES)
        raise LowprecTypeError(f"lowprec.quantize: recipe must be one of {allowed}; got {type(recipe).__name__}")
    if tensor_name not in TENSOR_NAMES:
        raise LowprecValueError(
            f"lowprec.quantize: tensor_name must be one of {', '.join(map(repr, TENSOR_NAMES))}; got {tensor_name!r}"
        )
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.dim() == 0:
        raise LowprecTypeError(
            f"lowprec.quantize: tensor must be a floating-point torch.Tensor of 1 or more dimensions; got {tensor!r:.80}"
        )
    quantizer = recipe.quantizers(QUANTIZE_LAYER)[tensor_name]
    x = tensor.detach().reshape(math.prod(tensor.shape[:-1]), tensor.shape[-1])
    if isinstance(quantizer, DelayedScalingQuantizer):
        quantizer.scale_for(x)  # moves its state to the tensor's device
        quantizer.record_amax(amax_of(x))
    return QuantizedView(quantizer.quantize(x, transpose=True), tensor.shape)
