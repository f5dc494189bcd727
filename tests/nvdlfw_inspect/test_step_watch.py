"""A forgotten ``debug_api.step()`` is said: at the second optimizer step without one (once), at ``end_debug`` of a
session that never called it, and by ``diagnose`` and ``report`` of a run whose every statistic is from one iteration.
Gradient accumulation (several micro-batches per step) with ``step()`` stays silent."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
import torch.optim.optimizer as optimizer_module
from browser import CHROMIUM, dom
from logreader import main_log_path

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.cli import main
from nvdlfw_inspect.errors import ConfigError
from nvdlfw_inspect.report import write_report

CONFIG = {
    "stats": {
        "enabled": True,
        "layers": {"layer_name_regex_pattern": "fc"},
        "LogTensorStats": {"enabled": True, "stats": ["max", "l2_norm"], "tensors": ["activation"], "freq": 1},
    }
}
NOT_BETWEEN = "debug_api.step() was not called between two training steps"
NEVER = "debug_api.step() was never called"


def train(log_dir, steps: int, micro_batches: int = 1, call_step: bool = True) -> list[str]:
    """A linear layer trained with SGD, its input's statistics fed per micro-batch; the step warnings said."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        debug_api.initialize(config_file=CONFIG, log_dir=str(log_dir), default_logging_enabled=True)
        for _ in range(steps):
            for _ in range(micro_batches):
                x = torch.randn(4, 8)
                debug_api.log_tensor_stats("model.fc", tensor=x, tensor_name="activation")
                layer(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if call_step:
                debug_api.step()
        debug_api.end_debug()
    return [str(w.message) for w in caught if "debug_api.step()" in str(w.message)]


def test_twenty_steps_without_step_are_said_once_at_the_second_and_at_the_end(tmp_path):
    said = train(tmp_path, steps=20, call_step=False)
    assert said == [
        f"{NOT_BETWEEN}: SGD.step() ran twice while the debug API stayed at iteration 0: the statistics of several "
        "training steps are merged into one iteration, so trends cannot be seen; call debug_api.step() once per "
        "training step, after optimizer.step() (lowprec.integrations.hf.DebugCallback, "
        "lowprec.integrations.lightning.DebugCallback and lowprec.integrations.accelerate.DebugRun do it for Hugging "
        "Face Trainer, Lightning and accelerate).",
        f"{NEVER}: every statistic of this run is logged as iteration 0 (model.fc's activation was fed 20 times); if "
        "the run trained more than one step, its steps are merged into that iteration; call debug_api.step() once "
        "per training step, after optimizer.step() "
        "(lowprec.integrations.hf.DebugCallback, lowprec.integrations.lightning.DebugCallback and "
        "lowprec.integrations.accelerate.DebugRun do it for Hugging Face Trainer, Lightning and accelerate).",
    ]
    log = main_log_path(tmp_path).read_text()
    assert log.count(NOT_BETWEEN) == 1 and log.count(NEVER) == 1


def test_gradient_accumulation_with_step_is_silent(tmp_path):
    assert train(tmp_path, steps=5, micro_batches=4) == []
    assert "debug_api.step()" not in main_log_path(tmp_path).read_text()


def test_a_session_without_an_optimizer_is_told_at_end_debug(tmp_path):
    with pytest.warns(
        UserWarning, match=re.escape(NEVER) + ": every statistic of this run is logged as iteration 3 .*fed 5 times"
    ):
        debug_api.initialize(config_file=CONFIG, log_dir=str(tmp_path), init_training_step=3)
        for _ in range(5):
            debug_api.log_tensor_stats("model.fc", tensor=torch.ones(4), tensor_name="activation")
        debug_api.end_debug()


def test_a_failed_initialize_leaves_no_optimizer_hook(tmp_path):
    hooks = dict(optimizer_module._global_optimizer_post_hooks)
    with pytest.raises(ConfigError):
        debug_api.initialize(config_file={"bad": {"enabled": True}}, log_dir=str(tmp_path))
    assert dict(optimizer_module._global_optimizer_post_hooks) == hooks
    debug_api.initialize(config_file=CONFIG, log_dir=str(tmp_path))
    debug_api.end_debug()
    assert dict(optimizer_module._global_optimizer_post_hooks) == hooks


def test_diagnose_of_a_one_iteration_run_gives_no_bare_all_clear(tmp_path, capsys):
    train(tmp_path, steps=20, call_step=False)
    capsys.readouterr()
    assert main(["diagnose", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"No findings in {tmp_path} (iterations 0 to 0;")
    assert lines[1] == (
        "caution: every statistic is from iteration 0 alone, so what persists or grows cannot be judged and no finding "
        "is no all-clear; if the run trained more than one step, debug_api.step() was never called and every step was "
        "merged into that iteration: call it once per training step, after optimizer.step()"
    )
    assert main(["diagnose", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["caution"] == lines[1].removeprefix("caution: ")

    stepped = tmp_path / "stepped"
    train(stepped, steps=3)
    assert main(["diagnose", str(stepped), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["caution"] is None


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (scripts/test.sh installs it)")
def test_the_report_page_shows_the_caution(tmp_path):
    train(tmp_path / "run", steps=20, call_step=False)
    html, errors = dom(write_report(tmp_path / "run", tmp_path / "report.html"))
    assert errors == []
    assert '<p id="diagnosis-caution" class="caution">Caution: every statistic is from iteration 0 alone' in html
    train(tmp_path / "stepped", steps=3)
    html, errors = dom(write_report(tmp_path / "stepped", tmp_path / "stepped.html"))
    assert errors == [] and '<p id="diagnosis-caution" class="caution" hidden="">' in html
