"""Per-step statistics buffers: features feed tensors during the step, ``debug_api.step()`` logs them.

Every statistics request (a layer, a tensor, a feature's options) owns one row of a per-device table
allocated once: feeding a tensor runs the statistics operator (``kernels.tensor_stats``), which merges
the tensor's partials straight into the rows of every request it serves, in one launch per tensor
(``one_launch``). Nothing is read back to the host inside a step.

``flush`` (at ``step()``) copies each device's table to the host once, reduces every row of one process group
with two packed all-reduces whose size does not grow with the number of ranks (``reduce``; the rows are packed
in an order all ranks agreed on once, and an object gather runs only when some rank's set of requests changed)
on a gloo group of the tool's own over the group's ranks (``desync.OwnGroup``), derives every statistic as a
column at once, hands them to the statistics loggers as ``{layer}_{tensor}_{stat}``, and resets the tables.

Threads: feeds and flushes may come from several threads. One lock guards the requests and tables; a
flush holds it only to take the tables (fresh ones take the feeds that follow), so a call lands whole
in the flush under way or in the next, and never waits for a collective. Flushes run one at a time.

Ranks: the first all-reduce carries the minimum and maximum over the ranks of each one's step counter and
newest iteration fed; ranks that disagree (then their stamps are gathered to name them), or that do not
answer within the timeout, raise ``DistributedDesyncError`` naming them (after the other groups are reduced
and logged, so that no peer waits for this rank); a rank that went away is named once in a warning, and the
others log their own rows of that group from then on. Groups are reduced in an order every rank shares.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import threading
from collections.abc import Callable, Generator, Hashable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from nvdlfw_inspect.distributed import get_distributed_world_size, group_ranks, is_distributed
from nvdlfw_inspect.errors import DistributedDesyncError
from nvdlfw_inspect.logging import MetricLogger, say_once
from nvdlfw_inspect.stats.catalog import column_amax, derive_floats, fields_for, reads
from nvdlfw_inspect.stats.desync import NO_ITERATION, OwnGroup, check_stamps
from nvdlfw_inspect.stats.fields import INDEX, identity_partials, merge_partials
from nvdlfw_inspect.stats.kernels import Grid, tensor_stats, unreadable_partials_reason, unreadable_reason, warn_skipped
from nvdlfw_inspect.stats.reduce import EXTREMES, MIN_FIELDS, combine, pack_min, pack_sum, unpack_min

_CPU = torch.device("cpu")
_CHANNELS = INDEX["channels"]
_CHANNELS_EXTREME = EXTREMES.index(_CHANNELS) - len(MIN_FIELDS)  # among the max fields of unpack_min's extremes
Stat = tuple[str, str]  # (name in the log, derivation)
Quantization = tuple[torch.Tensor, Grid]  # (scale, grid) of a cast whose statistics a request wants


@dataclass
class StatsBuffer:
    """One statistics request and its table row."""

    layer_name: str
    tensor_name: str
    stats: list[Stat]
    reduction_group: Any
    skip_reduction: bool
    accumulate: bool
    last_rank_only: bool
    device: torch.device
    row: int
    iteration: int | None = None  # the iteration fed since the last flush, None if not fed
    feeds: int = 0  # tensors offered since the last flush (taken or not): a forgotten step() shows in it
    want_abs_min: bool = False
    want_moments: bool = False  # M3 and M4 (kurtosis): the operator computes them for this row's launch
    want_channels: bool = False  # the per-column amax vector, kept in channel_amax beside the row
    channel_amax: torch.Tensor | None = None  # merged since the last flush
    derivations: tuple[str, ...] = ()  # each derivation its stats need, once

    def __post_init__(self) -> None:
        self.derivations = tuple(dict.fromkeys(derivation for _, derivation in self.stats))
        self.want_abs_min = "abs_min_nonzero" in fields_for(self.derivations)
        self.want_moments = reads(self.derivations, "m4")
        self.want_channels = reads(self.derivations, "channel_amax")

    def add_channels(self, table: torch.Tensor, amax: torch.Tensor) -> None:
        """Merge a tensor's ``column_amax`` into the request's vector (element-wise max, on its device) and its length
        into the row's ``channels`` field, which tells every rank the vector's length at the reduction. A tensor whose
        last dimension differs from the step's earlier ones is left out of them, said once (the run goes on)."""
        if amax.numel() == 0:
            return
        if self.channel_amax is None:
            self.channel_amax = amax.clone()
        elif self.channel_amax.shape != amax.shape:
            reason = (
                f"its last dimension has {amax.numel()} channels, {self.channel_amax.numel()} earlier in the step: "
                "its channel statistics leave it out"
            )
            return warn_skipped(self.layer_name, self.tensor_name, reason)
        else:
            torch.maximum(self.channel_amax, amax, out=self.channel_amax)
        table[self.row, _CHANNELS : _CHANNELS + 1].fill_(amax.numel())


