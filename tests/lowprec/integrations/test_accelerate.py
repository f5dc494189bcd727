"""lowprec.integrations.accelerate.DebugRun: one record per optimizer step with gradient accumulation, none from
an evaluation inside the loop, the model converted when asked, the run ended also when the loop raises."""

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
    config_file,
    eval_samples,
    tiny_llama,
    train_samples,
)

import lowprec
import nvdlfw_inspect.api as debug_api
from lowprec.errors import LowprecTypeError, LowprecValueError
from nvdlfw_inspect.errors import ConfigError

accelerate = pytest.importorskip("accelerate")

from lowprec.integrations.accelerate import DebugRun  # noqa: E402


def train(tmp_path, name: str, evaluate: bool, fail_at: int | None = None) -> tuple[torch.nn.Module, list[float]]:
    """The loop of accelerate's gradient-accumulation guide on an unconverted model that DebugRun converts; with
    ``evaluate``, an evaluation pass (eval mode, no grad) after every optimizer step."""
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=ACCUMULATION, cpu=True)
    model = tiny_llama(convert=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(train_samples(), batch_size=BATCH)
    eval_loader = torch.utils.data.DataLoader(eval_samples(), batch_size=BATCH)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    config = config_file(tmp_path)
    with DebugRun(accelerator, model, config, log_dir=tmp_path / name, recipe=RECIPE, convert=True) as run:
        for index, batch in enumerate(loader):
            if index == fail_at:
                raise RuntimeError("loss went away")
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            run.step()
            if evaluate and accelerator.sync_gradients:
                model.eval()
                with torch.no_grad():
                    for eval_batch in eval_loader:
                        model(**eval_batch)
                model.train()
    return model, losses


def test_loop_logs_one_record_per_optimizer_step_and_none_from_evaluation(tmp_path):
    model, losses = train(tmp_path, "with_eval", evaluate=True)
    assert len(losses) == STEPS * ACCUMULATION and all(math.isfinite(loss) for loss in losses)
    assert isinstance(model.model.layers[0].self_attn.q_proj, lowprec.Linear)  # converted, as asked
    assert model.model.layers[0].self_attn.q_proj.name == "model.model.layers.0.self_attn.q_proj"
    assert "forward" not in vars(model)
    evaluated = check_one_record_per_optimizer_step(tmp_path / "with_eval")
    train(tmp_path, "without_eval", evaluate=False)
    assert evaluated == check_one_record_per_optimizer_step(tmp_path / "without_eval")


def test_a_loop_that_raises_ends_the_run(tmp_path):
    with pytest.raises(RuntimeError, match="loss went away"):
        train(tmp_path, "logs", evaluate=False, fail_at=3)
    assert debug_api.DEBUG_MANAGER is None


def test_bad_arguments_name_the_value_and_what_is_allowed(tmp_path):
    accelerator = accelerate.Accelerator(cpu=True)
    model = tiny_llama()
    with pytest.raises(LowprecTypeError, match="accelerator must be an accelerate.Accelerator, got str"):
        DebugRun("accelerator", model, config_file(tmp_path))
    with pytest.raises(LowprecTypeError, match="recipe must be one of lowprec.DelayedScaling.*; got str"):
        DebugRun(accelerator, model, config_file(tmp_path), recipe="fp8")
    with pytest.raises(LowprecTypeError, match="config_file must be the path of a YAML config"):
        DebugRun(accelerator, model, None)
    with pytest.raises(LowprecValueError, match="config_file is empty"):
        DebugRun(accelerator, model, "")
    with pytest.raises(LowprecTypeError, match="convert must be a bool, got 'yes'"):
        DebugRun(accelerator, model, config_file(tmp_path), convert="yes")
    with pytest.raises(ConfigError, match=r"key 'rules\.0': missing required key 'layers'"):
        DebugRun(accelerator, model, config_file(tmp_path), plan={"rules": [{"recipe": "nvfp4"}]})
