"""lowprec.integrations.lightning.DebugCallback: one record per optimizer step with accumulate_grad_batches, none
from validation (the sanity check included), names of the LightningModule's inner model, the run ended also when
fitting raises, the layers a precision plan selects in its formats."""

from __future__ import annotations

import math

import pytest
import torch
from trainrun import (
    ACCUMULATION,
    BATCH,
    RECIPE,
    STEPS,
    check_one_record_per_optimizer_step,
    check_planned_formats,
    config_file,
    eval_samples,
    tiny_llama,
    train_samples,
)

import nvdlfw_inspect.api as debug_api
from lowprec.errors import LowprecTypeError, LowprecValueError

pl = pytest.importorskip("lightning.pytorch")

from lowprec.integrations.lightning import DebugCallback  # noqa: E402


class LitLlama(pl.LightningModule):
    def __init__(self, fail_at: int | None = None):
        super().__init__()
        self.model = tiny_llama()
        self.fail_at = fail_at
        self.losses: list[float] = []
        self.validations = 0

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise RuntimeError("loss went away")
        loss = self.model(**batch).loss
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        self.validations += 1
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(module: pl.LightningModule, callback: DebugCallback, validate: bool) -> pl.Trainer:
    loader = torch.utils.data.DataLoader(train_samples(), batch_size=BATCH)
    val_loader = torch.utils.data.DataLoader(eval_samples(), batch_size=BATCH)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATION,
        val_check_interval=ACCUMULATION,  # in training batches: after every optimizer step
        limit_val_batches=2 if validate else 0,
        num_sanity_val_steps=1 if validate else 0,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader, val_loader)
    return trainer


def run(tmp_path, name: str, validate: bool) -> tuple[dict, LitLlama]:
    module = LitLlama()
    trainer = fit(module, DebugCallback(config_file(tmp_path), log_dir=tmp_path / name, recipe=RECIPE), validate)
    assert trainer.global_step == STEPS and len(module.losses) == STEPS * ACCUMULATION
    assert all(math.isfinite(loss) for loss in module.losses)
    assert "training_step" not in vars(module) and "validation_step" not in vars(module)  # unwrapped again
    return check_one_record_per_optimizer_step(tmp_path / name), module


def test_fit_logs_one_record_per_optimizer_step_and_none_from_validation(tmp_path):
    validated, module = run(tmp_path, "with_val", validate=True)
    assert module.validations == 1 + STEPS * 2  # the sanity check's batch, then 2 batches after every step
    plain, _ = run(tmp_path, "without_val", validate=False)
    assert validated == plain  # the sanity check and the validations after every step added nothing
    assert module.model.model.layers[0].self_attn.q_proj.name == "model.model.layers.0.self_attn.q_proj"


def test_a_precision_plan_in_the_debug_config_gives_the_layers_it_selects_their_formats(tmp_path):
    """One file holds the debug config and, under ``precision_plan:``, the plan: initialize skips that key, the
    callback's plan reads only it."""
    config = config_file(tmp_path, plan=True)
    module = LitLlama()
    trainer = fit(module, DebugCallback(config, log_dir=tmp_path / "logs", recipe=RECIPE, plan=config), validate=False)
    assert trainer.global_step == STEPS and all(math.isfinite(loss) for loss in module.losses)
    check_one_record_per_optimizer_step(tmp_path / "logs")
    check_planned_formats(tmp_path / "logs")


def test_a_fit_that_raises_ends_the_run(tmp_path):
    module = LitLlama(fail_at=3)
    with pytest.raises(RuntimeError, match="loss went away"):
        fit(module, DebugCallback(config_file(tmp_path), log_dir=tmp_path / "logs", recipe=RECIPE), validate=False)
    assert debug_api.DEBUG_MANAGER is None
    assert "training_step" not in vars(module)


class TwoModels(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 2)
        self.loss = torch.nn.MSELoss()  # no parameters: not a candidate for the inner model


def test_the_inner_model_is_the_one_child_with_parameters_or_named(tmp_path):
    callback = DebugCallback(config_file(tmp_path))
    module = LitLlama()
    module.metric = torch.nn.Identity()  # a child without parameters does not count
    assert callback._inner(module) is module.model
    two = TwoModels()
    with pytest.warns(UserWarning, match="layer names start at the LightningModule TwoModels: it holds parameters in 2"):
        assert callback._inner(two) is two
    assert DebugCallback(config_file(tmp_path), inner_model="head")._inner(two) is two.head
    assert DebugCallback(config_file(tmp_path), inner_model="")._inner(two) is two
    with pytest.raises(LowprecValueError, match=r"inner_model='decoder' is no submodule of TwoModels; its children: \['encoder'"):
        DebugCallback(config_file(tmp_path), inner_model="decoder")._inner(two)
    with pytest.raises(LowprecTypeError, match="inner_model must be an attribute path"):
        DebugCallback(config_file(tmp_path), inner_model=1)
