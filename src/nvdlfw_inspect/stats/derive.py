"""Final statistics derived from merged partials, and which partial fields each statistic needs."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from nvdlfw_inspect.stats.partials import FIELDS

Values = dict[str, float]


def _std(p: Values) -> float:
    n = p["count"]
    return math.sqrt(max(p["m2"], 0.0) / (n - 1)) if n > 1 else math.nan


def _nan_if_empty(value: Callable[[Values], float]) -> Callable[[Values], float]:
    return lambda p: value(p) if p["count"] > 0 else math.nan


def _amax(p: Values) -> float:
    return max(abs(p["min"]), abs(p["max"]))


def _dynamic_range(p: Values) -> float:
    """``log2(amax) - log2(smallest non-zero |x|)``; 0 for a tensor of zeros."""
    amin = p["abs_min_nonzero"]
    amax = _amax(p)
    if math.isnan(amax) or math.isnan(amin):
        return math.nan
    if amax == 0:
        return 0.0
    if math.isinf(amin):
        # every non-zero magnitude is infinite: log2(inf) - log2(inf) is undefined
        return math.nan if math.isinf(amax) else 0.0
    return math.log2(amax) - math.log2(amin)


def _l2_norm(p: Values) -> float:
    """``sqrt(sum x^2)`` rebuilt from M2 and the mean; inf (not nan) when the tensor holds +/-inf but no NaN."""
    if math.isinf(p["abs_sum"]):
        return math.inf
    return math.sqrt(max(p["m2"] + p["count"] * p["mean"] ** 2, 0.0))


_DERIVATIONS: dict[str, tuple[Callable[[Values], float], tuple[str, ...]]] = {
    "min": (_nan_if_empty(lambda p: p["min"]), ()),
    "max": (_nan_if_empty(lambda p: p["max"]), ()),
    "mean": (_nan_if_empty(lambda p: p["mean"]), ()),
    "std": (_std, ()),
    "l1_norm": (lambda p: p["abs_sum"], ()),
    "l2_norm": (_l2_norm, ()),
    "cur_amax": (_nan_if_empty(_amax), ()),
    "dynamic_range": (_nan_if_empty(_dynamic_range), ("abs_min_nonzero",)),
}
STAT_PARTIALS = {name: fields for name, (_, fields) in _DERIVATIONS.items()}


def supported_stats() -> list[str]:
    return list(_DERIVATIONS)


def fields_for(stats: Iterable[str]) -> set[str]:
    """Optional partial fields that computing ``stats`` requires."""
    return {field for stat in stats for field in STAT_PARTIALS[stat]}


def derive_stats(partials: torch.Tensor, stats: Iterable[str]) -> dict[str, float]:
    """Compute the named statistics from one merged partial, copying it to the host once."""
    values = dict(zip(FIELDS, partials.detach().cpu().tolist(), strict=True))
    return {stat: float(_DERIVATIONS[stat][0](values)) for stat in stats}
