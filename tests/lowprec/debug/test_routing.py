"""Routing: the plain path when no feature applies, answer combination, config errors at initialize."""

from __future__ import annotations

import contextlib

import pytest
import torch
from debugrun import make_linear, section, start, train_step

import lowprec
import lowprec.debug.layer_state as layer_state
import nvdlfw_inspect.api as debug_api
from lowprec.debug.features.api import EveryIteration, TransformerEngineAPI, normalize_answer
from lowprec.debug.features.nonfinite_guard import NonfiniteGuard
from lowprec.debug.quantizer import DebugProcessing
from lowprec.modules.linear_function import LinearFunction
from nvdlfw_inspect.errors import ConfigError

X, DY = torch.randn(4, 32), torch.randn(4, 24)


@pytest.fixture
def counters(monkeypatch):
    """Counts routing rounds, debug-path forwards and autograd-function forwards."""
    counts = {"plans": 0, "debug": 0, "function": 0}
    original_plan, original_init, original_apply = layer_state.build_plan, DebugProcessing.__init__, LinearFunction.apply

    def plan(*args):
        counts["plans"] += 1
        return original_plan(*args)

    def init(self, *args, **kwargs):
        counts["debug"] += 1
        original_init(self, *args, **kwargs)

    def apply(*args):
        counts["function"] += 1
        return original_apply(*args)

    monkeypatch.setattr(layer_state, "build_plan", plan)
    monkeypatch.setattr(DebugProcessing, "__init__", init)
    monkeypatch.setattr(LinearFunction, "apply", apply)
    return counts


def test_unselected_layer_asks_once_then_runs_plain(log_dir, counters):
    start(section({"DisableFP8GEMM": {"enabled": True, "gemms": ["fprop"]}}, {"layer_types": ["elsewhere"]}), log_dir)
    layer = make_linear()
    for _ in range(5):
        train_step(layer, X, DY, fp8=False)
        debug_api.step()
    assert counters == {"plans": 1, "debug": 0, "function": 0}  # torch.nn.functional.linear after one question
    for _ in range(3):
        train_step(layer, X, DY)  # FP8 turned on: ask again once, then the plain FP8 path
        debug_api.step()
    assert counters == {"plans": 2, "debug": 0, "function": 3}


def test_without_debug_session_no_routing(counters):
    layer = make_linear()
    train_step(layer, X, DY)
    assert counters == {"plans": 0, "debug": 0, "function": 1}


def test_micro_batches_share_one_plan(log_dir, counters):
    start(section({"DisableFP8GEMM": {"enabled": True, "gemms": ["fprop"]}}), log_dir)
    layer = make_linear()
    for _ in range(2):
        for _ in range(4):
            train_step(layer, X, DY)
        debug_api.step()
    assert counters == {"plans": 2, "debug": 8, "function": 8}


def test_new_session_starts_fresh(log_dir, counters):
    layer = make_linear()
    start(section({"DisableFP8GEMM": {"enabled": True, "gemms": ["fprop"]}}), log_dir)
    train_step(layer, X, DY)
    debug_api.end_debug()
    train_step(layer, X, DY)  # no session: plain
    start(section({"DisableFP8GEMM": {"enabled": True, "gemms": ["fprop"]}}), log_dir)
    train_step(layer, X, DY)
    assert counters["plans"] == 2 and counters["debug"] == 2


@pytest.mark.parametrize(
    ("api", "outputs", "expected"),
    [
        ("inspect_tensor_enabled", [(False, 7), (True, 3)], (True, 3)),
        ("inspect_tensor_enabled", [False, (False, None)], (False, 6)),  # a bare bool asks again next iteration
        ("inspect_tensor_enabled", [(False, None), (False, None)], (False, None)),
        ("fp8_gemm_enabled", [(True, None), (False, 9)], (False, 9)),  # any feature disabling FP8 wins
        ("fp8_gemm_enabled", [True, True], (True, 6)),
    ],
)
def test_answers_of_several_features_combine(api, outputs, expected):
    assert TransformerEngineAPI().handle_multi_feature_output(api, outputs, {}, iteration=5) == expected


@pytest.mark.parametrize(
    ("api", "outputs", "every_iteration", "expected"),
    [
        ("inspect_tensor_enabled", [(False, 7), EveryIteration(5)], True, (True, 6)),  # one feature every iteration
        ("inspect_tensor_enabled", [(True, 6), (True, 6)], False, (True, 6)),  # the same pair, but asked again
        ("fp8_gemm_enabled", [EveryIteration(5), (False, 9)], False, (False, 6)),  # not for a vote that can be lost
    ],
)
def test_an_every_iteration_answer_combines(api, outputs, every_iteration, expected):
    answer = TransformerEngineAPI().handle_multi_feature_output(api, outputs, {}, iteration=5)
    assert answer == expected and isinstance(answer, EveryIteration) is every_iteration


