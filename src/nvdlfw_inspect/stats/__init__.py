"""Tensor statistics as mergeable partials: compute per tensor, merge across ranks, derive at the end."""

from nvdlfw_inspect.stats.derive import STAT_PARTIALS, derive_stats, derive_tensors, supported_stats
from nvdlfw_inspect.stats.partials import compute_partials, merge_partials

__all__ = [
    "STAT_PARTIALS",
    "compute_partials",
    "derive_stats",
    "derive_tensors",
    "merge_partials",
    "supported_stats",
]
