"""transformer_engine LogTensorStats: every tensor of every GEMM, micro-batches, schedule, float64 references."""

from __future__ import annotations

import math

import pytest
import torch
from collecting import Collect
from debugrun import make_linear, section, start, train_step
from logreader import read_messages, read_stats
from statref import reference_stats

import lowprec
import nvdlfw_inspect.api as debug_api
from lowprec.debug.features.api import EveryIteration
from lowprec.debug.features.log_tensor_stats import schedule
from lowprec.debug.schedule import every_iteration_from, next_enabled_iter
from nvdlfw_inspect.errors import ConfigError

ALL_STATS = ["min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range"]
ALL_TENSORS = ["activation", "weight", "gradient", "output", "wgrad", "dgrad"]


def stats_config(**keys) -> dict:
    feature = {"enabled": True, "tensors": ALL_TENSORS, "stats": ALL_STATS}
    feature.update(keys)
    return section({"LogTensorStats": feature})


def assert_stats(values: dict, layer: str, tensor: str, t: torch.Tensor, iteration: int = 0) -> None:
    for stat, want in reference_stats(t).items():
        assert values[(f"{layer}_{tensor}_{stat}", iteration)] == pytest.approx(want, rel=1e-5, abs=1e-6), (tensor, stat)


def test_every_tensor_of_an_fp8_linear(log_dir):
    collect = Collect()
    start(stats_config(), log_dir, statistics_logger=collect)
    layer = make_linear()
    x, dy = torch.randn(8, 32), torch.randn(8, 24)
    y, dx, dw = train_step(layer, x, dy)
    debug_api.step()
    assert_stats(collect.values, "lin", "activation", x)
    assert_stats(collect.values, "lin", "weight", layer.weight)
    assert_stats(collect.values, "lin", "gradient", dy)
    assert_stats(collect.values, "lin", "output", y)
    assert_stats(collect.values, "lin", "dgrad", dx)
    assert_stats(collect.values, "lin", "wgrad", dw)
    assert len(collect.values) == len(ALL_TENSORS) * len(ALL_STATS)


def test_micro_batches_accumulate_but_weights_count_once(log_dir):
    collect = Collect()
    start(
        stats_config(tensors=["activation", "weight", "gradient"], stats=["mean", "std", "l1_norm"]),
        log_dir,
        statistics_logger=collect,
    )
    layer = make_linear()
    xs = [torch.randn(8, 32) + i for i in range(3)]
    dys = [torch.randn(8, 24) * (i + 1) for i in range(3)]
    for x, dy in zip(xs, dys, strict=True):
        train_step(layer, x, dy)
    debug_api.step()
    for stat in ("mean", "std", "l1_norm"):
        assert collect.values[(f"lin_activation_{stat}", 0)] == pytest.approx(
            reference_stats(torch.cat(xs))[stat], rel=1e-6, abs=1e-8
        )
        assert collect.values[(f"lin_gradient_{stat}", 0)] == pytest.approx(
            reference_stats(torch.cat(dys))[stat], rel=1e-6, abs=1e-8
        )
        assert collect.values[(f"lin_weight_{stat}", 0)] == pytest.approx(reference_stats(layer.weight)[stat], rel=1e-6, abs=1e-8)


def test_file_log_and_once_only_message(log_dir):
    start(stats_config(tensors=["activation"], stats=["max"]), log_dir)
    layer = make_linear()
    for _ in range(3):
        train_step(layer, torch.ones(2, 32), torch.ones(2, 24), fp8=False)
        debug_api.step()
    debug_api.end_debug()
    assert read_stats(log_dir) == {("lin_activation_max", i): 1.0 for i in range(3)}
    messages = [m for _, m in read_messages(log_dir)]
    assert messages.count("LAYER=lin: Feature=LogTensorStats, API=look_at_tensor_before_process: activation") == 1


