"""Per-tensor partial statistics that merge exactly across micro-batches and ranks.

A partial is a float64 vector laid out as ``FIELDS``. Each field has a merge rule: counts and sums
add, extremes take the min or max, and mean/M2 (sum of squared deviations) merge with Chan's
formula, so std stays accurate even when the mean dwarfs the spread. Fields a feature does not fill
keep their identity value, so one layout serves every statistic.

``compute_partials`` reads a tensor once with the statistics operator (``kernels.tensor_stats``:
a Triton kernel for CUDA tensors, a C kernel for CPU tensors, torch reductions without them). None
synchronises with the host.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

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


def _on_device(values: list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor built on ``device`` by scalar fills: no copy from host memory, which on
    CUDA would wait for the device."""
    out = torch.zeros(len(values), dtype=dtype, device=device)
    for i, value in enumerate(values):
        if value:
            out[i : i + 1].fill_(value)
    return out


def identity_partials(device: torch.device | str) -> torch.Tensor:
    """The cached empty partial of ``device`` (do not modify it; ``empty_partials`` gives a copy)."""
    device = torch.device(device)
    if device not in _identity_cache:
        _identity_cache[device] = _on_device(_IDENTITY, torch.float64, device)
    return _identity_cache[device]


def _rule_codes(device: torch.device) -> torch.Tensor:
    """Per field: 0 merges by sum, 1 by min, 2 by max (mean and M2 are overwritten by Chan's formula)."""
    if device not in _rule_cache:
        _rule_cache[device] = _on_device([_RULE_CODE[rule] for rule, _ in _LAYOUT.values()], torch.int8, device)
    return _rule_cache[device]


def empty_partials(device: torch.device | str = "cpu") -> torch.Tensor:
    """The partial of an empty tensor: the identity of ``merge_partials``."""
    return identity_partials(device).clone()


def compute_partials(tensor: torch.Tensor, fields: Iterable[str] = ()) -> torch.Tensor:
    """Partials of ``tensor`` (any dtype, any shape) as one row. Optional fields (``OPTIONAL_FIELDS``)
    are computed only when named."""
    from nvdlfw_inspect.stats.kernels import tensor_stats

    row = empty_partials(tensor.device)
    tensor_stats(tensor.detach(), row.view(1, -1), [0], want_abs_min="abs_min_nonzero" in set(fields))
    return row


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


def set_fields(partials: torch.Tensor, values: dict[str, torch.Tensor | float]) -> torch.Tensor:
    """Write fields (underflows, blockwise_dr, ...) into a partial in place, on its device: tensors
    are copied device to device, Python numbers filled in (no copy from host memory)."""
    for name, value in values.items():
        target = partials[INDEX[name] : INDEX[name] + 1]
        if isinstance(value, torch.Tensor):
            target.copy_(value.reshape(1))
        else:
            target.fill_(value)
    return partials
