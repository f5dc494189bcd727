"""lowprec.integrations.hf.DebugCallback: one record per optimizer step with gradient accumulation, none from the
evaluations the Trainer runs in between, names of the unwrapped model, the run ended also when training raises, the
layers a precision plan selects in its formats."""

from __future__ import annotations

import math

import pytest
from trainrun import (
    ACCUMULATION,
    BATCH,
    PLAN_YAML,
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
from lowprec.autocast import active_recipe
from lowprec.errors import LowprecTypeError
from nvdlfw_inspect.errors import ConfigError

transformers = pytest.importorskip("transformers")

from lowprec.integrations.hf import DebugCallback  # noqa: E402


def trainer(tmp_path, model, callback, evaluate: bool, max_steps: int = STEPS):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=max_steps,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATION,
        eval_strategy="steps" if evaluate else "no",
        eval_steps=1,
        learning_rate=1e-3,
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    return transformers.Trainer(
        model=model, args=args, train_dataset=train_samples(), eval_dataset=eval_samples(), callbacks=[callback]
    )


def run(tmp_path, name: str, evaluate: bool) -> tuple[dict, object]:
    log_dir = tmp_path / name
    model = tiny_llama()
    callback = DebugCallback(config_file(tmp_path), log_dir=log_dir, recipe=RECIPE)
    hf_trainer = trainer(tmp_path, model, callback, evaluate)
    with callback:
        output = hf_trainer.train()
    assert output.global_step == STEPS and math.isfinite(output.training_loss)
    evaluations = [entry for entry in hf_trainer.state.log_history if "eval_loss" in entry]
    assert len(evaluations) == (STEPS if evaluate else 0)
    assert "forward" not in vars(model)  # the autocast wrapper is gone
    return check_one_record_per_optimizer_step(log_dir), model


def test_trainer_logs_one_record_per_optimizer_step_and_none_from_evaluation(tmp_path):
    evaluated, model = run(tmp_path, "with_eval", evaluate=True)
    plain, _ = run(tmp_path, "without_eval", evaluate=False)
    assert evaluated == plain  # the evaluations after every step added nothing to any step's statistics
    assert model.model.layers[0].self_attn.q_proj.name == "model.model.layers.0.self_attn.q_proj"


def test_a_training_that_raises_ends_the_run_and_unwraps_the_forward(tmp_path):
    model = tiny_llama()
    callback = DebugCallback(config_file(tmp_path), log_dir=tmp_path / "logs", recipe=RECIPE)
    failing = trainer(tmp_path, model, callback, evaluate=False)

    def broken(*args, **kwargs):
        assert debug_api.DEBUG_MANAGER is not None  # inside the run
        raise RuntimeError("loss went away")

    failing.compute_loss = broken
    with pytest.raises(RuntimeError, match="loss went away"), callback:
        failing.train()
    assert debug_api.DEBUG_MANAGER is None
    assert "forward" not in vars(model)


def test_training_forwards_run_under_the_recipe_and_evaluation_paused(tmp_path):
    """What the wrapped forward sees: the recipe in training and in evaluation, the pause in evaluation only."""
    seen = []
    model = tiny_llama()
    inner = model.model.layers[0].mlp.down_proj

    def look(module, args):
        seen.append((module.training, active_recipe(), debug_api.DEBUG_MANAGER.paused))

    inner.register_forward_pre_hook(look)
    callback = DebugCallback(config_file(tmp_path), log_dir=tmp_path / "logs", recipe=RECIPE)
    with callback:
        trainer(tmp_path, model, callback, evaluate=True, max_steps=1).train()
    training = [s for s in seen if s[0]]
    evaluation = [s for s in seen if not s[0]]
    assert training == [(True, RECIPE, False)] * ACCUMULATION
    assert evaluation and set(evaluation) == {(False, RECIPE, True)}


def test_a_resumed_training_logs_at_its_own_steps(tmp_path):
    """Iterations count from the Trainer's global step at on_train_begin (a training resumed from a checkpoint)."""
    model = tiny_llama()
    callback = DebugCallback(config_file(tmp_path), log_dir=tmp_path / "logs", recipe=RECIPE)
    state = transformers.TrainerState(global_step=5)
    callback.on_train_begin(None, state, None, model=model)
    assert debug_api.DEBUG_MANAGER._trainer_iteration_count == 5
    callback.on_step_end(None, state, None, model=model)
    assert debug_api.DEBUG_MANAGER._trainer_iteration_count == 6
    callback.on_train_end(None, state, None, model=model)
    assert debug_api.DEBUG_MANAGER is None


def test_the_iteration_is_not_an_initialize_keyword_here(tmp_path):
    with pytest.raises(LowprecTypeError, match="init_training_step is set by the integration"):
        DebugCallback(config_file(tmp_path), init_training_step=3)


def test_a_precision_plan_gives_the_layers_it_selects_their_formats(tmp_path):
    """The plan as a file of its own: q_proj trains in NVFP4 and one down_proj's wgrad in MXFP8, every other GEMM in the
    callback's recipe; the statistics still come once per optimizer step."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN_YAML)
    callback = DebugCallback(config_file(tmp_path), log_dir=tmp_path / "logs", recipe=RECIPE, plan=plan)
    with callback:
        output = trainer(tmp_path, tiny_llama(), callback, evaluate=False).train()
    assert output.global_step == STEPS and math.isfinite(output.training_loss)
    check_one_record_per_optimizer_step(tmp_path / "logs")
    check_planned_formats(tmp_path / "logs")


def test_a_bad_plan_fails_at_construction_naming_its_key_and_value(tmp_path):
    plan = {"rules": [{"layers": {"layer_name_regex_pattern": "q_proj$"}, "recipe": "fp9"}]}
    with pytest.raises(ConfigError, match=r"key 'rules\.0\.recipe'.*unknown recipe.*'fp9'"):
        DebugCallback(config_file(tmp_path), log_dir=tmp_path / "logs", plan=plan)
    assert debug_api.DEBUG_MANAGER is None and not (tmp_path / "logs").exists()  # nothing started
