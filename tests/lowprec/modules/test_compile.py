"""torch.compile over lowprec layers: one graph (fullgraph) in high precision and with current scaling,
forward and backward equal to eager; delayed scaling, block recipes and debug features run their layers eagerly
(a graph break each) and give exactly the eager numbers and statistics."""

from __future__ import annotations

import pytest
import torch
from logreader import read_stats

import lowprec
import nvdlfw_inspect.api as debug_api

CURRENT = lowprec.Float8CurrentScaling()


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        lowprec.LayerNormLinear(32, 64, name="qkv"),
        torch.nn.GELU(),
        lowprec.Linear(64, 32, name="proj"),
        lowprec.LayerNormMLP(32, 48, name="mlp"),
    )


def train(model: torch.nn.Module, run, recipe, steps: int = 3) -> list[torch.Tensor]:
    """``steps`` optimizer steps of ``run`` (the model or its compiled version); returns every output,
    input gradient and parameter along the way."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    results = []
    for step in range(steps):
        x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(step), requires_grad=True)
        with lowprec.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            y = run(x)
        y.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if debug_api.DEBUG_MANAGER is not None:
            debug_api.step()
        results += [y.detach(), x.grad, *(p.detach().clone() for p in model.parameters())]
    return results


def compiled_and_eager(recipe, backend: str, fullgraph: bool, steps: int = 3):
    eager_model, compiled_model = make_model(), make_model()
    eager = train(eager_model, eager_model, recipe, steps)
    compiled = train(compiled_model, torch.compile(compiled_model, backend=backend, fullgraph=fullgraph), recipe, steps)
    return eager, compiled


@pytest.mark.parametrize("recipe", [None, CURRENT], ids=["high precision", "current scaling"])
def test_fullgraph_training_traces_the_same_operations_as_eager(recipe):
    torch._dynamo.reset()
    eager, compiled = compiled_and_eager(recipe, "aot_eager", fullgraph=True)  # traced graphs run by eager kernels
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)


def test_inductor_fullgraph_step_equals_eager_within_float_rounding():
    torch._dynamo.reset()
    eager, compiled = compiled_and_eager(CURRENT, "inductor", fullgraph=True, steps=1)
    for a, b in zip(eager, compiled, strict=True):  # fused kernels may round a scale differently by an ulp
        assert torch.allclose(a, b, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize(
    "recipe", [lowprec.DelayedScaling(amax_history_len=4), lowprec.NVFP4BlockScaling()], ids=["delayed", "nvfp4"]
)
def test_stateful_recipes_compile_with_a_graph_break_per_layer_and_train_exactly_as_eager(recipe):
    """Delayed scaling (an amax history) and the block recipes (emulated; NVFP4's noise stream) run eagerly."""
    torch._dynamo.reset()
    eager, compiled = compiled_and_eager(recipe, "aot_eager", fullgraph=False)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)
    model = make_model()
    with lowprec.fp8_autocast(fp8_recipe=recipe):
        explanation = torch._dynamo.explain(model)(torch.randn(2, 32))
    assert explanation.break_reasons  # each lowprec layer's GEMMs break the graph, and nothing else does
    assert all("run_eagerly" in reason.reason for reason in explanation.break_reasons)


def test_debug_features_under_compile_log_the_eager_statistics(tmp_path):
    torch._dynamo.reset()
    config = {
        "sec": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": "proj|mlp"},
            "transformer_engine": {
                "LogTensorStats": {"enabled": True, "tensors": ["activation", "weight", "gradient"], "stats": ["max", "l2_norm"]},
                "LogFp8TensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["underflows%"]},
            },
        }
    }
    logs = {}
    for mode in ("eager", "compiled"):
        model = make_model()
        debug_api.initialize(config_file=config, feature_dirs=[lowprec.FEATURE_DIR], log_dir=tmp_path / mode)
        run = model if mode == "eager" else torch.compile(model, backend="aot_eager")
        train(model, run, CURRENT)
        debug_api.end_debug()
        logs[mode] = read_stats(tmp_path / mode)
    assert logs["compiled"] == logs["eager"]
    assert {name for name, _ in logs["eager"]} >= {"proj_activation_max", "mlp.fc2_gradient_l2_norm"}
