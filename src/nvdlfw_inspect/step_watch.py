"""A forgotten ``debug_api.step()``: every training step's statistics merged into one iteration, without a word.

Micro-batches (gradient accumulation) legitimately feed a tensor many times per iteration, so the number of feeds
tells nothing. The optimizer does: an optimizer that steps twice while the debug API stays at one iteration ran two
training steps that ``step()`` did not separate. A global ``torch.optim`` step hook (a dictionary update per
optimizer step; none where nothing is fed) notices it at the second training step and says so once. Where no
``torch.optim`` optimizer steps, ``end_debug`` still says it of a run that never called ``step()`` and fed a tensor
more than once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from nvdlfw_inspect.logging import say_once

FIX = (
    "call debug_api.step() once per training step, after optimizer.step() (lowprec.integrations.hf.DebugCallback, "
    "lowprec.integrations.lightning.DebugCallback and lowprec.integrations.accelerate.DebugRun do it for Hugging "
    "Face Trainer, Lightning and accelerate)"
)


class StepWatch:
    """Watches one debug session for training steps that ``debug_api.step()`` does not separate.

    ``iteration``: the session's current iteration; ``fed``: whether any statistic was fed since the last
    ``step()`` (merging matters only then)."""

    def __init__(self, iteration: Callable[[], int], fed: Callable[[], bool]):
        self._iteration, self._fed = iteration, fed
        self._optimizer_steps: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
        self.debug_steps = 0
        self._handle = register_optimizer_step_post_hook(self._optimizer_stepped)

    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        steps = self._optimizer_steps[optimizer] = self._optimizer_steps.get(optimizer, 0) + 1
        if steps == 2 and self._fed():
            say_once(
                f"debug_api.step() was not called between two training steps: {type(optimizer).__name__}.step() ran "
                f"twice while the debug API stayed at iteration {self._iteration()}: the statistics of several training steps "
                f"are merged into one iteration, so trends cannot be seen; {FIX}.",
                call_site=__name__,
            )

    def debug_step(self) -> None:
        """``debug_api.step()`` ran: the optimizers start counting again."""
        self.debug_steps += 1
        self._optimizer_steps.clear()

    def close(self, most_fed: tuple[str, str, int] | None) -> None:
        """Stop watching; ``most_fed``: the (layer, tensor, feeds) fed most often since the last ``step()``. A session
        that never called ``step()`` and fed a tensor more than once says so."""
        self._handle.remove()
        if self.debug_steps == 0 and most_fed is not None and most_fed[2] > 1:
            layer, tensor, feeds = most_fed
            say_once(
                f"debug_api.step() was never called: every statistic of this run is logged as iteration "
                f"{self._iteration()} ({layer}'s {tensor} was fed {feeds} times); if the run trained more than one "
                f"step, its steps are merged into that iteration; {FIX}.",
                call_site=__name__,
            )