@pytest.mark.parametrize(
    ("window", "iterations", "asked_at"),
    [
        ({"freq": 2, "start_step": 1, "end_step": 5}, {2, 4}, {0, 2, 4}),
        ({"start_end_list": [[0, 1], [4, 4]]}, {0, 1, 4}, {0, 1, 4}),  # closed windows
        ({"start_step": 3}, {3, 4, 5, 6, 7}, {0, 3}),  # from 3 on: answered once for every iteration
        ({"end_step": -1, "freq": 4}, {0, 4}, {0, 4}),
    ],
)
def test_schedule_and_the_layer_sleeps_in_between(log_dir, window, iterations, asked_at, monkeypatch):
    import lowprec.debug.plan as plan

    asked = []  # the iterations at which the layer asked a routing question (normalizing its answer)
    original = plan.normalize_answer
    monkeypatch.setattr(plan, "normalize_answer", lambda answer, it: asked.append(it) or original(answer, it))
    import lowprec.modules.gemm_unit as gemm_unit

    debug_path = set()  # the iterations at which the layer took its debug path (not its plain one)
    processing = gemm_unit.DebugProcessing
    monkeypatch.setattr(
        gemm_unit,
        "DebugProcessing",
        lambda *args, **kwargs: debug_path.add(debug_api.DEBUG_MANAGER._trainer_iteration_count) or processing(*args, **kwargs),
    )
    start(stats_config(tensors=["activation"], stats=["mean"], **window), log_dir)
    layer = make_linear()
    for _ in range(8):
        train_step(layer, torch.randn(2, 32), torch.randn(2, 24))
        debug_api.step()
    debug_api.end_debug()
    assert {it for name, it in read_stats(log_dir)} == iterations
    assert set(asked) == asked_at  # routing questions only when something is due
    assert debug_path == iterations  # a plan lapses after the iteration its answers were for


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((1, None, None, 3, 0), (False, 3)),
        ((1, None, None, 3, 2), (False, 3)),
        ((1, None, None, 3, 3), (True, 6)),
        ((None, None, [[0, 2], [5, 6]], 2, 2), (True, 6)),
        ((None, None, [[0, 2], [5, 6]], 2, 6), (True, None)),
        ((0, 4, None, 1, 4), (True, None)),
        ((0, -1, None, 1, 9), (True, 10)),  # -1: no end
    ],
)
def test_next_enabled_iter(args, expected):
    assert next_enabled_iter(*args) == expected


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((None, None, None, 1, 0), True),  # no window keys: every iteration
        ((3, None, None, 1, 2), False),  # not yet
        ((3, -1, None, 1, 3), True),
        ((0, 9, None, 1, 4), False),  # the window ends
        ((0, None, None, 2, 4), False),  # every other iteration
        ((None, None, [[0, 2], [5, -1]], 1, 6), True),  # in the window with no end
        ((None, None, [[0, 2], [5, -1]], 1, 1), False),
    ],
)
def test_every_iteration_from(args, expected):
    assert every_iteration_from(*args) is expected
    runs, upcoming = next_enabled_iter(*args)
    if expected:  # the same answer as the schedule's, for this iteration and every later one
        assert all(next_enabled_iter(*args[:4], it) == (True, it + 1) for it in range(args[4], args[4] + 50))
    start_step, end_step, windows, freq, iteration = args
    config = {"start_step": start_step, "end_step": end_step, "start_end_list": windows, "freq": freq}
    answer = schedule({k: v for k, v in config.items() if v is not None}, iteration)
    assert answer == (runs, upcoming) and isinstance(answer, EveryIteration) is expected


