"""Activation checkpointing, saved-tensor hooks and CPU offload over lowprec layers: every GEMM operand
goes through ``ctx.save_for_backward``, and a recomputed forward repeats its original exactly (recipe,
scales, debug plan), so checkpointed training equals plain training number for number, with
``use_reentrant=False`` and ``use_reentrant=True`` alike."""

from __future__ import annotations

import warnings

import pytest
import torch
from logreader import read_stats, stats_log_path
from tiny_models import tiny_llama_config
from torch.utils.checkpoint import checkpoint

import lowprec
import nvdlfw_inspect.api as debug_api
from lowprec.debug.names import TENSOR_GEMMS
from lowprec.errors import LowprecValueError
from lowprec.modules.gemm_unit import GemmUnit

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
        if self.mode in ("checkpoint", "reentrant"):
            return checkpoint(block, x, use_reentrant=self.mode == "reentrant")
        return block(x)

    def forward(self, x):
        return self._run(self.block2, self._run(self.block1, x) + x)


def batches(steps: int, micro: int, requires_grad: bool = False) -> list[list[torch.Tensor]]:
    """``requires_grad``: what a reentrant checkpoint needs of its inputs to give its region gradients."""
    g = torch.Generator().manual_seed(1)
    data = [[torch.randn(2, 6, 16, generator=g) * (1 + s) for _ in range(micro)] for s in range(steps)]
    return [[x.requires_grad_(requires_grad) for x in step] for step in data]


def units(model: torch.nn.Module) -> list[GemmUnit]:
    return [unit for module in model.modules() for unit in vars(module).values() if isinstance(unit, GemmUnit)]


def amax_histories(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every delayed-scaling quantizer's amax history (none for the other recipes)."""
    quantizers = [quantizer for unit in units(model) for made in unit._by_recipe.values() for quantizer in made.values()]
    return [quantizer.amax_history.clone() for quantizer in quantizers if hasattr(quantizer, "amax_history")]


def train(mode: str, recipe, data, fp8_backward: bool = False, hooks=None, interleave: bool = False):
    """Train a fresh model (``recipe`` None: in high precision); returns (losses, final parameters, amax
    histories). ``interleave``: all micro-batch forwards of a step before their backwards, as a pipeline
    schedule runs them."""
    model = Model()
    model.mode = mode
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _step, micro_batches in enumerate(data):
        pending = []
        for x in micro_batches:
            with lowprec.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe), hooks() if hooks else _nothing():
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
    assert all(len(unit.reentrant_forwards) == 0 for unit in units(model))  # every recomputation found its forward
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()], amax_histories(model)


