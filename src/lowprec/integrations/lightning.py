"""Lightning: a ``Callback`` that runs a debug session over ``trainer.fit()``.

::

    trainer = lightning.pytorch.Trainer(..., accumulate_grad_batches=2, callbacks=[
        DebugCallback("config.yaml", log_dir="logs", recipe=lowprec.Float8CurrentScaling())])
    trainer.fit(lit_module)

At ``on_fit_start`` the run starts (iterations count from ``trainer.global_step``), with the layers named from the
LightningModule's inner model (``inner_model``) without its wrappers, as a plain training loop names that model: a
LightningModule holding a LlamaForCausalLM in ``self.model`` gives ``model.model.layers.0.self_attn.q_proj``, not
``model.model.model...``. It steps after each training batch that made an optimizer step, so once per optimizer step
whatever ``accumulate_grad_batches``; it ends at ``on_fit_end`` and, when fitting raises, at ``on_exception``.
``training_step`` runs under ``lowprec.autocast(recipe=..., plan=...)``; ``validation_step`` (the sanity check
included) under the same autocast with inspection paused, so validation adds nothing to the statistics. With
``plan`` (a precision plan: a YAML path, a mapping or a ``lowprec.plan.PrecisionPlan``), the layers its rules select
run its recipes, per GEMM and for validation forwards, the others ``recipe``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lowprec.errors import LowprecTypeError, LowprecValueError
from lowprec.integrations.session import DebugSession
from nvdlfw_inspect.logging import say_once


class DebugCallback(Callback):
    """Arguments as ``lowprec.integrations.session.DebugSession``'s (``plan`` included: a bad one raises its
    ``ConfigError`` here, before fitting), and ``inner_model``: the attribute path of the
    model to name inside the LightningModule (``"model"``, ``"net.backbone"``; ``""``: the LightningModule itself).
    None: the LightningModule's one child that holds parameters, when it has no other and no parameters of its own;
    else the LightningModule itself, said once."""

    def __init__(
        self,
        config_file: str | os.PathLike | dict,
        *,
        inner_model: str | None = None,
        **options: Any,
    ):
        if inner_model is not None and not isinstance(inner_model, str):
            raise LowprecTypeError(f"inner_model must be an attribute path (a string) or None, got {inner_model!r}")
        self.inner_model = inner_model
        self.session = DebugSession(config_file, **options)
        self._global_step = 0

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._global_step = trainer.global_step
        self.session.start(
            pl_module,
            entries=("training_step", "validation_step"),
            named=self._inner(pl_module),
            init_training_step=trainer.global_step,
        )

    def _inner(self, pl_module: LightningModule) -> torch.nn.Module:
        if self.inner_model is not None:
            try:
                return pl_module.get_submodule(self.inner_model)
            except AttributeError:
                children = [name for name, _ in pl_module.named_children()]
                raise LowprecValueError(
                    f"inner_model={self.inner_model!r} is no submodule of {type(pl_module).__name__}; its children: "
                    f"{children} ('' names from the LightningModule itself)"
                ) from None
        holders = [child for child in pl_module.children() if next(child.parameters(), None) is not None]
        if len(holders) == 1 and next(pl_module.parameters(recurse=False), None) is None:
            return holders[0]
        say_once(
            f"layer names start at the LightningModule {type(pl_module).__name__}: it holds parameters in "
            f"{len(holders)} children or itself, not in one inner model; pass DebugCallback(inner_model=...) to name "
            "from one"
        )
        return pl_module

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self._global_step:  # this batch ended with an optimizer step
            self._global_step = trainer.global_step
            self.session.step()

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """Refuses a checkpoint of a poisoned run (``DebugSession.check_checkpoint``): Lightning calls this before
        it writes one."""
        self.session.check_checkpoint()

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.session.end()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.session.end()
