"""The base ``LogTensorStats`` end to end: config, schedule, numbers in the statistics log, errors."""

from __future__ import annotations

import math

import pytest
import torch
from logreader import read_messages, read_stats
from statref import SIX, reference_stats

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.errors import ConfigError
from nvdlfw_inspect.logging import BaseLogger


def config(**feature) -> dict:
    body = {"enabled": True, "tensors": ["activation"], "stats": list(SIX)}
    body.update(feature)
    return {"block": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "LogTensorStats": body}}


def expected(x: torch.Tensor) -> dict[str, float]:
    return reference_stats(x, SIX)


def run_steps(steps: int, layer: str = "l1", tensor_name: str = "activation", **kwargs) -> list[torch.Tensor]:
    tensors = []
    for step in range(steps):
        t = torch.randn(64, generator=torch.Generator().manual_seed(step)) + step
        debug_api.log_tensor_stats(layer_name=layer, tensor=t, tensor_name=tensor_name, **kwargs)
        debug_api.step()
        tensors.append(t)
    return tensors


def logged_iterations(log_dir, name: str = "l1_activation_mean") -> set[int]:
    return {it for stat, it in read_stats(log_dir) if stat == name}


def test_logged_values_match_float64_statistics(log_dir):
    debug_api.initialize(config_file=config(), log_dir=log_dir)
    tensors = run_steps(3)
    stats = read_stats(log_dir)
    for it, t in enumerate(tensors):
        for stat, value in expected(t).items():
            assert stats[(f"l1_activation_{stat}", it)] == pytest.approx(value, abs=5e-5, rel=1e-4)  # 4 decimals in the file


def test_returned_values_and_custom_logger_get_full_precision(log_dir):
    class Collect(BaseLogger):
        def __init__(self):
            self.rows = []

        def log_scalar(self, name, value, iteration):
            self.rows.append((name, value, iteration))

    collect = Collect()
    debug_api.initialize(config_file=config(), statistics_logger=collect, log_dir=log_dir)
    t = torch.randn(1000, dtype=torch.bfloat16) * 1e-3
    out = debug_api.log_tensor_stats(layer_name="model.fc1", tensor=t, tensor_name="activation")
    ref = expected(t)
    assert set(out) == set(SIX)
    for stat in SIX:
        assert out[stat].item() == pytest.approx(ref[stat], rel=1e-6)
    assert sorted(name for name, _, _ in collect.rows) == sorted(f"model.fc1_activation_{s}" for s in SIX)
    got = {name.rsplit("_activation_", 1)[1]: value for name, value, _ in collect.rows}
    for stat in SIX:
        assert got[stat] == pytest.approx(ref[stat], rel=1e-12)
    assert {it for _, _, it in collect.rows} == {0}


@pytest.mark.parametrize(
    ("window", "iterations"),
    [
        ({"freq": 3}, {0, 3, 6, 9}),
        ({"start_step": 4}, {4, 5, 6, 7, 8, 9}),
        ({"start_step": 2, "end_step": 5}, {2, 3, 4, 5}),  # closed window
        ({"start_step": 1, "freq": 3}, {3, 6, 9}),  # absolute phase
        ({"start_end_list": [[0, 2], [6, 8]]}, {0, 1, 6, 7}),  # half-open windows
        ({"start_end_list": [[5, -1]], "start_step": 0, "end_step": 1}, {5, 6, 7, 8, 9}),  # overrides start/end
        ({"end_step": -1, "freq": 5}, {0, 5}),
    ],
)
def test_schedule(log_dir, window, iterations):
    debug_api.initialize(config_file=config(**window), log_dir=log_dir)
    run_steps(10)
    debug_api.end_debug()
    assert logged_iterations(log_dir) == iterations


def test_iteration_kwarg_overrides_the_counter(log_dir):
    debug_api.initialize(config_file=config(freq=10), log_dir=log_dir)
    t = torch.ones(4)
    debug_api.log_tensor_stats(layer_name="l1", tensor=t, tensor_name="activation", iteration=20)
    debug_api.log_tensor_stats(layer_name="l1", tensor=t, tensor_name="activation", iteration=21)
    assert logged_iterations(log_dir) == {20}


def test_init_training_step_starts_the_counter(log_dir):
    debug_api.initialize(config_file=config(freq=2), log_dir=log_dir, init_training_step=7)
    run_steps(3)  # iterations 7, 8, 9
    assert logged_iterations(log_dir) == {8}


