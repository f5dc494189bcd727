"""``lowprec.quantize``: a tensor cast by a recipe, as plain bytes and scales a user can study.

Training keeps quantized tensors in the layout its GEMMs want (padded blocks, FP8 dtypes, one
orientation at a time). Someone studying a format on their own tensors wants something simpler: for
each orientation one uint8 code per element in the logical shape, the scales (as the format stores them
and as plain numbers), and the dequantized values. ``quantize`` gives that, computed by the very
quantizers the layers train with (so the numbers are the training numbers, bit for bit).

Stochastic rounding (NVFP4's gradients, unless ``disable_stochastic_rounding``) draws its noise from the key
``(recipe.seed, f"{layer_name}.gradient", cast number, orientation)``, hashed per element index
(``formats/noise.py``): the same on every device, and never from torch's global random state. A layer's
gradient quantizer numbers its casts 0, 1, 2, ... in order: one cast per backward of the layer (both
orientations, for dgrad and wgrad, come from that one cast); a recomputed forward (activation checkpointing)
and statistics replay a cast's noise without advancing the count. So the gradient a layer named ``X`` casts in
its Nth backward (counted from its first training forward under the recipe; with gradient accumulation, one per
micro-batch) is ``quantize(dy, recipe, "gradient", layer_name="X", cast_index=N - 1)``, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lowprec.errors import LowprecTypeError, LowprecValueError
from lowprec.formats import hadamard
from lowprec.formats.elements import E2M1
from lowprec.formats.scales import E8M0_BIAS, E8M0_NAN, nvfp4_tensor_scales, power_of_two
from lowprec.quant.block import BlockQuantizer
from lowprec.quant.per_tensor import DelayedScalingQuantizer, amax_of, nan_ignoring_amax
from lowprec.quant.protocol import BlockScaledData, Float8Tensor, QuantizedTensor
from lowprec.recipe import RECIPES, Recipe
from nvdlfw_inspect.errors import is_int

TENSOR_NAMES = ("activation", "weight", "gradient")
ORIENTATIONS = ("rowwise", "columnwise")
QUANTIZE_LAYER = "lowprec.quantize"
"""The layer name ``quantize`` casts under by default: it keys NVFP4's stochastic-rounding noise."""


@dataclass(frozen=True)
class Orientation:
    """One orientation of a cast. ``codes``: uint8, one per element, in this orientation's logical shape
    (FP8 bytes; E2M1 codes: bit 3 the sign, bits 0-2 the index into 0, 0.5, 1, 1.5, 2, 3, 4, 6; FP6 E3M2
    and E2M3 codes: the 6-bit pattern, bit 5 the sign);
    ``scale_inv``: the decode scales as the format stores them, one per block (rows of blocks x blocks
    per row; E8M0 or E4M3 bytes as uint8, see :func:`decode_e8m0`, :func:`decode_e4m3`; fp32 for FP8 block
    scaling) or one per tensor (fp32, 0-dim);
    ``global_scale_inv``: NVFP4's per-tensor decode scale ``S_dec = global_amax / (448 * 6)`` (fp32, 0-dim), None
    for other formats;
    ``block``: (height, width) of a block, None per tensor;
    ``scale``: per-tensor FP8, the scale the cast multiplied by (``scale_inv`` is its fp32 reciprocal, which does
    not always give it back exactly), None for block formats;
    ``global_amax`` and ``global_scale``: NVFP4's tensor amax (NaN ignored; of ``transformed_input`` where this
    orientation went through the Hadamard transform) and the encode scale ``S_enc = 448 * 6 / global_amax`` it
    gives, None for other formats (and where the view was made without the input);
    ``hadamard_signs``: the key of the random Hadamard transform's signs this orientation went through before the
    cast (``"transformer_engine"`` or an int seed; NVFP4's wgrad operands, activation and gradient columnwise),
    None if it did not; ``transformed_input``: then the values the cast read, this orientation of the input through
    the transform (rounded to the input's dtype, as Transformer Engine does; fp32).
    :meth:`values` gives what the codes and scales represent, in the transformed domain where there is one."""

    codes: torch.Tensor
    scale_inv: torch.Tensor
    global_scale_inv: torch.Tensor | None
    block: tuple[int, int] | None
    scale: torch.Tensor | None = None
    global_amax: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    hadamard_signs: hadamard.HadamardSigns | None = None
    transformed_input: torch.Tensor | None = None
    _decoded: Callable[[], torch.Tensor] | None = field(default=None, repr=False, compare=False)

    def values(self) -> torch.Tensor:
        """The values ``codes`` and the scales represent, fp32, in this orientation's logical shape, the Hadamard
        transform NOT undone (compare them with ``transformed_input``). The transform mixes each 16-element
        chunk of a row, so where a row's length is not a multiple of 16 its last chunk also spreads over the
        padding, which these values and ``codes`` crop off; ``QuantizedView.dequantize`` inverts the whole chunk."""
        if self._decoded is None:
            raise LowprecValueError("this Orientation was built by hand: it has no cast to decode")
        return self._decoded()