def test_an_every_iteration_answer_is_asked_once_a_session(log_dir, monkeypatch):
    """The guard enables its tensors at every iteration: each question is asked at the first step only, and the
    layer still takes its debug path (and the guard sees a NaN) at later steps; a new session asks again."""
    asked = []
    original = NonfiniteGuard.inspect_tensor_enabled

    def counted(self, config, layer_name, tensor_name, iteration):
        asked.append((tensor_name, iteration))
        return original(self, config, layer_name, tensor_name, iteration)

    counted.is_api = True  # still an API of the feature when a session loads the features
    monkeypatch.setattr(NonfiniteGuard, "inspect_tensor_enabled", counted)
    layer = make_linear()
    for _session in range(2):
        start(section({"NonfiniteGuard": {"enabled": True}}), log_dir)
        for step in range(4):
            x = X.clone()
            if step == 3:
                x[1, 2] = float("nan")
            train_step(layer, x, DY)
            with (
                pytest.warns(RuntimeWarning, match="at step 3: first in layer lin, tensor activation")
                if step == 3
                else contextlib.nullcontext()
            ):
                debug_api.step()
        debug_api.end_debug()
        assert sorted(asked) == sorted((t, 0) for t in ("activation", "weight", "output", "gradient", "dgrad", "wgrad"))
        asked.clear()


def test_normalize_answer():
    assert normalize_answer(True, 4) == (True, 5)
    assert normalize_answer((False, None), 4) == (False, None)


def test_fake_quant_and_disable_on_one_gemm(log_dir):
    """Two features answer fp8_gemm_enabled for fprop; both say high precision."""
    features = {
        "DisableFP8GEMM": {"enabled": True, "gemms": ["fprop"]},
        "FakeQuant": {"enabled": True, "gemms": ["fprop"], "tensors": ["weight"], "quant_format": "FP8E4M3"},
    }
    start(section(features), log_dir)
    layer = make_linear()
    y, _, _ = train_step(layer, X, DY)
    from fp8ref import current_fake_quant

    assert torch.allclose(y, X @ current_fake_quant(layer.weight.detach()).t() + layer.bias.detach(), atol=1e-6)


def test_two_features_modifying_one_tensor_is_an_error(log_dir):
    features = {
        "FakeQuant": {"enabled": True, "gemms": ["fprop"], "tensors": ["weight"], "quant_format": "FP8E4M3"},
        "PerTensorScaling": {"enabled": True, "gemms": ["fprop"], "tensors": ["weight"]},
    }
    start(section(features), log_dir)
    with pytest.raises(ValueError, match=r"Only 1 feature may serve transformer_engine.modify_tensor_enabled for layer 'lin'"):
        train_step(make_linear(), X, DY)


@pytest.mark.parametrize(
    ("features", "message"),
    [
        (
            {"DisableFP8GEMM": {"enabled": True, "gemms": ["fprp"]}},
            r"DisableFP8GEMM\.gemms\.0'.*unknown GEMM.*'fprp'.*did you mean 'fprop'",
        ),
        ({"DisableFP8GEMM": {"enabled": True}}, r"DisableFP8GEMM'.*needs 'gemms: \[names\]' or 'gemms_struct"),
        (
            {"DisableFP8GEMM": {"enabled": True, "gemms": ["fprop"], "tensors": ["weight"]}},
            r"DisableFP8GEMM\.tensors'.*unknown key",
        ),
        ({"DisableFP8Layer": {"enabled": True, "gemms": ["fprop"]}}, r"DisableFP8Layer\.gemms'.*takes no keys besides 'enabled'"),
        (
            {"PerTensorScaling": {"enabled": True, "gemms": ["fprop"], "tensors": ["output"]}},
            r"PerTensorScaling\.tensors\.0'.*not supported by PerTensorScaling.*'output'.*allowed: 'activation', 'weight'",
        ),
        ({"PerTensorScaling": {"enabled": True, "gemms": ["fprop"], "tensors": ["weight"], "margin": -1}}, r"margin'.*got -1"),
        ({"FakeQuant": {"enabled": True, "gemms": ["fprop"], "tensors": ["weight"]}}, r"FakeQuant'.*needs 'quant_format'"),
        (
            {"FakeQuant": {"enabled": True, "gemms": ["fprop"], "tensors": ["weight"], "quant_format": "FP8E4M4"}},
            r"FakeQuant\.quant_format'.*unsupported format.*'FP8E4M4'.*did you mean 'FP8E4M3'",
        ),
        (
            {"FakeQuant": {"enabled": True, "gemms_struct": [{"gemm": "wgrad", "tensors": ["gradient"], "quant_format": "E5"}]}},
            r"FakeQuant\.gemms_struct\.0\.quant_format'.*'E5'",
        ),
        ({"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["p99"]}}, r"LogTensorStats\.stats\.0'.*'p99'"),
        (
            {"LogTensorStats": {"enabled": True, "tensors": ["act"], "stats": ["max"]}},
            r"LogTensorStats\.tensors\.0'.*'act'.*allowed: 'activation'",
        ),
        (
            {"LogTensorStats": {"enabled": True, "gemms": ["fprop"], "tensors": ["activation"], "stats": ["max"]}},
            r"LogTensorStats\.gemms'.*unknown key",
        ),
        (
            {"DisableFP8Gemm": {"enabled": True, "gemms": ["fprop"]}},
            r"transformer_engine\.DisableFP8Gemm'.*did you mean 'DisableFp8Gemm'",
        ),
    ],
)
def test_config_errors_at_initialize(log_dir, features, message):
    with pytest.raises(ConfigError, match=message):
        start(section(features), log_dir)
    assert debug_api.DEBUG_MANAGER is None


def test_features_load_without_feature_dirs_once_lowprec_is_imported(log_dir):
    debug_api.initialize(config_file=section({"DisableFP8Layer": {"enabled": True}}), log_dir=log_dir)
    layer = make_linear()
    y, _, _ = train_step(layer, X, DY)
    assert torch.equal(y, torch.nn.functional.linear(X, layer.weight, layer.bias).detach())
    assert lowprec.FEATURE_DIR.is_dir()
