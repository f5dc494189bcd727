"""What every quantizer and quantized tensor of ``lowprec`` offers, and the two quantized tensors.

A ``Quantizer`` casts high-precision tensors; what it returns is a ``QuantizedTensor`` whose inner
tensors have names (``inner_tensors()``), so autograd saves them by name and rebuilds the tensor with
``from_inner`` (no positional tuples to keep in step). ``Float8Tensor`` has one scale per tensor;
``BlockScaledTensor`` one scale per block (MXFP8, FP8 block scaling, NVFP4).

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

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lowprec.errors import LowprecValueError
from lowprec.formats import hadamard
from lowprec.formats.elements import ElementFormat, FP8Format
from lowprec.kernels import cpu_cast

CastState = tuple[torch.Tensor, torch.Tensor] | int | None
"""What a recomputation needs to repeat a cast: a per-tensor cast's ``(scale, scale_inv)``, a block
cast's stochastic-rounding offset (None: nothing to repeat, or the cast used no noise)."""


def detached(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` cut from its autograd graph: itself when it has none (a ``detach`` is a dispatched op, and the casts
    and the guard take every GEMM tensor of a step)."""
    return tensor.detach() if tensor.requires_grad else tensor


class QuantizedTensor:
    """Base of the quantized tensors: a high-precision ``dtype`` it stands for, named inner tensors
    (what autograd saves) and the metadata that rebuilds it from them."""

    dtype: torch.dtype

    def inner_tensors(self) -> dict[str, torch.Tensor | None]:
        raise NotImplementedError

    def metadata(self) -> dict[str, Any]:
        """What :meth:`from_inner` needs besides :meth:`inner_tensors`."""
        raise NotImplementedError

    @classmethod
    def from_inner(cls, inner: dict[str, torch.Tensor | None], metadata: dict[str, Any]) -> QuantizedTensor:
        raise NotImplementedError

    def cast_state(self) -> CastState:
        """What a recomputed forward needs to cast this tensor again bit for bit."""
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        raise NotImplementedError

    def t(self) -> QuantizedTensor:
        raise NotImplementedError


class Quantizer(Protocol):
    """Casts tensors to one format. ``format``: the FP8 format features that cast per tensor use for it;
    ``label``: the statistics name of the recipe that made it (``fp8_delayed_scaling``, ``mxfp8``, ...)."""

    format: FP8Format
    label: str

    @property
    def dtype(self) -> torch.dtype: ...

    def quantize(self, tensor: torch.Tensor, transpose: bool = False) -> QuantizedTensor:
        """``tensor`` cast; with ``transpose`` also what a GEMM reading it transposed needs."""
        ...

    def replaying(self, state: CastState) -> Quantizer:
        """A quantizer that repeats the cast whose ``cast_state()`` was ``state`` (a recomputed forward),
        recording nothing and advancing no noise stream."""
        ...


class Float8Tensor(QuantizedTensor):
    """FP8 ``data`` with its fp32 ``scale_inv``; ``dtype`` is the high-precision dtype it stands for.

    ``other_layout``, when present, holds the same values in the other memory order (a column-major
    view when ``data`` is row-major), made by the fused cast so that GEMMs wanting that order need no
    copy. ``scale``, when known, is the scale the cast multiplied by (statistics recompute the cast
    from it: its reciprocal ``scale_inv`` does not always give it back exactly). ``nonfinite_probe``, when the
    cast's own read of the source told it: a 0-dim fp32 tensor, 0 if every source value was finite, NaN if one was
    NaN or infinite (``NonfiniteGuard`` takes it instead of reading the source again); not part of the saved state.
    """

    def __init__(
        self,
        data: torch.Tensor,
        scale_inv: torch.Tensor,
        fmt: FP8Format,
        dtype: torch.dtype,
        other_layout: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
        nonfinite_probe: torch.Tensor | None = None,
    ):
        self.data = data
        self.scale_inv = scale_inv
        self.format = fmt
        self.dtype = dtype
        self.other_layout = other_layout
        self.scale = scale
        self.nonfinite_probe = nonfinite_probe

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def t(self) -> Float8Tensor:
        """The transpose (views of the same bytes)."""
        other = self.other_layout.t() if self.other_layout is not None else None
        return Float8Tensor(self.data.t(), self.scale_inv, self.format, self.dtype, other, self.scale, self.nonfinite_probe)

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

    def values(self) -> torch.Tensor:
        """Each code's fp32 value, unscaled (``FP8Format.decode``): on a CPU the C kernel's one pass over a row-major
        layout (``cpu_cast.decode_fp8``), where it serves."""
        if cpu_cast.decodes(self.data):
            return cpu_cast.decode_fp8(self.row_major(), self.format)
        return self.format.decode(self.data)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (self.values() * self.scale_inv).to(dtype or self.dtype)

    def inner_tensors(self) -> dict[str, torch.Tensor | None]:
        return {"data": self.data, "scale_inv": self.scale_inv, "other_layout": self.other_layout, "scale": self.scale}

    def metadata(self) -> dict[str, Any]:
        return {"fmt": self.format, "dtype": self.dtype}

    @classmethod
    def from_inner(cls, inner: dict[str, torch.Tensor | None], metadata: dict[str, Any]) -> Float8Tensor:
        return cls(inner["data"], inner["scale_inv"], metadata["fmt"], metadata["dtype"], inner["other_layout"], inner["scale"])

    def cast_state(self) -> CastState:
        return None if self.scale is None else (self.scale, self.scale_inv)

    def __repr__(self) -> str:
        return f"Float8Tensor({self.format.name}, shape={tuple(self.shape)}, dtype={self.dtype})"


@dataclass(frozen=True)
class BlockLayout:
    """What one orientation's tensors mean: element format, block ``(height, width)`` (width along the
    last dimension), the unpadded ``shape``, and the key of the Hadamard transform's signs its blocks went
    through (``hadamard.TE_SIGNS`` or an int seed; None: none)."""

    element: ElementFormat
    block: tuple[int, int]
    shape: tuple[int, int]
    hadamard_seed: hadamard.HadamardSigns | None = None


@dataclass
class BlockScaledData:
    """One orientation: ``data`` (padded; FP8 bytes or E2M1 codes), ``scales`` (one per block; their
    ``.float()`` multiplies the block's elements) and NVFP4's per-tensor ``tensor_scale_inv``."""

    data: torch.Tensor
    scales: torch.Tensor
    tensor_scale_inv: torch.Tensor | None
    layout: BlockLayout
    kept: dict[bool, torch.Tensor] | None = dataclasses.field(default=None, compare=False, repr=False)
    """Where :meth:`gemm_operand` keeps what it computed (None: it keeps nothing); a cached weight's cast has one,
    so a GEMM decodes the unchanged weight once, not at every micro-batch."""
    nonfinite_flags: torch.Tensor | None = dataclasses.field(default=None, compare=False, repr=False)
    """What the cast's own read of the source found: fp32 values (one, or one per kernel program), all 0 when every
    source value was finite, one NaN where a value was NaN or infinite; None where the cast did not keep them (see
    :attr:`BlockScaledTensor.nonfinite_probe`). Not part of the saved state."""

    def gemm_operand(self, transformed: bool) -> torch.Tensor:
        """What an emulated GEMM multiplies (read-only): :meth:`values` (``transformed``: both operands went through
        the same Hadamard transform, which cancels in the product), else :meth:`dequantize`."""
        if self.kept is not None and transformed in self.kept:
            return self.kept[transformed]
        operand = self.values() if transformed else self.dequantize()
        if self.kept is not None:
            self.kept[transformed] = operand
        return operand

    def values(self) -> torch.Tensor:
        """The represented values, padded and still Hadamard-transformed if they were (fp32)."""
        if cpu_cast.decodes(self.data):
            return cpu_cast.decode(self.data, self.layout.element, self.layout.block, self.scales, self.tensor_scale_inv)
        height, width = self.layout.block
        rows, cols = self.data.shape
        elements = self.layout.element.decode(self.data).reshape(rows // height, height, cols // width, width)
        out = elements.mul_(self.scales.float()[:, None, :, None]).reshape(rows, cols)  # decode's tensor is this one's
        return out if self.tensor_scale_inv is None else out.mul_(self.tensor_scale_inv)

    def dequantize(self) -> torch.Tensor:
        """The represented values in the unpadded shape, the Hadamard transform undone (fp32)."""
        out = self.values()
        if self.layout.hadamard_seed is not None:
            out = hadamard.inverse(out, self.layout.hadamard_seed)
        rows, cols = self.layout.shape
        return out[:rows, :cols]


class BlockScaledTensor(QuantizedTensor):
    """A 2-D tensor quantized blockwise: ``rowwise`` and optionally ``columnwise`` (see module docstring).

    ``format`` is the FP8 format that features casting per tensor use for it (the element format for
    FP8 recipes, the recipe's ``fp8_format`` for NVFP4); ``dtype`` the high-precision dtype it stands
    for; ``rounding_offset`` the cast number whose noise stochastic rounding used (None: none used).
    """

    def __init__(
        self,
        rowwise: BlockScaledData | None,
        columnwise: BlockScaledData | None,
        fmt: FP8Format,
        dtype: torch.dtype,
        rounding_offset: int | None = None,
    ):
        if rowwise is None and columnwise is None:
            raise LowprecValueError("a BlockScaledTensor needs its rowwise or its columnwise quantization; got neither")
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
            raise LowprecValueError(
                "this BlockScaledTensor has no quantization blocked along the GEMM's inner dimension: quantize "
                "with transpose=True to have it as a GEMM's right operand"
            )
        return self.rowwise

    @property
    def nonfinite_probe(self) -> torch.Tensor | None:
        """As ``Float8Tensor.nonfinite_probe`` (0, or NaN: the source held NaN or inf), from an orientation's
        ``nonfinite_flags`` (several: one reduction on the device, only when asked); None if neither kept them."""
        for part in (self.rowwise, self.columnwise):
            if part is not None and part.nonfinite_flags is not None:
                flags = part.nonfinite_flags
                return flags if flags.dim() == 0 else flags.amax()  # amax propagates NaN
        return None

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The represented values (rowwise, else columnwise) in ``dtype`` (default: the tensor's)."""
        values = self.rowwise.dequantize() if self.rowwise is not None else self.columnwise.dequantize().t()
        return values.to(dtype or self.dtype)

    def inner_tensors(self) -> dict[str, torch.Tensor | None]:
        inner: dict[str, torch.Tensor | None] = {}
        for name, part in (("rowwise", self.rowwise), ("columnwise", self.columnwise)):
            for field in ("data", "scales", "tensor_scale_inv"):
                inner[f"{name}_{field}"] = getattr(part, field) if part is not None else None
        return inner

    def metadata(self) -> dict[str, Any]:
        layouts = {name: part.layout if part is not None else None for name, part in self._parts()}
        kept = {name: part.kept if part is not None else None for name, part in self._parts()}
        return {
            "layouts": layouts,
            "kept": kept,
            "fmt": self.format,
            "dtype": self.dtype,
            "rounding_offset": self.rounding_offset,
        }

    @classmethod
    def from_inner(cls, inner: dict[str, torch.Tensor | None], metadata: dict[str, Any]) -> BlockScaledTensor:
        parts = {}
        for name, layout in metadata["layouts"].items():
            fields = (inner[f"{name}_data"], inner[f"{name}_scales"], inner[f"{name}_tensor_scale_inv"])
            parts[name] = BlockScaledData(*fields, layout, metadata["kept"][name]) if layout is not None else None
        return cls(parts["rowwise"], parts["columnwise"], metadata["fmt"], metadata["dtype"], metadata["rounding_offset"])

    def cast_state(self) -> CastState:
        return self.rounding_offset

    def _parts(self) -> tuple[tuple[str, BlockScaledData | None], ...]:
        return (("rowwise", self.rowwise), ("columnwise", self.columnwise))

    def __repr__(self) -> str:
        layout = (self.rowwise or self.columnwise).layout
        return (
            f"BlockScaledTensor({layout.element.name}, block={layout.block}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"columnwise={self.columnwise is not None})"
        )
