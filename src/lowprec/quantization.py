"""Quantized tensors and the quantizers that make them.

A ``Float8Tensor`` is FP8 data plus ``scale_inv`` (one fp32 value): the real value of an element is
``data * scale_inv``. Quantizers own the scale: ``CurrentScalingQuantizer`` derives it from the
tensor being cast, ``DelayedScalingQuantizer`` from the amax history of earlier casts. Everything
stays on the tensor's device: no value is read back to the host.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from lowprec.block_quantization import BlockQuantizer
from lowprec.formats import FP8Format
from lowprec.recipe import DelayedScaling

FP32_MAX = torch.finfo(torch.float32).max


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


def scale_from_amax(amax: torch.Tensor, fmt: FP8Format, margin: int = 0, fallback: torch.Tensor | float = 1.0) -> torch.Tensor:
    """``fp8_max / amax / 2**margin`` in fp32, fp32 max if that overflows; ``fallback`` where amax is
    0 or not finite."""
    amax = amax.float()
    usable = torch.isfinite(amax) & (amax > 0)
    scale = fmt.max / torch.where(usable, amax, 1.0) / (2.0**margin)
    scale = torch.where(torch.isinf(scale), FP32_MAX, scale)
    return torch.where(usable, scale, fallback)


FUSED_KERNELS = os.environ.get("LOWPREC_FUSED_CAST", "1") != "0"
"""Cast CUDA tensors with the Triton kernels of ``lowprec.triton_cast`` (env ``LOWPREC_FUSED_CAST=0``: no)."""


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _has_fp8_conversions(device: torch.device) -> bool:
    """Triton's FP8 types need compute capability 8.9 or later (as do FP8 GEMMs)."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


def uses_fused_kernels(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is cast by the Triton kernels: a 2-D tensor on a CUDA device with FP8
    support, with Triton installed and ``FUSED_KERNELS`` on, outside ``torch.compile`` (the compiler
    fuses the same torch operations itself)."""
    return (
        FUSED_KERNELS
        and not torch.compiler.is_compiling()
        and tensor.is_cuda
        and tensor.dim() == 2
        and _triton_installed()
        and _has_fp8_conversions(tensor.device)
    )


def quantize_with_scale(
    tensor: torch.Tensor,
    scale: torch.Tensor,
    fmt: FP8Format,
    transpose: bool = False,
    scale_inv: torch.Tensor | None = None,
) -> Float8Tensor:
    """Cast ``tensor * scale`` to ``fmt`` (round to nearest even, saturating); on the fused path
    ``transpose`` also writes the other memory order. ``scale_inv`` saves the reciprocal's kernel."""
    return _cast(tensor, scale, fmt, transpose, scale_inv, record_amax=False)[0]


def _cast(
    tensor: torch.Tensor,
    scale: torch.Tensor,
    fmt: FP8Format,
    transpose: bool,
    scale_inv: torch.Tensor | None,
    record_amax: bool,
) -> tuple[Float8Tensor, torch.Tensor | None]:
    """The cast, and on the fused path with ``record_amax`` its amax partials (see ``triton_cast``)."""
    scale_inv = scale.reciprocal() if scale_inv is None else scale_inv
    if uses_fused_kernels(tensor):
        from lowprec import triton_cast

        data, data_t, partials = triton_cast.cast_fp8(tensor, scale, fmt, transpose, record_amax)
        other = data_t.t() if data_t is not None else None
        return Float8Tensor(data, scale_inv, fmt, tensor.dtype, other, scale), partials
    return Float8Tensor(fmt.cast(tensor.float() * scale), scale_inv, fmt, tensor.dtype, scale=scale), None


def amax_of(tensor: torch.Tensor) -> torch.Tensor:
    """Largest magnitude as a 0-dim fp32 tensor (0 for an empty tensor; NaN if any element is NaN)."""
    if tensor.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=tensor.device)
    if uses_fused_kernels(tensor):
        from lowprec import triton_cast

        return triton_cast.amax_of(tensor)
    return tensor.detach().abs().amax().float()


