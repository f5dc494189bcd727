"""What the integrations share: the model found inside its wrappers, and a session's start, wrapping and end."""

from __future__ import annotations

import pytest
import torch
from trainrun import PLAN_YAML, RECIPE, config_file, tiny_llama

import lowprec
import nvdlfw_inspect.api as debug_api
from lowprec.autocast import active_recipe, current_state
from lowprec.errors import LowprecValueError
from lowprec.integrations.session import DebugSession, unwrap
from lowprec.plan import PrecisionPlan


def test_unwrap_removes_every_wrapper_however_nested():
    peft = pytest.importorskip("peft")
    model = tiny_llama()
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    wrapped = torch.nn.DataParallel(torch.compile(lora))
    assert unwrap(wrapped) is model
    assert unwrap(model) is model


def test_a_model_with_a_child_called_module_is_not_taken_for_a_wrapper():
    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = torch.nn.Linear(2, 2)

    holder = Holder()
    assert unwrap(holder) is holder


def test_names_come_from_the_unwrapped_peft_model(tmp_path):
    peft = pytest.importorskip("peft")
    model = tiny_llama()
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    session = DebugSession(config_file(tmp_path), log_dir=tmp_path / "logs", recipe=RECIPE)
    session.start(lora)
    try:
        q_proj = lora.base_model.model.model.layers[0].self_attn.q_proj
        assert q_proj.name == "model.model.layers.0.self_attn.q_proj"  # PEFT's LoRA layer, holding ...
        assert q_proj.base_layer.name == "model.model.layers.0.self_attn.q_proj.base_layer"  # ... the lowprec layer
    finally:
        session.end()


def test_the_wrapped_entry_runs_under_the_recipe_paused_in_eval_mode_and_is_restored(tmp_path):
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append((active_recipe(), debug_api.DEBUG_MANAGER.paused))
            return x

    probe = Probe()
    previous = lambda x: probe.__class__.forward(probe, x)  # noqa: E731  (what another library set on the instance)
    probe.forward = previous
    session = DebugSession(config_file(tmp_path), log_dir=tmp_path / "logs", recipe=RECIPE)
    session.start(probe)
    probe(1)
    probe.eval()
    probe(1)
    assert seen == [(RECIPE, False), (RECIPE, True)]
    session.end()
    session.end()  # twice: nothing more
    assert vars(probe)["forward"] is previous and debug_api.DEBUG_MANAGER is None


@pytest.mark.parametrize("fp8", [False, True])
def test_fp8_false_trains_in_high_precision_with_statistics(tmp_path, fp8):
    """The recipe in force inside the wrapped forward (a pre-hook runs outside it): none with ``fp8=False``."""
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append(active_recipe())
            return x

    probe = Probe()
    session = DebugSession(config_file(tmp_path), log_dir=tmp_path / "logs", fp8=fp8, recipe=RECIPE)
    session.start(probe)
    probe(1)
    session.end()
    assert seen == [RECIPE if fp8 else None]


def test_a_run_left_open_is_ended_at_the_next_start_and_a_failed_start_leaves_none(tmp_path):
    session = DebugSession(config_file(tmp_path), log_dir=tmp_path / "logs", convert=True)
    model = tiny_llama(convert=False)
    session.start(model)
    with pytest.warns(UserWarning, match="the previous training's debug run was not ended"):
        session.start(model)
    session.end()
    with pytest.raises(LowprecValueError, match="convert=True cannot convert a bare Linear in place"):
        session.start(torch.nn.Linear(2, 2))
    assert debug_api.DEBUG_MANAGER is None and not session.active
    assert isinstance(model.lm_head, lowprec.Linear)


def test_the_plan_is_read_at_construction_and_in_force_in_training_and_evaluation(tmp_path):
    """The plan's file is read once, when the session is made (a file changed later changes nothing), and every
    forward, training or evaluation, runs under it and the recipe."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN_YAML)
    session = DebugSession(config_file(tmp_path), log_dir=tmp_path / "logs", recipe=RECIPE, plan=plan)
    plan.write_text("not: a plan")
    assert isinstance(session.plan, PrecisionPlan) and [rule.name for rule in session.plan.rules] == [
        "q_proj in NVFP4",
        "layer 1's down_proj wgrad in MXFP8",
    ]
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append((current_state().recipe, current_state().plan))
            return x

    probe = Probe()
    session.start(probe)
    probe(1)
    probe.eval()
    probe(1)
    session.end()
    assert seen == [(RECIPE, session.plan)] * 2
    with pytest.raises(FileNotFoundError, match=r"precision plan file '.*missing.yaml' not found"):
        DebugSession(config_file(tmp_path), plan=tmp_path / "missing.yaml")
