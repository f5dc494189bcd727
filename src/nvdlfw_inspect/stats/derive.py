"""Final statistics derived from merged partials, and which optional partial fields each one needs.

Derivations are elementwise torch expressions over the partial's fields, so the same code gives one
0-dim tensor on the device (returned to callers without a host sync) or a whole column of values for
every buffer of a step at once (at ``debug_api.step()``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from nvdlfw_inspect.stats.partials import FIELDS

Columns = dict[str, torch.Tensor]


def _nan_if_empty(value: Callable[[Columns], torch.Tensor]) -> Callable[[Columns], torch.Tensor]:
    return lambda p: torch.where(p["count"] > 0, value(p), math.nan)


def _std(p: Columns) -> torch.Tensor:
    n = p["count"]
    return torch.where(n > 1, (p["m2"].clamp(min=0) / (n - 1).clamp(min=1)).sqrt(), math.nan)


def _amax(p: Columns) -> torch.Tensor:
    return torch.maximum(p["min"].abs(), p["max"].abs())


def _dynamic_range(p: Columns) -> torch.Tensor:
    """``log2(amax) - log2(smallest non-zero |x|)``; 0 for a tensor of zeros, NaN if undefined."""
    amin, amax = p["abs_min_nonzero"], _amax(p)
    ratio = amax.log2() - amin.log2()
    ratio = torch.where(amin.isinf(), torch.where(amax.isinf(), math.nan, 0.0), ratio)
    ratio = torch.where(amax == 0, 0.0, ratio)
    return torch.where(amax.isnan() | amin.isnan(), math.nan, ratio)


def _l2_norm(p: Columns) -> torch.Tensor:
    """``sqrt(sum x^2)`` rebuilt from M2 and the mean; inf (not NaN) when the tensor holds +/-inf but no NaN."""
    norm = (p["m2"] + p["count"] * p["mean"].square()).clamp(min=0).sqrt()
    return torch.where(p["abs_sum"].isinf(), math.inf, norm)


def _percent(field: str) -> Callable[[Columns], torch.Tensor]:
    return _nan_if_empty(lambda p: 100.0 * p[field] / p["count"].clamp(min=1))


_DERIVATIONS: dict[str, tuple[Callable[[Columns], torch.Tensor], tuple[str, ...]]] = {
    "min": (_nan_if_empty(lambda p: p["min"]), ()),
    "max": (_nan_if_empty(lambda p: p["max"]), ()),
    "mean": (_nan_if_empty(lambda p: p["mean"]), ()),
    "std": (_std, ()),
    "l1_norm": (lambda p: p["abs_sum"], ()),
    "l2_norm": (_l2_norm, ()),
    "cur_amax": (_nan_if_empty(_amax), ()),
    "dynamic_range": (_nan_if_empty(_dynamic_range), ("abs_min_nonzero",)),
    "underflows%": (_percent("underflows"), ()),
    "overflows%": (_percent("overflows"), ()),
    "mse": (_nan_if_empty(lambda p: p["sq_err"] / p["count"].clamp(min=1)), ()),
    "scale_inv_min": (_nan_if_empty(lambda p: p["scale_inv_min"]), ()),
    "scale_inv_max": (_nan_if_empty(lambda p: p["scale_inv_max"]), ()),
    "max_blockwise_dynamic_range": (_nan_if_empty(lambda p: p["blockwise_dr"]), ()),
    "count": (lambda p: p["count"], ()),  # how many values were fed: summed over micro-batches and ranks
}
STAT_PARTIALS = {name: fields for name, (_, fields) in _DERIVATIONS.items()}
BASE_STATS = ("min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range")


def supported_stats() -> list[str]:
    """The statistics computed from the tensor alone (FP8 and blockwise ones need their feature)."""
    return list(BASE_STATS)


def fields_for(stats: Iterable[str]) -> set[str]:
    """Optional partial fields that computing ``stats`` requires."""
    return {field for stat in stats for field in STAT_PARTIALS[stat]}


def derive_tensors(partials: torch.Tensor, stats: Iterable[str]) -> dict[str, torch.Tensor]:
    """The named statistics of merged partials ``[..., FIELDS]``, as float64 tensors on their device."""
    columns = {name: partials[..., i] for i, name in enumerate(FIELDS)}
    return {stat: _DERIVATIONS[stat][0](columns) for stat in stats}


def derive_stats(partials: torch.Tensor, stats: Iterable[str]) -> dict[str, float]:
    """The named statistics of one merged partial as Python floats (one copy to the host)."""
    stats = list(stats)
    values = derive_tensors(partials.detach().cpu(), stats)
    return {stat: float(value) for stat, value in values.items()}
