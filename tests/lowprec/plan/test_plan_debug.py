"""A debug session over a model trained under a precision plan: statistics, routing records and messages follow each
layer's own format."""

from __future__ import annotations

import warnings

import pytest
import torch

import lowprec
import nvdlfw_inspect.api as debug_api
from lowprec.autocast import current_state
from lowprec.plan import UnusedPlanRuleWarning
from nvdlfw_inspect.reading import iter_statistics, read_routing

NVFP4 = lowprec.NVFP4BlockScaling(disable_stochastic_rounding=True)
PLAN = {
    "rules": [
        {"layers": {"exact_layer_names": ["model.nvfp4"]}, "recipe": {"name": "nvfp4", "disable_stochastic_rounding": True}},
        {"name": "mixed", "layers": {"exact_layer_names": ["model.mixed"]}, "fprop": "mxfp8", "dgrad": "nvfp4", "wgrad": "nvfp4"},
    ]
}
FEATURES = {
    "LogFp8TensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["underflows%", "mxfp8_underflows%"]},
    "LogNvfp4TensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["mse"]},
}
NAMES = ("model.fp8", "model.nvfp4", "model.mixed")


def layers() -> list[lowprec.Linear]:
    torch.manual_seed(0)
    return [lowprec.Linear(64, 64, name=name) for name in NAMES]


def train(log_dir, plan=PLAN, steps: int = 1) -> list[torch.Tensor]:
    """One step of three chained layers; returns each layer's input."""
    config = {"sec": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "transformer_engine": FEATURES}}
    debug_api.initialize(config_file=config, feature_dirs=[lowprec.FEATURE_DIR], log_dir=log_dir)
    model = layers()
    inputs = []
    for _ in range(steps):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3)) * 1e-3
        x[0, :8] = 50.0  # an outlier that flushes small values to zero
        inputs = []
        with lowprec.autocast(recipe=lowprec.Float8CurrentScaling(), plan=plan):
            for layer in model:
                inputs.append(x.detach().clone())
                x = layer(x)
        x.sum().backward()
        debug_api.step()
    debug_api.end_debug()
    return inputs


def underflows(x: torch.Tensor, recipe: lowprec.Recipe) -> float:
    values = lowprec.quantize(x, recipe).dequantize()
    return ((x != 0) & (values == 0)).sum().item() / x.numel() * 100


def test_each_layers_statistics_describe_its_own_format(log_dir):
    inputs = dict(zip(NAMES, train(log_dir), strict=True))
    got = {(layer, stat): value for _, layer, tensor, stat, _, value in iter_statistics(log_dir) if tensor == "activation"}
    own = {"model.fp8": lowprec.Float8CurrentScaling(), "model.nvfp4": NVFP4, "model.mixed": lowprec.MXFP8BlockScaling()}
    for name, recipe in own.items():
        assert got[(name, "underflows%")] == pytest.approx(underflows(inputs[name], recipe)), name
        assert got[(name, "mxfp8_underflows%")] == pytest.approx(underflows(inputs[name], lowprec.MXFP8BlockScaling()))
    assert got[("model.fp8", "underflows%")] != got[("model.nvfp4", "underflows%")]
    # LogNvfp4TensorStats: the NVFP4 layer alone (the mixed one's activation is reported as fprop's MXFP8 cast)
    assert {layer for layer, stat in got if stat == "nvfp4_mse"} == {"model.nvfp4"}
    log = next((log_dir / "nvdlfw_inspect_logs").glob("*.log")).read_text()
    assert "LogNvfp4TensorStats: activation of model.fp8 skipped: the layer runs fp8_current_scaling" in log
    assert "model.mixed: activation: fprop reads it as mxfp8, wgrad as nvfp4; its quantization statistics" in log
    assert (
        "model.mixed: precision plan precision plan dict, rule #1 (mixed): training GEMMs fprop MXFP8BlockScaling(), "
        "dgrad NVFP4BlockScaling(), wgrad NVFP4BlockScaling()" in log
    )
    assert "model.fp8: precision plan precision plan dict, no rule selects it (the plan's default): training GEMMs" in log


def test_routing_records_name_each_gemms_format(log_dir):
    train(log_dir)
    formats = {(r.layer, r.gemm, r.tensor): r.format for r in read_routing(log_dir)}
    assert formats[("model.fp8", "fprop", "activation")] == "fp8_current_scaling"
    assert formats[("model.nvfp4", "wgrad", "gradient")] == "nvfp4"
    assert formats[("model.mixed", "fprop", "weight")] == "mxfp8"
    assert formats[("model.mixed", "dgrad", "weight")] == "nvfp4"
    assert formats[("model.mixed", "wgrad", "activation")] == "nvfp4"


