"""accelerate: a context manager that runs a debug session over a hand-written training loop.

::

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with DebugRun(accelerator, model, "config.yaml", log_dir="logs", recipe=lowprec.Float8CurrentScaling()) as run:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            run.step()  # after every batch: steps the debug run only when accelerator.sync_gradients
        accelerator.save_state("checkpoint")  # refused (PoisonedCheckpointError) after a poisoned step

Entering starts the run, with the layers named from the model without its wrappers (``accelerator.prepare``'s
DDP, FSDP, DeepSpeed, ``torch.compile``; PEFT); leaving ends it, also when the loop raises. The prepared model's
forward runs under ``lowprec.autocast(recipe=..., plan=...)`` in train mode, and in eval mode (an evaluation inside
the loop) under the same autocast with inspection paused, so that evaluation adds nothing to the statistics. With
``plan`` (a precision plan: a YAML path, a mapping or a ``lowprec.plan.PrecisionPlan``), the layers its rules select
run its recipes, per GEMM and for evaluation forwards, the others ``recipe``.

While the run is open, ``accelerator.save_state`` and ``accelerator.save_model`` first call
``DebugSession.check_checkpoint``: after a step in which ``NonfiniteGuard`` saw NaN or inf they raise
``PoisonedCheckpointError`` before anything is written (FSDP and DeepSpeed write parts of a state before
accelerate's own save hooks run, so the check wraps the two methods instead), unless
``allow_poisoned_checkpoint=True``.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from accelerate import Accelerator

from lowprec.errors import LowprecTypeError
from lowprec.integrations.session import DebugSession

SAVING = ("save_state", "save_model")  # the Accelerator methods that write a checkpoint, checked while a run is open


class DebugRun:
    """Arguments after ``model`` as ``lowprec.integrations.session.DebugSession``'s (config, feature dirs, log dir,
    ``initialize`` keywords, recipe, ``fp8``, ``plan``, ``convert``; a bad plan raises its ``ConfigError`` here);
    ``init_training_step`` sets the first iteration (a resumed training)."""

    def __init__(
        self,
        accelerator: Accelerator,
        model: torch.nn.Module,
        config_file: str | os.PathLike | dict,
        *,
        init_training_step: int = 0,
        **options: Any,
    ):
        if not isinstance(accelerator, Accelerator):
            raise LowprecTypeError(f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}")
        self.accelerator = accelerator
        self.model = model
        self.init_training_step = init_training_step
        self.session = DebugSession(config_file, **options)

    def __enter__(self) -> DebugRun:
        self.session.start(self.model, init_training_step=self.init_training_step)
        for name in SAVING:
            self._guard_saving(name)
        return self

    def _guard_saving(self, name: str) -> None:
        """``accelerator.<name>`` checks the run first (this instance's attribute, removed when the run ends)."""
        save = getattr(self.accelerator, name)

        @functools.wraps(save)
        def checked_save(*args: Any, **kwargs: Any) -> Any:
            self.session.check_checkpoint()
            return save(*args, **kwargs)

        setattr(self.accelerator, name, checked_save)

    def step(self) -> None:
        """Call after every batch: at the batch that ends a gradient accumulation (``accelerator.sync_gradients``,
        the batch whose ``optimizer.step()`` updated the model) it logs the step's statistics."""
        if self.accelerator.sync_gradients:
            self.session.step()

    def __exit__(self, *exc_info: object) -> None:
        try:
            for name in SAVING:  # the instance's attributes: the class's methods show again
                vars(self.accelerator).pop(name, None)
        finally:
            self.session.end()
