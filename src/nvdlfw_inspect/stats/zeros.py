"""The ``num_zeros`` family of ``LogTensorStats`` (a Megatron-LM fork's tensor inspection uses it): how many values
are zero, or near it.

``num_zeros`` counts the values whose magnitude is at most a threshold, exactly zero without one; ``num_zeros%`` is
that count in % of all the values; ``num_zeros[1e-10]`` and ``num_zeros[1e-10]%`` give the threshold. NaN is no
zero (``|NaN| <= t`` is false); infinities are not either. Values are compared in the tensor's own precision, as
torch compares a tensor with a number (``float32(1e-10)`` counts for ``num_zeros[1e-10]``). Each threshold is one
request of its own whose partial holds the count of values and of zeros (the ``zeros`` field, summed), so both stay
exact over micro-batches and ranks; its cost is one comparison and one sum over the tensor per threshold.
"""

from __future__ import annotations

import math
import re
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from nvdlfw_inspect.stats.buffers import STATS_BUFFERS
from nvdlfw_inspect.stats.catalog import reducible
from nvdlfw_inspect.stats.fields import empty_partials, set_fields
from nvdlfw_inspect.stats.kernels import unreadable_reason, warn_skipped

FAMILY = "num_zeros"
FORMS = ("num_zeros", "num_zeros%", "num_zeros[T]", "num_zeros[T]%")  # T: a threshold >= 0, such as 1e-10
_PATTERN = re.compile(r"num_zeros(?:\[(?P<threshold>[^\]]*)\])?(?P<percent>%)?")


@dataclass(frozen=True)
class ZerosStat:
    """One statistic of the family: its name as written (and logged), its threshold, whether in %."""

    name: str
    threshold: float
    percent: bool

    @property
    def derivation(self) -> str:
        """Its catalog entry."""
        return "num_zeros%" if self.percent else "num_zeros"


def parse_zeros(entry: str) -> ZerosStat | None:
    """The statistic ``entry`` names when it is of the family, None when it is not; ValueError for a family name
    whose threshold is not a number >= 0."""
    match = _PATTERN.fullmatch(entry)
    if match is None:
        return None
    written = match.group("threshold")
    threshold = 0.0
    if written is not None:
        try:
            threshold = float(written)
        except ValueError:
            threshold = math.nan
        if not math.isfinite(threshold) or threshold < 0:
            raise ValueError(f"the threshold of {entry!r} must be a finite number >= 0, such as 1e-10")
    return ZerosStat(entry, threshold, match.group("percent") is not None)


def zeros_partials(tensor: torch.Tensor, threshold: float) -> torch.Tensor:
    """A partial of ``tensor`` holding its count of values and of those whose magnitude is at most ``threshold``,
    computed on its device (no host sync); integer, bool and 8-bit float values compared as float32 (``reducible``)."""
    zeros = (reducible(tensor).abs() <= threshold).sum() if tensor.numel() else 0.0
    return set_fields(empty_partials(tensor.device), {"count": tensor.numel(), "zeros": zeros})


def feed_zeros(stats: Iterable[ZerosStat], key: Hashable, tensor: torch.Tensor, **feed: Any) -> dict[float, torch.Tensor]:
    """Feed ``tensor`` to one request per threshold of ``stats`` (keyed ``key`` + the threshold); ``feed``: the rest
    of ``STATS_BUFFERS.feed``'s arguments. Returns each threshold's partial of this call, for those taken. A tensor
    that cannot be read is skipped, said once as ``feed`` says it."""
    reason = unreadable_reason(tensor)
    if reason is not None:
        warn_skipped(feed["layer_name"], feed["tensor_name"], reason)
        return {}
    by_threshold: dict[float, list[ZerosStat]] = {}
    for stat in stats:
        by_threshold.setdefault(stat.threshold, []).append(stat)
    taken = {}
    for threshold, group in by_threshold.items():
        partials = zeros_partials(tensor, threshold)
        named = [(stat.name, stat.derivation) for stat in group]
        if STATS_BUFFERS.feed((key, FAMILY, threshold), stats=named, partials=partials, **feed):
            taken[threshold] = partials
    return taken
