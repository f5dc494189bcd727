"""``BlockScaledTensor``: a tensor quantized with one scale per block (MXFP8, FP8 block scaling, NVFP4).

A block format scales blocks along one dimension, so a tensor and its transpose quantize to different
values; each GEMM wants its operands blocked along its inner dimension. A ``BlockScaledTensor`` holds
a 2-D tensor's ``rowwise`` quantization (blocks along its rows, for when it is a GEMM's left operand)
and, when asked for, its ``columnwise`` one (blocks down its columns, stored transposed, for when it is
a right operand), each made from the high-precision tensor as Transformer Engine makes them.
``t()`` swaps the two, so ``a @ b`` reads ``a.rowwise`` and ``b.t().rowwise``.

Padding: each orientation is padded with zeros to whole blocks (its last dimension to the block
width; its rows to the block height for 2-D blocks, e.g. 16 x 16). Zeros quantize to zero and leave
every block's amax as it is, so padding changes no value; ``dequantize`` crops it off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowprec.formats import hadamard
from lowprec.formats.elements import ElementFormat, FP8Format


class Float8Tensor:
    """FP8 ``data`` with its fp32 ``scale_inv``; ``dtype`` is the high-precision dtype it stands for.

    ``other_layout``, when present, holds the same values in the other memory order (a column-major
    view when ``data`` is row-major), made by the fused cast so that GEMMs wanting that order need no
    copy. ``scale``, when known, is the scale the cast multiplied by (statistics recompute the cast
    from it: its reciprocal ``scale_inv`` does not always give it back exactly).
    """

    def __init__(
        self,
        data: torch.Tensor,
        scale_inv: torch.Tensor,
        fmt: FP8Format,
        dtype: torch.dtype,
        other_layout: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
    ):
        self.data = data
        self.scale_inv = scale_inv
        self.format = fmt
        self.dtype = dtype
        self.other_layout = other_layout
        self.scale = scale

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def t(self) -> Float8Tensor:
        """The transpose (views of the same bytes)."""
        other = self.other_layout.t() if self.other_layout is not None else None
        return Float8Tensor(self.data.t(), self.scale_inv, self.format, self.dtype, other, self.scale)

    def row_major(self) -> torch.Tensor:
        """The values in row-major order: a stored layout if one is, else a copy."""
        for layout in (self.data, self.other_layout):
            if layout is not None and layout.is_contiguous():
                return layout
        return self.data.contiguous()

    def column_major(self) -> torch.Tensor:
        """The values in column-major order (``.t()`` contiguous): a stored layout if one is, else a copy."""
        for layout in (self.data, self.other_layout):
            if layout is not None and layout.t().is_contiguous():
                return layout
        return self.data.t().contiguous().t()

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (self.data.float() * self.scale_inv).to(dtype or self.dtype)

    TENSOR_COUNT = 4  # what tensors() returns

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(data, scale_inv, other_layout, scale)``: what autograd must save (and checkpointing may
        recompute) to rebuild this tensor with :meth:`from_tensors`."""
        return self.data, self.scale_inv, self.other_layout, self.scale

    def metadata(self) -> tuple[FP8Format, torch.dtype]:
        """What :meth:`from_tensors` needs besides :meth:`tensors`."""
        return self.format, self.dtype

    @classmethod
    def from_tensors(cls, tensors: tuple[torch.Tensor | None, ...], fmt: FP8Format, dtype: torch.dtype) -> Float8Tensor:
        data, scale_inv, other_layout, scale = tensors
        return cls(data, scale_inv, fmt, dtype, other_layout, scale)

    def __repr__(self) -> str:
        return f"Float8Tensor({self.format.name}, shape={tuple(self.shape)}, dtype={self.dtype})"


@dataclass(frozen=True)
class BlockLayout:
    """What one orientation's tensors mean: element format, block ``(height, width)`` (width along the
    last dimension), the unpadded ``shape``, and the seed of the Hadamard transform its blocks went
    through (None: none)."""

    element: ElementFormat
    block: tuple[int, int]
    shape: tuple[int, int]
    hadamard_seed: int | None = None


