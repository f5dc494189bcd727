"""Scales of FP8 casts computed on the GPU by one tiny Triton kernel each, from the amax partials that
``kernels.fp8_cast`` writes: current scaling's scale, and delayed scaling's amax history and next scale.

Every rounding follows ``formats.scales.scale_from_amax``: ``(fp8_max * 2**-margin) / amax``, one correctly
rounded division (``tl.math.div_rn``, TE's ``__fdiv_rn``), so the scales equal the CPU emulation's and
Transformer Engine's bit for bit. Amaxes ignore NaN, as TE's ``fmaxf`` does.

From partials of shape ``(2, P)`` the same kernel also writes a probe: a 0-dim fp32 that is 0 when the tensor
held only finite values and NaN when it held a NaN or an infinity (row 1 of the partials). A NaN/inf guard
reads it (or adds it to what it checks anyway) instead of reading the tensor again, and no host waits for it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowprec.formats.elements import FP8Format
from lowprec.kernels.fp8_cast import FP32_MAX_CONSTEXPR, OPTIONS, amax_partials, fp32, nan_ignoring_max

PARTIALS_BLOCK = 1024


@triton.jit
def _reduce_partials(partials_ptr, n, BLOCK: tl.constexpr, PROBE: tl.constexpr):
    """``(amax, probe)`` of ``n`` partials: the max of row 0, NaN ignored, and with ``PROBE`` NaN if row 1
    (``n`` further on) flags a non-finite value, else 0. Without ``PROBE`` (1-D partials) row 1 is not read."""
    running = tl.zeros((BLOCK,), dtype=tl.float32)
    flagged = tl.zeros((BLOCK,), dtype=tl.float32)
    start = 0
    while start < n:  # not ``for``: see ``kernels.fp8_cast``'s docstring
        offsets = start + tl.arange(0, BLOCK)
        value = tl.load(partials_ptr + offsets, mask=offsets < n, other=0.0)
        running = tl.where(value > running, value, running)  # False for NaN: ignored
        if PROBE:
            flagged = tl.maximum(flagged, tl.load(partials_ptr + n + offsets, mask=offsets < n, other=0.0))
        start += BLOCK
    return tl.max(running), tl.where(tl.max(flagged) > 0.0, float("nan"), 0.0)


@triton.jit
def _scale_from_amax(reference, fallback, SCALED_MAX: tl.constexpr):
    """``formats.scales.scale_from_amax``: ``SCALED_MAX / amax`` (``SCALED_MAX = fp8_max * 2**-margin``)
    correctly rounded, fp32 max for an overflow, ``fallback`` for an amax of 0, inf or NaN."""
    usable = (reference == reference) & (reference < float("inf")) & (reference > 0.0)
    scale = tl.math.div_rn(tl.zeros_like(reference) + SCALED_MAX, tl.where(usable, reference, 1.0))
    scale = tl.where(scale == float("inf"), FP32_MAX_CONSTEXPR, scale)
    return tl.where(usable, scale, fallback)


@triton.jit
def _current_scale(partials_ptr, n, scale_ptr, scale_inv_ptr, probe_ptr, SCALED_MAX: tl.constexpr, BLOCK: tl.constexpr):
    amax, probe = _reduce_partials(partials_ptr, n, BLOCK, True)
    scale = _scale_from_amax(amax, 1.0, SCALED_MAX)
    tl.store(scale_ptr, scale)
    tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale))
    tl.store(probe_ptr, probe)


@triton.jit
def _delayed_update(
    partials_ptr,
    n,
    history_ptr,
    new_history_ptr,
    scale_ptr,
    new_scale_ptr,
    new_scale_inv_ptr,
    probe_ptr,
    HISTORY: tl.constexpr,
    HISTORY_BLOCK: tl.constexpr,
    USE_MAX: tl.constexpr,
    SCALED_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
    PROBE: tl.constexpr,
):
    amax, probe = _reduce_partials(partials_ptr, n, BLOCK, PROBE)
    slot = tl.arange(0, HISTORY_BLOCK)
    older = tl.load(history_ptr + slot - 1, mask=(slot >= 1) & (slot < HISTORY), other=0.0)
    history = tl.where(slot == 0, amax, older)  # newest first, the oldest dropped
    tl.store(new_history_ptr + slot, history, mask=slot < HISTORY)
    reference = nan_ignoring_max(tl.where(slot < HISTORY, history, 0.0)) if USE_MAX else amax
    scale = _scale_from_amax(reference, tl.load(scale_ptr), SCALED_MAX)
    tl.store(new_scale_ptr, scale)
    tl.store(new_scale_inv_ptr, tl.math.div_rn(1.0, scale))
    if PROBE:
        tl.store(probe_ptr, probe)


def scaled_max(fmt: FP8Format, margin: int) -> float:
    """``fp8_max * 2**-margin`` as an fp32 value (what the scale kernels divide by the amax)."""
    return fp32(fmt.max * 2.0**-margin)


def current_scaling(tensor: torch.Tensor, fmt: FP8Format, margin: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scale, scale_inv, probe)`` of ``tensor`` under current scaling (0-dim fp32): one read of the tensor
    and one tiny kernel, equal to ``scale_from_amax(amax_of(tensor), fmt, margin)`` and its reciprocal; the
    probe 0, or NaN if the tensor held a NaN or an infinity (see the module docstring)."""
    partials = amax_partials(tensor)
    scale, scale_inv, probe = (torch.empty((), dtype=torch.float32, device=tensor.device) for _ in range(3))
    _current_scale[(1,)](
        partials,
        partials.shape[1],
        scale,
        scale_inv,
        probe,
        SCALED_MAX=scaled_max(fmt, margin),
        BLOCK=PARTIALS_BLOCK,
        **OPTIONS,
    )
    return scale, scale_inv, probe


def delayed_scaling_update(
    partials: torch.Tensor, history: torch.Tensor, scale: torch.Tensor, fmt: FP8Format, margin: int, use_max: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(history, scale, scale_inv, probe)`` after a cast whose amax partials are ``partials``: the amax
    pushed into the history (newest first), the next scale from the history's max (``use_max``) or
    the newest amax, ``scale`` kept where that amax is 0 or not finite. One tiny kernel; the same
    numbers as ``DelayedScalingQuantizer.record_amax``. ``partials`` of shape ``(2, P)`` (a cast's) also
    give the probe (see the module docstring); 1-D ones, amaxes alone (a caller that has only an amax),
    give None."""
    if partials.dim() == 2 and partials.shape[0] != 2:
        raise ValueError(f"amax partials of shape (2, P) or (P,), not {tuple(partials.shape)}")
    with_probe = partials.dim() == 2
    partials = partials.contiguous()
    new_history = torch.empty_like(history)
    new_scale, new_scale_inv = (torch.empty((), dtype=torch.float32, device=history.device) for _ in range(2))
    probe = torch.empty((), dtype=torch.float32, device=history.device) if with_probe else None
    _delayed_update[(1,)](
        partials,
        partials.shape[1] if with_probe else partials.numel(),
        history,
        new_history,
        scale.reshape(1),
        new_scale,
        new_scale_inv,
        probe if probe is not None else new_scale,  # not written without PROBE
        HISTORY=history.numel(),
        HISTORY_BLOCK=triton.next_power_of_2(history.numel()),
        USE_MAX=use_max,
        SCALED_MAX=scaled_max(fmt, margin),
        BLOCK=PARTIALS_BLOCK,
        PROBE=with_probe,
        **OPTIONS,
    )
    return new_history, new_scale, new_scale_inv, probe
