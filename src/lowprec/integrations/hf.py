"""Hugging Face ``Trainer``: a ``TrainerCallback`` that runs a debug session over ``trainer.train()``.

::

    callback = DebugCallback("config.yaml", log_dir="logs", recipe=lowprec.Float8CurrentScaling())
    trainer = Trainer(model=model, args=args, train_dataset=..., eval_dataset=..., callbacks=[callback])
    with callback:  # ends the run also when train() raises
        trainer.train()

At ``on_train_begin`` the run starts (iterations count from ``state.global_step``, so a resumed training logs at
its own steps), with the layers named from the model without its wrappers (see ``session.unwrap``); it steps at
``on_step_end``, once per optimizer step whatever ``gradient_accumulation_steps``; it ends at ``on_train_end``.
Training forwards run under ``lowprec.autocast(recipe=..., plan=...)``; the Trainer's evaluations (the model in eval
mode) run under the same autocast with inspection paused, so they add nothing to the statistics. With ``plan`` (a
precision plan: a YAML path, a mapping or a ``lowprec.plan.PrecisionPlan``), the layers its rules select run its
recipes, per GEMM and for evaluation forwards, the others ``recipe``::

    callback = DebugCallback("config.yaml", log_dir="logs", recipe=lowprec.MXFP8BlockScaling(), plan="plan.yaml")
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback

from lowprec.integrations.session import DebugSession


class DebugCallback(TrainerCallback):
    """Arguments as ``lowprec.integrations.session.DebugSession``'s (config, feature dirs, log dir, ``initialize``
    keywords, recipe, ``fp8``, ``plan``, ``convert``); a bad plan raises its ``ConfigError`` here, before training.
    Used as a context manager around ``train()``, it also ends the run when training raises (the Trainer calls no
    callback then); otherwise a failed run ends at the next ``train()`` or at exit."""

    def __init__(self, config_file: str | os.PathLike | dict, **options: Any):
        self.session = DebugSession(config_file, **options)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.session.start(model, init_training_step=state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Also refuses the checkpoint the Trainer is about to save after a poisoned step (``check_checkpoint``):
        its ``on_save`` comes after the save."""
        self.session.step()
        if getattr(control, "should_save", False):
            self.session.check_checkpoint()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.end()

    def __enter__(self) -> DebugCallback:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.session.end()