@dataclass
class BlockScaledData:
    """One orientation: ``data`` (padded; FP8 bytes or E2M1 codes), ``scales`` (one per block; their
    ``.float()`` multiplies the block's elements) and NVFP4's per-tensor ``tensor_scale_inv``."""

    data: torch.Tensor
    scales: torch.Tensor
    tensor_scale_inv: torch.Tensor | None
    layout: BlockLayout

    def values(self) -> torch.Tensor:
        """The represented values, padded and still Hadamard-transformed if they were (fp32)."""
        height, width = self.layout.block
        rows, cols = self.data.shape
        elements = self.layout.element.decode(self.data).reshape(rows // height, height, cols // width, width)
        out = (elements * self.scales.float()[:, None, :, None]).reshape(rows, cols)
        return out if self.tensor_scale_inv is None else out * self.tensor_scale_inv

    def dequantize(self) -> torch.Tensor:
        """The represented values in the unpadded shape, the Hadamard transform undone (fp32)."""
        out = self.values()
        if self.layout.hadamard_seed is not None:
            out = hadamard.inverse(out, self.layout.hadamard_seed)
        rows, cols = self.layout.shape
        return out[:rows, :cols]


class BlockScaledTensor:
    """A 2-D tensor quantized blockwise: ``rowwise`` and optionally ``columnwise`` (see module docstring).

    ``format`` is the FP8 format that features casting per tensor use for it (the element format for
    FP8 recipes, the recipe's ``fp8_format`` for NVFP4); ``dtype`` the high-precision dtype it stands
    for; ``rounding_offset`` the cast number whose noise stochastic rounding used (None: none used).
    """

    TENSOR_COUNT = 6  # what tensors() returns

    def __init__(
        self,
        rowwise: BlockScaledData | None,
        columnwise: BlockScaledData | None,
        fmt: FP8Format,
        dtype: torch.dtype,
        rounding_offset: int | None = None,
    ):
        if rowwise is None and columnwise is None:
            raise ValueError("a BlockScaledTensor needs its rowwise or its columnwise quantization; got neither")
        self.rowwise = rowwise
        self.columnwise = columnwise
        self.format = fmt
        self.dtype = dtype
        self.rounding_offset = rounding_offset

    @property
    def shape(self) -> torch.Size:
        if self.rowwise is not None:
            return torch.Size(self.rowwise.layout.shape)
        return torch.Size(reversed(self.columnwise.layout.shape))

    @property
    def device(self) -> torch.device:
        return (self.rowwise or self.columnwise).data.device

    def t(self) -> BlockScaledTensor:
        """The transpose: the columnwise quantization becomes the rowwise one and back (no copy)."""
        return BlockScaledTensor(self.columnwise, self.rowwise, self.format, self.dtype, self.rounding_offset)

    def gemm_rows(self) -> BlockScaledData:
        """The quantization a GEMM reads when this is its left operand (blocks along the rows)."""
        if self.rowwise is None:
            raise ValueError(
                "this BlockScaledTensor has no quantization blocked along the GEMM's inner dimension: quantize "
                "with transpose=True to have it as a GEMM's right operand"
            )
        return self.rowwise

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The represented values (rowwise, else columnwise) in ``dtype`` (default: the tensor's)."""
        values = self.rowwise.dequantize() if self.rowwise is not None else self.columnwise.dequantize().t()
        return values.to(dtype or self.dtype)

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """``(data, scales, tensor_scale_inv)`` of the rowwise then the columnwise quantization (None where
        absent): what autograd saves to rebuild this tensor with :meth:`from_tensors`."""
        out: list[torch.Tensor | None] = []
        for part in (self.rowwise, self.columnwise):
            out.extend((part.data, part.scales, part.tensor_scale_inv) if part is not None else (None, None, None))
        return tuple(out)

    def metadata(self) -> tuple:
        """What :meth:`from_tensors` needs besides :meth:`tensors`."""
        layouts = tuple(part.layout if part is not None else None for part in (self.rowwise, self.columnwise))
        return layouts, self.format, self.dtype, self.rounding_offset

    @classmethod
    def from_tensors(
        cls,
        tensors: tuple[torch.Tensor | None, ...],
        layouts: tuple[BlockLayout | None, BlockLayout | None],
        fmt: FP8Format,
        dtype: torch.dtype,
        rounding_offset: int | None,
    ) -> BlockScaledTensor:
        parts = []
        for layout, (data, scales, tensor_scale_inv) in zip(layouts, (tensors[:3], tensors[3:]), strict=True):
            parts.append(BlockScaledData(data, scales, tensor_scale_inv, layout) if layout is not None else None)
        return cls(parts[0], parts[1], fmt, dtype, rounding_offset)

    def __repr__(self) -> str:
        layout = (self.rowwise or self.columnwise).layout
        return (
            f"BlockScaledTensor({layout.element.name}, block={layout.block}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"columnwise={self.columnwise is not None})"
        )