def test_tensors_struct_gives_each_tensor_its_stats_and_window(log_dir):
    cfg = config(
        tensors_struct=[
            {"tensor": "activation", "stats": ["max"]},
            {"tensor": "gradient", "stats": ["min", "l1_norm"], "freq": 2},
        ]
    )
    del cfg["block"]["LogTensorStats"]["tensors"]
    debug_api.initialize(config_file=cfg, log_dir=log_dir)
    for _ in range(4):
        for name in ("activation", "gradient", "weight"):
            debug_api.log_tensor_stats(layer_name="l1", tensor=torch.arange(5.0), tensor_name=name)
        debug_api.step()
    stats = read_stats(log_dir)
    assert {name for name, _ in stats} == {"l1_activation_max", "l1_gradient_min", "l1_gradient_l1_norm"}
    assert {it for name, it in stats if name == "l1_activation_max"} == {0, 1, 2, 3}
    assert {it for name, it in stats if name == "l1_gradient_min"} == {0, 2}
    assert stats[("l1_gradient_l1_norm", 2)] == 10.0


def test_unselected_tensor_or_layer_logs_nothing(log_dir):
    cfg = config()
    cfg["block"]["layers"] = {"layer_types": ["fc1"]}
    debug_api.initialize(config_file=cfg, log_dir=log_dir)
    assert debug_api.log_tensor_stats(layer_name="fc2", tensor=torch.ones(3), tensor_name="activation") == {}
    assert debug_api.log_tensor_stats(layer_name="fc1", tensor=torch.ones(3), tensor_name="weight") == {}
    debug_api.end_debug()
    assert read_stats(log_dir) == {}


def test_called_message_once_per_layer_and_tensor(log_dir):
    cfg = config(tensors=["activation", "gradient"])
    debug_api.initialize(config_file=cfg, log_dir=log_dir)
    for _ in range(3):
        for layer in ("a", "b"):
            for name in ("activation", "gradient"):
                debug_api.log_tensor_stats(layer_name=layer, tensor=torch.ones(2), tensor_name=name)
        debug_api.step()
    debug_api.end_debug()
    called = [m for _, m in read_messages(log_dir) if m.endswith(": Called")]
    assert sorted(called) == sorted(
        f"LAYER={layer}: Feature=LogTensorStats, API=log_tensor_stats, TENSOR={name}: Called"
        for layer in ("a", "b")
        for name in ("activation", "gradient")
    )


def test_nan_and_inf_tensors_are_logged(log_dir):
    debug_api.initialize(config_file=config(stats=["max", "mean"]), log_dir=log_dir)
    out = debug_api.log_tensor_stats(
        layer_name="l1", tensor=torch.tensor([1.0, float("inf"), float("nan")]), tensor_name="activation"
    )
    assert math.isnan(out["mean"].item()) and math.isnan(out["max"].item())
    out = debug_api.log_tensor_stats(layer_name="l2", tensor=torch.tensor([1.0, float("inf")]), tensor_name="activation")
    assert out["max"].item() == math.inf


@pytest.mark.parametrize(
    ("feature", "message"),
    [
        ({"stats": ["mean", "median"]}, r"LogTensorStats\.stats\.1'.*unsupported statistic.*'median'.*allowed:.*'mean'"),
        ({"stats": ["cur_amax"]}, r"unsupported statistic.*'cur_amax'"),
        ({"stats": "mean"}, r"LogTensorStats\.stats'.*non-empty list"),
        ({"stats": None}, r"has no 'stats' list"),
        ({"freq": 0}, r"LogTensorStats\.freq'.*positive integer.*got 0"),
        ({"freq": "2"}, r"freq'.*got '2'"),
        ({"start_step": -1}, r"start_step'.*non-negative.*got -1"),
        ({"end_step": -2}, r"end_step'.*got -2"),
        ({"start_end_list": [[3, 1]]}, r"start_end_list\.0'.*got \[3, 1\]"),
        ({"start_end_list": [[0, 5], [4, 8]]}, r"start_end_list\.1'.*overlaps"),
        ({"start_end_list": "0-5"}, r"start_end_list'.*list of \[start, end\]"),
        ({"stat": ["mean"]}, r"LogTensorStats\.stat'.*unknown key.*did you mean 'stats'"),
    ],
)
def test_bad_config_fails_at_initialize(log_dir, feature, message):
    cfg = config(**feature)
    if cfg["block"]["LogTensorStats"].get("stats") is None:
        del cfg["block"]["LogTensorStats"]["stats"]
    with pytest.raises(ConfigError, match=message):
        debug_api.initialize(config_file=cfg, log_dir=log_dir)
    assert debug_api.DEBUG_MANAGER is None


def test_bad_tensors_struct_item_is_located(log_dir):
    cfg = config(tensors_struct=[{"tensor": "activation", "stats": ["max"]}, {"tensor": "gradient", "stats": ["p99"]}])
    del cfg["block"]["LogTensorStats"]["tensors"]
    with pytest.raises(ConfigError, match=r"tensors_struct\.1\.stats\.0'.*'p99'"):
        debug_api.initialize(config_file=cfg, log_dir=log_dir)