def as_stats(stats: Iterable[str | Stat]) -> list[Stat]:
    """``"mean"`` is shorthand for ``("mean", "mean")``."""
    return [(stat, stat) if isinstance(stat, str) else tuple(stat) for stat in stats]


class _Table:
    """Rows of partials on one device; row 0 stays empty (the identity that ranks without a request
    contribute to a reduction). Grows by doubling, which happens only while requests appear."""

    def __init__(self, device: torch.device):
        self.device = device
        self.used = 1
        self.rows = identity_partials(device).expand(16, -1).clone()

    def allocate(self) -> int:
        if self.used == self.rows.shape[0]:
            self.rows = torch.cat([self.rows, identity_partials(self.device).expand(self.used, -1)])
        self.used += 1
        return self.used - 1

    def take(self) -> torch.Tensor:
        """The rows as fed so far; empty ones take their place for the feeds that follow."""
        rows, self.rows = self.rows, identity_partials(self.device).expand_as(self.rows).clone()
        return rows


class _Launch:
    """What every request fed from one tensor wants: one operator call."""

    __slots__ = ("tensor", "rows", "row_variants", "quantizations", "want_abs_min", "want_moments", "amax_outs")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.rows: list[int] = []
        self.row_variants: list[int] = []
        self.quantizations: list[Quantization] = []
        self.want_abs_min = False
        self.want_moments = False
        self.amax_outs: list[torch.Tensor] = []

    def add(self, buffer: StatsBuffer | None, quantization: Quantization | None, amax_out: torch.Tensor | None) -> None:
        if amax_out is not None:
            self.amax_outs.append(amax_out)
        if buffer is None:
            return
        variant = -1
        if quantization is not None:
            scale, grid = quantization
            variant = next((i for i, (s, g) in enumerate(self.quantizations) if s is scale and g == grid), -1)
            if variant < 0:
                self.quantizations.append(quantization)
                variant = len(self.quantizations) - 1
        self.rows.append(buffer.row)
        self.row_variants.append(variant)
        self.want_abs_min |= buffer.want_abs_min
        self.want_moments |= buffer.want_moments

    @property
    def fed(self) -> bool:
        """Whether a request or an amax wants this tensor's operator call."""
        return bool(self.rows or self.amax_outs)

    def run(self, table: torch.Tensor, call_out: torch.Tensor | None = None) -> None:
        if self.fed or call_out is not None:
            scales = [scale for scale, _ in self.quantizations]
            grids = [grid for _, grid in self.quantizations]
            amax_out = self.amax_outs[0] if self.amax_outs else None
            tensor_stats(
                self.tensor,
                table,
                self.rows,
                self.row_variants,
                scales,
                grids,
                self.want_abs_min,
                call_out,
                amax_out,
                self.want_moments,
            )
            for other in self.amax_outs[1:]:
                other.copy_(amax_out)


@dataclass
class _Layout:
    """The agreed order of one group's rows: the union of every rank's requests when it was agreed, this
    rank's requests then, the union's signature (the same on every rank that agreed), where each row of the union
    is in this rank's rows (0: in none, the identity goes there), and the requests of this rank it logs."""

    mine: tuple | None  # None: no order agreed yet
    union: list[Hashable]
    signature: float
    index: torch.Tensor
    logs: frozenset