def test_stats_of_a_transformer_layer_by_type(log_dir):
    """layer_types: [layernorm_linear] selects the QKV projection whose name is ...layernorm_qkv."""
    collect = Collect()
    config = section(
        {"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["std"]}}, {"layer_types": ["layernorm_linear"]}
    )
    start(config, log_dir, statistics_logger=collect)
    layer = lowprec.TransformerLayer(32, 32, 4, name="tl", hidden_dropout=0.0, attention_dropout=0.0)
    captured = []
    layer.self_attention.layernorm_qkv.norm.register_forward_hook(lambda _m, _a, out: captured.append(out.detach()))
    with lowprec.fp8_autocast():
        layer(torch.randn(5, 2, 32)).sum().backward()
    debug_api.step()
    assert list(collect.values) == [("tl.self_attention.layernorm_qkv_activation_std", 0)]
    expected = reference_stats(captured[0])["std"]
    assert collect.values[("tl.self_attention.layernorm_qkv_activation_std", 0)] == pytest.approx(expected, rel=1e-6)


def test_debug_path_without_fp8_keeps_exact_gradients(log_dir):
    start(stats_config(tensors=["activation", "gradient"], stats=["max"]), log_dir)
    layer = make_linear()
    x, dy = torch.randn(4, 32), torch.randn(4, 24)
    y, dx, dw = train_step(layer, x, dy, fp8=False)
    ref = torch.nn.Linear(32, 24)
    ref.load_state_dict({"weight": layer.weight.detach(), "bias": layer.bias.detach()})
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref)
    y_ref.backward(dy)
    assert torch.allclose(y, y_ref, atol=1e-6) and torch.allclose(dx, x_ref.grad, atol=1e-6)
    assert torch.allclose(dw, ref.weight.grad, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_tensors_log_the_statistics_of_their_float32_values(log_dir, dtype):
    """A float8 tensor given to the namespace's API (torch reduces none) is logged as its exact float32 upcast."""
    collect = Collect()
    blockwise = {"max_blockwise_dynamic_range": {"block_size": 4, "dims": 1}}
    start(stats_config(tensors=["gradient"], stats=[*ALL_STATS, blockwise]), log_dir, statistics_logger=collect)
    t = (torch.randn(16, 40, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
    assert (
        debug_api.transformer_engine.inspect_tensor(
            layer_name="lin", tensor_name="gradient", tensor=t, iteration=0, tp_group=None
        )
        is None
    )
    debug_api.step()
    assert_stats(collect.values, "lin", "gradient", t.float())
    name = "lin_gradient_max_blockwise_dynamic_range_block_size_4_dims_1"
    assert collect.values[(name, 0)] == pytest.approx(block_range_ref(t.float(), 4, 1), rel=1e-5)


def block_range_ref(t: torch.Tensor, block: int, dims: int) -> float:
    """Max over blocks of log2(max|x|) - log2(min non-zero |x|), block by block in Python (float64)."""
    x = t.double().reshape(-1, t.shape[-1])
    rows, cols = x.shape
    best = 0.0
    tiles = (
        [x[r, c : c + block] for r in range(rows) for c in range(0, cols, block)]
        if dims == 1
        else [x[r : r + block, c : c + block] for r in range(0, rows, block) for c in range(0, cols, block)]
    )
    for tile in tiles:
        nonzero = tile.abs()[tile != 0]
        if nonzero.numel():
            best = max(best, math.log2(nonzero.max().item()) - math.log2(nonzero.min().item()))
    return best


@pytest.mark.parametrize(("block", "dims"), [(4, 1), (32, 1), (8, 2), (5, 1)])
def test_max_blockwise_dynamic_range(log_dir, block, dims):
    collect = Collect()
    entry = {"max_blockwise_dynamic_range": {"block_size": block, "dims": dims}}
    start(stats_config(tensors=["activation", "gradient"], stats=["max", entry]), log_dir, statistics_logger=collect)
    layer = make_linear(in_f=40, out_f=24)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 40, generator=g) * torch.exp(torch.randn(16, 40, generator=g) * 2)
    x[0, :8] = 0.0  # an all-zero block counts as range 0
    dy = torch.randn(16, 24, generator=g)
    train_step(layer, x, dy)
    debug_api.step()
    name = f"max_blockwise_dynamic_range_block_size_{block}_dims_{dims}"
    both = max(block_range_ref(x, block, dims), block_range_ref(x.t(), block, dims))  # activation: both orientations
    assert collect.values[(f"lin_activation_{name}_max_over_orientations", 0)] == pytest.approx(both, rel=1e-5)
    assert collect.values[(f"lin_gradient_{name}", 0)] == pytest.approx(block_range_ref(dy, block, dims), rel=1e-5)
    assert collect.values[("lin_activation_max", 0)] == pytest.approx(x.max().item())


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"max_blockwise_dynamic_range": {"block_size": 0}}, r"stats\.1\.max_blockwise_dynamic_range\.block_size'.*positive"),
        ({"max_blockwise_dynamic_range": {"dims": 3}}, r"max_blockwise_dynamic_range\.dims'.*1 or 2"),
        ({"max_blockwise_dynamic_range": {"size": 4}}, r"max_blockwise_dynamic_range\.size'.*unknown option"),
        ({"max_blockwise_dynamic_range": 4}, r"stats\.1\.max_blockwise_dynamic_range'.*mapping"),
        ({"other": {}}, r"stats\.1'.*unsupported statistic"),
        ("median", r"stats\.1'.*unsupported statistic"),
    ],
)
def test_blockwise_config_errors(log_dir, entry, message):
    with pytest.raises(ConfigError, match=message):
        start(stats_config(stats=["max", entry]), log_dir)


