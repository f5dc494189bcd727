"""Tensor statistics as mergeable partials: compute per tensor, merge across ranks, derive at the end."""

from nvdlfw_inspect.stats.derive import STAT_PARTIALS, derive_stats, supported_stats
from nvdlfw_inspect.stats.partials import compute_partials, merge_partials
from nvdlfw_inspect.stats.reduction import reduce_partials

__all__ = [
    "STAT_PARTIALS",
    "compute_partials",
    "derive_stats",
    "merge_partials",
    "reduce_partials",
    "supported_stats",
]
