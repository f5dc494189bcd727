"""A run's statistics gathered per series, and what a series says once its warm-up is set aside.

A run is read once: every value by (layer, tensor, stat, rank) and iteration, and for every tensor
the first record that held NaN or inf together with its place in its iteration. Records of an
iteration are written in the order the tensors were inspected, so that place is the execution order
and tells where a divergence began.
"""

from __future__ import annotations

import gc
import math
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property

from nvdlfw_inspect.reading import Statistic

Points = dict[int, float]


@dataclass(frozen=True)
class FirstNonfinite:
    """Where a tensor first held NaN or inf: iteration, place among its iteration's records, stat, rank."""

    iteration: int
    position: int
    stat: str
    rank: int


@dataclass
class Run:
    """Every statistic of a run, by ``(layer, tensor, stat, rank)`` and iteration (``merged``: read it
    only once the run is collected)."""

    points: dict[tuple[str, str, str, int], Points] = field(default_factory=lambda: defaultdict(dict))
    nonfinite: dict[tuple[str, str], FirstNonfinite] = field(default_factory=dict)

    @property
    def first_iteration(self) -> int:
        return min((min(values) for values in self.points.values() if values), default=0)

    @cached_property
    def merged(self) -> dict[tuple[str, str, str], Points]:
        """One series per (layer, tensor, stat): at each iteration the worst rank (the largest value,
        NaN if any rank had it). Activations and gradients are reduced over ranks already; weights are
        per rank, and the worst one is the one at risk. A series of one rank is shared, not copied."""
        by_key: dict[tuple[str, str, str], list[Points]] = defaultdict(list)
        for (layer, tensor, stat, _), values in self.points.items():
            by_key[(layer, tensor, stat)].append(values)
        return {key: ranks[0] if len(ranks) == 1 else _worst(ranks) for key, ranks in by_key.items()}


def _worst(ranks: list[Points]) -> Points:
    out: Points = {}
    for values in ranks:
        for iteration, value in values.items():
            old = out.get(iteration)
            out[iteration] = value if old is None or math.isnan(value) or value > old else old
    return out


def collect(statistics: Iterable[Statistic]) -> Run:
    """Read ``statistics`` (in the order the run wrote them) into a ``Run``."""
    with _no_cycle_collection():
        return _collect(statistics)


@contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """Python's cycle collector off while a run is read: each of its passes walks every tuple made so far, a
    fifth of reading 10^6 records, and a run's records hold no cycles (reference counting frees them)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _collect(statistics: Iterable[Statistic]) -> Run:
    run = Run()
    points, isfinite = run.points, math.isfinite
    where_rank, where_iteration, place = None, None, 0  # the records being read: their rank and iteration, the place
    for rank, layer, tensor, stat, iteration, value in statistics:  # unpacked: a field read each costs a third
        points[(layer, tensor, stat, rank)][iteration] = value
        if iteration != where_iteration or rank != where_rank:
            where_rank, where_iteration, place = rank, iteration, 0
        else:
            place += 1
        if not isfinite(value):
            seen = run.nonfinite.get((layer, tensor))
            if seen is None or (iteration, place) < (seen.iteration, seen.position):
                run.nonfinite[(layer, tensor)] = FirstNonfinite(iteration, place, stat, rank)
    return run


@dataclass(frozen=True)
class Summary:
    """A series against a threshold, the warm-up set aside.

    ``persistent``: the median of the last ``tail`` of the iterations after warm-up (NaN when the run ends
    in NaN); ``above``: the fraction of the finite ones over the threshold, and ``first_above`` the first of
    them; ``worst`` and ``worst_iteration``: their largest finite value; ``warmup_only``: nothing was logged after
    warm-up, so the warm-up's values stand in for it (and ``worst`` is the warm-up's). ``warmup_worst`` and
    ``warmup_worst_iteration``: the largest finite value of the warm-up that was set aside (None where no warm-up
    value was logged, or the run is all warm-up), which headlines and colours leave out: at iteration 0 delayed
    scaling's scale is still 1 and a tensor's values are those of an untrained model.
    """

    persistent: float
    above: float
    first_above: int | None
    worst: float
    worst_iteration: int
    warmup_only: bool
    threshold: float
    warmup_worst: float | None = None
    warmup_worst_iteration: int | None = None

    def is_problem(self, persistence: float) -> bool:
        """Persistently over the threshold: at the end of the run, or for ``persistence`` of it."""
        return self.persistent > self.threshold or self.above >= persistence

    def is_transient(self, persistence: float) -> bool:
        """Over the threshold at some point after warm-up, but not persistently (a passing spike)."""
        return self.worst > self.threshold and not self.is_problem(persistence)

    def is_warmup_transient(self, persistence: float) -> bool:
        """Over the threshold during warm-up alone: never after it, nor (a run all warm-up) persistently."""
        over = self.warmup_worst is not None and self.warmup_worst > self.threshold
        return over and self.worst <= self.threshold and not self.is_problem(persistence)

    @property
    def warmup_exceeds(self) -> bool:
        """Whether the warm-up set aside held a larger value than any after it (worth a secondary clause)."""
        return self.warmup_worst is not None and self.warmup_worst > self.worst

    def as_dict(self) -> dict[str, float | int | bool | None]:
        return {
            "persistent": self.persistent if math.isfinite(self.persistent) else str(self.persistent),  # strict JSON
            "above": self.above,
            "first_above": self.first_above,
            "worst": self.worst,
            "worst_iteration": self.worst_iteration,
            "warmup_only": self.warmup_only,
            "warmup_worst": self.warmup_worst,
            "warmup_worst_iteration": self.warmup_worst_iteration,
            "threshold": self.threshold,
        }


def _median_nan_last(values: list[float]) -> float:
    """The median with NaN ordered above every number: a tail that ends in NaN has a NaN median (the run
    ended broken), while a single NaN among finite values moves it no more than any largest value would."""
    ordered = sorted(values, key=lambda v: (math.isnan(v), 0.0 if math.isnan(v) else v))
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def summarize(points: Points, threshold: float, warmup_end: int, tail: float) -> Summary | None:
    """``points`` against ``threshold``; iterations before ``warmup_end`` are warm-up, set aside unless they are all
    there is. The end of the run (``persistent``) is taken over every logged value, NaN and inf included, so a run
    that ends broken does not show its last finite values; the rest over the finite values. None when no value is
    finite."""
    logged = sorted(points.items())
    finite = [(iteration, value) for iteration, value in logged if math.isfinite(value)]
    if not finite:
        return None
    warmup_only = finite[-1][0] < warmup_end
    steady = finite if warmup_only else [(i, v) for i, v in finite if i >= warmup_end]
    warmup = [] if warmup_only else [(i, v) for i, v in finite if i < warmup_end]
    ending = [v for i, v in logged if i >= warmup_end] or [v for _, v in logged]
    over = [i for i, v in steady if v > threshold]
    worst_iteration, worst = max(steady, key=lambda point: (point[1], -point[0]))  # ties: the first
    warmup_worst_iteration, warmup_worst = max(warmup, key=lambda point: (point[1], -point[0])) if warmup else (None, None)
    return Summary(
        persistent=_median_nan_last(ending[-max(1, math.ceil(tail * len(ending))) :]),
        above=len(over) / len(steady),
        first_above=over[0] if over else None,
        worst=worst,
        worst_iteration=worst_iteration,
        warmup_only=warmup_only,
        threshold=threshold,
        warmup_worst=warmup_worst,
        warmup_worst_iteration=warmup_worst_iteration,
    )
