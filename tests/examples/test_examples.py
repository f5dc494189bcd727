"""The examples run, log what their configs ask for, and produce the right numbers."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from logreader import read_messages, read_stats

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SAMPLE_NS = EXAMPLES / "sample_namespace"
sys.path.insert(0, str(EXAMPLES))
sys.path.insert(0, str(SAMPLE_NS))

import run_fake_quant  # noqa: E402
import train_mlp_stats  # noqa: E402

SIX = ("min", "max", "mean", "std", "l1_norm", "l2_norm")


# --- train_mlp_stats.py ------------------------------------------------------------------------
def test_training_example_logs_what_its_config_selects(log_dir):
    losses = train_mlp_stats.train(steps=21, log_dir=log_dir)
    assert losses[-1] < losses[0]
    stats = read_stats(log_dir)
    names = {name for name, _ in stats}
    expected = {f"mlp.{layer}_activation_{s}" for layer in ("fc1", "fc2", "fc3", "out") for s in SIX}
    expected |= {"mlp.out_gradient_std", "mlp.out_gradient_l2_norm"}
    assert names == expected
    assert {it for name, it in stats if name == "mlp.fc1_activation_mean"} == set(range(21))
    assert {it for name, it in stats if name == "mlp.out_gradient_std"} == {10, 15, 20}


def test_training_example_statistics_are_consistent(log_dir):
    train_mlp_stats.train(steps=3, log_dir=log_dir)
    stats = read_stats(log_dir)
    n = 256 * 16  # fc1's input: a batch of 256 standard normal vectors of 16
    for it in range(3):
        get = {s: stats[(f"mlp.fc1_activation_{s}", it)] for s in SIX}
        assert get["min"] <= get["mean"] <= get["max"]
        assert abs(get["mean"]) < 0.1 and 0.9 < get["std"] < 1.1
        # ||x||^2 = (n - 1) std^2 + n mean^2 and E|x| = sqrt(2/pi) for a standard normal
        assert get["l2_norm"] == pytest.approx(math.sqrt((n - 1) * get["std"] ** 2 + n * get["mean"] ** 2), rel=1e-3)
        assert get["l1_norm"] / n == pytest.approx(math.sqrt(2 / math.pi), rel=0.05)


def run_training_script(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(EXAMPLES / "train_mlp_stats.py"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_training_example_command_line(tmp_path):
    result = run_training_script("--steps", "3", "--log-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert f"Statistics log: {tmp_path / 'nvdlfw_inspect_statistics_logs'}" in result.stdout
    assert "mlp.out_activation_l2_norm iteration=000002 value=" in result.stdout


def test_training_example_rejects_bad_steps(tmp_path):
    result = run_training_script("--steps", "0", "--log-dir", str(tmp_path))
    assert result.returncode == 2
    assert "--steps must be at least 1, got 0" in result.stderr


# --- sample_namespace ------------------------------------------------------------------------
def _fake_quant_config(**overrides) -> dict:
    config = yaml.safe_load((SAMPLE_NS / "fake_quant_config.yaml").read_text())
    config["fake_quant_config"]["sample_namespace"]["FakeQuant"].update(overrides)
    return config


def test_fake_quant_matches_torch_fake_quantize(log_dir):
    debug_api.initialize(config_file=SAMPLE_NS / "fake_quant_config.yaml", feature_dirs=[SAMPLE_NS], log_dir=log_dir)
    t = torch.linspace(-8, 8, 101)
    out = debug_api.sample_namespace.process_tensor(layer_name="layer1.attention", tensor=t, tensor_name="linear_proj_in")
    assert torch.equal(out["tensor"], torch.fake_quantize_per_tensor_affine(t, 0.05, 0, -128, 127))
    assert out["tensor"].max().item() == pytest.approx(127 * 0.05)
    # not selected: another tensor, another layer; the default feature hands the tensor back untouched
    other = debug_api.sample_namespace.process_tensor(layer_name="layer1.attention", tensor=t, tensor_name="other")
    assert other["tensor"] is t
    assert (
        debug_api.sample_namespace.process_tensor(layer_name="layer1.mlp", tensor=t, tensor_name="linear_proj_in")["tensor"] is t
    )
    debug_api.end_debug()
    messages = [m for _, m in read_messages(log_dir)]
    assert "LAYER=layer1.attention: Feature=FakeQuant, API=process_tensor: None, linear_proj_in: FakeQuant" in messages


def test_fake_quant_selects_gemms(log_dir):
    config = _fake_quant_config(gemms_struct=[{"gemm": "gemm1", "tensors": ["linear_proj_in"], "scale": 0.5}])
    del config["fake_quant_config"]["sample_namespace"]["FakeQuant"]["tensors"]
    debug_api.initialize(config_file=config, feature_dirs=[SAMPLE_NS], log_dir=log_dir)
    t = torch.tensor([0.2, 0.3, 1.26])
    call = debug_api.sample_namespace.process_tensor
    assert torch.equal(
        call(layer_name="a.attention", gemm="gemm1", tensor=t, tensor_name="linear_proj_in")["tensor"],
        torch.tensor([0.0, 0.5, 1.5]),
    )
    assert call(layer_name="a.attention", gemm="gemm2", tensor=t, tensor_name="linear_proj_in")["tensor"] is t
    assert call(layer_name="a.attention", tensor=t, tensor_name="linear_proj_in")["tensor"] is t


def test_fake_quant_config_errors_at_initialize(log_dir):
    config = _fake_quant_config()
    del config["fake_quant_config"]["sample_namespace"]["FakeQuant"]["scale"]
    with pytest.raises(ConfigError, match=r"fake_quant_config\.sample_namespace\.FakeQuant.*missing 'scale'"):
        debug_api.initialize(config_file=config, feature_dirs=[SAMPLE_NS], log_dir=log_dir)
    with pytest.raises(ConfigError, match=r"FakeQuant\.gemms.*non-empty list of GEMM names"):
        debug_api.initialize(config_file=_fake_quant_config(gemms="gemm1"), feature_dirs=[SAMPLE_NS], log_dir=log_dir)


def test_process_tensor_needs_tensor_kwargs(log_dir):
    debug_api.initialize(config_file=SAMPLE_NS / "fake_quant_config.yaml", feature_dirs=[SAMPLE_NS], log_dir=log_dir)
    with pytest.raises(TypeError, match=r"\['tensor'\]"):
        debug_api.sample_namespace.process_tensor(layer_name="l.attention", tensor_name="linear_proj_in")


def test_run_fake_quant_script(log_dir):
    change = run_fake_quant.run(log_dir)
    # each projection input moves by at most half a step (0.025), so each output by 0.025 * |row of W|_1
    bound = max(0.025 * layer.linear_proj.weight.abs().sum(dim=1).max().item() for layer in run_fake_quant.build_model())
    assert 0 < change <= bound
