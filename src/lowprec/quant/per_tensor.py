"""Quantized tensors and the quantizers that make them.

A ``Float8Tensor`` is FP8 data plus ``scale_inv`` (one fp32 value): the real value of an element is
``data * scale_inv``. Quantizers own the scale: ``CurrentScalingQuantizer`` derives it from the
tensor being cast, ``DelayedScalingQuantizer`` from the amax history of earlier casts. Everything
stays on the tensor's device: no value is read back to the host.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch

from lowprec import kernels
from lowprec.formats.elements import FP8Format
from lowprec.formats.scales import scale_from_amax
from lowprec.kernels import cpu_cast
from lowprec.quant.protocol import CastState, Float8Tensor, Quantizer, detached

DELAYED_LABEL, CURRENT_LABEL = "fp8_delayed_scaling", "fp8_current_scaling"
"""How statistics name the per-tensor recipes (``LogFp8TensorStats``' ``fp8_delayed_scaling_underflows%``)."""


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
    """The cast, and on the fused path with ``record_amax`` its amax partials (see ``kernels.fp8_cast``)."""
    scale_inv = scale.reciprocal() if scale_inv is None else scale_inv
    if kernels.runs_on(tensor):
        from lowprec.kernels import fp8_cast

        data, data_t, partials = fp8_cast.cast_fp8(tensor, scale, fmt, transpose, record_amax)
        other = data_t.t() if data_t is not None else None
        return Float8Tensor(data, scale_inv, fmt, tensor.dtype, other, scale), partials
    return Float8Tensor(fmt.cast(tensor.float() * scale, overwrite=True), scale_inv, fmt, tensor.dtype, scale=scale), None


def amax_of(tensor: torch.Tensor) -> torch.Tensor:
    """Largest magnitude as a 0-dim fp32 tensor, NaN ignored (0 for an empty or all-NaN tensor): Transformer
    Engine's amax kernels reduce with ``fmaxf`` / ``__hmax``, which drop NaN (``recipe/current_scaling.cu``), so
    a NaN element leaves the scale of the others as it was."""
    return amax_and_probe(tensor)[0]


def amax_and_probe(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`amax_of` and, where the read that finds it also tells it (the C kernel on a CPU), the tensor's
    non-finite probe (``Float8Tensor.nonfinite_probe``); else None: finding it would take another read."""
    if tensor.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=tensor.device), None
    if kernels.runs_on(tensor):
        from lowprec.kernels import fp8_cast

        return fp8_cast.amax_of(tensor), None
    if cpu_cast.scans(tensor):
        return cpu_cast.amax_and_probe(tensor)
    return nan_ignoring_amax(tensor.detach().abs()), None


def nan_ignoring_amax(magnitudes: torch.Tensor) -> torch.Tensor:
    """The largest of non-negative ``magnitudes`` as a 0-dim fp32 tensor, NaN ignored (0 if none is a number)."""
    return magnitudes.nan_to_num(nan=0.0, posinf=math.inf).amax().float()


class CurrentScalingQuantizer:
    """Per-tensor current scaling: each cast takes its scale from the tensor's own amax."""

    label = CURRENT_LABEL

    def __init__(self, fmt: FP8Format, margin: int = 0):
        self.format = fmt
        self.margin = margin

    @property
    def dtype(self) -> torch.dtype:
        return self.format.dtype

    def scale_for(self, tensor: torch.Tensor) -> torch.Tensor:
        """The scale of ``tensor``: on the fused path one pass for the amax and a tiny kernel."""
        if kernels.runs_on(tensor):
            from lowprec.kernels import fp8_scales

            return fp8_scales.current_scaling(tensor, self.format, self.margin)[0]
        return scale_from_amax(amax_of(tensor), self.format, self.margin)

    def quantize(self, tensor: torch.Tensor, transpose: bool = False) -> Float8Tensor:
        """On the fused path: one pass for the amax (and the non-finite probe), a tiny kernel for the scale, one for
        the cast."""
        tensor = detached(tensor)
        if kernels.runs_on(tensor):
            from lowprec.kernels import fp8_scales

            scale, scale_inv, probe = fp8_scales.current_scaling(tensor, self.format, self.margin)
            quantized = quantize_with_scale(tensor, scale, self.format, transpose, scale_inv)
        else:
            amax, probe = amax_and_probe(tensor)
            quantized = quantize_with_scale(tensor, scale_from_amax(amax, self.format, self.margin), self.format, transpose)
        quantized.nonfinite_probe = probe
        return quantized

    def replaying(self, state: CastState) -> Quantizer:
        return self if state is None else FixedScaleQuantizer(self.format, *state, label=self.label)


def outside_inference_mode() -> AbstractContextManager:
    """Where a quantizer updates the state it keeps between forwards: under ``torch.inference_mode`` (a validation
    between training steps, Lightning's default) that state would become inference tensors, which the next
    training step could not save for backward. Inside this block it stays made of normal tensors."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else nullcontext()


class AmaxHistorySettings(Protocol):
    """What delayed scaling takes from its recipe (``lowprec.DelayedScaling``)."""

    margin: int
    amax_history_len: int
    amax_compute_algo: str


class DelayedScalingQuantizer:
    """Delayed scaling: cast with the scale computed from earlier amaxes, then record this amax.

    The history holds the last ``amax_history_len`` amaxes (newest first); the next scale uses their
    maximum (``"max"``) or the newest (``"most_recent"``). The first cast uses scale 1. Every cast records its
    amax, evaluation forwards' (under ``torch.no_grad`` or ``torch.inference_mode``, alike) included.
    """

    label = DELAYED_LABEL

    def __init__(self, fmt: FP8Format, recipe: AmaxHistorySettings):
        self.format = fmt
        self.recipe = recipe
        self.scale = torch.ones((), dtype=torch.float32)
        self.scale_inv = torch.ones((), dtype=torch.float32)
        self.amax_history = torch.zeros(recipe.amax_history_len, dtype=torch.float32)
        self._initial_state = (self.scale, self.scale_inv, self.amax_history)  # every update replaces the tensors

    @property
    def dtype(self) -> torch.dtype:
        return self.format.dtype

    def scale_for(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.scale.device != tensor.device:
            self._move_state(tensor.device)
        return self.scale

    def _move_state(self, device: torch.device) -> None:
        """The state on ``device``: the initial one made there (a copy from the host inside the first step
        would wait for the GPU), one that recorded amaxes copied."""
        state = (self.scale, self.scale_inv, self.amax_history)
        if all(now is initial for now, initial in zip(state, self._initial_state, strict=True)):
            self.scale, self.scale_inv = (torch.ones((), dtype=torch.float32, device=device) for _ in range(2))
            self.amax_history = torch.zeros(self.recipe.amax_history_len, dtype=torch.float32, device=device)
        else:
            self.scale, self.scale_inv, self.amax_history = (t.to(device) for t in state)

    def quantize(self, tensor: torch.Tensor, transpose: bool = False) -> Float8Tensor:
        """On the fused path: one pass casts (and transposes if asked) and records the amax; a tiny
        kernel then updates the history and the scales."""
        tensor = detached(tensor)
        with outside_inference_mode():
            scale = self.scale_for(tensor)
            quantized, partials = _cast(tensor, scale, self.format, transpose, self.scale_inv, record_amax=True)
            if partials is None:
                amax, quantized.nonfinite_probe = amax_and_probe(tensor)
                self.record_amax(amax)
            else:
                from lowprec.kernels import fp8_scales

                use_max = self.recipe.amax_compute_algo == "max"
                self.amax_history, self.scale, self.scale_inv, quantized.nonfinite_probe = fp8_scales.delayed_scaling_update(
                    partials, self.amax_history, scale, self.format, self.recipe.margin, use_max
                )
        return quantized

    def record_amax(self, amax: torch.Tensor) -> None:
        """Push ``amax`` (a 0-dim fp32 tensor) into the history and compute the scale of the next cast."""
        with outside_inference_mode():
            if kernels.runs_on(amax.reshape(1, 1)):
                from lowprec.kernels import fp8_scales

                use_max = self.recipe.amax_compute_algo == "max"
                self.amax_history, self.scale, self.scale_inv, _ = fp8_scales.delayed_scaling_update(
                    amax.reshape(1), self.amax_history, self.scale, self.format, self.recipe.margin, use_max
                )
                return
            self.amax_history = torch.cat([amax.reshape(1).to(self.amax_history), self.amax_history[:-1]])
            if self.recipe.amax_compute_algo == "max":
                reference = nan_ignoring_amax(self.amax_history)  # ``fmaxf`` over the history (``delayed_scaling.cu``)
            else:
                reference = self.amax_history[0]
            self.scale = scale_from_amax(reference, self.format, self.recipe.margin, fallback=self.scale)
            self.scale_inv = self.scale.reciprocal()

    def replaying(self, state: CastState) -> Quantizer:
        """Without a state (the original did not cast) the current scale, so nothing is recorded."""
        scale, scale_inv = state if state is not None else (self.scale, self.scale_inv)
        return FixedScaleQuantizer(self.format, scale, scale_inv, label=self.label)


class FixedScaleQuantizer:
    """Casts with a scale given up front and records nothing: how a recomputed forward (activation
    checkpointing) repeats the casts of its original forward exactly, whatever the recipe."""

    def __init__(self, fmt: FP8Format, scale: torch.Tensor, scale_inv: torch.Tensor, label: str = CURRENT_LABEL):
        self.format = fmt
        self.scale = scale
        self.scale_inv = scale_inv
        self.label = label

    @property
    def dtype(self) -> torch.dtype:
        return self.format.dtype

    def scale_for(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.scale

    def quantize(self, tensor: torch.Tensor, transpose: bool = False) -> Float8Tensor:
        return quantize_with_scale(tensor.detach(), self.scale, self.format, transpose, self.scale_inv)

    def replaying(self, state: CastState) -> Quantizer:
        return self if state is None else FixedScaleQuantizer(self.format, *state, label=self.label)
