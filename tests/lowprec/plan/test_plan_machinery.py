"""Under a precision plan of mixed formats the training machinery behaves as under one recipe: activation checkpointing
(non-reentrant and reentrant), torch.compile, pickling, GroupedLinear experts and the weight cast cache give the numbers
of a plain eager run, bit for bit, with amax histories kept per layer and recipe.

The plan mixes the pairs of formats a tensor can feed: ``fc1`` runs MXFP8 fprop and NVFP4 dgrad and wgrad (stochastic
rounding on the gradient), ``fc2`` an MXFP8 fprop and the autocast's delayed scaling for dgrad and wgrad, ``mlp.fc1``
high precision, and ``mlp.fc2`` a delayed-scaling fprop with an NVFP4 dgrad and a current-scaling wgrad.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from logreader import read_stats
from test_plan_debug import underflows
from test_plan_training import GemmRecorder, check_operand, operand_views
from torch.utils.checkpoint import checkpoint

import lowprec
import nvdlfw_inspect.api as debug_api
from lowprec.debug.names import TENSOR_GEMMS
from lowprec.modules.gemm_unit import GemmUnit
from lowprec.plan import load_plan
from lowprec.quant.block import BlockQuantizer
from lowprec.quant.per_tensor import DelayedScalingQuantizer
from nvdlfw_inspect.reading import iter_statistics

DELAYED = lowprec.DelayedScaling(amax_history_len=4)
CURRENT = lowprec.Float8CurrentScaling()
NVFP4 = lowprec.NVFP4BlockScaling(disable_stochastic_rounding=True)
EXPERT_PLAN = load_plan({"rules": [{"layers": {"layer_name_regex_pattern": "gemm_1$"}, "recipe": NVFP4}]})
PLAN = load_plan(
    {
        "rules": [
            {"name": "mixed", "layers": {"exact_layer_names": ["fc1"]}, "fprop": "mxfp8", "dgrad": "nvfp4", "wgrad": "nvfp4"},
            {"name": "MXFP8 fprop", "layers": {"exact_layer_names": ["fc2"]}, "fprop": "mxfp8"},
            {
                "name": "delayed fprop",
                "layers": {"exact_layer_names": ["mlp.fc2"]},
                "fprop": DELAYED,
                "dgrad": {"name": "nvfp4", "disable_stochastic_rounding": True},
                "wgrad": "current",
            },
            {"name": "high", "layers": {"exact_layer_names": ["mlp.fc1"]}, "recipe": "high_precision"},
        ]
    }
)


class Model(torch.nn.Module):
    """Two blocks of lowprec layers; ``mode`` says how each block's forward runs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.block1 = torch.nn.Sequential(lowprec.Linear(32, 64, name="fc1"), torch.nn.GELU(), lowprec.Linear(64, 32, name="fc2"))
        self.block2 = lowprec.LayerNormMLP(32, 64, name="mlp")
        self.mode = "plain"

    def _run(self, block, x):
        if self.mode in ("checkpoint", "reentrant"):
            return checkpoint(block, x, use_reentrant=self.mode == "reentrant")
        return block(x)

    def forward(self, x):
        return self._run(self.block2, self._run(self.block1, x) + x)


def batches(steps: int, micro: int) -> list[list[torch.Tensor]]:
    """Inputs that require grad: what a reentrant checkpoint needs of them to give its region gradients."""
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(2, 16, 32, generator=g) * (1 + s)).requires_grad_() for _ in range(micro)] for s in range(steps)]


def units(model: torch.nn.Module) -> list[GemmUnit]:
    return [unit for module in model.modules() for unit in vars(module).values() if isinstance(unit, GemmUnit)]


def amax_histories(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every delayed-scaling quantizer's amax history, per layer and recipe."""
    quantizers = [quantizer for unit in units(model) for made in unit._by_recipe.values() for quantizer in made.values()]
    return [quantizer.amax_history.clone() for quantizer in quantizers if hasattr(quantizer, "amax_history")]


def train(mode: str, data, plan=PLAN, interleave: bool = False):
    """Train a fresh model; returns (losses, final parameters, amax histories). ``interleave``: all micro-batch forwards
    of a step before their backwards, as a pipeline schedule runs them."""
    model = Model()
    model.mode = mode
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for micro_batches in data:
        pending = []
        for x in micro_batches:
            with lowprec.autocast(recipe=DELAYED, plan=plan):
                loss = model(x).square().mean()
            losses.append(loss.detach())
            pending.append(loss)
            if not interleave:
                pending.pop().backward()
        for loss in pending:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if debug_api.DEBUG_MANAGER is not None:
            debug_api.step()
    assert all(len(unit.reentrant_forwards) == 0 for unit in units(model))  # every recomputation found its forward
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()], amax_histories(model)


