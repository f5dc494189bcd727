"""Per-step statistics buffers: features feed tensors during the step, ``debug_api.step()`` logs them.

Feeding computes the tensor's partial statistics on its device and merges them into the buffer
(micro-batches of one step accumulate); nothing is read back to the host until ``flush``. ``flush``
merges every buffer across its reduction group, derives the configured statistics once, and hands
them to the statistics loggers as ``{layer}_{tensor}_{stat}``.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from nvdlfw_inspect.logging import MetricLogger
from nvdlfw_inspect.stats.derive import derive_stats, fields_for
from nvdlfw_inspect.stats.partials import compute_partials, empty_partials, merge_partials
from nvdlfw_inspect.utils import get_distributed_world_size


@dataclass
class StatsBuffer:
    layer_name: str
    tensor_name: str
    stats: list[str]
    reduction_group: Any
    skip_reduction: bool
    accumulate: bool
    partials: torch.Tensor | None = None
    iteration: int = 0
    fields: set[str] = field(default_factory=set)

    def feed(self, tensor: torch.Tensor, iteration: int) -> None:
        if self.partials is not None and not self.accumulate:
            return  # e.g. weights: counted once per step however many micro-batches ran
        if tensor.numel() == 0:
            return
        new = compute_partials(tensor, self.fields)
        self.partials = new if self.partials is None else merge_partials(torch.stack([self.partials, new]))
        self.iteration = iteration


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
        tensor: torch.Tensor,
        stats: list[str],
        iteration: int,
        accumulate: bool = True,
        reduction_group: Any = None,
        skip_reduction: bool = False,
    ) -> None:
        """Add ``tensor`` to the buffer ``key`` (created on first use with these settings)."""
        buffer = self.buffers.get(key)
        if buffer is None:
            buffer = StatsBuffer(layer_name, tensor_name, list(stats), reduction_group, skip_reduction, accumulate)
            buffer.fields = fields_for(buffer.stats)
            self.buffers[key] = buffer
        buffer.skip_reduction = skip_reduction
        buffer.feed(tensor, iteration)

    def flush(self) -> dict[tuple[str, str, str, int], float]:
        """Log every buffer fed since the last flush; returns ``{(layer, tensor, stat, iteration): value}``."""
        logged: dict[tuple[str, str, str, int], float] = {}
        for group, keys in self._groups().items():
            merged = self._reduce(group, keys)
            for key, partials in merged.items():
                buffer = self.buffers[key]
                for stat, value in derive_stats(partials, buffer.stats).items():
                    MetricLogger.log_scalar(f"{buffer.layer_name}_{buffer.tensor_name}_{stat}", value, buffer.iteration)
                    logged[(buffer.layer_name, buffer.tensor_name, stat, buffer.iteration)] = value
        for buffer in self.buffers.values():
            buffer.partials = None
        return logged

    def _groups(self) -> dict[Any, list[Hashable]]:
        """Keys of every buffer, grouped by the process group they reduce over (``"local"`` for none)."""
        groups: dict[Any, list[Hashable]] = {}
        for key, buffer in self.buffers.items():
            local = buffer.skip_reduction or get_distributed_world_size(buffer.reduction_group) == 1
            groups.setdefault("local" if local else buffer.reduction_group, []).append(key)
        return groups

    def _reduce(self, group: Any, keys: list[Hashable]) -> dict[Hashable, torch.Tensor]:
        """Merged partials of the buffers this rank fed, over ``group``: one object and one tensor gather."""
        fed = [key for key in keys if self.buffers[key].partials is not None]
        if group == "local":
            return {key: self.buffers[key].partials for key in fed}
        process_group = None if group is None else group
        world = get_distributed_world_size(process_group)
        every_rank_keys: list[list[Hashable]] = [[] for _ in range(world)]
        dist.all_gather_object(every_rank_keys, fed, group=process_group)
        union = list(dict.fromkeys(key for rank_keys in every_rank_keys for key in rank_keys))
        if not union:
            return {}
        device = next((self.buffers[k].partials.device for k in fed), torch.device("cpu"))
        if dist.get_backend(process_group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        rows = torch.stack([self._partials_or_empty(key, device) for key in union])
        gathered = [torch.empty_like(rows) for _ in range(world)]
        dist.all_gather(gathered, rows, group=process_group)
        stacked = torch.stack(gathered)  # [rank, key, field]
        mine = set(fed)
        return {key: merge_partials(stacked[:, i]) for i, key in enumerate(union) if key in mine}

    def _partials_or_empty(self, key: Hashable, device: torch.device) -> torch.Tensor:
        buffer = self.buffers.get(key)
        if buffer is None or buffer.partials is None:
            return empty_partials(device)
        return buffer.partials.to(device)

    def reset(self) -> None:
        self.buffers.clear()


STATS_BUFFERS = StatsBuffers()