class CurrentScalingQuantizer:
    """Per-tensor current scaling: each cast takes its scale from the tensor's own amax."""

    def __init__(self, fmt: FP8Format, margin: int = 0):
        self.format = fmt
        self.margin = margin

    @property
    def dtype(self) -> torch.dtype:
        return self.format.dtype

    def scale_for(self, tensor: torch.Tensor) -> torch.Tensor:
        """The scale of ``tensor``: on the fused path one pass for the amax and a tiny kernel."""
        if uses_fused_kernels(tensor):
            from lowprec import triton_scales

            return triton_scales.current_scaling(tensor, self.format, self.margin)[0]
        return scale_from_amax(amax_of(tensor), self.format, self.margin)

    def quantize(self, tensor: torch.Tensor, transpose: bool = False) -> Float8Tensor:
        """On the fused path: one pass for the amax, a tiny kernel for the scale, one for the cast."""
        tensor = tensor.detach()
        if uses_fused_kernels(tensor):
            from lowprec import triton_scales

            scale, scale_inv = triton_scales.current_scaling(tensor, self.format, self.margin)
            return quantize_with_scale(tensor, scale, self.format, transpose, scale_inv)
        return quantize_with_scale(tensor, self.scale_for(tensor), self.format, transpose)


class DelayedScalingQuantizer:
    """Delayed scaling: cast with the scale computed from earlier amaxes, then record this amax.

    The history holds the last ``amax_history_len`` amaxes (newest first); the next scale uses their
    maximum (``"max"``) or the newest (``"most_recent"``). The first cast uses scale 1.
    """

    def __init__(self, fmt: FP8Format, recipe: DelayedScaling):
        self.format = fmt
        self.recipe = recipe
        self.scale = torch.ones((), dtype=torch.float32)
        self.scale_inv = torch.ones((), dtype=torch.float32)
        self.amax_history = torch.zeros(recipe.amax_history_len, dtype=torch.float32)

    @property
    def dtype(self) -> torch.dtype:
        return self.format.dtype

    def scale_for(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.scale.device != tensor.device:
            self.scale, self.scale_inv = self.scale.to(tensor.device), self.scale_inv.to(tensor.device)
            self.amax_history = self.amax_history.to(tensor.device)
        return self.scale

    def quantize(self, tensor: torch.Tensor, transpose: bool = False) -> Float8Tensor:
        """On the fused path: one pass casts (and transposes if asked) and records the amax; a tiny
        kernel then updates the history and the scales."""
        tensor = tensor.detach()
        scale = self.scale_for(tensor)
        quantized, partials = _cast(tensor, scale, self.format, transpose, self.scale_inv, record_amax=True)
        if partials is None:
            self.record_amax(amax_of(tensor))
        else:
            from lowprec import triton_scales

            use_max = self.recipe.amax_compute_algo == "max"
            self.amax_history, self.scale, self.scale_inv = triton_scales.delayed_scaling_update(
                partials, self.amax_history, scale, self.format, self.recipe.margin, use_max
            )
        return quantized

    def record_amax(self, amax: torch.Tensor) -> None:
        """Push ``amax`` (a 0-dim fp32 tensor) into the history and compute the scale of the next cast."""
        if uses_fused_kernels(amax.reshape(1, 1)):
            from lowprec import triton_scales

            use_max = self.recipe.amax_compute_algo == "max"
            self.amax_history, self.scale, self.scale_inv = triton_scales.delayed_scaling_update(
                amax.reshape(1), self.amax_history, self.scale, self.format, self.recipe.margin, use_max
            )
            return
        self.amax_history = torch.cat([amax.reshape(1).to(self.amax_history), self.amax_history[:-1]])
        if self.recipe.amax_compute_algo == "max":
            reference = self.amax_history.amax()
        else:
            reference = self.amax_history[0]
        self.scale = scale_from_amax(reference, self.format, self.recipe.margin, fallback=self.scale)
        self.scale_inv = self.scale.reciprocal()


class FixedScaleQuantizer:
    """Casts with a scale given up front and records nothing: how a recomputed forward (activation
    checkpointing) repeats the casts of its original forward exactly, whatever the recipe."""

    def __init__(self, fmt: FP8Format, scale: torch.Tensor, scale_inv: torch.Tensor):
        self.format = fmt
        self.scale = scale
        self.scale_inv = scale_inv

    @property
    def dtype(self) -> torch.dtype:
        return self.format.dtype

    def scale_for(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.scale

    def quantize(self, tensor: torch.Tensor, transpose: bool = False) -> Float8Tensor:
        return quantize_with_scale(tensor.detach(), self.scale, self.format, transpose, self.scale_inv)


Quantizer = CurrentScalingQuantizer | DelayedScalingQuantizer | FixedScaleQuantizer | BlockQuantizer