def assert_same(run_a, run_b):
    losses_a, params_a, amaxes_a = run_a
    losses_b, params_b, amaxes_b = run_b
    assert torch.equal(losses_a, losses_b)
    assert len(amaxes_a) == len(amaxes_b)
    for a, b in zip(params_a + amaxes_a, params_b + amaxes_b, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("interleave", [False, True], ids=["micro-batches", "pipelined"])
def test_checkpointed_training_under_a_mixed_plan_equals_plain_training(interleave):
    """A recomputation repeats each GEMM's casts in its own recipe, a tensor's second GEMM's cast of another recipe with
    its own original scale or noise. A reentrant checkpoint's forward runs without grad, so fc2's input does not
    require grad there: its weight is still cast for its delayed-scaling dgrad in forward, as without checkpoints."""
    data = batches(steps=2, micro=2)
    plain = train("plain", data, interleave=interleave)
    assert_same(train("checkpoint", data, interleave=interleave), plain)
    assert_same(train("reentrant", data, interleave=interleave), plain)
    # the delayed quantizers of fc2 (wgrad's activation, dgrad's weight, the gradient) and mlp.fc2 (fprop's activation
    # and weight; its gradient's casts are NVFP4 and current scaling); a weight's cast is reused by the second
    # micro-batch (one amax a step) once the first's backward ran
    weight = 4 if interleave else 2
    assert [history.count_nonzero().item() for history in plain[2]] == [4, weight, 4, 4, weight, 0]
    assert not torch.equal(plain[0], train("plain", data, plan=None, interleave=interleave)[0])  # the plan really ran


def test_a_checkpointed_debug_run_under_a_plan_logs_and_trains_as_without_checkpoints(tmp_path):
    """On the debug path too a recomputation repeats the casts of both recipes a tensor feeds, runs FakeQuant's
    modification again and inspects nothing twice."""
    features = {
        "LogTensorStats": {"enabled": True, "tensors": list(TENSOR_GEMMS), "stats": ["min", "max", "l2_norm"]},
        "LogFp8TensorStats": {"enabled": True, "tensors": ["activation", "weight", "gradient"], "stats": ["underflows%"]},
        "FakeQuant": {"enabled": True, "gemms": ["wgrad"], "tensors": ["activation"], "quant_format": "FP8E5M2"},
    }
    layers = {"layer_name_regex_pattern": "^(fc1|fc2|mlp.fc2)$"}  # not mlp.fc1: high precision has no underflows%
    config = {"sec": {"enabled": True, "layers": layers, "transformer_engine": features}}
    data = batches(steps=2, micro=2)
    runs, logs = {}, {}
    for mode in ("plain", "checkpoint", "reentrant"):
        debug_api.initialize(config_file=config, feature_dirs=[lowprec.FEATURE_DIR], log_dir=tmp_path / mode)
        runs[mode] = train(mode, data)
        debug_api.end_debug()
        logs[mode] = read_stats(tmp_path / mode)
    assert len(logs["plain"]) == 2 * 3 * (6 * 3 + 3)  # steps x layers x (LogTensorStats + LogFp8TensorStats)
    for mode in ("checkpoint", "reentrant"):
        assert_same(runs[mode], runs["plain"])
        assert logs[mode] == logs["plain"]


def step_results(model: torch.nn.Module, run, settings) -> list[torch.Tensor]:
    """One SGD step of ``run`` (the model or its compiled version) per ``(recipe, plan)`` of ``settings`` (recipe None:
    the autocast disabled): every output, input gradient and parameter along the way, then the amax histories."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    results = []
    for step, (recipe, plan) in enumerate(settings):
        x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(step), requires_grad=True)
        with lowprec.autocast(enabled=recipe is not None, recipe=recipe, plan=plan):
            y = run(x)
        y.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        results += [y.detach(), x.grad, *(p.detach().clone() for p in model.parameters())]
    return results + amax_histories(model)


def test_compiled_training_under_a_plan_equals_eager_training():
    """Under a plan every lowprec layer runs eagerly (a graph break each); a model compiled and first run without a
    plan, its high-precision layers traced into the graph, is traced again when a plan comes in force."""
    torch._dynamo.reset()
    settings = [(None, None), (CURRENT, PLAN)]
    eager_model, compiled_model = Model(), Model()
    eager = step_results(eager_model, eager_model, settings)
    compiled = step_results(compiled_model, torch.compile(compiled_model, backend="aot_eager"), settings)
    assert len(compiled) == len(eager)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)


def test_a_model_trained_under_a_plan_copies_with_each_recipes_state_and_trains_on_as_the_original():
    """``torch.save``, ``copy.deepcopy`` and ``pickle`` keep every layer's quantizers per recipe: delayed scaling's amax
    histories and NVFP4's stochastic-rounding stream (fc1's gradient), so the next step is the original's."""
    model = Model()
    step_results(model, model, [(DELAYED, PLAN)] * 2)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = [torch.load(buffer, weights_only=False), copy.deepcopy(model), pickle.loads(pickle.dumps(model))]
    for copied in copies:
        for unit, original in zip(units(copied), units(model), strict=True):
            assert list(unit._by_recipe) == list(original._by_recipe)
        for a, b in zip(amax_histories(copied), amax_histories(model), strict=True):
            assert torch.equal(a, b)
    # the original last: each step moves the recipe state on
    *got, want = [step_results(copied, copied, [(DELAYED, PLAN)]) for copied in [*copies, model]]
    for results in got:
        for a, b in zip(results, want, strict=True):
            assert torch.equal(a, b)


