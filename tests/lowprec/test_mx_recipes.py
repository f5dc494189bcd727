"""``MXBlockScaling``: the whole OCP MX family (MXFP8, MXFP6 E3M2 and E2M3, MXFP4) under either E8M0 scale rule, in
training (every layer, ``convert``, GroupedLinear), in ``lowprec.quantize`` and in ``compare``'s recipe names."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from mxref import ELEMENTS, torchao_dequantized
from test_block_recipes import LAYERS, assert_trains_close, train_mlp

import lowprec
from lowprec.compare import RECIPES as COMPARE_RECIPES
from lowprec.compare import compare_formats, parse_recipes
from lowprec.errors import LowprecValueError
from lowprec.formats.elements import E4M3, E5M2

NEW = {
    "mxfp8_ocp": lowprec.MXBlockScaling("e4m3", scale_rule="ocp"),
    "mxfp8_e5m2": lowprec.MXBlockScaling("e5m2"),
    "mxfp6_e3m2": lowprec.MXBlockScaling("e3m2"),
    "mxfp6_e2m3": lowprec.MXBlockScaling("e2m3"),
    "mxfp4": lowprec.MXBlockScaling("e2m1"),
    "mxfp4_nvidia": lowprec.MXBlockScaling("e2m1", scale_rule="nvidia"),
}
# relative L2 error of outputs and gradients against float32, worst over the layers (measured: FP8 and FP6 up to
# 0.17, E5M2 and E3M2 having 2 mantissa bits; FP4 up to 0.37)
FP4_TOLERANCE, TOLERANCE = 0.45, 0.22
#: how far the final loss may sit above bf16's (measured: FP8 and FP6 0.1% below to 1.9% above, FP4 6.5% and 7.5% above)
LOSS_FACTOR = {"mxfp8_ocp": 1.05, "mxfp8_e5m2": 1.05, "mxfp6_e3m2": 1.05, "mxfp6_e2m3": 1.05, "mxfp4": 1.15, "mxfp4_nvidia": 1.15}


def sample(rows: int = 40, cols: int = 96, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.logspace(-4, 4, cols)


def test_defaults_rules_and_labels():
    recipe = lowprec.MXBlockScaling()
    assert (recipe.element, recipe.gradient_element, recipe.scale_rule) == ("e4m3", None, None)
    for name, rule, label in [
        ("e4m3", "nvidia", "mxfp8"),
        ("e5m2", "nvidia", "mxfp8"),
        ("e3m2", "ocp", "mxfp6_e3m2"),
        ("e2m3", "ocp", "mxfp6_e2m3"),
        ("e2m1", "ocp", "mxfp4"),
    ]:
        quantizers = lowprec.MXBlockScaling(name).quantizers("fc")
        for quantizer in quantizers.values():
            assert quantizer.rule.convention == rule and quantizer.label == label and quantizer.element is ELEMENTS[name]
            assert quantizer.block == (1, 32)
        if name in ("e3m2", "e2m3", "e2m1"):  # features that cast per tensor: E4M3 forward, E5M2 gradients
            assert (quantizers["activation"].format, quantizers["gradient"].format) == (E4M3, E5M2)
    other = lowprec.MXBlockScaling("e2m1", gradient_element="e4m3", scale_rule="nvidia").quantizers("fc")
    assert other["weight"].label == "mxfp4_nvidia" and other["gradient"].label == "mxfp8" and other["gradient"].element is E4M3
    assert lowprec.MXBlockScaling("e4m3", scale_rule="ocp").quantizers("fc")["weight"].label == "mxfp8_ocp"
    assert lowprec.MXBlockScaling("e2m3", enable_2d_quantization=True).quantizers("fc")["weight"].block == (32, 32)


@pytest.mark.parametrize(
    ("general", "mxfp8"),
    [
        (lowprec.MXBlockScaling(), lowprec.MXFP8BlockScaling()),
        (
            lowprec.MXBlockScaling("e4m3", gradient_element="e5m2", enable_2d_quantization=True),
            lowprec.MXFP8BlockScaling(fp8_format=lowprec.Format.HYBRID, enable_2d_quantization=True),
        ),
    ],
    ids=["e4m3", "hybrid-2d"],
)
def test_mxfp8_block_scaling_is_mx_block_scaling_of_fp8(general, mxfp8):
    x = sample()
    for operand in ("activation", "weight", "gradient"):
        a, b = lowprec.quantize(x, general, operand), lowprec.quantize(x, mxfp8, operand)
        for part in ("rowwise", "columnwise"):
            assert torch.equal(getattr(a, part).codes, getattr(b, part).codes), (operand, part)
            assert torch.equal(getattr(a, part).scale_inv, getattr(b, part).scale_inv), (operand, part)


def test_bad_values_name_the_allowed_ones():
    allowed = r"\['e4m3', 'e5m2', 'e3m2', 'e2m3', 'e2m1'\]"
    with pytest.raises(LowprecValueError, match=rf"MXBlockScaling.element must be one of {allowed}, got 'e2m2'"):
        lowprec.MXBlockScaling("e2m2")
    with pytest.raises(LowprecValueError, match=rf"MXBlockScaling.gradient_element must be one of {allowed}, got \['e5m2'\]"):
        lowprec.MXBlockScaling(gradient_element=["e5m2"])
    with pytest.raises(LowprecValueError, match=r"scale_rule must be one of \['nvidia', 'ocp'\] or None .*, got 'floor'"):
        lowprec.MXBlockScaling(scale_rule="floor")
    with pytest.raises(LowprecValueError, match="enable_2d_quantization must be a bool, got 1"):
        lowprec.MXBlockScaling(enable_2d_quantization=1)


def tolerance(recipe: lowprec.MXBlockScaling) -> float:
    return FP4_TOLERANCE if recipe.element == "e2m1" else TOLERANCE


@pytest.mark.parametrize("recipe", NEW.values(), ids=NEW.keys())
@pytest.mark.parametrize("make", LAYERS.values(), ids=LAYERS.keys())
def test_every_layer_trains_under_every_mx_format(make, recipe):
    assert_trains_close(make, recipe, tolerance(recipe))


@pytest.mark.parametrize("recipe", [NEW["mxfp4"], NEW["mxfp6_e3m2"]], ids=["mxfp4", "mxfp6_e3m2"])
def test_grouped_linear_is_a_linear_per_expert(recipe):
    splits = [5, 0, 7, 4]
    torch.manual_seed(0)
    grouped = lowprec.GroupedLinear(len(splits), 32, 24, name="moe")
    experts = []
    for i in range(len(splits)):
        expert = lowprec.Linear(32, 24, name=f"expert{i}")
        with torch.no_grad():
            expert.weight.copy_(grouped.weight[i] * 10.0**i)
            expert.bias.copy_(grouped.bias[i])
            grouped.weight[i].mul_(10.0**i)  # experts of very different magnitudes: each has its own scales
        experts.append(expert)
    x = torch.randn(sum(splits), 32, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    dy = torch.randn(sum(splits), 24)
    with lowprec.autocast(recipe=recipe):
        y = grouped(x, splits)
        y_ref = torch.cat([expert(rows) for expert, rows in zip(experts, x_ref.split(splits), strict=True)])
    y.backward(dy)
    y_ref.backward(dy)
    assert torch.equal(y, y_ref) and torch.equal(x.grad, x_ref.grad)
    for i, expert in enumerate(experts):
        assert torch.equal(grouped.weight.grad[i], expert.weight.grad), i
    with lowprec.autocast(enabled=False):
        assert not torch.equal(grouped(x, splits), y)  # the recipe quantized


def test_training_with_each_mx_format_stays_near_bf16():
    first, reference = train_mlp(None, bf16=True)
    assert reference < 0.35 * first
    for name, factor in LOSS_FACTOR.items():
        first_q, quantized = train_mlp(NEW[name])
        assert quantized < 0.35 * first_q and reference / 1.05 < quantized < factor * reference, name


def decode_bits(codes: torch.Tensor, exponent_bits: int, mantissa_bits: int) -> torch.Tensor:
    """A mini-float's value from its bit pattern, by the OCP definition (bias 2**(e-1) - 1, subnormals at field 0)."""
    codes = codes.long()
    sign = torch.where((codes >> (exponent_bits + mantissa_bits)) & 1 == 1, -1.0, 1.0)
    field = (codes >> mantissa_bits) & (2**exponent_bits - 1)
    mantissa = (codes & (2**mantissa_bits - 1)).double() / 2**mantissa_bits
    bias = 2 ** (exponent_bits - 1) - 1
    magnitude = torch.where(field == 0, mantissa * 2.0 ** (1 - bias), (1 + mantissa) * torch.pow(2.0, (field - bias).double()))
    return sign * magnitude


