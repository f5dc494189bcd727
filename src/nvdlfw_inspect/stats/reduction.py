"""Combine partial statistics across ranks: a few floats per rank travel, never whole tensors."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nvdlfw_inspect.stats.partials import merge_partials
from nvdlfw_inspect.utils import get_distributed_rank, get_distributed_world_size


def reduce_partials(partials: torch.Tensor, group: Any = None, to_last_rank: bool = False) -> torch.Tensor | None:
    """Merge one partial from every member of ``group``.

    With ``to_last_rank`` the partials are gathered on the last rank of the default group only, and
    the other ranks get None (the reference's behaviour when no reduction group is set).
    """
    world_size = get_distributed_world_size(group)
    if world_size == 1:
        return partials
    partials = partials.contiguous()
    if to_last_rank:
        dst = world_size - 1
        rows = [torch.empty_like(partials) for _ in range(world_size)] if get_distributed_rank() == dst else None
        dist.gather(partials, rows, dst=dst)
        return merge_partials(torch.stack(rows)) if rows is not None else None
    rows = [torch.empty_like(partials) for _ in range(world_size)]
    dist.all_gather(rows, partials, group=group)
    return merge_partials(torch.stack(rows))
