"""Per-tensor partial statistics that merge exactly across micro-batches and ranks.

A partial is a float64 vector laid out as ``FIELDS``. Each field has a merge rule: counts and sums
add, extremes take the min or max, and mean/M2 (sum of squared deviations) merge with Chan's
formula, so std stays accurate even when the mean dwarfs the spread. Fields a feature does not fill
keep their identity value, so one layout serves every statistic.

``compute_partials`` reads a tensor once: a CUDA tensor with a Triton kernel (``triton_partials``),
a CPU tensor with a C kernel compiled on first use (``cpu_native``). Without them it makes one pass
per reduction in float32 (float64 for float64 input) with no float64 copy. None synchronises with
the host.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Iterable

import torch

from nvdlfw_inspect.stats.cpu_native import DTYPE_CODES, native_kernel

# name -> (merge rule, identity)
_LAYOUT: dict[str, tuple[str, float]] = {
    "count": ("sum", 0.0),
    "mean": ("chan", 0.0),
    "m2": ("chan", 0.0),
    "min": ("min", math.inf),
    "max": ("max", -math.inf),
    "abs_sum": ("sum", 0.0),
    "abs_min_nonzero": ("min", math.inf),
    "underflows": ("sum", 0.0),
    "overflows": ("sum", 0.0),
    "sq_err": ("sum", 0.0),
    "scale_inv_min": ("min", math.inf),
    "scale_inv_max": ("max", -math.inf),
    "blockwise_dr": ("max", -math.inf),
}
FIELDS = tuple(_LAYOUT)
INDEX = {name: i for i, name in enumerate(FIELDS)}
OPTIONAL_FIELDS = frozenset({"abs_min_nonzero"})
_IDENTITY = [identity for _, identity in _LAYOUT.values()]
_RULE_CODE = {"sum": 0, "chan": 0, "min": 1, "max": 2}
_identity_cache: dict[torch.device, torch.Tensor] = {}
_rule_cache: dict[torch.device, torch.Tensor] = {}
_scratch_cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def identity_partials(device: torch.device) -> torch.Tensor:
    """The cached empty partial of ``device`` (do not modify it; ``empty_partials`` gives a copy)."""
    cached = _identity_cache.get(device)
    if cached is None:  # built by scalar fills: no host-to-device copy, which could wait on the device
        cached = torch.zeros(len(FIELDS), dtype=torch.float64, device=device)
        for i, value in enumerate(_IDENTITY):
            if value:
                cached[i] = value
        _identity_cache[device] = cached
    return cached


def _rule_codes(device: torch.device) -> torch.Tensor:
    """Per field: 0 merges by sum, 1 by min, 2 by max (mean and M2 are overwritten by Chan's formula)."""
    cached = _rule_cache.get(device)
    if cached is None:
        cached = torch.zeros(len(FIELDS), dtype=torch.int8, device=device)
        for i, (rule, _) in enumerate(_LAYOUT.values()):
            if _RULE_CODE[rule]:
                cached[i] = _RULE_CODE[rule]
        _rule_cache[device] = cached
    return cached


def empty_partials(device: torch.device | str = "cpu") -> torch.Tensor:
    """The partial of an empty tensor: the identity of ``merge_partials``."""
    return identity_partials(torch.device(device)).clone()


def _scratch(x: torch.Tensor) -> torch.Tensor:
    """A reusable work buffer shaped like ``x``: no fresh allocation (and page faults) per call."""
    key = (x.device, x.dtype)
    buffer = _scratch_cache.get(key)
    if buffer is None or buffer.numel() < x.numel():
        buffer = _scratch_cache[key] = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
    return buffer[: x.numel()]


@functools.cache
def _fused_kernel() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The Triton kernel for CUDA tensors, or None (with a warning, once) when Triton cannot load."""
    try:
        from nvdlfw_inspect.stats.triton_partials import triton_partials
    except ImportError as error:
        warnings.warn(f"Triton is unavailable ({error}): statistics of CUDA tensors use several torch kernels", stacklevel=3)
        return None
    return triton_partials


def compute_partials(tensor: torch.Tensor, fields: Iterable[str] = ()) -> torch.Tensor:
    """Partials of ``tensor`` (any dtype, any shape). Optional fields are computed only when named.

    The mean (summed pairwise, so accurate to float32 rounding) is the shift that makes
    ``sum((x - mean)^2)`` a well-conditioned M2.
    """
    x = tensor.detach().reshape(-1)
    n = x.numel()
    if n == 0:
        return empty_partials(x.device)
    fused = _fused_kernel() if x.is_cuda else None
    if fused is not None:
        return fused(x)
    native = native_kernel() if x.device.type == "cpu" and x.dtype in DTYPE_CODES else None
    if native is not None:
        out = identity_partials(x.device).clone()
        native(x if x.is_contiguous() else x.contiguous(), out, "abs_min_nonzero" in set(fields))
        return out
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()
    mean = x.mean()
    work = torch.sub(x, mean, out=_scratch(x))
    m2 = work.square_().sum()
    abs_sum = torch.abs(x, out=work).sum()
    low, high = torch.aminmax(x)
    count = torch.full((1,), n, dtype=torch.float64, device=x.device)
    core = torch.stack([mean, m2, low, high, abs_sum]).to(torch.float64)
    out = torch.cat([count, core, identity_partials(x.device)[len(core) + 1 :]])
    if "abs_min_nonzero" in set(fields):
        out[INDEX["abs_min_nonzero"]] = work.masked_fill_(work == 0, math.inf).min().to(torch.float64)
    return out


def set_fields(partials: torch.Tensor, values: dict[str, torch.Tensor | float]) -> torch.Tensor:
    """Write extra fields (underflows, sq_err, ...) into a partial in place, on its device."""
    for name, value in values.items():
        partials[INDEX[name]] = value.to(torch.float64) if isinstance(value, torch.Tensor) else value
    return partials


def merge_partials(rows: torch.Tensor) -> torch.Tensor:
    """Merge partials along dim -2: ``[..., rows, FIELDS] -> [..., FIELDS]`` (a 1-D input is returned)."""
    if rows.dim() == 1:
        return rows
    count = rows[..., INDEX["count"]]
    total = count.sum(-1)
    means = rows[..., INDEX["mean"]]
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    weighted = torch.where(count > 0, count * means, torch.zeros_like(means))
    mean = weighted.sum(-1) / safe_total
    spread = torch.where(count > 0, count * (means - mean.unsqueeze(-1)).square(), torch.zeros_like(means))
    m2 = torch.where(count > 0, rows[..., INDEX["m2"]], torch.zeros_like(means)).sum(-1) + spread.sum(-1)
    rule = _rule_codes(rows.device)
    out = torch.where(rule == 0, rows.sum(-2), torch.where(rule == 1, rows.amin(-2), rows.amax(-2)))
    out[..., INDEX["mean"]] = torch.where(total > 0, mean, torch.zeros_like(mean))
    out[..., INDEX["m2"]] = torch.where(total > 0, m2, torch.zeros_like(m2))
    return out
