"""Activation checkpointing: a recomputed forward must repeat its original forward exactly.

``torch.utils.checkpoint`` (``use_reentrant=False``) reruns a region's forward during backward to get
back the tensors it saved. By then the user's ``fp8_autocast`` has usually exited, delayed-scaling
quantizers have moved to the next scale and the debug session may have logged the step; a naive rerun
would run in high precision, cast with other scales, record amaxes twice and log statistics twice.

So a ``GemmUnit`` remembers each of its forwards whose autograd graph may still need it (the recipe and
debug plan it ran with, and its autograd node, which knows the state of its casts), and a forward that
runs inside a backward replays the oldest unfinished one: micro-batches and pipeline schedules run their
backwards in the order of their forwards. The replay casts with the original scales (block recipes
compute theirs from the tensor, which is the same again) and the original stochastic-rounding noise,
records no amax, advances no noise stream and inspects nothing; ``modify_tensor`` features run again,
as they must to give the same tensors.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any, NamedTuple

import torch

from lowprec.debug.plan import LayerPlan
from lowprec.quant.protocol import CastState, Quantizer
from lowprec.recipe import Recipe


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread: a forward now is a recomputation."""
    return torch._C._current_graph_task_id() != -1


class Forward(NamedTuple):
    """One remembered forward: its autograd node (``LinearFunction``'s ctx) and what it ran with."""

    node: Any
    recipe: Recipe | None
    plan: LayerPlan | None


class ForwardHistory:
    """A unit's forwards whose backward has not run yet, oldest first. Entries hold their node weakly:
    a graph freed without a backward (evaluation with grad on, a dropped loss) leaves nothing behind."""

    def __init__(self) -> None:
        self._entries: deque[tuple[weakref.ref, Recipe | None, LayerPlan | None]] = deque()

    def remember(self, node: Any, recipe: Recipe | None, plan: LayerPlan | None) -> None:
        self._drop_finished()
        self._entries.append((weakref.ref(node), recipe, plan))

    def oldest(self) -> Forward | None:
        """Take the oldest unfinished forward (a recomputation replays it), or None if there is none:
        the original forward ran ``torch.nn.functional.linear`` (no FP8, no debug feature)."""
        self._drop_finished()
        if not self._entries:
            return None
        node_ref, recipe, plan = self._entries.popleft()
        return Forward(node_ref(), recipe, plan)

    def _drop_finished(self) -> None:
        while self._entries:
            node = self._entries[0][0]()
            if node is not None and not getattr(node, "backward_done", False):
                return
            self._entries.popleft()

    def __len__(self) -> int:
        return len(self._entries)


def replay_quantizers(live: dict[str, Quantizer], cast_states: dict[str, CastState]) -> dict[str, Quantizer]:
    """Quantizers that repeat a forward's casts: each input cast with the scale (or the noise) the
    original used. An input the original did not cast keeps a quantizer that records nothing
    (``modify_tensor`` features may still ask for it)."""
    return {name: quantizer.replaying(cast_states.get(name)) for name, quantizer in live.items()}
