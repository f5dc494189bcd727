"""Rank, world size, process groups and gathers, the same with or without a default process group:
without one there is a single process, and no collective runs."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """True when a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def get_distributed_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


def get_distributed_rank(group: Any = None) -> int:
    return dist.get_rank(group) if is_distributed() else 0


def group_ranks(group: Any) -> list[int]:
    """The global ranks of ``group`` (None: the default group), in group-rank order."""
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def default_store() -> Any:
    """The default group's store; None when it cannot be had."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def own_gloo_group(ranks: list[int], prefix: str, timeout: datetime.timedelta) -> Any:
    """A gloo group over the global ``ranks`` for the tool alone, set up by its members only (waiting for them up to
    ``timeout``) in the default store under ``prefix``, which its members must share and use once.

    Not ``dist.new_group``: that needs every rank of the default group, members or not, to call it in the order of
    the training's own ``new_group`` calls (it numbers groups with one counter), and the training's
    ``destroy_process_group`` would destroy it. Its collectives are the backend's own (``allreduce``, ``allgather``).
    """
    store = dist.PrefixStore(prefix, default_store())
    return dist.ProcessGroupGloo(store, ranks.index(dist.get_rank()), len(ranks), timeout)


def gather_along_first_dim(tensor: torch.Tensor, process_group: Any = None) -> tuple[torch.Tensor, None]:
    """All-gather ``tensor`` from every member of ``process_group`` and concatenate along dim 0.

    Returns ``(gathered, None)``, the shape downstream code unpacks.
    """
    world_size = get_distributed_world_size(process_group)
    if world_size == 1:
        return tensor, None
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(parts, tensor.contiguous(), group=process_group)
    return torch.cat(parts, dim=0), None


def gather_tensor_on_last_rank(tensor: torch.Tensor) -> torch.Tensor | None:
    """Gather ``tensor`` from every rank of the default group onto the last rank; other ranks get None."""
    world_size = get_distributed_world_size()
    if world_size == 1:
        return tensor
    dst = world_size - 1
    parts = [torch.empty_like(tensor) for _ in range(world_size)] if dist.get_rank() == dst else None
    dist.gather(tensor.contiguous(), parts, dst=dst)
    return torch.cat(parts, dim=0) if parts is not None else None