def _logs_here(every_rank: list[tuple], me: int, buffers: dict[Hashable, StatsBuffer]) -> frozenset:
    """The requests of group rank ``me`` that it logs: all but those logged on one rank only (no reduction group
    given), which the last rank holding each logs: the default group's last rank when every rank holds it, else
    (pipeline stages) the last rank of the stage that holds the layer."""
    last = {key: rank for rank, keys in enumerate(every_rank) for key in keys}
    return frozenset(key for key in every_rank[me] if not buffers[key].last_rank_only or last[key] == me)


def _signature(keys: tuple) -> float:
    """A hash of request keys that is the same in every process (an exact, non-negative float64)."""
    return float(int.from_bytes(hashlib.sha256(repr(keys).encode()).digest()[:6], "big"))


def _say_differences(every_rank: list[tuple], union: list[Hashable], ranks: list[int]) -> None:
    """Name the ranks of a group that lack some of the group's statistics requests (once per message): their rows
    count only the ranks that fed them, which is right for layers a rank does not hold (experts, pipeline
    stages) and a sign of different configs otherwise."""
    lacking = {
        rank: len(union) - len(set(keys)) for rank, keys in zip(ranks, every_rank, strict=True) if len(set(keys)) < len(union)
    }
    if lacking:
        shown = ", ".join(f"rank {rank} lacks {count}" for rank, count in lacking.items())
        say_once(
            f"the ranks {ranks} of a statistics reduction group log different requests ({shown} of the group's "
            f"{len(union)}): each statistic is reduced over the ranks that fed it",
            level=logging.INFO,
            warning=None,
            call_site=__name__,
        )


@dataclass
class _Snapshot:
    """What one flush reduces and logs, taken under the lock so that feeds go on into fresh tables."""

    buffers: dict[Hashable, StatsBuffer]
    rows: dict[torch.device, torch.Tensor]
    channels: dict[Hashable, torch.Tensor]  # each request's per-column amax vector, for those that keep one
    fed: dict[Hashable, int]  # every request fed since the last flush -> the iteration it was fed at
    groups: dict[Any, list[Hashable]]
    step: int | None
    timeout: float | None


