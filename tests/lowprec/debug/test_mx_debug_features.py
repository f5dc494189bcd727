"""The MX family in the debug features: FakeQuant's ``quant_format`` (MXFP6E3M2, MXFP6E2M3, MXFP4) and ``scale_rule``,
and LogFp8TensorStats' what-if MX statistics and a layer's own MX statistics, against torchao's casts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from debugrun import make_linear, section, start, train_step
from mxref import ELEMENTS, MODE, torchao_cast, torchao_dequantized
from test_log_fp8_tensor_stats import fp8_config, run, wide

import lowprec
from lowprec.formats.elements import E4M3, E5M2
from nvdlfw_inspect.errors import ConfigError

X, DY = torch.randn(16, 64), torch.randn(16, 48)


@pytest.mark.parametrize(
    ("quant_format", "scale_rule", "element", "rule"),
    [
        ("MXFP6E3M2", None, "e3m2", "ocp"),
        ("MXFP6E2M3", None, "e2m3", "ocp"),
        ("MXFP4", None, "e2m1", "ocp"),
        ("MXFP4", "nvidia", "e2m1", "nvidia"),
        ("MXFP8E4M3", "ocp", "e4m3", "ocp"),
        ("MXFP8E5M2", None, "e5m2", "nvidia"),
    ],
)
def test_fake_quant_mx_formats(log_dir, quant_format, scale_rule, element, rule):
    options = {"quant_format": quant_format} | ({"scale_rule": scale_rule} if scale_rule else {})
    config = {**options, "gemms_struct": [{"gemm": "fprop", "tensors": ["activation", "weight"]}]}
    start(section({"FakeQuant": {"enabled": True, **config}}), log_dir)
    layer = make_linear(in_f=64, out_f=48)
    x = X * torch.logspace(-3, 3, 64)  # blocks of different magnitudes

    def reference(t: torch.Tensor) -> torch.Tensor:
        return torchao_dequantized(t, ELEMENTS[element], rule)

    y, _, _ = train_step(layer, x, DY, fp8=False)
    expected = F.linear(reference(x), reference(layer.weight.detach()), layer.bias.detach())
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)
    assert not torch.equal(reference(x), x)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"quant_format": "MXFP6"}, r"quant_format'.*'MXFP6'.*MXFP6E3M2.*MXFP6E2M3.*MXFP4"),
        ({"quant_format": "FP8E4M3", "scale_rule": "ocp"}, r"scale_rule'.*chooses the E8M0 scales of the MX formats"),
        ({"quant_format": "NVFP4", "scale_rule": "nvidia"}, r"scale_rule'.*NVFP4 has none"),
        ({"quant_format": "MXFP4", "scale_rule": "floor"}, r"scale_rule'.*unknown scale rule.*'floor'.*nvidia.*ocp"),
    ],
)
def test_fake_quant_mx_config_errors(log_dir, options, message):
    with pytest.raises(ConfigError, match=message):
        start(section({"FakeQuant": {"enabled": True, **options, "gemms": ["fprop"], "tensors": ["weight"]}}), log_dir)


def mx_stats(x: torch.Tensor, element: str, rule: str) -> dict[str, float]:
    """The quantization statistics of torchao's MX cast of ``x`` (2-D, blocks along its rows)."""
    dequantized = torchao_dequantized(x, ELEMENTS[element], rule).double()
    scale_bytes = torchao_cast(x, ELEMENTS[element], MODE[rule])[0].double()
    x = x.double()
    return {
        "underflows%": 100 * ((x != 0) & (dequantized == 0)).sum().item() / x.numel(),
        "mse": (x - dequantized).square().mean().item(),
        "scale_inv_min": scale_bytes[scale_bytes != 0].min().item(),
        "scale_inv_max": scale_bytes.max().item(),
    }


WHAT_IF = {  # prefix: (element of activations, of gradients, rule); mxfp8 ones take the layer's FP8 format
    "mxfp4": ("e2m1", "e2m1", "ocp"),
    "mxfp4_nvidia": ("e2m1", "e2m1", "nvidia"),
    "mxfp6_e3m2": ("e3m2", "e3m2", "ocp"),
    "mxfp6_e2m3_nvidia": ("e2m3", "e2m3", "nvidia"),
    "mxfp8_ocp": ("e4m3", "e5m2", "ocp"),
}