class QuantizedView:
    """``tensor`` as ``recipe`` casts it: ``rowwise`` (blocks along the last dimension, how a GEMM reads
    its left operand) and ``columnwise`` (the transpose, blocked along its rows), None for an orientation a block
    cast was made without; ``dequantize(dtype, orientation)`` gives the values an orientation represents, in the
    input's shape. ``source``: the 2-D tensor cast, which gives NVFP4's ``global_amax`` and ``global_scale`` and
    the Hadamard-transformed input (None: those fields are None)."""

    def __init__(self, quantized: QuantizedTensor, shape: torch.Size, source: torch.Tensor | None = None):
        self.quantized = quantized
        self.shape = shape
        if isinstance(quantized, Float8Tensor):
            self.rowwise = _per_tensor(quantized, quantized.data, lambda: quantized.dequantize(torch.float32))
            self.columnwise = _per_tensor(
                quantized, quantized.column_major().t(), lambda: quantized.dequantize(torch.float32).t()
            )
        else:  # a BlockScaledTensor
            self.rowwise = None if quantized.rowwise is None else _block(quantized.rowwise, source)
            columns = None if source is None else source.t()
            self.columnwise = None if quantized.columnwise is None else _block(quantized.columnwise, columns)

    def dequantize(self, dtype: torch.dtype = torch.float32, orientation: str | None = None) -> torch.Tensor:
        """The values ``orientation`` (``"rowwise"`` or ``"columnwise"``) represents, in the input's shape (the
        columnwise cast transposed back, its Hadamard transform undone). None: the rowwise cast, or the
        columnwise one where the cast has no rowwise one. The two differ for block formats (each blocks its own
        way) and are the same values per tensor."""
        if orientation is None or isinstance(self.quantized, Float8Tensor):
            if orientation not in (None, *ORIENTATIONS):
                raise _bad_orientation(orientation)
            return self.quantized.dequantize(dtype).reshape(self.shape)
        if orientation not in ORIENTATIONS:
            raise _bad_orientation(orientation)
        part = getattr(self.quantized, orientation)
        if part is None:
            raise LowprecValueError(f"this cast was made without its {orientation} orientation")
        values = part.dequantize() if orientation == "rowwise" else part.dequantize().t()
        return values.to(dtype).reshape(self.shape)

    def __repr__(self) -> str:
        return f"QuantizedView({self.quantized!r})"


def _bad_orientation(orientation: object) -> LowprecValueError:
    return LowprecValueError(f"orientation must be one of {', '.join(map(repr, ORIENTATIONS))} or None; got {orientation!r}")


def _per_tensor(quantized: Float8Tensor, data: torch.Tensor, decoded: Callable[[], torch.Tensor]) -> Orientation:
    scale = None if quantized.scale is None else quantized.scale.reshape(())
    codes = data.contiguous().view(torch.uint8)
    return Orientation(codes, quantized.scale_inv.reshape(()), None, None, scale=scale, _decoded=decoded)


def _block(part: BlockScaledData, source: torch.Tensor | None) -> Orientation:
    """One orientation of a block cast; ``source``: the tensor it cast, in its orientation (None: unknown)."""
    rows, cols = part.layout.shape
    scales = part.scales
    if scales.dtype in (torch.float8_e8m0fnu, torch.float8_e4m3fn):
        scales = scales.view(torch.uint8)
    codes = part.data[:rows, :cols]
    if codes.dtype != torch.uint8:
        codes = codes.contiguous().view(torch.uint8)
    signs = part.layout.hadamard_seed
    global_amax = global_scale = transformed = None
    if source is not None and (signs is not None or part.tensor_scale_inv is not None):
        cast_input = _cast_input(source, part.layout.block, signs)
        if signs is not None:
            transformed = cast_input[:rows, :cols]
        if part.tensor_scale_inv is not None:
            global_amax = nan_ignoring_amax(cast_input.abs())
            global_scale = nvfp4_tensor_scales(global_amax)[0]
    return Orientation(
        codes.contiguous(),
        scales,
        part.tensor_scale_inv,
        part.layout.block,
        global_amax=global_amax,
        global_scale=global_scale,
        hadamard_signs=signs,
        transformed_input=transformed,
        _decoded=lambda: part.values()[:rows, :cols],
    )


