"""Per-step statistics buffers: features feed partials during the step, ``debug_api.step()`` logs them.

A feed stores the tensor's partial statistics (a few float64 values on the tensor's device); nothing
is merged, reduced or read back to the host until ``flush``. ``flush`` merges each buffer's
micro-batches, reduces every buffer of one process group with one object gather (which entries
exist) and one tensor gather (all their partials), copies the result to the host once, derives every
statistic as a column at once, and hands them to the statistics loggers as ``{layer}_{tensor}_{stat}``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from nvdlfw_inspect.logging import MetricLogger
from nvdlfw_inspect.stats.derive import derive_tensors, fields_for
from nvdlfw_inspect.stats.partials import compute_partials, empty_partials, merge_partials
from nvdlfw_inspect.utils import get_distributed_rank, get_distributed_world_size

Stat = tuple[str, str]  # (name in the log, derivation)
Entry = tuple[Hashable, int]  # (buffer key, iteration)


@dataclass
class StatsBuffer:
    layer_name: str
    tensor_name: str
    stats: list[Stat]
    reduction_group: Any
    skip_reduction: bool
    accumulate: bool
    last_rank_only: bool
    pending: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def feed(self, partials: torch.Tensor, iteration: int) -> None:
        rows = self.pending.setdefault(iteration, [])
        if rows and not self.accumulate:
            return  # e.g. weights: counted once per step however many micro-batches ran
        rows.append(partials)


def as_stats(stats: Iterable[str | Stat]) -> list[Stat]:
    """``"mean"`` is shorthand for ``("mean", "mean")``."""
    return [(stat, stat) if isinstance(stat, str) else tuple(stat) for stat in stats]


class StatsBuffers:
    """All buffers of a run, keyed by whatever identifies one statistics request (layer, tensor, options)."""

    def __init__(self) -> None:
        self.buffers: dict[Hashable, StatsBuffer] = {}

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
        accumulate: bool = True,
        reduction_group: Any = None,
        skip_reduction: bool = False,
        last_rank_only: bool = False,
    ) -> None:
        """Add ``tensor`` (or its precomputed ``partials``) to the buffer ``key``, created on first use.

        ``stats`` are names, or ``(logged name, derivation)`` pairs such as
        ``("fp8_current_scaling_mse", "mse")``. Empty tensors are ignored.
        """
        buffer = self.buffers.get(key)
        if buffer is None:
            buffer = StatsBuffer(
                layer_name, tensor_name, as_stats(stats), reduction_group, skip_reduction, accumulate, last_rank_only
            )
            self.buffers[key] = buffer
        buffer.skip_reduction = skip_reduction
        if partials is None:
            if tensor is None or tensor.numel() == 0:
                return
            partials = compute_partials(tensor, fields_for(derivation for _, derivation in buffer.stats))
        buffer.feed(partials, iteration)

    def flush(self) -> dict[tuple[str, str, str, int], float]:
        """Log every buffer fed since the last flush; returns ``{(layer, tensor, stat, iteration): value}``."""
        logged: dict[tuple[str, str, str, int], float] = {}
        last_rank = get_distributed_rank() == get_distributed_world_size() - 1
        for group, keys in self._groups().items():
            merged = self._reduce(group, keys)
            if not merged:
                continue
            entries = sorted(merged, key=lambda entry: entry[1])  # by iteration, then feeding order
            derivations = {d for key, _ in entries for _, d in self.buffers[key].stats}
            rows = torch.stack([merged[entry] for entry in entries]).cpu()
            columns = {d: column.tolist() for d, column in derive_tensors(rows, derivations).items()}
            for i, (key, iteration) in enumerate(entries):
                buffer = self.buffers[key]
                if buffer.last_rank_only and not last_rank:
                    continue
                for name, derivation in buffer.stats:
                    logged[(buffer.layer_name, buffer.tensor_name, name, iteration)] = float(columns[derivation][i])
        for buffer in self.buffers.values():
            buffer.pending.clear()
        if logged:
            with MetricLogger.batch():
                for (layer, tensor, stat, iteration), value in logged.items():
                    MetricLogger.log_statistic(layer, tensor, stat, value, iteration)
        return logged

    def _groups(self) -> dict[Any, list[Hashable]]:
        """Keys of every buffer, grouped by the process group they reduce over (``"local"`` for none)."""
        groups: dict[Any, list[Hashable]] = {}
        for key, buffer in self.buffers.items():
            local = buffer.skip_reduction or get_distributed_world_size(buffer.reduction_group) == 1
            groups.setdefault("local" if local else buffer.reduction_group, []).append(key)
        return groups

    def _merged_here(self, keys: list[Hashable]) -> dict[Entry, torch.Tensor]:
        """This rank's entries, each with its micro-batches merged (one batched merge for all)."""
        entries = [(key, it) for key in keys for it, rows in self.buffers[key].pending.items() if rows]
        if not entries:
            return {}
        depth = max(len(self.buffers[key].pending[it]) for key, it in entries)
        if depth == 1:  # one call per entry (no micro-batches): nothing to merge
            return {entry: self.buffers[entry[0]].pending[entry[1]][0] for entry in entries}
        padded = []
        for key, it in entries:
            rows = self.buffers[key].pending[it]
            padded += rows + [empty_partials(rows[0].device)] * (depth - len(rows))
        merged = merge_partials(torch.stack(padded).view(len(entries), depth, -1))
        return dict(zip(entries, merged, strict=True))

    def _reduce(self, group: Any, keys: list[Hashable]) -> dict[Entry, torch.Tensor]:
        """Merged partials of the entries this rank fed, over ``group``."""
        mine = self._merged_here(keys)
        if group == "local":
            return mine
        world = get_distributed_world_size(group)
        every_rank: list[list[Entry]] = [[] for _ in range(world)]
        dist.all_gather_object(every_rank, list(mine), group=group)
        union = list(dict.fromkeys(entry for entries in every_rank for entry in entries))
        if not union:
            return {}
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
        rows = torch.stack([mine[e].to(device) if e in mine else empty_partials(device) for e in union])
        gathered = [torch.empty_like(rows) for _ in range(world)]
        dist.all_gather(gathered, rows, group=group)
        merged = merge_partials(torch.stack(gathered, dim=1))  # [entry, rank, field] -> [entry, field]
        return {entry: merged[i] for i, entry in enumerate(union) if entry in mine}

    def reset(self) -> None:
        self.buffers.clear()


STATS_BUFFERS = StatsBuffers()