class StatsBuffers:
    """All requests of a run, keyed by whatever identifies one (layer, tensor, feature options)."""

    def __init__(self) -> None:
        self.buffers: dict[Hashable, StatsBuffer] = {}
        self._tables: dict[torch.device, _Table] = {}
        self._layouts: dict[Any, _Layout] = {}
        self._own: dict[tuple[int, ...], OwnGroup] = {}  # the tool's own group over each rank set reduced over
        self._session = 0  # resets so far: debug sessions of this process, which name the own groups
        self._one_launch: _OneLaunch | None = None  # the innermost one_launch() under way
        self._lock = threading.RLock()  # the requests, tables and launch: every feed, and a flush's snapshot
        # One flush at a time, so that steps reach the loggers in order; reentrant for end_debug's reset from a
        # signal handler that interrupted this thread's flush.
        self._flush_lock = threading.RLock()

    def _table(self, device: torch.device) -> _Table:
        if device not in self._tables:
            self._tables[device] = _Table(device)
        return self._tables[device]

    def _buffer(
        self, key: Hashable, iteration: int, device: torch.device, skip_reduction: bool, make: Callable[[int], StatsBuffer]
    ) -> StatsBuffer | None:
        """The request ``key`` fed at ``iteration`` (made with ``make(row)`` on first use), or None when it takes
        no more data this step (a request that does not accumulate, such as a weight, was fed already)."""
        buffer = self.buffers.get(key)
        if buffer is not None and buffer.iteration is not None and buffer.iteration != iteration:  # a late feed of another step
            return self._buffer((key, "iteration", iteration), iteration, device, skip_reduction, make)
        if buffer is None:
            buffer = self.buffers[key] = make(self._table(device).allocate())
        buffer.feeds += 1
        if buffer.iteration is not None and not buffer.accumulate:
            return None
        buffer.iteration = iteration
        buffer.skip_reduction = skip_reduction
        return buffer

    def fed(self) -> bool:
        """Whether any request was fed since the last flush."""
        return any(buffer.iteration is not None for buffer in self.buffers.values())

    def most_fed(self) -> tuple[str, str, int] | None:
        """The (layer, tensor, feeds) of the request offered the most tensors since the last flush, if any."""
        fed = [buffer for buffer in self.buffers.values() if buffer.iteration is not None]
        top = max(fed, key=lambda buffer: buffer.feeds, default=None)
        return None if top is None else (top.layer_name, top.tensor_name, top.feeds)

    def one_launch(self, tensor: torch.Tensor) -> _OneLaunch:
        """A context in which every ``feed`` of ``tensor`` joins one operator call, run at its end. It holds
        the lock throughout, so that a flush finds the call's requests and their data together."""
        return _OneLaunch(self, tensor)

    def feed(
        self,
        key: Hashable,
        *,
        layer_name: str,
        tensor_name: str,
        stats: Iterable[str | Stat],
        iteration: int,
        tensor: torch.Tensor | None = None,
        partials: torch.Tensor | None = None,
        quantization: Quantization | None = None,
        call_out: torch.Tensor | None = None,
        amax_out: torch.Tensor | None = None,
        channel_amax: torch.Tensor | None = None,
        accumulate: bool = True,
        reduction_group: Any = None,
        skip_reduction: bool = False,
        last_rank_only: bool = False,
    ) -> bool:
        """Add ``tensor`` (or its precomputed ``partials``) to the request ``key``, created on first use;
        whether the request took it (one that does not accumulate takes one tensor per step).

        ``stats`` are names, or ``(logged name, derivation)`` pairs such as
        ``("fp8_current_scaling_mse", "mse")``. ``quantization`` adds the statistics of casting the
        tensor with that scale on that grid. ``call_out`` (an empty partial) receives this call's own
        partials, ``amax_out`` (a 0-dim float32 tensor) the tensor's max |x| (NaN ignored). ``channel_amax``: the
        tensor's ``column_amax`` when the caller has it already (computed here otherwise, for the channel
        statistics). An empty tensor is logged as one (count 0, NaN extremes).
        """
        source = tensor if tensor is not None else partials
        if source is None:
            return False
        reason = unreadable_reason(tensor) if tensor is not None else unreadable_partials_reason(partials)
        if reason is not None:  # skipped before it gets a row: a tensor that cannot be read must not poison the step
            warn_skipped(layer_name, tensor_name, reason)
            return False
        device = source.device

        def make(row: int) -> StatsBuffer:
            return StatsBuffer(
                layer_name, tensor_name, as_stats(stats), reduction_group, skip_reduction, accumulate, last_rank_only, device, row
            )

        with self._lock:
            buffer = self._buffer(key, iteration, device, skip_reduction, make)
            table = self._table(device).rows
            if partials is not None:
                if buffer is not None:
                    table[buffer.row] = merge_partials(torch.stack([table[buffer.row], partials]))
                return buffer is not None
            if buffer is None:
                amax_out = None  # nothing to record either
            taken = buffer is not None
            if taken and buffer.want_channels:
                buffer.add_channels(table, channel_amax if channel_amax is not None else column_amax(tensor))
            if tensor.numel() > 0 or call_out is not None or amax_out is not None:  # an empty tensor: the row stays empty
                scope = self._one_launch
                if scope is not None and scope.tensor is tensor:
                    scope.joined().add(buffer, quantization, amax_out)
                else:
                    launch = _Launch(tensor)
                    launch.add(buffer, quantization, amax_out)
                    launch.run(table, call_out)
            return taken

    def flush(self, step: int | None = None, timeout: float | None = None) -> dict[tuple[str, str, str, int], float]:
        """Log every request fed since the last flush; returns ``{(layer, tensor, stat, iteration): value}``.

        ``step`` is the caller's step counter, the same on every rank of a reduction group; ``timeout``
        bounds each of the group's collectives in seconds (None: the tool's group's own timeout, torch's default).
        A group whose ranks are out of step or do not answer raises ``DistributedDesyncError`` once the other groups
        are reduced (their peers must not wait for this rank) and logged; its statistics are dropped. A group a rank
        went away from is said once (``DistributedDesyncWarning``); this rank's own statistics of it are logged.
        """
        with self._flush_lock:
            with self._lock:
                snapshot = self._take(step, timeout)
            if snapshot is None:
                return {}
            table, where, channels, errors = self._collect(snapshot)
            logged = self._derive(table, where, channels, snapshot)
            if logged:
                with MetricLogger.batch():
                    MetricLogger.log_statistics([(*name, value, iteration) for (*name, iteration), value in logged.items()])
            if errors:
                raise errors[0]
            return logged

    def _take(self, step: int | None, timeout: float | None) -> _Snapshot | None:
        """Every request fed since the last flush and its rows, leaving empty tables; None if none was fed."""
        fed = {key: buffer.iteration for key, buffer in self.buffers.items() if buffer.iteration is not None}
        if not fed:
            return None
        channels = {}
        for key in fed:
            buffer = self.buffers[key]
            buffer.iteration = None
            buffer.feeds = 0
            if buffer.channel_amax is not None:
                channels[key], buffer.channel_amax = buffer.channel_amax, None
        rows = {device: table.take() for device, table in self._tables.items()}
        return _Snapshot(dict(self.buffers), rows, channels, fed, self._groups(), step, timeout)

    def _collect(
        self, snapshot: _Snapshot
    ) -> tuple[torch.Tensor, dict[Hashable, int], dict[Hashable, torch.Tensor], list[DistributedDesyncError]]:
        """The rows of every group, reduced over it where it is reduced, in one host table (each device's table is
        copied to the host once, before the reductions); the row of each request this rank logs; the per-column amax
        vectors on the host, reduced likewise; and the desync errors of the groups that could not be reduced."""
        devices = list(dict.fromkeys(buffer.device for buffer in snapshot.buffers.values()))  # not a table no row is in
        host = [snapshot.rows[device].cpu() for device in devices]
        starts = dict(zip(devices, itertools.accumulate((table.shape[0] for table in host), initial=0), strict=False))
        table = host[0] if len(host) == 1 else torch.cat(host)
        channels = {key: amax.cpu() for key, amax in snapshot.channels.items()}
        pieces: list[torch.Tensor] = []
        where: dict[Hashable, int] = {}
        errors: list[DistributedDesyncError] = []
        for group, keys in snapshot.groups.items():
            rows = table[[starts[snapshot.buffers[key].device] + snapshot.buffers[key].row for key in keys]]
            logs: Iterable[Hashable] = keys
            if group != "local":
                try:
                    reduced = self._reduced(group, tuple(keys), rows, channels, snapshot)
                except DistributedDesyncError as error:
                    errors.append(error)
                    continue
                if reduced is not None:
                    rows, logs, merged_channels = reduced
                    channels.update(merged_channels)
            offset = sum(piece.shape[0] for piece in pieces)
            logged = set(logs)
            where.update((key, offset + i) for i, key in enumerate(keys) if key in logged)
            pieces.append(rows)
        return (torch.cat(pieces) if pieces else table[:0]), where, channels, errors

    def _derive(
        self, table: torch.Tensor, where: dict[Hashable, int], channels: dict[Hashable, torch.Tensor], snapshot: _Snapshot
    ) -> dict:
        """Every logged request's statistics from the host rows, ordered by iteration then feeding order."""
        fed = sorted((key for key in snapshot.fed if key in where), key=snapshot.fed.__getitem__)
        rows = table.tolist()  # Python floats: see derive_floats
        logged: dict[tuple[str, str, str, int], float] = {}
        for key in fed:
            buffer = snapshot.buffers[key]
            amax = channels[key].tolist() if key in channels else ()
            values = derive_floats(rows[where[key]], buffer.derivations, amax)
            iteration = snapshot.fed[key]
            for name, derivation in buffer.stats:
                logged[(buffer.layer_name, buffer.tensor_name, name, iteration)] = values[derivation]
        return logged

    def _groups(self) -> dict[Any, list[Hashable]]:
        """Keys of every request by the process group it reduces over (``"local"``: none), the groups in an order
        every rank shares (by their ranks, then names), so that ranks in several groups reduce them in one order."""
        groups: dict[Any, list[Hashable]] = {}
        distributed = is_distributed()
        for key, buffer in self.buffers.items():
            local = not distributed or buffer.skip_reduction or get_distributed_world_size(buffer.reduction_group) == 1
            groups.setdefault("local" if local else buffer.reduction_group, []).append(key)

        def order(group: Any) -> tuple:
            if group == "local":
                return (0, (), "")
            return (1, tuple(group_ranks(group)), "" if group is None else group.group_name)

        return dict(sorted(groups.items(), key=lambda item: order(item[0])))

    def _reduced(
        self, group: Any, mine: tuple, rows: torch.Tensor, channels: dict[Hashable, torch.Tensor], snapshot: _Snapshot
    ) -> tuple[torch.Tensor, frozenset, dict[Hashable, torch.Tensor]] | None:
        """The rows of ``mine`` merged over ``group`` (on the tool's own group over its ranks), in ``mine`` order, the
        requests this rank logs, and the per-column amax vectors of ``mine`` merged likewise; None when that group is
        lost (a rank went away, said once): this rank's rows are then logged as they are."""
        ranks = group_ranks(group)
        own = self._own.get(tuple(ranks))
        if own is None:
            own = self._own[tuple(ranks)] = OwnGroup(ranks, self._session)
        step = NO_ITERATION if snapshot.step is None else snapshot.step
        newest = max((snapshot.fed[key] for key in mine if key in snapshot.fed), default=NO_ITERATION)
        reduction = partial(self._reduction, own, group, mine, step, newest)
        data = (rows, {key: channels[key] for key in mine if key in channels})
        return own.run(reduction, data, snapshot.step, snapshot.timeout)

    def _reduction(
        self,
        own: OwnGroup,
        group: Any,
        mine: tuple,
        step: float,
        newest: float,
        data: tuple[torch.Tensor, dict[Hashable, torch.Tensor]] | None,
    ) -> Generator[Any, None, tuple[torch.Tensor, frozenset, dict[Hashable, torch.Tensor]]]:
        """The collectives of one group's reduction, each yielded for ``OwnGroup.run`` to wait for: two packed
        all-reduces (``_all_reduce``), and, when the first shows that some rank's requests changed since the ranks
        agreed on the order of the rows (or that none was agreed yet), a gather of every rank's requests that agrees
        on a new one, after which both run again. ``data``: the rows and the per-column amax vectors of ``mine``;
        None: empty ones (a reduction run late, only to keep the ranks' collectives in one order)."""
        rows, channels = data if data is not None else (identity_partials(_CPU).expand(len(mine), -1), {})
        layout = self._layouts.get(group) or _Layout(None, [], -1.0, torch.empty(0, dtype=torch.long), frozenset())
        merged = yield from self._all_reduce(own, layout, mine, rows, channels, step, newest)
        if merged is not None:
            return merged[0], layout.logs, merged[1]
        every_rank = yield from own.gather_objects(mine)
        union = list(dict.fromkeys(key for keys_of_rank in every_rank for key in keys_of_rank))
        _say_differences(every_rank, union, own.ranks)
        position = {key: i + 1 for i, key in enumerate(mine)}
        index = torch.tensor([position.get(key, 0) for key in union], dtype=torch.long)
        logs = _logs_here(every_rank, own.ranks.index(dist.get_rank()), self.buffers)
        layout = self._layouts[group] = _Layout(mine, union, _signature(tuple(union)), index, logs)
        merged = yield from self._all_reduce(own, layout, mine, rows, channels, step, newest)
        if merged is None:  # every rank took the same union from one gather: only a bug gets here
            raise DistributedDesyncError(f"the ranks {own.ranks} could not agree on the order of their statistics")
        return merged[0], layout.logs, merged[1]

    def _all_reduce(
        self,
        own: OwnGroup,
        layout: _Layout,
        mine: tuple,
        rows: torch.Tensor,
        channels: dict[Hashable, torch.Tensor],
        step: float,
        newest: float,
    ) -> Generator[Any, None, tuple[torch.Tensor, dict[Hashable, torch.Tensor]] | None]:
        """This rank's rows in the agreed order through a MIN all-reduce (extremes, and a stamp: the order's
        signature, step and newest iteration fed) and a SUM one (sums, and the moments around a shared shift), then
        the merged rows in ``mine`` order and the per-column amax vectors merged by ``_max_channels``. None
        when some rank's requests changed since the order was agreed (it sends the identity and signature -1);
        ``DistributedDesyncError`` naming the ranks when they are not in step (their stamps gathered only then)."""
        n = len(layout.union)
        identity = identity_partials(_CPU)
        if layout.mine == mine:
            ordered = torch.cat([identity.unsqueeze(0), rows]).index_select(0, layout.index)
            signature = layout.signature
        else:
            ordered, signature = identity.expand(n, -1), -1.0
        first = pack_min(ordered, signature, step, newest)
        yield own.all_reduce(first, dist.ReduceOp.MIN)
        stamp, extremes, shift = unpack_min(first, n)
        if not stamp.in_step:
            work, stamps = own.all_gather(torch.tensor([step, newest], dtype=torch.float64))
            yield work
            steps, newest_fed = torch.stack(stamps).T.tolist()
            check_stamps(steps, newest_fed, own.ranks)
            raise DistributedDesyncError(f"the ranks {own.ranks} of a statistics reduction group are out of step")
        if not stamp.agreed:
            return None
        second = pack_sum(ordered, shift)
        yield own.all_reduce(second, dist.ReduceOp.SUM)
        merged = combine(extremes, shift, second, n)
        order = {key: i for i, key in enumerate(layout.union)}
        lengths = extremes[:, len(MIN_FIELDS) + _CHANNELS_EXTREME].tolist()  # the same on every rank
        vectors = yield from _max_channels(own, lengths, [order[key] for key in channels], list(channels.values()))
        merged_channels = {key: vectors[order[key]] for key in mine if order[key] in vectors}
        return (merged[[order[key] for key in mine]] if mine else merged[:0]), merged_channels

    def reset(self) -> None:
        with self._flush_lock, self._lock:
            self.buffers.clear()
            self._tables.clear()
            self._layouts.clear()
            for own in self._own.values():
                own.release()
            self._own.clear()
            self._session += 1
            self._one_launch = None