@pytest.mark.parametrize("rule", ["nvidia", "ocp"])
@pytest.mark.parametrize(("name", "bits"), [("e3m2", (3, 2)), ("e2m3", (2, 3)), ("e2m1", (2, 1))])
def test_quantize_gives_codes_and_e8m0_bytes(name, bits, rule):
    x = sample(rows=40, cols=70, seed=1)  # 70: the last block of each row is padded
    q = lowprec.quantize(x, lowprec.MXBlockScaling(name, scale_rule=rule), tensor_name="weight")
    for part, values in ((q.rowwise, q.dequantize()), (q.columnwise, q.dequantize().t())):
        assert part.codes.dtype == torch.uint8 and int(part.codes.max()) < 2 ** (1 + sum(bits)) and part.block == (1, 32)
        assert part.scale_inv.dtype == torch.uint8 and part.global_scale_inv is None
        scale = torch.exp2(part.scale_inv.double() - 127).repeat_interleave(32, 1)[:, : part.codes.shape[1]]
        decoded = (decode_bits(part.codes, *bits) * scale).float()
        assert torch.equal(decoded, values) is (part is q.rowwise)  # columnwise: its own cast of the transpose
    assert torch.equal(q.dequantize(), torchao_dequantized(x, ELEMENTS[name], rule))  # torchao's values, bit for bit


