"""Layers under ``torch.autocast`` (mixed-precision training): they compute what ``F.linear`` computes under
it whether or not a debug feature is active on them, and FP8 recipes keep their fp32 accumulation."""

from __future__ import annotations

import pytest
import torch
import yaml

import lowprec
import nvdlfw_inspect.api as debug_api

LAYERS = {
    "Linear": lambda: lowprec.Linear(32, 48, name="layer"),
    "LayerNormLinear": lambda: lowprec.LayerNormLinear(32, 48, name="layer"),
    "LayerNormMLP": lambda: lowprec.LayerNormMLP(32, 48, name="layer"),
}


def step(layer: torch.nn.Module, x: torch.Tensor, recipe=None) -> list[torch.Tensor]:
    """One forward under bf16 autocast and a backward: the output, the input's gradient, every parameter's."""
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16), lowprec.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        y = layer(x)
    y.float().square().sum().backward()
    out = [y.detach(), x.grad, *(p.grad.clone() for p in layer.parameters())]
    layer.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("name", list(LAYERS))
def test_an_inspected_step_computes_the_same_as_an_uninspected_one(tmp_path, name):
    config = tmp_path / "stats.yaml"
    features = {"LogTensorStats": {"enabled": True, "tensors": ["activation", "gradient", "weight"], "stats": ["max"], "freq": 2}}
    section = {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "transformer_engine": features}
    config.write_text(yaml.safe_dump({"stats": section}))
    torch.manual_seed(0)
    layer, x = LAYERS[name](), torch.randn(4, 32)
    debug_api.initialize(config_file=str(config), feature_dirs=[lowprec.FEATURE_DIR], log_dir=str(tmp_path))
    try:
        inspected = step(layer, x)  # step 0: the statistics are due, the layer runs lowprec's GEMMs
        debug_api.step()
        plain = step(layer, x)  # step 1: nothing due, the layer is plain F.linear under autocast
    finally:
        debug_api.end_debug()
    assert inspected[0].dtype == torch.bfloat16 and all(p.dtype == torch.float32 for p in inspected[2:])
    for got, want in zip(inspected, plain, strict=True):
        assert torch.equal(got, want)
    assert any(path.suffix == ".log" for path in tmp_path.rglob("*"))


def test_fp8_gemms_accumulate_in_fp32_under_autocast():
    torch.manual_seed(1)
    layer, x = lowprec.Linear(64, 32, name="fc"), torch.randn(8, 64) * 3
    recipe = lowprec.Float8CurrentScaling()
    under_autocast = step(layer, x, recipe)
    x_bf16 = x.bfloat16().requires_grad_()
    with lowprec.fp8_autocast(fp8_recipe=recipe):
        y = layer(x_bf16)  # no torch.autocast: the activation already bf16, the GEMM emulated in fp32
    y.float().square().sum().backward()
    assert torch.equal(under_autocast[0], y.detach()) and torch.equal(under_autocast[2], layer.weight.grad)
    assert torch.equal(under_autocast[1], x_bf16.grad.float())