def test_what_if_mx_statistics(log_dir):
    x, dy = wide((128, 256), 4), wide((128, 128), 5)
    stats = [f"{prefix}_{name}{suffix}" for prefix in WHAT_IF for name in ("underflows%", "mse", "scale_inv_min", "scale_inv_max")
             for suffix in ("", "_columnwise")]  # fmt: skip
    got = run(fp8_config(stats, tensors=("activation", "gradient")), log_dir, [(x, dy)])  # the run uses current scaling
    for tensor_name, tensor in (("activation", x), ("gradient", dy)):
        for prefix, (forward, backward, rule) in WHAT_IF.items():
            element = backward if tensor_name == "gradient" else forward
            for suffix, oriented in (("", tensor), ("_columnwise", tensor.t().contiguous())):
                for name, value in mx_stats(oriented, element, rule).items():
                    key = (f"lin_{tensor_name}_{prefix}_{name}{suffix}", 0)
                    assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-12), key
    # fewer bits, more underflows; the OCP rule's floor gives scales up to 2x smaller than NVIDIA's rounding up
    assert got[("lin_activation_mxfp4_underflows%", 0)] > got[("lin_activation_mxfp6_e3m2_underflows%", 0)] > 0
    assert got[("lin_activation_mxfp4_scale_inv_max", 0)] <= got[("lin_activation_mxfp4_nvidia_scale_inv_max", 0)]


def test_own_mx_statistics_are_the_layers_casts(log_dir):
    x, dy = wide((128, 256), 6), wide((128, 128), 7)
    recipe = lowprec.MXBlockScaling("e2m1", gradient_element="e3m2")
    stats = ["underflows%", "mse", "scale_inv_max", "mse_columnwise", "mxfp4_mse", "mxfp6_e3m2_underflows%"]
    got = run(fp8_config(stats, tensors=("activation", "gradient")), log_dir, [(x, dy)], recipe=recipe)
    for tensor_name, tensor, element in (("activation", x, "e2m1"), ("gradient", dy, "e3m2")):
        expected = mx_stats(tensor, element, "ocp")
        for name in ("underflows%", "mse", "scale_inv_max"):
            assert got[(f"lin_{tensor_name}_{name}", 0)] == pytest.approx(expected[name], rel=1e-5), (tensor_name, name)
        columnwise = mx_stats(tensor.t().contiguous(), element, "ocp")["mse"]
        assert got[(f"lin_{tensor_name}_mse_columnwise", 0)] == pytest.approx(columnwise, rel=1e-5)
    assert got[("lin_activation_mxfp4_mse", 0)] == got[("lin_activation_mse", 0)]  # the what-if cast is the layer's
    assert got[("lin_gradient_mxfp6_e3m2_underflows%", 0)] == got[("lin_gradient_underflows%", 0)]


@pytest.mark.parametrize(
    ("stat", "message"),
    [
        ("mxfp5_underflows%", r"unsupported statistic.*'mxfp5_underflows%'"),
        ("mxfp4_overflows%", "overflows% exists only under delayed scaling"),
        ("mxfp6_e3m2_ocp_mse", r"unsupported statistic.*did you mean"),  # OCP is MXFP6's default: no suffix
    ],
)
def test_mx_statistic_names_are_checked(log_dir, stat, message):
    with pytest.raises(ConfigError, match=message):
        start(fp8_config([stat]), log_dir)


def test_the_default_element_formats_of_what_if_mxfp8_ocp():
    # what-if mxfp8_ocp casts in the layer's FP8 format, as mxfp8 does: E4M3 forward, E5M2 gradients (HYBRID layers)
    from lowprec.quant.block import mx_what_if_quantizer

    for fmt in (E4M3, E5M2):
        quantizer = mx_what_if_quantizer("mxfp8_ocp", fmt)
        assert quantizer.element is fmt and quantizer.rule.convention == "ocp" and quantizer.label == "mxfp8_ocp"
