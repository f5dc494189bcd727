"""Scales of FP8 casts computed on the GPU by one tiny Triton kernel each, from the amax partials that
``kernels.fp8_cast`` writes: current scaling's scale, and delayed scaling's amax history and next scale.

Every rounding follows ``formats.scales.scale_from_amax`` as torch performs it (``fp8_max / amax`` is
``reciprocal(amax) * fp8_max`` there), with correctly rounded divisions, so the scales equal the CPU
emulation's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowprec.formats.elements import FP8Format
from lowprec.kernels.fp8_cast import FP32_MAX_CONSTEXPR, OPTIONS, _nan_aware_max, amax_partials

PARTIALS_BLOCK = 1024


@triton.jit
def _max_of_partials(partials_ptr, n, BLOCK: tl.constexpr):
    running = tl.zeros((BLOCK,), dtype=tl.float32)
    start = 0
    while start < n:  # not ``for``: see ``kernels.fp8_cast``'s docstring
        offsets = start + tl.arange(0, BLOCK)
        value = tl.load(partials_ptr + offsets, mask=offsets < n, other=0.0)
        running = tl.where((value > running) | (value != value), value, running)
        start += BLOCK
    return _nan_aware_max(running)


@triton.jit
def _scale_from_amax(reference, fallback, FP8_MAX: tl.constexpr, MARGIN_FACTOR: tl.constexpr):
    """``formats.scales.scale_from_amax`` step by step, each rounding as torch does it there:
    ``fp8_max / amax`` is ``reciprocal(amax) * fp8_max`` in torch, then ``/ 2**margin``."""
    usable = (reference == reference) & (reference < float("inf")) & (reference > 0.0)
    scale = tl.math.div_rn(1.0, tl.where(usable, reference, 1.0)) * FP8_MAX
    scale = tl.math.div_rn(scale, MARGIN_FACTOR)
    scale = tl.where(scale == float("inf"), FP32_MAX_CONSTEXPR, scale)
    return tl.where(usable, scale, fallback)


@triton.jit
def _current_scale(
    partials_ptr, n, scale_ptr, scale_inv_ptr, FP8_MAX: tl.constexpr, MARGIN_FACTOR: tl.constexpr, BLOCK: tl.constexpr
):
    scale = _scale_from_amax(_max_of_partials(partials_ptr, n, BLOCK), 1.0, FP8_MAX, MARGIN_FACTOR)
    tl.store(scale_ptr, scale)
    tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale))


@triton.jit
def _delayed_update(
    partials_ptr,
    n,
    history_ptr,
    new_history_ptr,
    scale_ptr,
    new_scale_ptr,
    new_scale_inv_ptr,
    HISTORY: tl.constexpr,
    HISTORY_BLOCK: tl.constexpr,
    USE_MAX: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MARGIN_FACTOR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    amax = _max_of_partials(partials_ptr, n, BLOCK)
    slot = tl.arange(0, HISTORY_BLOCK)
    older = tl.load(history_ptr + slot - 1, mask=(slot >= 1) & (slot < HISTORY), other=0.0)
    history = tl.where(slot == 0, amax, older)  # newest first, the oldest dropped
    tl.store(new_history_ptr + slot, history, mask=slot < HISTORY)
    reference = _nan_aware_max(tl.where(slot < HISTORY, history, 0.0)) if USE_MAX else amax
    scale = _scale_from_amax(reference, tl.load(scale_ptr), FP8_MAX, MARGIN_FACTOR)
    tl.store(new_scale_ptr, scale)
    tl.store(new_scale_inv_ptr, tl.math.div_rn(1.0, scale))


def current_scaling(tensor: torch.Tensor, fmt: FP8Format, margin: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, scale_inv)`` of ``tensor`` under current scaling (0-dim fp32): one read of the tensor
    and one tiny kernel, equal to ``scale_from_amax(amax_of(tensor), fmt, margin)`` and its reciprocal."""
    partials = amax_partials(tensor)
    scale, scale_inv = (torch.empty((), dtype=torch.float32, device=tensor.device) for _ in range(2))
    _current_scale[(1,)](
        partials, partials.numel(), scale, scale_inv, FP8_MAX=fmt.max, MARGIN_FACTOR=2.0**margin, BLOCK=PARTIALS_BLOCK, **OPTIONS
    )
    return scale, scale_inv


def delayed_scaling_update(
    partials: torch.Tensor, history: torch.Tensor, scale: torch.Tensor, fmt: FP8Format, margin: int, use_max: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(history, scale, scale_inv)`` after a cast whose amax partials are ``partials``: the amax
    pushed into the history (newest first), the next scale from the history's max (``use_max``) or
    the newest amax, ``scale`` kept where that amax is 0 or not finite. One tiny kernel; the same
    numbers as ``DelayedScalingQuantizer.record_amax``."""
    new_history = torch.empty_like(history)
    new_scale, new_scale_inv = (torch.empty((), dtype=torch.float32, device=history.device) for _ in range(2))
    _delayed_update[(1,)](
        partials,
        partials.numel(),
        history,
        new_history,
        scale.reshape(1),
        new_scale,
        new_scale_inv,
        HISTORY=history.numel(),
        HISTORY_BLOCK=triton.next_power_of_2(history.numel()),
        USE_MAX=use_max,
        FP8_MAX=fmt.max,
        MARGIN_FACTOR=2.0**margin,
        BLOCK=PARTIALS_BLOCK,
        **OPTIONS,
    )
    return new_history, new_scale, new_scale_inv
