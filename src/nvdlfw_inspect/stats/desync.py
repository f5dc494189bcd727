"""Ranks out of step at ``debug_api.step()``, late or gone: detect it, name them, and keep the statistics reductions
of every rank in one order, on a process group of the tool's own.

The packed reduction's stamp carries each rank's step counter and the newest iteration it fed; ``check_stamps``
raises when they disagree (the reduction would merge different steps).

``OwnGroup``: the reductions run on a group of the tool's own over a reduction group's ranks, never on the training's
group. A reduction that a rank stops waiting for (``collective_timeout``) is still under way in the backend, and gloo
and NCCL pair a group's collectives by their order: on the training's group, the training's next collective would
pair with it, and the training's collectives would stay out of order until the process group's timeout. On its own
group the rank keeps the reduction it owes and finishes it first at its next ``step()``, so every rank runs the same
collectives in the same order, and a late rank costs one step of statistics, not the training's collectives.

Names: ranks still waiting after a quarter of the timeout mark themselves in the default store, so an unmarked rank
is one that never came; a rank that stops waiting notes whom it waited for, so that the late rank, timing out in its
turn, is told that it was the late one instead of blaming the ranks that gave up on it. A collective that fails (a
rank's process went away: gloo's "Connection closed by peer") ends the group for this rank: the ranks that do not
mark themselves alive within a grace time are named once, in a ``DistributedDesyncWarning``, and this rank logs its
own statistics of that group from then on. Nothing touches the store while the ranks are on time, except once per
group to set it up.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import math
import pickle
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nvdlfw_inspect.distributed import default_store, own_gloo_group
from nvdlfw_inspect.errors import DistributedDesyncError, DistributedDesyncWarning
from nvdlfw_inspect.logging import say_once

NO_ITERATION = -math.inf  # in a stamp: no step given, or no request of the group fed since the last flush
_MARK_AFTER = 0.25  # the share of the timeout after which a rank still waiting marks itself in the store
# How long the group's set-up waits for its members, and its collectives for a late rank, before they fail (the
# rank is then taken for gone): torch's default process group timeout.
_OWN_TIMEOUT = datetime.timedelta(minutes=30)
_GONE_GRACE_S = 2.0  # without a collective_timeout: how long a rank whose collective failed waits for the others' marks
_KEPT: list[OwnGroup] = []  # released with a collective under way: deleting their backend would wait for it

Reduction = Callable[[Any], Generator[Any, None, Any]]  # (this step's rows, or None: empty ones) -> works, then a result


def _holders(values: list[float], ranks: list[int]) -> str:
    """``iteration 5 on ranks [0, 2]; iteration 4 on ranks [1]``: who holds which iteration."""
    holders: dict[float, list[int]] = {}
    for value, rank in zip(values, ranks, strict=True):
        holders.setdefault(value, []).append(rank)
    return "; ".join(f"iteration {value:.0f} on ranks {members}" for value, members in holders.items())


def check_stamps(steps: list[float], newest: list[float], ranks: list[int]) -> None:
    """Raise unless the ranks flush the same step (their step counters) and fed the same newest iteration
    (ranks that fed none aside): else the reduction would merge statistics of different steps."""
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


def _marker(name: str, rank: int) -> str:
    return f"nvdlfw_inspect/step_wait/{name}/{rank}"


def _note_key(name: str, rank: int) -> str:
    return f"nvdlfw_inspect/gave_up/{name}/{rank}"


def _mark(name: str, count: int) -> None:
    """Note in the store that this rank waits in (or saw fail) the ``count``-th collective of group ``name``."""
    store = default_store()
    if store is not None:
        with contextlib.suppress(Exception):  # a diagnostic: a store failure must not hide the timeout
            store.set(_marker(name, dist.get_rank()), str(count))


def _silent_ranks(name: str, ranks: list[int], count: int) -> list[int] | None:
    """The ranks not marked as waiting in collective ``count`` of group ``name``; None when the store cannot tell."""
    store = default_store()
    if store is None:
        return None
    expected = str(count).encode()
    try:
        keys = {rank: _marker(name, rank) for rank in ranks}
        return [rank for rank, key in keys.items() if not store.check([key]) or store.get(key) != expected]
    except Exception:  # the store failed (its host rank died): the caller says it cannot tell
        return None


def _gave_up_on_me(name: str, ranks: list[int], count: int) -> dict[int, str]:
    """Which of ``ranks`` noted that they gave up waiting for this rank in collective ``count`` or before, and at
    which iteration: this rank came late to them."""
    store, me = default_store(), dist.get_rank()
    found: dict[int, str] = {}
    for rank in ranks:
        key = _note_key(name, rank)
        with contextlib.suppress(Exception):  # the store cannot tell: not named as giving up
            if store.check([key]):  # a get would wait for the key
                noted_count, iteration, waited_for = store.get(key).decode().split(":")
                if int(noted_count) <= count and str(me) in waited_for.split(","):
                    found[rank] = iteration
    return found


def _finished(work: Any, seconds: float) -> bool:
    """Whether the collective ``work`` finished within ``seconds``; its own failure raises."""
    try:
        work.wait(datetime.timedelta(seconds=seconds))
    except RuntimeError:
        if work.is_completed():
            raise  # it failed (a peer closed its connection): not a timeout
        return False
    return True


@dataclass
class _Owed:
    """A reduction this rank owes its group: started (``generator``) or not yet, and the collective it waits for."""

    reduction: Reduction
    step: int | None
    generator: Generator[Any, None, Any] | None = None
    work: Any = None
    count: int = 0  # the number of the collective ``work`` on the group (its marker)


class _Failed(Exception):
    """A collective of the group failed: a rank's process went away (or the group could not be set up)."""


