"""Tensor statistics as mergeable partials: compute per tensor, merge across ranks, derive at the end.

``fields``: the partials layout; ``catalog``: every statistic and its derivation; ``kernels``: the
operator that computes partials; ``buffers``: the per-step table that ``debug_api.step()`` reduces and logs.
"""

from nvdlfw_inspect.stats.catalog import STAT_PARTIALS, derive_stats, derive_tensors, supported_stats
from nvdlfw_inspect.stats.fields import merge_partials
from nvdlfw_inspect.stats.kernels import compute_partials

__all__ = [
    "STAT_PARTIALS",
    "compute_partials",
    "derive_stats",
    "derive_tensors",
    "merge_partials",
    "supported_stats",
]