def test_a_rule_that_selects_no_layer_is_said_once_with_the_closest_names(log_dir):
    plan = {"rules": [*PLAN["rules"], {"name": "typo", "layers": {"exact_layer_names": ["model.nvfp5"]}, "recipe": "mxfp8"}]}
    with pytest.warns(UnusedPlanRuleWarning) as caught:
        train(log_dir, plan=plan, steps=2)
    said = [str(w.message) for w in caught if issubclass(w.category, UnusedPlanRuleWarning)]
    assert said == [
        "precision plan rule #2 (typo) selects no layer; closest layer names: model.nvfp4, model.fp8, model.mixed (in "
        "precision plan dict; 3 layers ran under it): fix the rule's selector, or remove it"
    ]


def test_a_shadowed_rule_is_said_and_a_used_plan_says_nothing(log_dir):
    plan = {"rules": [{"layers": {"layer_name_regex_pattern": "model"}, "recipe": "mxfp8"}, *PLAN["rules"]]}
    with pytest.warns(UnusedPlanRuleWarning, match=r"rule #1 .*every layer it selects is taken by earlier rule #0"):
        train(log_dir, plan=plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedPlanRuleWarning)
        train(log_dir)


def test_a_layer_whose_format_changes_starts_fresh_quantizers_and_says_so(caplog):
    layer = lowprec.Linear(32, 32, name="model.switch")
    x = torch.randn(4, 32)
    with lowprec.autocast(recipe=lowprec.DelayedScaling()):
        layer(x).sum().backward()
    delayed = layer.gemm_unit.quantizers(lowprec.DelayedScaling(), "model.switch")
    assert delayed["activation"].amax_history.abs().sum() > 0
    plan = {"rules": [{"layers": {"exact_layer_names": ["model.switch"]}, "dgrad": "current"}]}
    with caplog.at_level("INFO", logger="lowprec"), lowprec.autocast(recipe=lowprec.DelayedScaling(), plan=plan):
        layer(x).sum().backward()
    assert "model.switch: its training GEMMs changed format (dgrad DelayedScaling() -> Float8CurrentScaling())" in caplog.text
    # fprop and wgrad keep delayed scaling and its history; back to one recipe, dgrad's current scaling is dropped
    assert layer.gemm_unit.quantizers(lowprec.DelayedScaling(), "model.switch") is delayed
    assert (delayed["activation"].amax_history != 0).sum() == 2  # one amax per forward, none lost
    with lowprec.autocast(recipe=lowprec.DelayedScaling()):
        layer(x).sum().backward()
    assert lowprec.Float8CurrentScaling() not in layer.gemm_unit._by_recipe


def test_a_plan_file_is_read_once_while_it_is_unchanged(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("precision_plan:\n  rules:\n    - layers: {layer_name_regex_pattern: 'a'}\n      recipe: mxfp8\n")
    with lowprec.autocast(plan=str(path)):
        first = current_state().plan
    with lowprec.autocast(plan=path):
        assert current_state().plan is first
    rule = "    - layers: {layer_name_regex_pattern: 'a'}\n      recipe: nvfp4\n      eval: bf16\n"
    path.write_text("precision_plan:\n  rules:\n" + rule)
    with lowprec.autocast(plan=path):
        changed = current_state().plan
    assert changed is not first and changed.rules[0].training.fprop == lowprec.NVFP4BlockScaling()


def test_a_training_format_change_keeps_an_evaluation_recipes_quantizers():
    layer = lowprec.Linear(32, 32, name="model.eval")
    x = torch.randn(4, 32)
    plan = {"eval": "delayed", "rules": []}
    with lowprec.autocast(recipe=lowprec.MXFP8BlockScaling(), plan=plan):
        layer(x).sum().backward()
        layer.eval()
        with torch.no_grad():
            layer(x)
        layer.train()
    evaluation = layer.gemm_unit.quantizers(lowprec.DelayedScaling(), "model.eval")
    with lowprec.autocast(recipe=lowprec.Float8CurrentScaling(), plan=plan):
        layer(x).sum().backward()
    assert lowprec.MXFP8BlockScaling() not in layer.gemm_unit._by_recipe  # the training recipe it left
    assert layer.gemm_unit.quantizers(lowprec.DelayedScaling(), "model.eval") is evaluation