def _cast_input(source: torch.Tensor, block: tuple[int, int], signs: hadamard.HadamardSigns | None) -> torch.Tensor:
    """What the cast read: ``source`` in fp32, padded with zeros to whole blocks and, with ``signs``, through the
    Hadamard transform rounded to ``source``'s dtype (as ``BlockQuantizer`` does)."""
    rows, cols = source.shape
    height, width = block
    padded = F.pad(source.float(), (0, -cols % width, 0, -rows % height))
    return padded if signs is None else hadamard.transform(padded, signs, source.dtype)


def quantize(
    tensor: torch.Tensor,
    recipe: Recipe,
    tensor_name: str = "activation",
    *,
    layer_name: str = QUANTIZE_LAYER,
    cast_index: int = 0,
) -> QuantizedView:
    """Cast ``tensor`` as ``recipe`` casts a layer's ``tensor_name`` (``"activation"``, ``"weight"`` or
    ``"gradient"``: each has its own format, block shape and options, e.g. NVFP4's 16 x 16 weight blocks
    and stochastically rounded gradients). Tensors of more than two dimensions are viewed as
    ``[-1, last_dim]``, as a GEMM reads them. Delayed scaling casts with the scale the tensor's own amax
    gives (as if its amax history held it), not with the scale 1 of a fresh layer's first cast.

    ``layer_name`` and ``cast_index`` pick the stochastic-rounding noise (NVFP4 gradients; other casts draw
    none and ignore them): that of the layer's cast number ``cast_index`` (0 first), so the gradient a layer named
    ``X`` cast in its step N's backward is ``quantize(dy, recipe, "gradient", layer_name="X", cast_index=N - 1)``
    (see the module docstring for what keys the noise and how it advances)."""
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
    if not isinstance(layer_name, str):
        raise LowprecTypeError(f"lowprec.quantize: layer_name must be a str; got {layer_name!r}")
    if not is_int(cast_index) or cast_index < 0:
        raise LowprecValueError(f"lowprec.quantize: cast_index must be a non-negative integer; got {cast_index!r}")
    quantizer = recipe.quantizers(layer_name)[tensor_name]
    x = tensor.detach().reshape(math.prod(tensor.shape[:-1]), tensor.shape[-1])
    if isinstance(quantizer, DelayedScalingQuantizer):
        quantizer.scale_for(x)  # moves its state to the tensor's device
        quantizer.record_amax(amax_of(x))
    if isinstance(quantizer, BlockQuantizer):
        quantizer = quantizer.replaying(cast_index)  # the noise of cast ``cast_index`` (itself without noise)
    return QuantizedView(quantizer.quantize(x, transpose=True), tensor.shape, x)


def _as_bytes(codes: torch.Tensor, float8: torch.dtype, function: str) -> torch.Tensor:
    if codes.dtype == float8:
        return codes.view(torch.uint8)
    if codes.dtype != torch.uint8:
        raise LowprecTypeError(f"lowprec.study.{function}: expected a uint8 (or {float8}) tensor; got {codes.dtype}")
    return codes


def decode_e8m0(scale_bytes: torch.Tensor) -> torch.Tensor:
    """MX block scales (E8M0 bytes, uint8) as fp32: byte ``b`` is ``2**(b - 127)`` (byte 0 is 2**-127, an fp32
    subnormal), byte 255 is NaN (the scale of a block holding a NaN, see ``docs/formats.md``)."""
    b = _as_bytes(scale_bytes, torch.float8_e8m0fnu, "decode_e8m0").int()
    return torch.where(b == E8M0_NAN, math.nan, power_of_two(b - E8M0_BIAS))


def decode_e4m3(scale_bytes: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes (uint8: NVFP4's block scales, MXFP8's E4M3 codes) as fp32: sign bit 7, exponent bits 3-6
    (bias 7), mantissa bits 0-2; exponent 0 is subnormal (``m/8 * 2**-6``); 0x7F and 0xFF are NaN (no infinity)."""
    b = _as_bytes(scale_bytes, torch.float8_e4m3fn, "decode_e4m3").int()
    exponent, mantissa = (b >> 3) & 0xF, (b & 0x7).float()
    magnitude = torch.where(
        exponent == 0, mantissa * 2.0**-9, (8 + mantissa) * power_of_two(exponent - 10)
    )  # m/8 * 2**-6; (1 + m/8) * 2**(e-7)
    magnitude = torch.where((b & 0x7F) == 0x7F, math.nan, magnitude)
    return torch.where((b & 0x80) != 0, -magnitude, magnitude)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, NVFP4's and MXFP4's elements) as fp32: bit 3 the sign, bits 0-2 index 0, 0.5, 1, 1.5, 2,
    3, 4, 6 (no NaN, no infinity)."""
    if codes.dtype != torch.uint8 or bool((codes > 15).any()):
        raise LowprecValueError("lowprec.study.decode_e2m1: expected uint8 codes in [0, 15]")
    return E2M1.decode(codes)
