"""Quantizers of the block-scaled recipes, with the interface of the per-tensor ones.

``quantize(tensor, transpose)`` returns a ``BlockScaledTensor``: always the rowwise quantization
(blocks along the last dimension, the GEMM operand as laid out), and with ``transpose`` the
columnwise one too (the operand of the GEMM that reads the tensor transposed), each made from the
high-precision values. For ``y = x W^T``: fprop reads x and W rowwise (blocks along K), dgrad
``dy W`` reads dy rowwise and W columnwise (blocks along N), wgrad ``dy^T x`` reads dy and x
columnwise (blocks along the tokens). Casts are emulated with torch operations on the tensor's device or run
as fused kernels: Triton on CUDA GPUs (``kernels.block_fp8``, ``kernels.nvfp4``), C on the CPU
(``kernels.cpu_cast``); either way the stored values and scales are bit for bit those the format defines
(``formats/scales.py``), the same on every device.

What-if quantization for statistics (``mx_what_if_quantizer``, ``mxfp8_quantize``, ``block_scaling_quantize``):
- MX (MXFP8, MXFP6, MXFP4): blocks of 32 consecutive elements of a row (of a column for the columnwise
  copy), each with an E8M0 scale byte ``e`` (the block's values are ``data * 2**(e-127)``) under the
  NVIDIA rule (``e = 127 + ceil(log2(amax * fp32(1/elem_max)))``, ``MXFP8BlockScaling``'s) or the OCP
  one (``e = 127 + floor(log2(amax)) - emax_elem``), see ``formats/scales.py``.
- FP8 block scaling: 128 x 128 tiles, each with an fp32 power-of-two scale
  ``2**floor(log2(fp8_max / amax))`` (``Float8BlockScaling``'s weight rule).

Both pad the tensor with zeros to whole blocks; zeros quantize to zero, so padding changes no
statistic of the values. Block amaxes ignore NaN, as in training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from lowprec import kernels
from lowprec.errors import LowprecValueError
from lowprec.formats import hadamard
from lowprec.formats.elements import E2M1, E2M3, E3M2, E4M3, E5M2, ElementFormat, FP4Format, FP8Format
from lowprec.formats.noise import RoundingStream
from lowprec.formats.scales import (
    FLOAT8_BLOCK,
    MX_BLOCK,
    MX_SCALE_RULES,
    NVFP4_BLOCK,
    Float8BlockScaleRule,
    MXScaleRule,
    NVFP4ScaleRule,
    ScaleRule,
    default_mx_scale_rule,
)
from lowprec.kernels import cpu_cast
from lowprec.quant.protocol import BlockLayout, BlockScaledData, BlockScaledTensor, CastState, detached

MXFP8_LABEL, FLOAT8_BLOCK_LABEL, NVFP4_LABEL = "mxfp8", "fp8_block_scaling", "nvfp4"
"""How statistics name the block recipes (``LogFp8TensorStats``' ``mxfp8_underflows%``)."""


class BlockQuantizer:
    """Casts to one block-scaled format: ``rule`` makes the scales from block amaxes, ``element`` holds
    the scaled values, ``block`` is ``(height, width)`` with width along the GEMM's inner dimension.
    ``hadamard_seed``: the columnwise quantization first goes through the random Hadamard transform with the
    signs of this key (``hadamard.TE_SIGNS`` or an int seed; None: no transform).
    ``rounding``: stochastic rounding with that noise stream (E2M1 elements only); ``fixed_offset``
    replays one earlier cast's noise (see :meth:`replaying`). ``label``: the statistics name of the recipe that
    made it (empty: none did)."""

    def __init__(
        self,
        rule: ScaleRule,
        element: ElementFormat,
        block: tuple[int, int],
        fmt: FP8Format,
        hadamard_seed: hadamard.HadamardSigns | None = None,
        rounding: RoundingStream | None = None,
        fixed_offset: int | None = None,
        label: str = "",
    ):
        if rounding is not None and not isinstance(element, FP4Format):
            raise LowprecValueError(
                f"stochastic rounding is implemented for E2M1 elements only, got element format {element.name}"
            )
        self.rule = rule
        self.element = element
        self.block = block
        self.format = fmt
        self.hadamard_seed = hadamard_seed
        self.rounding = rounding
        self.fixed_offset = fixed_offset
        self.label = label

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the FP8 format features cast this tensor to (see ``BlockScaledTensor.format``)."""
        return self.format.dtype

    def quantize(self, tensor: torch.Tensor, transpose: bool = False) -> BlockScaledTensor:
        """``tensor`` viewed as 2-D (``[-1, last_dim]``), rowwise and, with ``transpose``, columnwise."""
        tensor = detached(tensor)
        x = tensor.reshape(math.prod(tensor.shape[:-1]), tensor.shape[-1]) if tensor.dim() > 1 else tensor.reshape(1, -1)
        offset = None
        if self.rounding is not None:
            offset = self.fixed_offset if self.fixed_offset is not None else self.rounding.take()
        if self._uses_kernel(x):
            return self._quantize_fused(x, transpose, tensor.dtype, offset)
        dtype = tensor.dtype
        if cpu_cast.runs_on(x) and cpu_cast.supports(self.rule, self.element):
            source, orientation = x.contiguous(), self._cpu_orientation
        else:
            source, orientation = x.contiguous().float(), self._orientation
        rowwise = orientation(source, False, None, offset, dtype)
        columnwise = None
        if transpose:
            square = self.block[0] == self.block[1] and self.hadamard_seed is None and offset is None
            columnwise = transposed(rowwise) if square else orientation(source, True, self.hadamard_seed, offset, dtype)
        return BlockScaledTensor(rowwise, columnwise, self.format, tensor.dtype, offset)

    def replaying(self, offset: CastState) -> BlockQuantizer:
        """A quantizer that repeats a cast of this one (a recomputed forward): stochastic rounding with the
        noise of cast ``offset`` (None: of the next cast), without advancing the stream. Without
        stochastic rounding the casts are deterministic and this quantizer itself repeats them."""
        if self.rounding is None:
            return self
        fixed = offset if offset is not None else self.rounding.next_offset
        return BlockQuantizer(
            self.rule, self.element, self.block, self.format, self.hadamard_seed, self.rounding, fixed, self.label
        )

    def _uses_kernel(self, x: torch.Tensor) -> bool:
        """Whether a fused Triton kernel casts ``x``: ``kernels.nvfp4``'s for NVFP4, ``kernels.block_fp8``'s for
        MXFP8 and FP8 block scaling in blocks it handles, on a device where ``kernels.runs_on`` holds
        (the kernel modules are imported only here: they need Triton)."""
        if not kernels.runs_on(x):
            return False
        if isinstance(self.rule, NVFP4ScaleRule):
            return self.element == E2M1 and self.block[1] == NVFP4_BLOCK and self.block[0] in (1, NVFP4_BLOCK)
        from lowprec.kernels import block_fp8

        return self.hadamard_seed is None and block_fp8.supports(self.rule, self.element, self.block)

    def _quantize_fused(self, x: torch.Tensor, transpose: bool, dtype: torch.dtype, offset: int | None) -> BlockScaledTensor:
        if isinstance(self.rule, NVFP4ScaleRule):
            rowwise, columnwise = self._nvfp4_kernel(x, transpose, offset)
            return BlockScaledTensor(rowwise, columnwise, self.format, dtype, offset)
        from lowprec.kernels import block_fp8

        data, scales, data_t, scales_t, flags = block_fp8.quantize_block_fp8(x, self.rule, self.block, transpose)
        layout = BlockLayout(self.element, self.block, tuple(x.shape))
        rowwise = BlockScaledData(data, scales, None, layout, nonfinite_flags=flags)
        columnwise = None
        if transpose:
            columnwise = BlockScaledData(data_t, scales_t, None, BlockLayout(self.element, self.block, tuple(x.t().shape)))
        return BlockScaledTensor(rowwise, columnwise, self.format, dtype)

    def _nvfp4_kernel(
        self, x: torch.Tensor, transpose: bool, offset: int | None
    ) -> tuple[BlockScaledData, BlockScaledData | None]:
        """Both orientations from one kernel, or, when the columnwise one goes through the Hadamard transform,
        the rowwise one from the kernel and the columnwise one from a second launch on the transformed transpose."""
        from lowprec.kernels import nvfp4

        keys = None if offset is None else (self.rounding.key(offset, "rowwise"), self.rounding.key(offset, "columnwise"))
        both = transpose and self.hadamard_seed is None
        data, scales, inv, data_t, scales_t, inv_t, flags = nvfp4.quantize_nvfp4(x, self.block[0], both, keys)
        layout = BlockLayout(self.element, self.block, tuple(x.shape))
        rowwise = BlockScaledData(data, scales, inv, layout, nonfinite_flags=flags)  # flags: x's own, never transformed
        if not transpose:
            return rowwise, None
        if not both:  # transformed down x's columns in its own layout (contiguous rows), then read transposed
            transformed = self._padded(x.float(), self.hadamard_seed, x.dtype, columnwise=True).t()
            column_keys = None if keys is None else (keys[1], 0)
            data_t, scales_t, inv_t, *_ = nvfp4.quantize_nvfp4(transformed, self.block[0], False, column_keys)
        layout = BlockLayout(self.element, self.block, tuple(x.t().shape), self.hadamard_seed)
        return rowwise, BlockScaledData(data_t, scales_t, inv_t, layout)

    def _padded(
        self, x: torch.Tensor, hadamard_seed: hadamard.HadamardSigns | None, dtype: torch.dtype, columnwise: bool = False
    ) -> torch.Tensor:
        """``x`` padded with zeros to whole blocks of its rows (``columnwise``: of its columns, the block's width down
        them; not copied when whole already), then through the Hadamard transform of ``hadamard_seed`` along the
        block's width, rounded to ``dtype`` (the input's: Transformer Engine transforms bf16 in bf16)."""
        rows, cols = x.shape
        height, width = self.block[::-1] if columnwise else self.block
        padded = x if rows % height == cols % width == 0 else F.pad(x, (0, -cols % width, 0, -rows % height))
        if hadamard_seed is None:
            return padded
        return hadamard.transform(padded, hadamard_seed, dtype, dim=0 if columnwise else -1)

    def _orientation(
        self,
        x: torch.Tensor,
        columnwise: bool,
        hadamard_seed: hadamard.HadamardSigns | None,
        offset: int | None,
        dtype: torch.dtype,
    ) -> BlockScaledData:
        """The rowwise (``columnwise``: the columnwise, stored as ``x.t()``'s rows) quantization of fp32 ``x``, whose
        values came from a tensor of ``dtype``. Columns are blocked in ``x``'s own layout, where a reduction or a
        Hadamard butterfly down the rows runs on whole contiguous rows (a transposed copy's 16-wide rows take 10x
        longer), and the scaled values are transposed, so the element cast and its noise see ``x.t()``'s layout."""
        rows, cols = x.shape
        height, width = self.block[::-1] if columnwise else self.block
        padded = self._padded(x, hadamard_seed, dtype, columnwise)
        padded_rows, padded_cols = padded.shape
        tiles = padded.reshape(padded_rows // height, height, padded_cols // width, width)
        work = torch.empty_like(tiles)  # the magnitudes, then the scaled values
        amax, has_nan = block_amaxes(tiles, work, self.rule.marks_nan)
        scales = self.rule.scales(amax, dtype, has_nan)
        scaled = torch.mul(tiles, scales.multiplier[:, None, :, None], out=work).view(padded.shape)
        if columnwise:  # the element cast and its noise in ``x.t()``'s layout
            scaled = dense_transpose(scaled)
        if offset is None:
            data = self.element.cast(scaled, overwrite=True)
        else:
            part = "columnwise" if columnwise else "rowwise"
            data = self.element.cast(scaled, self.rounding.noise(offset, part, scaled.shape, scaled.device), overwrite=True)
        stored = dense_transpose(scales.stored) if columnwise else scales.stored
        layout = BlockLayout(self.element, self.block, (cols, rows) if columnwise else (rows, cols), hadamard_seed)
        return BlockScaledData(data, stored, scales.tensor_scale_inv, layout)

    def _cpu_orientation(
        self,
        x: torch.Tensor,
        columnwise: bool,
        hadamard_seed: hadamard.HadamardSigns | None,
        offset: int | None,
        dtype: torch.dtype,
    ) -> BlockScaledData:
        """:meth:`_orientation` by the C kernel (``kernels.cpu_cast``) from contiguous CPU ``x`` of fp32, bf16 or fp16,
        in one pass (a columnwise Hadamard transform inside it, after a pass for the transformed tensor's amax, where
        ``cpu_cast.transforms``; else by torch first)."""
        rows, cols = x.shape
        signs = None
        if hadamard_seed is not None and cpu_cast.transforms(x, self.block):
            signs = hadamard.random_signs(hadamard_seed, x.device)
        elif hadamard_seed is not None:
            x = self._padded(x.float(), hadamard_seed, dtype, columnwise).contiguous()
        key = None if offset is None else self.rounding.key(offset, "columnwise" if columnwise else "rowwise")
        data, scales, scale_inv, flags = cpu_cast.quantize(x, self.rule, self.element, self.block, dtype, columnwise, key, signs)
        layout = BlockLayout(self.element, self.block, (cols, rows) if columnwise else (rows, cols), hadamard_seed)
        own = hadamard_seed is None  # else the cast read transformed values, whose probe is not x's
        return BlockScaledData(data, scales, scale_inv, layout, nonfinite_flags=flags if own else None)


def transposed(rowwise: BlockScaledData) -> BlockScaledData:
    """The columnwise quantization of a tensor in square blocks, cast without noise or transform: its rowwise one
    transposed (the same blocks hold the same values, so they get the same scales and, cast element by element, the
    same codes), for the price of two copies instead of a cast."""
    rows, cols = rowwise.layout.shape
    layout = replace(rowwise.layout, shape=(cols, rows))
    return BlockScaledData(dense_transpose(rowwise.data), dense_transpose(rowwise.scales), rowwise.tensor_scale_inv, layout)


def dense_transpose(matrix: torch.Tensor) -> torch.Tensor:
    """``matrix.t()`` in row-major strides, even where a side is 1 (``.contiguous()`` keeps the transposed strides
    there, and kernels and byte views need stride 1 on the last dimension)."""
    return matrix.new_empty(matrix.shape[::-1]).copy_(matrix.t())


def block_amaxes(
    tiles: torch.Tensor, scratch: torch.Tensor | None = None, nan_mask: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The amax of each block of ``tiles`` (``(rows, height, columns, width)``) ignoring NaN, as Transformer
    Engine's ``fmaxf`` does, and (``nan_mask``; else None) which blocks hold a NaN; without a host read. Reduced as
    the int32 bits of the magnitudes, which order as their values (NaN above inf): an int reduction over 16-wide
    rows is 5x faster on a CPU than a float one. ``scratch``: a tensor of ``tiles``' shape and dtype to overwrite."""
    bits = torch.bitwise_and(tiles.view(torch.int32), 0x7FFFFFFF, out=None if scratch is None else scratch.view(torch.int32))
    has_nan = bits.amax(dim=(1, 3)) > 0x7F800000 if nan_mask else None
    magnitudes = bits.view(torch.float32).nan_to_num_(nan=0.0, posinf=math.inf)
    return magnitudes.view(torch.int32).amax(dim=(1, 3)).view(torch.float32), has_nan


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


MX_FAMILY = {E4M3: MXFP8_LABEL, E5M2: MXFP8_LABEL, E3M2: "mxfp6_e3m2", E2M3: "mxfp6_e2m3", E2M1: "mxfp4"}
"""The statistics name of each MX element's recipe under its default scale rule."""


def mx_label(element: ElementFormat, rule: str) -> str:
    """How statistics name an MX cast: ``mxfp8``, ``mxfp6_e3m2``, ``mxfp6_e2m3`` or ``mxfp4`` under the
    element's default scale rule (``default_mx_scale_rule``), with ``_ocp`` or ``_nvidia`` appended under the other."""
    base = MX_FAMILY[element]
    return base if rule == default_mx_scale_rule(element) else f"{base}_{rule}"


MX_WHAT_IF = {mx_label(el, rule): (el, rule) for el in (E4M3, E3M2, E2M3, E2M1) for rule in MX_SCALE_RULES}
"""Every MX statistics name and the (element, scale rule) it casts with; the ``mxfp8`` ones take the
layer's FP8 format instead of E4M3."""


def mx_quantizer(
    element: ElementFormat, rule: str | None = None, block: tuple[int, int] = (1, MX_BLOCK), fmt: FP8Format = E4M3
) -> BlockQuantizer:
    """An MX cast: ``element`` values with E8M0 scales under ``rule`` (None: the element's default) in
    ``block``s. ``fmt``: the FP8 format of per-tensor features, the element itself for MXFP8."""
    rule = default_mx_scale_rule(element) if rule is None else rule
    fmt = element if isinstance(element, FP8Format) else fmt
    return BlockQuantizer(MXScaleRule(element, rule), element, block, fmt, label=mx_label(element, rule))


def mx_what_if_quantizer(label: str, fmt: FP8Format) -> BlockQuantizer:
    """What-if MX of statistics name ``label`` (``MX_WHAT_IF``): blocks of 32 along the rows (``transpose``:
    also down the columns); an ``mxfp8`` one in the layer's FP8 format ``fmt``."""
    element, rule = MX_WHAT_IF[label]
    return mx_quantizer(fmt if isinstance(element, FP8Format) else element, rule, fmt=fmt)


def mxfp8_quantizer(fmt: FP8Format) -> BlockQuantizer:
    """What-if MXFP8 (Transformer Engine's rule): blocks of 32 along the rows (``transpose``: also down the columns)."""
    return mx_quantizer(fmt)


def block_scaling_quantizer(fmt: FP8Format) -> BlockQuantizer:
    """What-if FP8 block scaling: 128 x 128 tiles with power-of-two scales."""
    return BlockQuantizer(Float8BlockScaleRule(fmt), fmt, (FLOAT8_BLOCK, FLOAT8_BLOCK), fmt, label=FLOAT8_BLOCK_LABEL)


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