class OwnGroup:
    """The tool's own gloo group over the global ``ranks`` of a reduction group, set up in the background at its first
    reduction by its members only (``own_gloo_group``), and the reductions this rank owes it.

    ``run`` first finishes the reductions this rank stopped waiting for at earlier steps, each started with empty
    rows (its statistics were dropped when it timed out: it runs only so that every rank's collectives stay in one
    order), then this step's. One is made per rank set and debug session (``initialize`` to ``end_debug``), named by
    both: its members share the name (its store prefix) when each ran as many sessions before, as ranks running one
    script do; nothing else is asked of the ranks, members or not.
    """

    def __init__(self, ranks: list[int], session: int) -> None:
        self.ranks = ranks
        self.name = f"{hashlib.sha256(repr(ranks).encode()).hexdigest()[:16]}/{session}"
        self.lost = False  # a collective failed: this rank reduces nothing more over the group
        self._owed: deque[_Owed] = deque()
        self._count = 0  # collectives posted; the set-up is number 0
        self._noted = False  # whether this rank's note that it gave up waiting is in the store
        self._backend: Any = None
        self._failure: Exception | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._set_up, name=f"nvdlfw_inspect group {self.name}", daemon=True).start()

    def _set_up(self) -> None:
        """Make the backend, waiting for every member (a member still waiting marks itself as in collective 0)."""
        try:
            _mark(self.name, 0)
            self._backend = own_gloo_group(self.ranks, f"nvdlfw_inspect/group/{self.name}/", _OWN_TIMEOUT)
        except Exception as error:  # said when a reduction needs the group
            self._failure = error
        finally:
            self._ready.set()

    def all_reduce(self, tensor: torch.Tensor, op: Any) -> Any:
        """Post an all-reduce of ``tensor`` in place; its work."""
        options = dist.AllreduceOptions()
        options.reduceOp = op
        return self._posted(self._backend.allreduce([tensor], options))

    def all_gather(self, tensor: torch.Tensor) -> tuple[Any, list[torch.Tensor]]:
        """Post an all-gather of ``tensor``; its work and the members' tensors, in group-rank order once it is done."""
        parts = [torch.empty_like(tensor) for _ in self.ranks]
        return self._posted(self._backend.allgather([parts], [tensor])), parts

    def gather_objects(self, value: Any) -> Generator[Any, None, list[Any]]:
        """Every member's picklable ``value``, in group-rank order: two all-gathers, of the sizes and of the bytes."""
        data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
        work, sizes = self.all_gather(torch.tensor([data.numel()]))
        yield work
        padded = torch.zeros(max(int(size) for size in sizes), dtype=torch.uint8)
        padded[: data.numel()] = data
        work, parts = self.all_gather(padded)
        yield work
        return [pickle.loads(part[: int(size)].numpy().tobytes()) for part, size in zip(parts, sizes, strict=True)]

    def _posted(self, work: Any) -> Any:
        self._count += 1
        return work

    def run(self, reduction: Reduction, rows: Any, step: int | None, timeout: float | None) -> Any:
        """The result of ``reduction(rows)``, this step's, run after the reductions this rank still owes the group;
        None when the group is lost (said once): the caller logs this rank's own rows. Raises
        ``DistributedDesyncError`` when this step's reduction finds the ranks out of step, or when a collective does
        not finish within ``timeout`` seconds (None: the group's own timeout); the reduction is then owed."""
        if self.lost:
            return None
        current = _Owed(reduction, step)
        self._owed.append(current)
        try:
            if not self._ready.wait(timeout):
                raise self._late(current, step, timeout)
            if self._failure is not None:
                raise _Failed(f"{type(self._failure).__name__}: {self._failure}")
            while self._owed:
                owed = self._owed[0]
                if owed.generator is None:
                    owed.generator = owed.reduction(rows if owed is current else None)
                try:
                    done, result = self._drive(owed, timeout)
                except DistributedDesyncError:  # it ended out of step: an owed one was dropped when it timed out
                    self._settle()
                    if owed is current:
                        raise
                    continue
                if not done:
                    raise self._late(owed, step, timeout)
                self._settle()
                if owed is current:
                    return result
        except _Failed as failure:
            self._lose(failure, step, timeout)
        return None

    def _drive(self, owed: _Owed, timeout: float | None) -> tuple[bool, Any]:
        """Advance ``owed`` to its end: ``(True, its result)``, or ``(False, None)`` when a collective did not finish
        within ``timeout`` (it stays owed, waiting for that collective); its own errors raise."""
        while True:
            if owed.work is not None:
                if not self._wait(owed.work, owed.count, timeout):
                    return False, None
                owed.work = None
            try:
                owed.work = owed.generator.send(None)
            except StopIteration as end:
                return True, end.value
            owed.count = self._count

    def _wait(self, work: Any, count: int, timeout: float | None) -> bool:
        """Whether collective ``count`` finished within ``timeout``, marking this rank as waiting in it after a
        quarter of it; ``_Failed`` when it failed."""
        try:
            if timeout is None:
                work.wait()
                return True
            if _finished(work, timeout * _MARK_AFTER):
                return True
            _mark(self.name, count)
            return _finished(work, timeout * (1 - _MARK_AFTER))
        except RuntimeError as error:
            raise _Failed(f"{type(error).__name__}: {error}") from error

    def _settle(self) -> None:
        """The first owed reduction ended; when none is left, this rank's note that it gave up waiting goes."""
        self._owed.popleft()
        if not self._owed and self._noted:
            with contextlib.suppress(Exception):
                default_store().delete_key(_note_key(self.name, dist.get_rank()))
            self._noted = False

    def _late(self, owed: _Owed, step: int | None, timeout: float | None) -> DistributedDesyncError:
        """The error of a wait that timed out, naming the ranks that did not come, or that gave up waiting for this
        one; notes in the store whom this rank gave up waiting for."""
        silent = _silent_ranks(self.name, self.ranks, owed.count)
        gave_up = _gave_up_on_me(self.name, silent or [], owed.count)
        others = [rank for rank in silent or [] if rank not in gave_up]
        store = default_store()
        with contextlib.suppress(Exception):  # a diagnostic for the late rank: a store failure must not hide the timeout
            store.set(_note_key(self.name, dist.get_rank()), f"{owed.count}:{owed.step}:{','.join(map(str, silent or []))}")
            self._noted = True
        said = []
        if silent is None:
            said.append("some ranks did not answer (the store that would tell which cannot be read)")
        if gave_up:
            said.append(
                f"ranks {sorted(gave_up)} gave up waiting for this rank ({dist.get_rank()}) at iteration "
                f"{next(iter(gave_up.values()))}: this rank came more than collective_timeout after them"
            )
        if others:
            said.append(f"ranks {others} did not answer: they failed, are stuck, or skipped debug_api.step()")
        if silent == []:
            said.append("every rank arrived, but the collective did not finish")
        waited = "the group's own timeout" if timeout is None else f"{timeout:g} s (collective_timeout)"
        return DistributedDesyncError(
            f"debug_api.step() at iteration {step} waited {waited} for the ranks {self.ranks} of a statistics reduction "
            f"group; {'; '.join(said)}. This group's statistics of this step are dropped; the reduction is finished "
            "with the other ranks at the next step()."
        )

    def _lose(self, failure: _Failed, step: int | None, timeout: float | None) -> None:
        """The group failed: name once the ranks that went away (those not marked alive within a grace time: half
        the timeout, when ranks still waiting mark themselves) and reduce nothing more over it."""
        self.lost = True
        self._owed.clear()
        if self._backend is None:
            who = f"the statistics reduction group over the ranks {self.ranks} could not be set up ({failure})"
        else:
            _mark(self.name, self._count)
            deadline = time.monotonic() + (timeout / 2 if timeout is not None else _GONE_GRACE_S)
            gone = _silent_ranks(self.name, self.ranks, self._count)
            while gone and time.monotonic() < deadline:
                time.sleep(0.05)
                gone = _silent_ranks(self.name, self.ranks, self._count)
            if gone is None:
                who = f"a rank of the statistics reduction group {self.ranks} went away (the store cannot tell which)"
            elif gone:
                who = f"the ranks {gone} of the statistics reduction group {self.ranks} went away"
            else:
                who = f"the statistics reduction group {self.ranks} failed although every rank answered"
            who += f" at iteration {step} ({failure})"
        say_once(
            f"{who}: from iteration {step} on, this rank logs its own statistics of that group only (not reduced over "
            "the group's ranks)",
            level=logging.WARNING,
            warning=DistributedDesyncWarning,
            call_site=__name__,
        )

    def release(self) -> None:
        """End this run's use of the group. One with a collective still under way is kept for the life of the
        process: deleting its backend would wait for that collective (up to ``_OWN_TIMEOUT``)."""
        if any(owed.work is not None for owed in self._owed):
            _KEPT.append(self)
