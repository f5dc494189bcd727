"""The lowprec examples: seed 003's TransformerLayer run and the user-written precision feature."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import yaml
from logreader import read_messages, read_stats

import lowprec
import nvdlfw_inspect.api as debug_api

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
sys.path.insert(0, str(EXAMPLES / "user_precision"))

import run_user_precision  # noqa: E402
import transformer_fp8_debug  # noqa: E402
from user_provided_precision import round_mantissa  # noqa: E402

SEED_003_PLAN = [
    (layer, tensor, gemm, "High precision" if layer.endswith(("fc1", "fc2")) and gemm == "fprop" else "FP8 quantization")
    for layer in (
        "transformer_layer.self_attention.layernorm_qkv",
        "transformer_layer.self_attention.proj",
        "transformer_layer.layernorm_mlp.fc1",
        "transformer_layer.layernorm_mlp.fc2",
    )
    for tensor, gemm in (
        ("activation", "fprop"),
        ("activation", "wgrad"),
        ("weight", "fprop"),
        ("weight", "dgrad"),
        ("gradient", "dgrad"),
        ("gradient", "wgrad"),
    )
]


def test_seed_003_logs_what_the_seed_shows(log_dir):
    transformer_fp8_debug.train(5, log_dir, EXAMPLES / "configs" / "seed003_config.yaml", "cpu")
    messages = [m for _, m in read_messages(log_dir)]
    assert messages[1:3] == [
        f"Reading config from {EXAMPLES / 'configs' / 'seed003_config.yaml'}.",
        "Loaded configs for dict_keys(['fc1_fprop_to_fp8', 'log_tensor_stats']).",
    ]
    plan = [m for m in messages if ": Tensor: " in m]
    assert plan == [f"{layer}: Tensor: {tensor}, gemm {gemm} - {precision}" for layer, tensor, gemm, precision in SEED_003_PLAN]
    assert (
        "LAYER=transformer_layer.self_attention.layernorm_qkv: Feature=LogTensorStats, "
        "API=look_at_tensor_before_process: activation" in messages
    )
    stats = read_stats(log_dir)
    prefix = "transformer_layer.self_attention.layernorm_qkv_activation_"
    assert set(stats) == {(prefix + s, it) for s in ("max", "min", "mean", "std", "l1_norm") for it in (2, 3, 4)}
    n = 10 * 32 * 512
    for it in (2, 3, 4):  # a LayerNorm output: mean 0, std 1, and |x| averages sqrt(2/pi) for normal data
        assert abs(stats[(prefix + "mean", it)]) < 1e-3
        assert stats[(prefix + "std", it)] == pytest.approx(1.0, abs=2e-3)
        assert stats[(prefix + "l1_norm", it)] / n == pytest.approx(math.sqrt(2 / math.pi), rel=0.01)
        assert stats[(prefix + "min", it)] < -3 < 3 < stats[(prefix + "max", it)]


def test_seed_002_configs_load_verbatim(log_dir):
    """Seed 002's feature examples (LogFp8TensorStats comes with the FP8 statistics)."""
    configs = yaml.safe_load((EXAMPLES / "configs" / "seed002_features.yaml").read_text())
    debug_api.initialize(config_file=EXAMPLES / "configs" / "seed002_features.yaml", log_dir=log_dir)
    assert set(configs) == {
        "example_tensor_stat_collection",
        "example_disable_fp8_gemm",
        "example_disable_fp8_layer",
        "example_per_tensor_scaling",
        "example_fake_quant_fp8",
    }
    layer = lowprec.LayerNormMLP(32, 64, name="transformer_layer.layernorm_mlp")
    with lowprec.fp8_autocast():
        layer(torch.randn(4, 32)).sum().backward()
    debug_api.step()


def test_round_mantissa():
    x = torch.randn(1000) * 100
    assert torch.equal(round_mantissa(x, 7), x.to(torch.bfloat16).float())
    assert torch.equal(round_mantissa(x, 23), x)
    assert round_mantissa(torch.tensor([1.0 + 2**-4, 1.0 + 3 * 2**-4]), 3).tolist() == [1.0, 1.25]  # ties to even


def test_user_feature_runs_and_narrow_formats_train_worse(log_dir):
    exact = run_user_precision.train(23, 60, log_dir)
    bf16_like = run_user_precision.train(7, 60, log_dir)
    narrow = run_user_precision.train(3, 60, log_dir)
    assert bf16_like == pytest.approx(exact, rel=0.1)
    assert narrow > exact
    messages = [m for _, m in read_messages(log_dir)]
    assert "LAYER=mlp.fc1: UserProvidedPrecision: weight of fprop rounded to 3 mantissa bits" in messages
    assert "mlp.fc1: Tensor: activation, gemm fprop - modify_tensor()" in messages
