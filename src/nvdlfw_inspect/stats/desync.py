"""Ranks out of step at ``debug_api.step()``: detect it, and bound the wait for a rank that never comes.

The packed gather's stamp row carries each rank's step counter and the newest iteration it fed;
``check_stamps`` raises when they disagree (the gather would merge different steps). ``wait_or_raise``
waits for a collective at most the user's timeout, and names the ranks that did not arrive: ranks
still waiting after a quarter of the timeout mark themselves in the process group's store, so an
unmarked rank is one that never came (nothing touches the store when the ranks are on time).
"""

from __future__ import annotations

import contextlib
import datetime
import math
from typing import Any

import torch.distributed as dist

from nvdlfw_inspect.distributed import group_ranks
from nvdlfw_inspect.errors import DistributedDesyncError

NO_ITERATION = -math.inf  # in a stamp: no step given, or no request of the group fed since the last flush
_MARK_AFTER = 0.25  # the share of the timeout after which a rank still waiting marks itself in the store


def _holders(values: list[float], ranks: list[int]) -> str:
    """``iteration 5 on ranks [0, 2]; iteration 4 on ranks [1]``: who holds which iteration."""
    holders: dict[float, list[int]] = {}
    for value, rank in zip(values, ranks, strict=True):
        holders.setdefault(value, []).append(rank)
    return "; ".join(f"iteration {value:.0f} on ranks {members}" for value, members in holders.items())


def check_stamps(steps: list[float], newest: list[float], ranks: list[int]) -> None:
    """Raise unless the ranks flush the same step (their step counters) and fed the same newest iteration
    (ranks that fed none aside): else the gather would merge statistics of different steps."""
    if len(set(steps)) > 1:
        raise DistributedDesyncError(
            f"debug_api.step() is out of step across the ranks {ranks} of a statistics reduction group: "
            f"{_holders(steps, ranks)}. A rank skipped or repeated debug_api.step(), or initialize_training_step() "
            "set different iterations; this group's statistics of this step are dropped."
        )
    feeding = [rank for value, rank in zip(newest, ranks, strict=True) if value != NO_ITERATION]
    fed = [value for value in newest if value != NO_ITERATION]
    if len(set(fed)) > 1:
        raise DistributedDesyncError(
            f"the ranks {ranks} of a statistics reduction group fed different iterations into one debug_api.step(): "
            f"newest {_holders(fed, feeding)}. A rank skipped or repeated debug_api.step(); this group's statistics "
            "of this step are dropped."
        )


def _store() -> Any:
    """The default group's store, where ranks waiting long in a collective mark themselves; None if none."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _marker(group: Any, rank: int) -> str:
    return f"nvdlfw_inspect/step_wait/{group.group_name}/{rank}"


def _mark(group: Any, count: int) -> None:
    """Note in the store that this rank waits in its ``count``-th timed collective of ``group``."""
    store = _store()
    if store is not None:
        with contextlib.suppress(Exception):  # a diagnostic: a store failure must not hide the timeout
            store.set(_marker(group, dist.get_rank()), str(count))


def _silent_ranks(group: Any, count: int) -> list[int] | None:
    """The ranks of ``group`` not marked as waiting in collective ``count``; None when the store cannot tell."""
    store = _store()
    if store is None:
        return None
    expected = str(count).encode()
    try:
        keys = {rank: _marker(group, rank) for rank in group_ranks(group)}
        return [rank for rank, key in keys.items() if not store.check([key]) or store.get(key) != expected]
    except Exception:  # the store failed (its host rank died): the error says it cannot tell
        return None


def _finished(work: Any, seconds: float) -> bool:
    """Whether the collective ``work`` finished within ``seconds``; its own failure raises."""
    try:
        work.wait(datetime.timedelta(seconds=seconds))
    except RuntimeError:
        if work.is_completed():
            raise  # it failed (a peer closed its connection): not a timeout
        return False
    return True


def wait_or_raise(work: Any, group: Any, timeout: float, count: int, step: int | None) -> None:
    """Wait at most ``timeout`` seconds for ``work``, else raise naming the ranks that did not reach it:
    ranks still waiting after a quarter of the timeout mark themselves in the store, so an unmarked
    rank is one that never came (nothing touches the store when the ranks are on time)."""
    early = timeout * _MARK_AFTER
    if _finished(work, early):
        return
    _mark(group, count)
    if _finished(work, timeout - early):
        return
    silent = _silent_ranks(group, count)
    if silent is None:
        who = "some ranks did not answer (the store that would tell which cannot be read)"
    elif silent:
        who = f"ranks {silent} did not answer: they failed, are stuck, or skipped debug_api.step()"
    else:
        who = "every rank arrived, but the collective did not finish"
    raise DistributedDesyncError(
        f"debug_api.step() at iteration {step} waited {timeout:g} s (collective_timeout) for the ranks {group_ranks(group)} "
        f"of a statistics reduction group; {who}. This group's statistics of this step are dropped."
    )
