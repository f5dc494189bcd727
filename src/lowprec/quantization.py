"""Quantized tensors and the quantizers that make them.

A ``Float8Tensor`` is FP8 data plus ``scale_inv`` (one fp32 value): the real value of an element is
``data * scale_inv``. Quantizers own the scale: ``CurrentScalingQuantizer`` derives it from the
tensor being cast, ``DelayedScalingQuantizer`` from the amax history of earlier casts. Everything
stays on the tensor's device: no value is read back to the host.
"""

from __future__ import annotations

import torch

from lowprec.formats import FP8Format
from lowprec.recipe import DelayedScaling

FP32_MAX = torch.finfo(torch.float32).max


class Float8Tensor:
    """FP8 ``data`` with its fp32 ``scale_inv``; ``dtype`` is the high-precision dtype it stands for."""

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor, fmt: FP8Format, dtype: torch.dtype):
        self.data = data
        self.scale_inv = scale_inv
        self.format = fmt
        self.dtype = dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def t(self) -> Float8Tensor:
        """The transpose (a view of the same bytes)."""
        return Float8Tensor(self.data.t(), self.scale_inv, self.format, self.dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (self.data.float() * self.scale_inv).to(dtype or self.dtype)

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


def quantize_with_scale(tensor: torch.Tensor, scale: torch.Tensor, fmt: FP8Format) -> Float8Tensor:
    """Cast ``tensor * scale`` to ``fmt`` (round to nearest even, saturating)."""
    data = fmt.cast(tensor.float() * scale)
    return Float8Tensor(data, scale.reciprocal(), fmt, tensor.dtype)


def amax_of(tensor: torch.Tensor) -> torch.Tensor:
    """Largest magnitude as a 0-dim fp32 tensor (0 for an empty tensor; NaN if any element is NaN)."""
    if tensor.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=tensor.device)
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
        return scale_from_amax(amax_of(tensor), self.format, self.margin)

    def quantize(self, tensor: torch.Tensor) -> Float8Tensor:
        return quantize_with_scale(tensor.detach(), self.scale_for(tensor), self.format)


class DelayedScalingQuantizer:
    """Delayed scaling: cast with the scale computed from earlier amaxes, then record this amax.

    The history holds the last ``amax_history_len`` amaxes (newest first); the next scale uses their
    maximum (``"max"``) or the newest (``"most_recent"``). The first cast uses scale 1.
    """

    def __init__(self, fmt: FP8Format, recipe: DelayedScaling):
        self.format = fmt
        self.recipe = recipe
        self.scale = torch.ones((), dtype=torch.float32)
        self.amax_history = torch.zeros(recipe.amax_history_len, dtype=torch.float32)

    @property
    def dtype(self) -> torch.dtype:
        return self.format.dtype

    def scale_for(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.scale.device != tensor.device:
            self.scale = self.scale.to(tensor.device)
            self.amax_history = self.amax_history.to(tensor.device)
        return self.scale

    def quantize(self, tensor: torch.Tensor) -> Float8Tensor:
        tensor = tensor.detach()
        quantized = quantize_with_scale(tensor, self.scale_for(tensor), self.format)
        self.record_amax(amax_of(tensor))
        return quantized

    def record_amax(self, amax: torch.Tensor) -> None:
        """Push ``amax`` into the history and compute the scale of the next cast."""
        self.amax_history = torch.cat([amax.reshape(1).to(self.amax_history), self.amax_history[:-1]])
        if self.recipe.amax_compute_algo == "max":
            reference = self.amax_history.amax()
        else:
            reference = self.amax_history[0]
        self.scale = scale_from_amax(reference, self.format, self.recipe.margin, fallback=self.scale)


Quantizer = CurrentScalingQuantizer | DelayedScalingQuantizer