def _max_channels(
    own: OwnGroup, lengths: list[float], positions: list[int], vectors: list[torch.Tensor]
) -> Generator[Any, None, dict[int, torch.Tensor]]:
    """The element-wise max over the ranks of each row's per-column amax vector, as ``{row: vector}``: one MAX
    all-reduce of them all laid end to end, each in a slot as long as the longest of the row's over the ranks
    (``lengths``, its ``channels`` field reduced), -inf where a rank has none; nothing when no row has one.
    ``positions``: the rows of this rank's ``vectors``."""
    sizes = [int(length) if length > 0 else 0 for length in lengths]  # -inf or NaN: none
    if not any(sizes):
        return {}
    starts = list(itertools.accumulate(sizes, initial=0))
    payload = torch.full((starts[-1],), -math.inf, dtype=torch.float64)
    for row, vector in zip(positions, vectors, strict=True):
        payload[starts[row] : starts[row] + vector.numel()] = vector
    yield own.all_reduce(payload, dist.ReduceOp.MAX)
    return {row: payload[starts[row] : starts[row] + size] for row, size in enumerate(sizes) if size}


class _OneLaunch:
    """``StatsBuffers.one_launch``: a class rather than a generator context, as it runs for every inspected tensor."""

    __slots__ = ("buffers", "tensor", "launch", "outer")

    def __init__(self, buffers: StatsBuffers, tensor: torch.Tensor):
        self.buffers, self.tensor, self.outer = buffers, tensor, None
        self.launch: _Launch | None = None  # made by the first feed (a tensor only the guard sees has none)

    def __enter__(self) -> None:
        self.buffers._lock.acquire()
        self.outer, self.buffers._one_launch = self.buffers._one_launch, self

    def __exit__(self, error_type: type | None, *_: object) -> None:
        buffers = self.buffers
        try:
            buffers._one_launch = self.outer
            launch = self.launch
            if error_type is None and launch is not None and launch.fed:  # else nothing fed it: no table to look up
                launch.run(buffers._table(launch.tensor.device).rows)
        finally:
            buffers._lock.release()

    def joined(self) -> _Launch:
        """The operator call that this tensor's feeds join."""
        if self.launch is None:
            self.launch = _Launch(self.tensor)
        return self.launch


STATS_BUFFERS = StatsBuffers()
