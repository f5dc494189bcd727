"""lowprec.GroupedLinear: each expert's GEMMs equal F.linear in high precision and a lowprec.Linear of its own under
FP8 (own scales, own weight cache), each expert is the debug layer ``{name}.gemm_{i}``, and an inspected expert
logs the tokens it received, summed over the step's micro-batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lowprec
import nvdlfw_inspect.api as debug_api
from lowprec.errors import LowprecTypeError, LowprecValueError
from nvdlfw_inspect.reading import iter_statistics

IN, OUT = 32, 24
MAGNITUDES = (1e-3, 1.0, 30.0, 1e3)  # one per expert: a shared scale would flush expert 0 to zero or overflow expert 3
SPLITS = [5, 0, 7, 4]


def section(features: dict, layers: dict | None = None) -> dict:
    """One config section of ``transformer_engine`` features selecting ``layers`` (default: every layer)."""
    return {"sec": {"enabled": True, "layers": layers or {"layer_name_regex_pattern": ".*"}, "transformer_engine": features}}


def start(config: dict, log_dir) -> None:
    debug_api.initialize(config_file=config, feature_dirs=[lowprec.FEATURE_DIR], log_dir=log_dir)


def make_grouped(bias: bool = True) -> lowprec.GroupedLinear:
    torch.manual_seed(0)
    layer = lowprec.GroupedLinear(len(MAGNITUDES), IN, OUT, bias=bias, name="moe")
    with torch.no_grad():
        for i, magnitude in enumerate(MAGNITUDES):
            layer.weight[i] *= magnitude
    return layer


def inputs(splits: list[int], seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(sum(splits), IN, requires_grad=True)


def logged(log_dir) -> dict[tuple[str, str, str, int], float]:
    return {(s.layer, s.tensor, s.stat, s.iteration): s.value for s in iter_statistics(log_dir)}


def test_high_precision_equals_f_linear_per_expert():
    layer = make_grouped()
    x = inputs(SPLITS, 1)
    dy = torch.randn(sum(SPLITS), OUT)
    y = layer(x, SPLITS)
    y.backward(dy)
    weights = [layer.weight[i].detach().clone().requires_grad_() for i in range(len(SPLITS))]
    biases = [layer.bias[i].detach().clone().requires_grad_() for i in range(len(SPLITS))]
    x_ref = x.detach().clone().requires_grad_()
    ref = torch.cat([F.linear(rows, w, b) for rows, w, b in zip(x_ref.split(SPLITS), weights, biases, strict=True)])
    ref.backward(dy)
    assert torch.equal(y, ref) and torch.equal(x.grad, x_ref.grad)
    assert torch.equal(layer.weight.grad, torch.stack([w.grad for w in weights]))
    assert torch.equal(layer.bias.grad, torch.stack([b.grad for b in biases]))
    assert torch.equal(layer.weight.grad[1], torch.zeros(OUT, IN))  # the expert that got no token


@pytest.mark.parametrize("recipe", [lowprec.Float8CurrentScaling(), lowprec.DelayedScaling(amax_history_len=4)], ids=type)
def test_fp8_is_bit_exact_with_a_lowprec_linear_per_expert(recipe):
    layer = make_grouped()
    experts = []
    for i in range(len(SPLITS)):
        expert = lowprec.Linear(IN, OUT, name=f"expert{i}")
        with torch.no_grad():
            expert.weight.copy_(layer.weight[i])
            expert.bias.copy_(layer.bias[i])
        experts.append(expert)
    for step, splits in enumerate([SPLITS, [3, 6, 1, 2], SPLITS]):  # delayed scaling: histories move step by step
        x = inputs(splits, 10 + step)
        x_ref = x.detach().clone().requires_grad_()
        dy = torch.randn(sum(splits), OUT)
        with lowprec.autocast(recipe=recipe):
            y = layer(x, splits)
            ys = [expert(rows) for expert, rows in zip(experts, x_ref.split(splits), strict=True) if rows.shape[0]]
        y.backward(dy)
        torch.cat(ys).backward(dy)
        assert torch.equal(y, torch.cat(ys)) and torch.equal(x.grad, x_ref.grad)
        for i, expert in enumerate(experts):
            if splits[i]:
                assert torch.equal(layer.weight.grad[i], expert.weight.grad) and torch.equal(layer.bias.grad[i], expert.bias.grad)
            expert.zero_grad()
        layer.zero_grad()


def test_each_expert_is_cast_with_its_own_scale(log_dir):
    layer = make_grouped(bias=False)
    config = section({"LogFp8TensorStats": {"enabled": True, "tensors": ["weight"], "stats": ["scale_inv_max"]}})
    start(config, log_dir)
    splits = [4, 4, 4, 4]
    x = inputs(splits, 2)
    with lowprec.autocast(recipe=lowprec.Float8CurrentScaling()):
        y = layer(x, splits)
    debug_api.step()
    debug_api.end_debug()
    stats = logged(log_dir)
    for i, (rows, out) in enumerate(zip(x.split(splits), y.split(splits), strict=True)):
        amax = layer.weight[i].detach().abs().max().item()
        assert stats[(f"moe.gemm_{i}", "weight", "scale_inv_max", 0)] == pytest.approx(amax / 448, rel=1e-6)  # E4M3
        exact = F.linear(rows, layer.weight[i])
        assert ((out - exact).norm() / exact.norm()).item() < 0.1  # a shared scale would zero expert 0 or clip expert 3


@pytest.mark.parametrize(
    ("layers", "selected"),
    [
        ({"layer_name_regex_pattern": ".*gemm_1"}, [1]),
        ({"layer_types": ["grouped_linear"]}, [0, 1, 2, 3]),
        ({"layer_name_regex_pattern": "^moe"}, [0, 1, 2, 3]),
    ],
    ids=["one expert", "all by type", "all by name"],
)
def test_configs_select_one_expert_or_all(log_dir, layers, selected):
    layer = make_grouped()
    config = section({"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max"]}}, layers)
    start(config, log_dir)
    splits = [3, 5, 2, 6]
    x = inputs(splits, 3)
    with lowprec.autocast(recipe=lowprec.Float8CurrentScaling()):
        layer(x, splits).sum().backward()
    debug_api.step()
    debug_api.end_debug()
    expected = {}
    for i, rows in enumerate(x.detach().split(splits)):
        if i in selected:
            expected[(f"moe.gemm_{i}", "activation", "max", 0)] = rows.max().item()
            expected[(f"moe.gemm_{i}", "activation", "tokens", 0)] = splits[i]
    assert logged(log_dir) == pytest.approx(expected)


def test_tokens_are_summed_over_micro_batches_and_logged_when_the_expert_is(log_dir):
    layer = make_grouped()
    config = section({"LogTensorStats": {"enabled": True, "tensors": ["weight"], "stats": ["l1_norm"], "freq": 2}})
    start(config, log_dir)
    micro_batches = [[3, 0, 5, 2], [1, 0, 4, 6]]
    for _ in range(3):
        for splits in micro_batches:
            with lowprec.autocast(recipe=lowprec.DelayedScaling()):
                layer(inputs(splits, 4), splits).sum().backward()
        with debug_api.paused(), torch.no_grad():  # an evaluation: counts nothing
            layer(inputs([9, 9, 9, 9], 5), [9, 9, 9, 9])
        debug_api.step()
    debug_api.end_debug()
    tokens = {key: value for key, value in logged(log_dir).items() if key[2] == "tokens"}
    totals = [sum(counts) for counts in zip(*micro_batches, strict=True)]
    assert tokens == {(f"moe.gemm_{i}", "activation", "tokens", step): totals[i] for i in range(4) for step in (0, 2)}
    assert totals[1] == 0  # an expert that received nothing logs 0


def test_micro_batches_reuse_each_experts_weight_cast_until_the_weight_changes():
    layer = make_grouped()
    units = layer.gemms.units
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    casts = []
    for splits in ([2, 3, 1, 4], [1, 1, 1, 1]):
        with lowprec.autocast(recipe=lowprec.Float8CurrentScaling()):
            layer(inputs(splits, 5), splits).sum().backward()
        casts.append([unit.weight_cache._cast for unit in units])
    assert all(cast is not None for cast in casts[0])
    assert all(first is second for first, second in zip(*casts, strict=True))  # one cast per expert and step
    assert len({id(cast) for cast in casts[0]}) == len(units)
    optimizer.step()
    with lowprec.autocast(recipe=lowprec.Float8CurrentScaling()):
        layer(inputs([1, 1, 1, 1], 6), [1, 1, 1, 1])
    assert all(unit.weight_cache._cast is not cast for unit, cast in zip(units, casts[0], strict=True))


def test_shares_a_3d_parameter_and_names_its_gemms():
    weight = torch.nn.Parameter(torch.randn(3, OUT, IN))
    layer = lowprec.GroupedLinear.sharing(weight, None, "experts")
    assert layer.weight is weight and layer.bias is None
    assert [name for name, _ in layer.debug_layers()] == ["experts.gemm_0", "experts.gemm_1", "experts.gemm_2"]
    layer.set_tensor_parallel_group("group")
    assert all(unit.tp_group == "group" for unit in layer.gemms.units)
    x = torch.randn(2, 3, IN)  # leading dimensions are flattened into rows
    assert layer(x, torch.tensor([1, 4, 1])).shape == (2, 3, OUT)


@pytest.mark.parametrize(
    ("splits", "error", "match"),
    [
        ([5, 0, 7], LowprecValueError, r"4 non-negative row counts .* 16 rows, got \[5, 0, 7\]"),
        ([5, 0, 7, 5], LowprecValueError, r"adding up to the input's 16 rows"),
        ([17, -1, 0, 0], LowprecValueError, r"non-negative"),
        ([5.0, 0, 7, 4], LowprecTypeError, r"m_splits must be a list of ints"),
        (torch.tensor([5.0, 0, 7, 4]), LowprecTypeError, r"1-D integer tensor"),
    ],
)
def test_bad_m_splits_are_named(splits, error, match):
    with pytest.raises(error, match=match):
        make_grouped()(torch.randn(16, IN), splits)


def test_bad_construction_is_named():
    with pytest.raises(LowprecValueError, match="num_gemms must be a positive integer, got 0"):
        lowprec.GroupedLinear(0, IN, OUT)
    with pytest.raises(LowprecValueError, match="weight must be a 3-D tensor"):
        lowprec.GroupedLinear.sharing(torch.nn.Parameter(torch.randn(OUT, IN)), None, "x")
    with pytest.raises(LowprecValueError, match=r"last dimension must be in_features=32"):
        make_grouped()(torch.randn(16, IN + 1), SPLITS)