def test_the_num_zeros_family_counts_over_micro_batches_and_weights_once(log_dir):
    """``num_zeros`` (exact zeros), ``num_zeros[T]`` (|x| <= T) and their shares, in the transformer_engine namespace."""
    collect = Collect()
    stats = ["num_zeros", "num_zeros%", "num_zeros[0.5]", "num_zeros[0.5]%", "max"]
    start(stats_config(tensors=["activation", "weight"], stats=stats), log_dir, statistics_logger=collect)
    layer = make_linear()
    with torch.no_grad():
        layer.weight[:4] = 0.0  # 4 rows of 32 exact zeros
    xs = [torch.randn(8, 32, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    xs[0][:, :5] = 0.0
    xs[1][0, 0] = -0.0
    for x in xs:
        train_step(layer, x, torch.randn(8, 24))
    debug_api.step()
    x, w = torch.cat(xs), layer.weight.detach()
    for name, t in (("activation", x), ("weight", w)):  # the weight once, though two micro-batches fed it
        assert collect.values[(f"lin_{name}_num_zeros", 0)] == float((t == 0).sum())
        assert collect.values[(f"lin_{name}_num_zeros%", 0)] == pytest.approx(100 * float((t == 0).sum()) / t.numel())
        assert collect.values[(f"lin_{name}_num_zeros[0.5]", 0)] == float((t.abs() <= 0.5).sum())
        assert collect.values[(f"lin_{name}_num_zeros[0.5]%", 0)] == pytest.approx(
            100 * float((t.abs() <= 0.5).sum()) / t.numel()
        )
    assert collect.values[("lin_activation_num_zeros", 0)] == 8 * 5 + 1
    assert collect.values[("lin_weight_num_zeros", 0)] == 4 * 32


@pytest.mark.parametrize("entry", ["num_zeros[abc]%", "num_zeros[-1]", "num_zeros[nan]", "num_zeros[inf]%", "num_zeros[]"])
def test_a_malformed_num_zeros_threshold_is_a_config_error(log_dir, entry):
    with pytest.raises(ConfigError) as info:
        start(stats_config(tensors=["activation"], stats=["max", entry]), log_dir)
    message = str(info.value)
    assert message.startswith("config dict: key 'sec.transformer_engine.LogTensorStats.stats.1': unsupported statistic: ")
    assert f"the threshold of {entry!r} must be a finite number >= 0, such as 1e-10" in message
    assert "'num_zeros', 'num_zeros%', 'num_zeros[T]', 'num_zeros[T]%'" in message