def test_each_expert_reads_its_operands_in_the_format_the_plan_gives_it(monkeypatch):
    """``{name}.gemm_1`` runs NVFP4, the other experts the autocast's current scaling: every GEMM of every expert reads
    both operands as ``lowprec.quantize`` casts them under its own recipe."""
    recorder = GemmRecorder(monkeypatch)
    torch.manual_seed(0)
    layer = lowprec.GroupedLinear(3, 32, 32, name="moe")
    splits = [16, 32, 16]
    x = torch.randn(sum(splits), 32, requires_grad=True)
    with lowprec.autocast(recipe=CURRENT, plan=EXPERT_PLAN):
        layer(x, splits).square().sum().backward()
    checked = set()
    for name, gemm, a, b, sources in recorder.records:
        recipe = NVFP4 if name == "moe.gemm_1" else CURRENT
        for tensor_name, (operand, orientation) in operand_views(gemm, a, b).items():
            check_operand(recipe, f"{name} {gemm} {tensor_name}", tensor_name, operand, orientation, sources[tensor_name])
        checked.add((name, gemm))
    assert checked == {(f"moe.gemm_{i}", gemm) for i in range(3) for gemm in ("fprop", "dgrad", "wgrad")}


def test_each_expert_logs_its_tokens_and_the_statistics_of_its_own_format(log_dir):
    """On the debug path each expert casts in its own format, which its statistics without a prefix describe."""
    features = {"LogFp8TensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["underflows%"]}}
    config = {"sec": {"enabled": True, "layers": {"layer_types": ["grouped_linear"]}, "transformer_engine": features}}
    debug_api.initialize(config_file=config, feature_dirs=[lowprec.FEATURE_DIR], log_dir=log_dir)
    torch.manual_seed(0)
    layer = lowprec.GroupedLinear(3, 32, 32, name="moe")
    splits = [16, 32, 16]
    x = torch.randn(sum(splits), 32) * 1e-3
    x[0] = 50.0  # an outlier that flushes small values to zero, differently in each format
    with lowprec.autocast(recipe=CURRENT, plan=EXPERT_PLAN):
        layer(x, splits).sum().backward()
    debug_api.step()
    debug_api.end_debug()
    got = {(s.layer, s.stat): s.value for s in iter_statistics(log_dir)}
    for i, rows in enumerate(x.split(splits)):
        recipe = NVFP4 if i == 1 else CURRENT
        assert got[(f"moe.gemm_{i}", "tokens")] == splits[i]
        assert got[(f"moe.gemm_{i}", "underflows%")] == pytest.approx(underflows(rows, recipe)), i
    assert got[("moe.gemm_1", "underflows%")] != pytest.approx(underflows(x.split(splits)[1], CURRENT))


@pytest.mark.parametrize("input_grad", [True, False], ids=["inner layer", "first layer"])
def test_micro_batches_reuse_both_weight_casts_and_an_evaluation_leaves_the_training_state_alone(monkeypatch, input_grad):
    """fprop (delayed scaling) and dgrad (NVFP4) read the weight in two casts: each made once a step, reused by the
    second micro-batch, made anew after the optimizer's step; the first layer (no dgrad) keeps its fprop cast too. An
    evaluation forward between the micro-batches runs the plan's MXFP8 and leaves delayed scaling's history, its scale
    and the cached training casts as they were."""
    layer = lowprec.Linear(32, 64, name="layer")
    rule = {"layers": {"exact_layer_names": ["layer"]}, "fprop": DELAYED, "dgrad": "nvfp4", "wgrad": "current", "eval": "mxfp8"}
    plan = load_plan({"rules": [rule]})
    weight_casts = []
    for cls in (DelayedScalingQuantizer, BlockQuantizer):
        original = cls.quantize

        def counted(quantizer, tensor, transpose=False, original=original):
            if tensor is layer.weight:
                weight_casts.append(quantizer.label)
            return original(quantizer, tensor, transpose)

        monkeypatch.setattr(cls, "quantize", counted)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    casts = []
    for step in range(2):
        for micro in range(2):
            x = torch.randn(32, 32, generator=torch.Generator().manual_seed(2 * step + micro), requires_grad=input_grad)
            with lowprec.autocast(recipe=CURRENT, plan=plan):
                layer(x).square().mean().backward()
            casts.append(sorted(weight_casts))
            weight_casts.clear()
            if micro == 0:
                delayed = layer.gemm_unit.quantizers(DELAYED, "layer")
                before = [(q.amax_history.clone(), q.scale.clone()) for q in delayed.values()]
                with torch.no_grad(), lowprec.autocast(recipe=CURRENT, plan=plan):
                    layer.eval()(x)
                layer.train()
                casts.append(list(weight_casts))
                weight_casts.clear()
                for (history, scale), quantizer in zip(before, delayed.values(), strict=True):
                    assert torch.equal(quantizer.amax_history, history) and torch.equal(quantizer.scale, scale)
        optimizer.step()
        optimizer.zero_grad()
    first = ["fp8_delayed_scaling", "nvfp4"] if input_grad else ["fp8_delayed_scaling"]
    assert casts == [first, ["mxfp8"], [], first, ["mxfp8"], []]
    assert layer.gemm_unit.quantizers(DELAYED, "layer")["weight"].amax_history.count_nonzero() == 2  # one amax a step


def test_a_format_change_under_a_debug_session_is_said_once_and_a_return_starts_a_fresh_history(log_dir):
    """Delayed scaling, MXFP8, delayed scaling again, MXFP8 again: back under delayed scaling the layer casts with the
    scale of an empty history (1, as at its first step), and its statistics follow each step's format."""
    features = {"LogFp8TensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["underflows%"]}}
    config = {"sec": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "transformer_engine": features}}
    debug_api.initialize(config_file=config, feature_dirs=[lowprec.FEATURE_DIR], log_dir=log_dir)
    layer = lowprec.Linear(32, 32, name="switch")
    mxfp8 = load_plan({"rules": [{"layers": {"exact_layer_names": ["switch"]}, "recipe": "mxfp8"}]})
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0)) * 1e-3
    x[0, :4] = 1.0
    delayed = []  # the layer's delayed-scaling activation quantizer after each step (None: it has none)
    for plan in (None, mxfp8, None, mxfp8):
        with lowprec.autocast(recipe=DELAYED, plan=plan):
            layer(x).sum().backward()
        delayed.append(layer.gemm_unit._by_recipe.get(DELAYED, {}).get("activation"))
        debug_api.step()
    debug_api.end_debug()
    assert delayed[0] is not delayed[2] and delayed[1] is delayed[3] is None
    assert delayed[2].amax_history.count_nonzero() == 1
    underflows_at = {s.iteration: s.value for s in iter_statistics(log_dir) if s.stat == "underflows%"}
    first_cast = DELAYED.quantizers("switch")["activation"].quantize(x).dequantize()  # an empty history's scale, 1
    assert underflows_at[0] == underflows_at[2] == pytest.approx(((first_cast == 0) & (x != 0)).sum().item() / x.numel() * 100)
    assert underflows_at[1] == underflows_at[3] == pytest.approx(underflows(x, lowprec.MXFP8BlockScaling()))
    assert underflows_at[0] > 50 > underflows_at[1]
    log = next((log_dir / "nvdlfw_inspect_logs").glob("*.log")).read_text()
    changes = "fprop DelayedScaling(amax_history_len=4) -> MXFP8BlockScaling(); dgrad"
    assert log.count(f"switch: its training GEMMs changed format ({changes}") == 1
    assert log.count("switch: its training GEMMs changed format (fprop MXFP8BlockScaling() -> DelayedScaling(") == 1