def test_compare_knows_the_mx_family():
    names = ["mxfp8_ocp", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4", "mxfp4_nvidia"]
    assert parse_recipes(",".join(names)) == names
    made = {name: COMPARE_RECIPES[name].make(0) for name in names}
    assert made["mxfp4"] == lowprec.MXBlockScaling("e2m1") and made["mxfp6_e3m2"] == lowprec.MXBlockScaling("e3m2")
    assert made["mxfp8_ocp"].quantizers("x")["weight"].label == "mxfp8_ocp"
    assert made["mxfp4_nvidia"].quantizers("x")["weight"].rule.convention == "nvidia"
    assert all(COMPARE_RECIPES[name].stats == ("underflows%", "mse") for name in names)
    with pytest.raises(LowprecValueError, match="unknown recipe 'mxfp5'"):
        parse_recipes("mxfp5")


def test_compare_trains_and_ranks_the_new_formats(tmp_path):
    page = compare_formats(["mxfp4", "mxfp6_e2m3"], steps=2, size="tiny", out=tmp_path, seed=3, device="cpu")
    data = json.loads(re.search(r'<script type="application/json" id="compare-data">(.*?)</script>', page.read_text(), re.S)[1])
    assert data["failed"] == [] and [run["name"] for run in data["runs"]] == ["mxfp4", "mxfp6_e2m3"]
    for run in data["runs"]:
        assert len(run["loss"]) == 2 and all(math.isfinite(loss) for loss in run["loss"])
        assert run["stats"] == ["underflows%", "mse"] and set(run["outliers"]) == {"underflows%", "relative mse"}


def test_the_fused_mxfp8_kernel_takes_only_what_it_implements():
    """The Triton kernel writes FP8 bytes under NVIDIA's rule: the OCP rule and the FP6 and FP4 elements go to the
    emulation, on every device."""
    pytest.importorskip("triton")
    from lowprec.formats.scales import MXScaleRule
    from lowprec.kernels import block_fp8

    assert block_fp8.supports(MXScaleRule(E4M3, "nvidia"), E4M3, (1, 32))
    assert not block_fp8.supports(MXScaleRule(E4M3, "ocp"), E4M3, (1, 32))
    for name in ("e3m2", "e2m3", "e2m1"):
        for rule in ("nvidia", "ocp"):
            assert not block_fp8.supports(MXScaleRule(ELEMENTS[name], rule), ELEMENTS[name], (1, 32))
