"""DisableFP8GEMM, DisableFP8Layer, FakeQuant and PerTensorScaling change exactly the GEMMs they select."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from debugrun import make_linear, section, start, train_step
from fp8ref import E5M2, current_fake_quant, e4m3_both, e5m2_first, hp, linear_grads
from logreader import read_messages

import lowprec
import nvdlfw_inspect.api as debug_api

X = torch.randn(6, 32, generator=torch.Generator().manual_seed(1)) * 3
DY = torch.randn(6, 24, generator=torch.Generator().manual_seed(2))


def check(layer, got, fprop, dgrad, wgrad):
    y, dx, dw = got
    y_ref, dx_ref, dw_ref = linear_grads(X, layer.weight.detach(), DY, fprop, dgrad, wgrad)
    assert torch.allclose(y, y_ref + layer.bias.detach(), rtol=1e-5, atol=1e-5), "fprop"
    assert torch.allclose(dx, dx_ref, rtol=1e-5, atol=1e-6), "dgrad"
    assert torch.allclose(dw, dw_ref, rtol=1e-5, atol=1e-5), "wgrad"


def test_no_feature_runs_every_gemm_in_fp8(log_dir):
    start(section({"DisableFP8GEMM": {"enabled": True, "gemms": ["fprop"]}}, {"layer_types": ["other"]}), log_dir)
    layer = make_linear()
    check(layer, train_step(layer, X, DY), e4m3_both, e5m2_first, e5m2_first)


@pytest.mark.parametrize("feature", ["DisableFP8GEMM", "DisableFp8Gemm", "DisableQuantizationGEMM"])
def test_disable_fprop_only(log_dir, feature):
    start(section({feature: {"enabled": True, "gemms": ["fprop"]}}), log_dir)
    layer = make_linear()
    check(layer, train_step(layer, X, DY), hp, e5m2_first, e5m2_first)
    # the fprop GEMM is exactly the high-precision one
    assert torch.equal(train_step(layer, X, DY)[0], F.linear(X, layer.weight, layer.bias).detach())


def test_disable_backward_gemms_with_gemms_struct(log_dir):
    start(section({"DisableFp8Gemm": {"enabled": True, "gemms_struct": [{"gemm": "dgrad"}, {"gemm": "wgrad"}]}}), log_dir)
    layer = make_linear()
    check(layer, train_step(layer, X, DY), e4m3_both, hp, hp)


@pytest.mark.parametrize("feature", ["DisableFP8Layer", "DisableFp8Layer", "DisableQuantizationLayer"])
def test_disable_layer(log_dir, feature):
    start(section({feature: {"enabled": True}}), log_dir)
    layer = make_linear()
    check(layer, train_step(layer, X, DY), hp, hp, hp)
    debug_api.end_debug()
    assert ("INFO", "LAYER=lin: Quantization Disabled") in read_messages(log_dir)


def test_fake_quant_seed_example(log_dir):
    """Seed 002: E5M2 fake quantization of fprop's activation and weight and of dgrad's gradient."""
    config = {
        "quant_format": "FP8E5M2",
        "gemms_struct": [{"gemm": "fprop", "tensors": ["activation", "weight"]}, {"gemm": "dgrad", "tensors": ["gradient"]}],
    }
    start(section({"FakeQuant": {"enabled": True, **config}}), log_dir)
    layer = make_linear()

    def e5m2_both(a, b):
        return current_fake_quant(a, E5M2), current_fake_quant(b, E5M2)

    def e5m2_gradient_only(g, w):
        return current_fake_quant(g, E5M2), w

    check(layer, train_step(layer, X, DY), e5m2_both, e5m2_gradient_only, e5m2_first)
    # without autocast the selected operands are still fake-quantized; the rest stays exact
    check(layer, train_step(layer, X, DY, fp8=False), e5m2_both, e5m2_gradient_only, hp)


def test_fake_quant_margin_and_output(log_dir):
    start(
        section(
            {
                "FakeQuant": {
                    "enabled": True,
                    "quant_format": "FP8E4M3",
                    "margin": 2,
                    "gemms_struct": [{"gemm": "fprop", "tensors": ["output"]}, {"gemm": "wgrad", "tensors": ["activation"]}],
                }
            }
        ),
        log_dir,
    )
    layer = make_linear()
    y, _, dw = train_step(layer, X, DY)
    exact = F.linear(X, layer.weight, layer.bias).detach()
    assert torch.equal(y, current_fake_quant(exact, margin=2))  # fprop runs in high precision, its output is rounded
    assert torch.allclose(dw, DY.t() @ current_fake_quant(X, margin=2), rtol=1e-5, atol=1e-5)


def test_per_tensor_scaling_under_delayed_scaling(log_dir):
    """First step: delayed scaling casts with scale 1; PerTensorScaling gives the activation its own scale."""
    start(section({"PerTensorScaling": {"enabled": True, "margin": 1, "gemms": ["fprop"], "tensors": ["activation"]}}), log_dir)
    layer = make_linear()
    y, _, _ = train_step(layer, X * 0.01, DY, recipe=lowprec.DelayedScaling())
    w = layer.weight.detach()
    w_scale_one = w.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    expected = current_fake_quant(X * 0.01, margin=1) @ w_scale_one.t() + layer.bias.detach()
    assert torch.allclose(y, expected, rtol=1e-5, atol=1e-6)
    debug_api.end_debug()
    assert ("INFO", "LAYER=lin: Feature=PerTensorScaling, API=process_tensor: fprop, activation") in read_messages(log_dir)


def test_per_tensor_scaling_without_autocast_pairs_with_a_high_precision_operand(log_dir):
    start(section({"PerTensorScaling": {"enabled": True, "gemms": ["fprop"], "tensors": ["activation"]}}), log_dir)
    layer = make_linear()
    y, _, _ = train_step(layer, X, DY, fp8=False)
    assert torch.allclose(y, current_fake_quant(X) @ layer.weight.detach().t() + layer.bias.detach(), rtol=1e-5, atol=1e-6)


def test_plan_lines_in_the_main_log(log_dir):
    start(section({"DisableFP8GEMM": {"enabled": True, "gemms": ["dgrad"]}}), log_dir)
    train_step(make_linear(), X, DY)
    debug_api.end_debug()
    lines = [m for _, m in read_messages(log_dir) if m.startswith("lin: Tensor:")]
    assert lines == [
        "lin: Tensor: activation, gemm fprop - FP8 quantization",
        "lin: Tensor: activation, gemm wgrad - FP8 quantization",
        "lin: Tensor: weight, gemm fprop - FP8 quantization",
        "lin: Tensor: weight, gemm dgrad - High precision",
        "lin: Tensor: gradient, gemm dgrad - High precision",
        "lin: Tensor: gradient, gemm wgrad - FP8 quantization",
    ]


def test_disable_fp8_gemm_applies_when_autocast_starts_later(log_dir):
    """A layer first run in high precision still honours DisableFP8GEMM once FP8 is turned on."""
    start(section({"DisableFP8GEMM": {"enabled": True, "gemms": ["fprop"]}}), log_dir)
    layer = make_linear()
    train_step(layer, X, DY, fp8=False)
    debug_api.step()
    check(layer, train_step(layer, X, DY), hp, e5m2_first, e5m2_first)