def _backward(loss, recipe, inside_autocast):
    if inside_autocast:  # users often call backward inside the autocast block
        with lowprec.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            loss.backward()
    else:
        loss.backward()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def assert_same(run_a, run_b):
    losses_a, params_a, amaxes_a = run_a
    losses_b, params_b, amaxes_b = run_b
    assert torch.equal(losses_a, losses_b)
    for a, b in zip(params_a + amaxes_a, params_b + amaxes_b, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", {**RECIPES, **BLOCK_RECIPES}.values(), ids={**RECIPES, **BLOCK_RECIPES}.keys())
@pytest.mark.parametrize("interleave", [False, True], ids=["micro-batches", "pipelined"])
def test_checkpointed_training_equals_plain_training(recipe, interleave):
    data = batches(steps=3, micro=2)
    plain = train("plain", recipe, data, interleave=interleave)
    assert_same(train("checkpoint", recipe, data, interleave=interleave), plain)
    assert_same(train("checkpoint", recipe, data, fp8_backward=True, interleave=interleave), plain)
    assert not torch.equal(plain[0], train("plain", None, data, interleave=interleave)[0])  # FP8 really ran


@pytest.mark.parametrize("recipe", {**RECIPES, **BLOCK_RECIPES}.values(), ids={**RECIPES, **BLOCK_RECIPES}.keys())
@pytest.mark.parametrize("interleave", [False, True], ids=["micro-batches", "pipelined"])
def test_reentrant_checkpointed_training_equals_plain_training(recipe, interleave):
    """``use_reentrant=True`` recomputes under its own graph, whose backward is the one that runs: still the
    original forward's casts (one amax record each for delayed scaling, the same stochastic-rounding noise)."""
    data = batches(steps=2, micro=2, requires_grad=True)
    plain = train("plain", recipe, data, interleave=interleave)
    assert_same(train("reentrant", recipe, data, interleave=interleave), plain)
    assert_same(train("reentrant", recipe, data, fp8_backward=True, interleave=interleave), plain)
    assert not torch.equal(plain[0], train("plain", None, data, interleave=interleave)[0])  # FP8 really ran


@pytest.mark.parametrize("mode", ["checkpoint", "reentrant"])
def test_checkpointing_a_high_precision_forward_stays_high_precision_under_a_backward_autocast(mode):
    data = batches(steps=2, micro=1, requires_grad=True)
    model = Model()
    model.mode = mode
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


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # the checkpoint run without grad
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
    x.requires_grad_()
    with lowprec.fp8_autocast(fp8_recipe=RECIPES["delayed"]), torch.no_grad():
        model(x)  # evaluation: no checkpoint to hand the forward to
        model.mode = "reentrant"
        model(x)  # a checkpoint without grad: its node is gone with the forward
    assert len(unit.reentrant_forwards) == 0
    with lowprec.fp8_autocast(fp8_recipe=RECIPES["delayed"]):
        y = model(x)
    assert len(unit.reentrant_forwards) == 1 and len(unit.forwards) == 0  # held by the checkpoint's node
    del y
    assert len(unit.reentrant_forwards) == 0


class Nested(torch.nn.Module):
    """``fc`` around an inner checkpoint of ``block`` inside an outer one: ``inner`` and ``outer`` say how each runs."""

    def __init__(self, inner: str, outer: str):
        super().__init__()
        torch.manual_seed(0)
        self.block = torch.nn.Sequential(lowprec.Linear(16, 16, name="a"), torch.nn.ReLU(), lowprec.Linear(16, 16, name="b"))
        self.fc = lowprec.Linear(16, 16, name="fc")
        self.inner, self.outer = inner, outer

    def _run(self, mode, function, x):
        return function(x) if mode == "plain" else checkpoint(function, x, use_reentrant=mode == "reentrant")

    def forward(self, x):
        return self._run(self.outer, lambda y: self.fc(self._run(self.inner, self.block, y)), x)


def _nested_gradients(inner: str, outer: str, recipe) -> list[torch.Tensor]:
    model = Nested(inner, outer)
    for x in batches(steps=1, micro=2, requires_grad=True)[0]:
        with lowprec.fp8_autocast(fp8_recipe=recipe):
            loss = model(x).square().mean()
        loss.backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("recipe", [RECIPES["delayed"], BLOCK_RECIPES["nvfp4"]], ids=["delayed", "nvfp4"])
def test_a_non_reentrant_checkpoint_inside_a_reentrant_one_trains_as_plain(recipe):
    plain = _nested_gradients("plain", "plain", recipe)
    for a, b in zip(_nested_gradients("checkpoint", "reentrant", recipe), plain, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("outer", "where"), [("reentrant", "inside another one"), ("checkpoint", "inside a recomputed")])
def test_a_reentrant_checkpoint_inside_another_checkpoint_raises_an_error_that_names_the_way_out(outer, where):
    """Its forward would run inside a recomputation, where its casts cannot be paired with the original's."""
    with pytest.raises(LowprecValueError, match=f"{where}.*use_reentrant=False"):
        _nested_gradients("reentrant", outer, RECIPES["delayed"])


class OwnReentrantCheckpoint(torch.autograd.Function):
    """A reentrant checkpoint of another library (Megatron and DeepSpeed have their own): forward without
    grad, backward recomputes the region and backpropagates through the recomputed graph."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        with torch.no_grad():
            return ctx.block(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = ctx.block(x)
        torch.autograd.backward(out, grad)
        return x.grad


def test_a_reentrant_checkpoint_lowprec_does_not_recognise_raises_instead_of_training_wrong(monkeypatch):
    block = Model().block1
    monkeypatch.setattr(OwnReentrantCheckpoint, "block", block, raising=False)

    def forward(ctx, x):
        ctx.block = block
        ctx.save_for_backward(x)
        with torch.no_grad():
            return block(x)

    monkeypatch.setattr(OwnReentrantCheckpoint, "forward", staticmethod(forward))
    x = torch.randn(4, 16, requires_grad=True)
    with lowprec.fp8_autocast(fp8_recipe=RECIPES["current"]):
        out = OwnReentrantCheckpoint.apply(x)
    with pytest.raises(LowprecValueError, match=r"does not recognise .*use_reentrant=False"):
        out.sum().backward()


def test_transformers_reentrant_gradient_checkpointing_trains_and_logs_as_without_it(tmp_path):
    """What trainers still do by default: ``gradient_checkpointing_enable`` with ``use_reentrant=True``, which
    wraps each decoder layer's forward in ``torch.utils.checkpoint`` (and makes the embeddings' output require grad)."""
    transformers = pytest.importorskip("transformers")
    config = tiny_llama_config()
    recipe = lowprec.DelayedScaling(amax_history_len=4)
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, 128, (2, 8), generator=g) for _ in range(2)]
    features = {"LogTensorStats": {"enabled": True, "tensors": list(TENSOR_GEMMS), "stats": ["max", "l2_norm"]}}
    runs, logs, lines = {}, {}, {}
    for run in ("plain", "reentrant"):
        torch.manual_seed(0)
        model = lowprec.convert(transformers.LlamaForCausalLM(config))
        if run == "reentrant":
            with warnings.catch_warnings():  # transformers 5 deprecates the name trainers still call
                warnings.simplefilter("ignore", FutureWarning)
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model.train()
        debug_api.initialize(config_file=_stats_config(features), feature_dirs=[lowprec.FEATURE_DIR], log_dir=tmp_path / run)
        for ids in inputs:
            with lowprec.fp8_autocast(fp8_recipe=recipe):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        debug_api.end_debug()
        runs[run] = [p.grad for p in model.parameters()] + amax_histories(model)
        logs[run] = read_stats(tmp_path / run)
        lines[run] = len(stats_log_path(tmp_path / run).read_text().splitlines())
    assert model.model.layers[0].gradient_checkpointing
    for a, b in zip(runs["reentrant"], runs["plain"], strict=True):
        assert torch.equal(a, b)
    assert logs["reentrant"] == logs["plain"]
    assert lines["reentrant"] == lines["plain"] == len(logs["plain"]) == 15 * 6 * 2  # 15 layers, 6 tensors, 2 stats


def _stats_config(features: dict) -> dict:
    return {"sec": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "transformer_engine": features}}


@pytest.mark.parametrize("recipe", {**RECIPES, **BLOCK_RECIPES}.values(), ids={**RECIPES, **BLOCK_RECIPES}.keys())
@pytest.mark.parametrize("mode", ["checkpoint", "reentrant"])
def test_checkpointed_debug_run_logs_the_plain_statistics_once_and_modifies_the_same(tmp_path, recipe, mode):
    # statistics of the layer's own recipe exist for the per-tensor recipes; block recipes get what-if ones
    own = recipe in RECIPES.values()
    fp8_stats = ["underflows%", "scale_inv_min"] if own else ["mxfp8_underflows%", "fp8_current_scaling_mse"]
    features = {
        "LogTensorStats": {"enabled": True, "tensors": list(TENSOR_GEMMS), "stats": ["min", "max", "l2_norm"]},
        "LogFp8TensorStats": {"enabled": True, "tensors": ["activation", "weight"], "stats": fp8_stats},
        "FakeQuant": {"enabled": True, "gemms": ["wgrad"], "tensors": ["activation"], "quant_format": "FP8E5M2"},
    }
    data = batches(steps=2, micro=2, requires_grad=True)
    runs, logs, lines = {}, {}, {}
    for run in ("plain", mode):
        debug_api.initialize(config_file=_stats_config(features), feature_dirs=[lowprec.FEATURE_DIR], log_dir=tmp_path / run)
        runs[run] = train(run, recipe, data)
        debug_api.end_debug()
        logs[run] = read_stats(tmp_path / run)
        lines[run] = len(stats_log_path(tmp_path / run).read_text().splitlines())
    assert_same(runs[mode], runs["plain"])
    assert logs[mode] == logs["plain"]
    assert lines[mode] == lines["plain"] == len(logs["plain"])  # each record once
    for tensor in TENSOR_GEMMS:  # forward and backward statistics of a layer inside the checkpointed regions
        assert any(f"fc1_{tensor}_l2_norm" in name for name, _ in logs["plain"])
