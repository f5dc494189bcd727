"""Activation checkpointing, saved-tensor hooks and CPU offload over lowprec layers: every GEMM operand
goes through ``ctx.save_for_backward``, and a recomputed forward repeats its original exactly (recipe,
scales, debug plan), so checkpointed training equals plain training number for number."""

from __future__ import annotations

import pytest
import torch
from logreader import read_stats
from torch.utils.checkpoint import checkpoint

import lowprec
import nvdlfw_inspect.api as debug_api
from lowprec.debug.names import TENSOR_GEMMS

RECIPES = {"current": lowprec.Float8CurrentScaling(), "delayed": lowprec.DelayedScaling(amax_history_len=4)}
BLOCK_RECIPES = {
    "mxfp8": lowprec.MXFP8BlockScaling(),
    "float8-block": lowprec.Float8BlockScaling(),
    "nvfp4": lowprec.NVFP4BlockScaling(),  # stochastic rounding and the Hadamard transform included
}


class Model(torch.nn.Module):
    """Two blocks of lowprec layers; ``mode`` says how each block's forward runs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.block1 = torch.nn.Sequential(lowprec.Linear(16, 32, name="fc1"), torch.nn.GELU(), lowprec.Linear(32, 16, name="fc2"))
        self.block2 = lowprec.LayerNormMLP(16, 48, name="mlp")
        self.mode = "plain"

    def _run(self, block, x):
        if self.mode == "checkpoint":
            return checkpoint(block, x, use_reentrant=False)
        return block(x)

    def forward(self, x):
        return self._run(self.block2, self._run(self.block1, x) + x)


def batches(steps: int, micro: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(2, 6, 16, generator=g) * (1 + s) for _ in range(micro)] for s in range(steps)]


def train(mode: str, recipe, data, fp8_backward: bool = False, hooks=None, interleave: bool = False):
    """Train a fresh model; returns (losses, final parameters). ``interleave``: all micro-batch forwards
    of a step before their backwards, as a pipeline schedule runs them."""
    model = Model()
    model.mode = mode
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _step, micro_batches in enumerate(data):
        pending = []
        for x in micro_batches:
            with lowprec.fp8_autocast(fp8_recipe=recipe), hooks() if hooks else _nothing():
                loss = model(x).square().mean()
            losses.append(loss.detach())
            pending.append(loss)
            if not interleave:
                _backward(pending.pop(), recipe, fp8_backward)
        for loss in pending:
            _backward(loss, recipe, fp8_backward)
        optimizer.step()
        optimizer.zero_grad()
        if debug_api.DEBUG_MANAGER is not None:
            debug_api.step()
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


def _backward(loss, recipe, inside_autocast):
    if inside_autocast:  # users often call backward inside the autocast block
        with lowprec.fp8_autocast(fp8_recipe=recipe):
            loss.backward()
    else:
        loss.backward()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def assert_same(run_a, run_b):
    losses_a, params_a = run_a
    losses_b, params_b = run_b
    assert torch.equal(losses_a, losses_b)
    for a, b in zip(params_a, params_b, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", {**RECIPES, **BLOCK_RECIPES}.values(), ids={**RECIPES, **BLOCK_RECIPES}.keys())
@pytest.mark.parametrize("interleave", [False, True], ids=["micro-batches", "pipelined"])
def test_checkpointed_training_equals_plain_training(recipe, interleave):
    data = batches(steps=3, micro=2)
    plain = train("plain", recipe, data, interleave=interleave)
    assert_same(train("checkpoint", recipe, data, interleave=interleave), plain)
    assert_same(train("checkpoint", recipe, data, fp8_backward=True, interleave=interleave), plain)
    assert not torch.equal(plain[0], train("plain", None, data, interleave=interleave)[0])  # FP8 really ran


def test_checkpointing_a_high_precision_forward_stays_high_precision_under_a_backward_autocast():
    data = batches(steps=2, micro=1)
    model = Model()
    model.mode = "checkpoint"
    x = data[0][0]
    loss = model(x).square().mean()
    with lowprec.fp8_autocast(fp8_recipe=RECIPES["current"]):
        loss.backward()  # the recomputation must not switch to FP8: the saved tensors would not match
    plain = Model()
    plain(x).square().mean().backward()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_saved_tensor_hooks_see_every_gemm_operand_and_cpu_offload_trains_the_same():
    recipe = RECIPES["delayed"]
    data = batches(steps=2, micro=1)
    seen: list[torch.dtype] = []

    def offload():
        def pack(tensor):
            seen.append(tensor.dtype)
            return tensor.clone()  # what an offload does: the original storage is no longer needed

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)

    assert_same(train("plain", recipe, data, hooks=offload), train("plain", recipe, data))
    assert seen.count(torch.float8_e4m3fn) >= 2 * 3 * 2  # FP8 activation and weight of 3 GEMM layers, 2 steps
    assert_same(train("plain", recipe, data, hooks=torch.autograd.graph.save_on_cpu), train("plain", recipe, data))


def test_a_layer_remembers_nothing_once_its_backward_ran_or_its_graph_is_gone():
    model = Model()
    x = torch.randn(3, 16)
    with lowprec.fp8_autocast(fp8_recipe=RECIPES["delayed"]):
        model(x).sum().backward()
        model(x).sum()  # a graph dropped without a backward
        unit = model.block1[0].gemm_unit
        y = unit.linear("fc1", x, model.block1[0].weight, None)
    assert len(unit.forwards) == 1  # only the forward whose graph is alive: the ones above left nothing behind
    del y
    assert unit.forwards.oldest() is None


def _stats_config(features: dict) -> dict:
    return {"sec": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "transformer_engine": features}}


@pytest.mark.parametrize("recipe", {**RECIPES, **BLOCK_RECIPES}.values(), ids={**RECIPES, **BLOCK_RECIPES}.keys())
def test_checkpointed_debug_run_logs_the_plain_statistics_once_and_modifies_the_same(tmp_path, recipe):
    # statistics of the layer's own recipe exist for the per-tensor recipes; block recipes get what-if ones
    own = recipe in RECIPES.values()
    fp8_stats = ["underflows%", "scale_inv_min"] if own else ["mxfp8_underflows%", "fp8_current_scaling_mse"]
    features = {
        "LogTensorStats": {"enabled": True, "tensors": list(TENSOR_GEMMS), "stats": ["min", "max", "l2_norm"]},
        "LogFp8TensorStats": {"enabled": True, "tensors": ["activation", "weight"], "stats": fp8_stats},
        "FakeQuant": {"enabled": True, "gemms": ["wgrad"], "tensors": ["activation"], "quant_format": "FP8E5M2"},
    }
    data = batches(steps=2, micro=2)
    runs, logs = {}, {}
    for mode in ("plain", "checkpoint"):
        debug_api.initialize(config_file=_stats_config(features), feature_dirs=[lowprec.FEATURE_DIR], log_dir=tmp_path / mode)
        runs[mode] = train(mode, recipe, data)
        debug_api.end_debug()
        logs[mode] = read_stats(tmp_path / mode)
    assert_same(runs["checkpoint"], runs["plain"])
    assert logs["checkpoint"] == logs["plain"]
    assert any("fc1_activation_l2_norm" in name for name, _ in logs["plain"])
