"""The base ``LogTensorStats`` end to end: config, schedule, numbers in the statistics log, errors."""

from __future__ import annotations

import gc
import math
import weakref

import numpy
import pytest
import torch
from logreader import read_messages, read_stats, stats_log_path
from statref import SIX, reference_stats

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.errors import ConfigError
from nvdlfw_inspect.logging import BaseLogger

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FILE_TOL = 5.1e-5  # the statistics file keeps 4 decimals
REL = 2e-6  # sums accumulate in float32


def config(**feature) -> dict:
    body = {"enabled": True, "tensors": ["activation"], "stats": list(SIX)}
    body.update(feature)
    return {"block": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "LogTensorStats": body}}


def struct_config(items: list[dict], **feature) -> dict:
    cfg = config(tensors_struct=items, **feature)
    body = cfg["block"]["LogTensorStats"]
    del body["tensors"]
    if "stats" not in feature:
        del body["stats"]
    return cfg


def expected(x: torch.Tensor, names=SIX) -> dict[str, float]:
    return reference_stats(x, tuple(names))


def torch_reductions(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the reference returns for each statistic (before ``.float()``)."""
    return {
        "min": t.min(),
        "max": t.max(),
        "mean": t.mean(),
        "std": t.std(),
        "l1_norm": torch.norm(t, p=1),
        "l2_norm": torch.norm(t, p=2),
    }


def tensor_for(step: int, n: int = 64, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(n, generator=torch.Generator().manual_seed(step)) + step).to(dtype)


def run_steps(steps: int, layer: str = "l1", tensor_name: str = "activation", **kwargs) -> list[torch.Tensor]:
    tensors = []
    for step in range(steps):
        t = tensor_for(step)
        debug_api.log_tensor_stats(layer_name=layer, tensor=t, tensor_name=tensor_name, **kwargs)
        debug_api.step()
        tensors.append(t)
    return tensors


def logged_iterations(log_dir, name: str = "l1_activation_mean") -> set[int]:
    return {it for stat, it in read_stats(log_dir) if stat == name}


class Collect(BaseLogger):
    def __init__(self):
        self.rows: list[tuple[str, float, int]] = []

    def log_scalar(self, name, value, iteration):
        self.rows.append((name, value, iteration))


# --- numbers ------------------------------------------------------------------------------


def test_logged_values_match_float64_statistics(log_dir):
    debug_api.initialize(config_file=config(), log_dir=log_dir)
    tensors = run_steps(3)
    stats = read_stats(log_dir)
    assert set(stats) == {(f"l1_activation_{stat}", it) for stat in SIX for it in range(3)}
    for it, t in enumerate(tensors):
        for stat, value in expected(t).items():
            assert stats[(f"l1_activation_{stat}", it)] == pytest.approx(value, abs=FILE_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_stat_for_every_dtype_in_file_return_value_and_custom_logger(log_dir, dtype):
    collect = Collect()
    debug_api.initialize(config_file=config(), statistics_logger=collect, log_dir=log_dir, default_logging_enabled=True)
    t = (torch.randn(3, 333, generator=torch.Generator().manual_seed(11)) * 2.5 - 0.75).to(dtype)
    ref = expected(t)
    out = debug_api.log_tensor_stats(layer_name="model.fc1", tensor=t, tensor_name="activation")
    # returned: float32 tensors, torch's own reductions of the tensor (in its dtype, as the reference)
    assert set(out) == set(SIX)
    for stat in SIX:
        assert out[stat].dtype == torch.float32 and out[stat].dim() == 0
        assert torch.equal(out[stat], torch_reductions(t)[stat].float()), stat
    assert collect.rows == []  # logged when the step ends
    debug_api.step()
    # custom logger: float64 values (float32 accumulation), named {layer}_{tensor}_{stat}
    assert sorted(name for name, _, _ in collect.rows) == sorted(f"model.fc1_activation_{s}" for s in SIX)
    got = {name.removeprefix("model.fc1_activation_"): value for name, value, _ in collect.rows}
    for stat in SIX:
        assert got[stat] == pytest.approx(ref[stat], rel=REL), stat
    assert {it for _, _, it in collect.rows} == {0}
    # the file (default logging kept on) holds the same numbers to 4 decimals
    stats = read_stats(log_dir)
    for stat in SIX:
        assert stats[(f"model.fc1_activation_{stat}", 0)] == pytest.approx(ref[stat], abs=FILE_TOL, rel=REL), stat


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_tensors_return_and_log_the_statistics_of_their_float32_values(log_dir, dtype):
    """torch reduces no float8 tensor: reading a returned statistic raised ``"min_all" not implemented for
    'Float8_e4m3fn'`` into the caller, although the logged ones were right. Both are now those of the float32
    upcast, which is exact."""
    collect = Collect()
    debug_api.initialize(config_file=config(), statistics_logger=collect, log_dir=log_dir)
    t = (torch.randn(3, 333, generator=torch.Generator().manual_seed(11)) * 2.5 - 0.75).to(dtype)
    upcast = t.float()
    out = debug_api.log_tensor_stats(layer_name="model.fc1", tensor=t, tensor_name="activation")
    assert set(out) == set(SIX) and repr(out).startswith("{'min': tensor(")  # every value read
    for stat in SIX:
        assert torch.equal(out[stat], torch_reductions(upcast)[stat]), stat
    debug_api.step()
    got = {name.removeprefix("model.fc1_activation_"): value for name, value, _ in collect.rows}
    for stat, want in expected(upcast).items():
        assert got[stat] == pytest.approx(want, rel=REL), stat


def test_std_is_unbiased_and_norms_are_exact(log_dir):
    collect = Collect()
    debug_api.initialize(config_file=config(), statistics_logger=collect, log_dir=log_dir)
    out = debug_api.log_tensor_stats(layer_name="l1", tensor=torch.tensor([1.0, 2.0, 3.0, 4.0]), tensor_name="activation")
    assert out["std"].item() == pytest.approx(math.sqrt(5 / 3), rel=1e-7)
    debug_api.step()
    values = {name: value for name, value, _ in collect.rows}
    assert values["l1_activation_std"] == pytest.approx(math.sqrt(5 / 3), rel=1e-15)
    assert values["l1_activation_l1_norm"] == 10.0
    assert values["l1_activation_l2_norm"] == pytest.approx(math.sqrt(30.0), rel=1e-15)
    assert values["l1_activation_mean"] == 2.5
    assert values["l1_activation_min"] == 1.0 and values["l1_activation_max"] == 4.0


def test_large_mean_small_spread(log_dir):
    collect = Collect()
    debug_api.initialize(config_file=config(stats=["std", "mean"]), statistics_logger=collect, log_dir=log_dir)
    t = (1000.0 + torch.randn(50_000, generator=torch.Generator().manual_seed(1))).float()
    debug_api.log_tensor_stats(layer_name="l1", tensor=t, tensor_name="activation")
    debug_api.step()
    values = {name: value for name, value, _ in collect.rows}
    assert values["l1_activation_std"] == pytest.approx(t.double().std().item(), rel=1e-6)


def test_stat_names_are_case_insensitive_and_logged_in_lower_case(log_dir):
    debug_api.initialize(config_file=config(stats=["MEAN", "Max"]), log_dir=log_dir)
    out = debug_api.log_tensor_stats(layer_name="l1", tensor=torch.arange(4.0), tensor_name="activation")
    assert set(out) == {"mean", "max"}
    debug_api.end_debug()
    assert read_stats(log_dir) == {("l1_activation_mean", 0): 1.5, ("l1_activation_max", 0): 3.0}


def test_empty_and_non_finite_tensors_are_logged_not_raised(log_dir):
    debug_api.initialize(config_file=config(), log_dir=log_dir)
    out = debug_api.log_tensor_stats(layer_name="l0", tensor=torch.empty(0), tensor_name="activation")
    for stat in ("min", "max", "mean", "std"):
        assert math.isnan(out[stat].item()), stat
    assert out["l1_norm"].item() == 0.0 and out["l2_norm"].item() == 0.0
    out = debug_api.log_tensor_stats(
        layer_name="l1", tensor=torch.tensor([1.0, float("inf"), float("nan")]), tensor_name="activation"
    )
    assert all(math.isnan(out[s].item()) for s in SIX)
    out = debug_api.log_tensor_stats(layer_name="l2", tensor=torch.tensor([1.0, float("inf")]), tensor_name="activation")
    assert out["max"].item() == math.inf and out["l1_norm"].item() == math.inf and out["l2_norm"].item() == math.inf
    assert out["min"].item() == 1.0 and math.isnan(out["std"].item())
    out = debug_api.log_tensor_stats(
        layer_name="l3", tensor=torch.tensor([-float("inf"), 2.0], dtype=torch.bfloat16), tensor_name="activation"
    )
    assert out["min"].item() == -math.inf and out["mean"].item() == -math.inf
    debug_api.end_debug()
    stats = read_stats(log_dir)  # "nan" and "inf" parse back
    assert math.isnan(stats[("l0_activation_mean", 0)]) and stats[("l0_activation_l2_norm", 0)] == 0.0
    assert stats[("l2_activation_max", 0)] == math.inf and stats[("l3_activation_min", 0)] == -math.inf


def test_layers_and_tensors_get_their_own_names(log_dir):
    cfg = config(tensors=["activation", "gradient"], stats=["max"])
    debug_api.initialize(config_file=cfg, log_dir=log_dir)
    for i, layer in enumerate(("model.layers.0.fc1", "model.layers.1.fc1")):
        for j, name in enumerate(("activation", "gradient")):
            debug_api.log_tensor_stats(layer_name=layer, tensor=torch.tensor([float(10 * i + j)]), tensor_name=name)
    debug_api.end_debug()
    assert read_stats(log_dir) == {
        ("model.layers.0.fc1_activation_max", 0): 0.0,
        ("model.layers.0.fc1_gradient_max", 0): 1.0,
        ("model.layers.1.fc1_activation_max", 0): 10.0,
        ("model.layers.1.fc1_gradient_max", 0): 11.0,
    }


def test_config_from_a_yaml_file(log_dir, tmp_path):
    path = tmp_path / "stats.yaml"
    path.write_text(
        "block:\n  enabled: True\n  layers:\n    layer_name_regex_pattern: .*\n  LogTensorStats:\n"
        "    enabled: True\n    tensors: [activation]\n    stats: [min, l1_norm]\n    freq: 2\n"
    )
    debug_api.initialize(config_file=str(path), log_dir=log_dir)
    tensors = run_steps(4)
    debug_api.end_debug()
    stats = read_stats(log_dir)
    assert {key[1] for key in stats} == {0, 2}
    for it in (0, 2):
        ref = expected(tensors[it], ("min", "l1_norm"))
        assert stats[("l1_activation_min", it)] == pytest.approx(ref["min"], abs=FILE_TOL)
        assert stats[("l1_activation_l1_norm", it)] == pytest.approx(ref["l1_norm"], abs=FILE_TOL)


# --- schedule -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("window", "iterations"),
    [
        ({}, set(range(10))),
        ({"freq": 1}, set(range(10))),
        ({"freq": 3}, {0, 3, 6, 9}),
        ({"start_step": 4}, {4, 5, 6, 7, 8, 9}),
        ({"end_step": 3}, {0, 1, 2, 3}),  # closed window
        ({"start_step": 2, "end_step": 5}, {2, 3, 4, 5}),  # closed window
        ({"start_step": 5, "end_step": 5}, {5}),
        ({"start_step": 1, "freq": 3}, {3, 6, 9}),  # absolute phase
        ({"start_step": 2, "end_step": 8, "freq": 4}, {4, 8}),
        ({"start_end_list": [[0, 2], [6, 8]]}, {0, 1, 6, 7}),  # half-open windows
        ({"start_end_list": [[0, 2], [2, 4]]}, {0, 1, 2, 3}),  # adjacent half-open windows do not overlap
        ({"start_end_list": [[3, 4]]}, {3}),
        ({"start_end_list": [[5, -1]], "start_step": 0, "end_step": 1}, {5, 6, 7, 8, 9}),  # overrides start/end
        ({"start_end_list": [[1, 3]], "start_step": 7}, {1, 2}),  # overrides start/end
        ({"start_end_list": [[0, 9]], "freq": 4}, {0, 4, 8}),
        ({"end_step": -1, "freq": 5}, {0, 5}),
        ({"start_step": 20}, set()),
    ],
)
def test_schedule(log_dir, window, iterations):
    debug_api.initialize(config_file=config(**window), log_dir=log_dir)
    returned = []
    for step in range(10):
        out = debug_api.log_tensor_stats(layer_name="l1", tensor=tensor_for(step), tensor_name="activation")
        returned.append(bool(out))
        debug_api.step()
    debug_api.end_debug()
    assert {i for i, was_logged in enumerate(returned) if was_logged} == iterations  # {} when not due
    if iterations:
        assert logged_iterations(log_dir) == iterations
    else:
        assert read_stats(log_dir) == {}


def test_iteration_kwarg_overrides_the_counter(log_dir):
    debug_api.initialize(config_file=config(freq=10), log_dir=log_dir)
    t = torch.ones(4)
    assert debug_api.log_tensor_stats(layer_name="l1", tensor=t, tensor_name="activation", iteration=20)
    assert debug_api.log_tensor_stats(layer_name="l1", tensor=t, tensor_name="activation", iteration=21) == {}
    debug_api.step()
    debug_api.step()  # the counter is independent of the kwarg
    assert debug_api.DEBUG_MANAGER._trainer_iteration_count == 2
    assert debug_api.log_tensor_stats(layer_name="l1", tensor=t, tensor_name="activation", iteration=30)
    assert debug_api.log_tensor_stats(layer_name="l1", tensor=t, tensor_name="activation") == {}  # counter at 2
    debug_api.step()
    assert logged_iterations(log_dir) == {20, 30}


def test_iteration_kwarg_with_windows(log_dir):
    debug_api.initialize(config_file=config(start_end_list=[[100, 102]]), log_dir=log_dir)
    for it in (99, 100, 101, 102):
        debug_api.log_tensor_stats(layer_name="l1", tensor=torch.ones(2), tensor_name="activation", iteration=it)
    debug_api.step()  # one step may carry several iterations: each is logged under its own
    assert logged_iterations(log_dir) == {100, 101}


def test_init_training_step_starts_the_counter(log_dir):
    debug_api.initialize(config_file=config(freq=2), log_dir=log_dir, init_training_step=7)
    assert debug_api.DEBUG_MANAGER._trainer_iteration_count == 7
    tensors = run_steps(3)  # iterations 7, 8, 9
    assert logged_iterations(log_dir) == {8}
    assert read_stats(log_dir)[("l1_activation_max", 8)] == pytest.approx(tensors[1].max().item(), abs=FILE_TOL)


def test_init_training_step_with_end_step(log_dir):
    debug_api.initialize(config_file=config(start_step=4, end_step=6), log_dir=log_dir, init_training_step=5)
    run_steps(4)  # iterations 5, 6, 7, 8
    assert logged_iterations(log_dir) == {5, 6}


def test_initialize_training_step_moves_the_counter(log_dir):
    debug_api.initialize(config_file=config(start_end_list=[[50, 52]]), log_dir=log_dir)
    run_steps(2)
    debug_api.initialize_training_step(50)
    run_steps(3)  # iterations 50, 51, 52
    assert logged_iterations(log_dir) == {50, 51}


# --- tensor selection ---------------------------------------------------------------------


def test_tensors_struct_gives_each_tensor_its_stats_and_window(log_dir):
    cfg = struct_config(
        [
            {"tensor": "activation", "stats": ["max"]},
            {"tensor": "gradient", "stats": ["min", "l1_norm"], "freq": 2},
            {"tensor": "weight", "stats": ["mean"], "start_end_list": [[1, 3]]},
        ]
    )
    debug_api.initialize(config_file=cfg, log_dir=log_dir)
    for _ in range(4):
        for name in ("activation", "gradient", "weight", "output"):
            debug_api.log_tensor_stats(layer_name="l1", tensor=torch.arange(5.0), tensor_name=name)
        debug_api.step()
    stats = read_stats(log_dir)
    assert {name for name, _ in stats} == {"l1_activation_max", "l1_gradient_min", "l1_gradient_l1_norm", "l1_weight_mean"}
    assert logged_iterations(log_dir, "l1_activation_max") == {0, 1, 2, 3}
    assert logged_iterations(log_dir, "l1_gradient_min") == {0, 2}
    assert logged_iterations(log_dir, "l1_gradient_l1_norm") == {0, 2}
    assert logged_iterations(log_dir, "l1_weight_mean") == {1, 2}
    assert stats[("l1_gradient_l1_norm", 2)] == 10.0 and stats[("l1_activation_max", 3)] == 4.0
    assert stats[("l1_weight_mean", 1)] == 2.0


def test_tensors_struct_items_inherit_and_override_feature_level_keys(log_dir):
    cfg = struct_config(
        [
            {"tensor": "activation"},  # stats and freq from the feature level
            {"tensor": "gradient", "stats": ["min"], "freq": 1},  # both overridden
            {"tensor": "weight", "start_end_list": [[1, 2]]},  # windows override the inherited freq phase
        ],
        stats=["max"],
        freq=2,
        start_step=2,
    )
    debug_api.initialize(config_file=cfg, log_dir=log_dir)
    for _ in range(5):
        for name in ("activation", "gradient", "weight"):
            debug_api.log_tensor_stats(layer_name="l1", tensor=torch.arange(3.0), tensor_name=name)
        debug_api.step()
    stats = read_stats(log_dir)
    assert {name for name, _ in stats} == {"l1_activation_max", "l1_gradient_min"}  # weight: freq 2 never hits [1, 2)
    assert logged_iterations(log_dir, "l1_activation_max") == {2, 4}
    assert logged_iterations(log_dir, "l1_gradient_min") == {2, 3, 4}


def test_unselected_tensor_or_layer_logs_nothing(log_dir):
    cfg = config()
    cfg["block"]["layers"] = {"layer_types": ["fc1"]}
    debug_api.initialize(config_file=cfg, log_dir=log_dir)
    for _ in range(2):
        assert debug_api.log_tensor_stats(layer_name="fc2", tensor=torch.ones(3), tensor_name="activation") == {}
        assert debug_api.log_tensor_stats(layer_name="fc1", tensor=torch.ones(3), tensor_name="weight") == {}
        assert debug_api.log_tensor_stats(layer_name="fc1", tensor=torch.ones(3), tensor_name="Activation") == {}
        debug_api.step()
    debug_api.end_debug()
    assert read_stats(log_dir) == {}
    assert not any(m.endswith(": Called") for _, m in read_messages(log_dir))


def test_a_tensor_name_no_feature_of_the_layer_selects_is_said_once_per_layer_and_name(log_dir, recwarn):
    """``activations`` for ``activation`` would return {} every step: said once, with the names the layer's
    config selects. A layer no section selects, or a name the config selects for other layers only (``output``
    below), is the config's choice: nothing is said for it."""
    cfg = struct_config([{"tensor": "activation", "stats": ["max"]}, {"tensor": "gradient", "stats": ["min"]}])
    cfg["block"]["layers"] = {"layer_types": ["fc1"]}
    cfg["head"] = {
        "enabled": True,
        "layers": {"exact_layer_names": ["head"]},
        "LogTensorStats": config()["block"]["LogTensorStats"],
    }
    cfg["head"]["LogTensorStats"]["tensors"] = ["output"]
    debug_api.initialize(config_file=cfg, log_dir=log_dir)
    calls = [("fc1", "activations"), ("model.fc1", "activations"), ("fc1", "weight"), ("fc2", "activations"), ("fc1", "output")]
    for _ in range(3):
        for layer, name in calls:
            assert debug_api.log_tensor_stats(layer_name=layer, tensor=torch.ones(3), tensor_name=name) == {}
        assert debug_api.log_tensor_stats(layer_name="fc1", tensor=torch.ones(3), tensor_name="activation")
        debug_api.step()
    debug_api.end_debug()
    selects = (
        "logs nothing: no section of the config selects that tensor name; the layer's feature LogTensorStats selects "
        "the tensors ['activation', 'gradient']"
    )
    said = [
        f"layer 'fc1': debug_api.log_tensor_stats(tensor_name='activations') {selects}; did you mean 'activation'?",
        f"layer 'model.fc1': debug_api.log_tensor_stats(tensor_name='activations') {selects}; did you mean 'activation'?",
        f"layer 'fc1': debug_api.log_tensor_stats(tensor_name='weight') {selects}",
    ]
    assert [str(w.message) for w in recwarn if "logs nothing" in str(w.message)] == said
    assert [m for level, m in read_messages(log_dir) if "logs nothing" in m and level == "WARNING"] == said
    assert logged_iterations(log_dir, "fc1_activation_max") == {0, 1, 2}


def test_disabled_feature_logs_nothing(log_dir):
    debug_api.initialize(config_file=config(enabled=False), log_dir=log_dir)
    assert debug_api.log_tensor_stats(layer_name="l1", tensor=torch.ones(3), tensor_name="activation") == {}
    debug_api.end_debug()
    assert not stats_log_path(log_dir).exists() or read_stats(log_dir) == {}


def test_missing_tensor_kwargs_are_type_errors(log_dir):
    debug_api.initialize(config_file=config(), log_dir=log_dir)
    with pytest.raises(TypeError, match="tensor_name"):
        debug_api.log_tensor_stats(layer_name="l1", tensor=torch.ones(2))
    with pytest.raises(TypeError, match="'tensor'"):
        debug_api.log_tensor_stats(layer_name="l1", tensor_name="activation")


def test_skip_reduction_is_accepted_in_a_single_process(log_dir):
    debug_api.initialize(config_file=config(stats=["mean"]), log_dir=log_dir)
    out = debug_api.log_tensor_stats(layer_name="l1", tensor=torch.arange(3.0), tensor_name="activation", skip_reduction=True)
    assert out["mean"].item() == 1.0


# --- returned values ----------------------------------------------------------------------


def test_returned_values_equal_torch_reductions_as_the_reference_asserts(log_dir):
    debug_api.initialize(config_file=config(), log_dir=log_dir)
    t = torch.rand((100, 100, 5), generator=torch.Generator().manual_seed(3))
    out = debug_api.log_tensor_stats("decoder.1.mlp.fc1", tensor=t, tensor_name="activation")
    assert out["mean"] == t.mean() and out["max"] == t.max() and out["std"] == t.std()
    assert out["l1_norm"] == torch.norm(t, p=1) and out["l2_norm"] == torch.norm(t, p=2)


def test_returned_values_describe_the_tensor_as_passed_after_an_in_place_change(log_dir):
    debug_api.initialize(config_file=config(stats=["mean", "max"]), log_dir=log_dir)
    t = torch.tensor([1.0, 2.0, 6.0])
    out = debug_api.log_tensor_stats(layer_name="l1", tensor=t, tensor_name="activation")
    t.mul_(100)  # an optimizer step before the values are read
    assert out["mean"].item() == 3.0 and out["max"].item() == 6.0  # from the partials taken at the call
    with torch.inference_mode():
        frozen = torch.tensor([1.0, 2.0, 6.0])  # keeps no version counter: the partials are used
        assert debug_api.log_tensor_stats(layer_name="l2", tensor=frozen, tensor_name="activation")["mean"].item() == 3.0


def test_returned_mapping_holds_the_tensor_only_while_it_lives(log_dir):
    debug_api.initialize(config_file=config(stats=["mean"]), log_dir=log_dir)
    values = numpy.ones(4, dtype=numpy.float32)  # the tensor's memory: alive while its owner array is
    alive = weakref.ref(values)
    out = debug_api.log_tensor_stats(layer_name="l1", tensor=torch.from_numpy(values), tensor_name="activation")
    del values
    assert alive() is not None and out["mean"].item() == 1.0
    del out
    gc.collect()
    assert alive() is None


# --- messages and loggers -----------------------------------------------------------------


def test_called_message_once_per_layer_and_tensor(log_dir):
    cfg = config(tensors=["activation", "gradient"], freq=2)
    debug_api.initialize(config_file=cfg, log_dir=log_dir)
    for _ in range(5):
        for layer in ("a", "b"):
            for name in ("activation", "gradient"):
                debug_api.log_tensor_stats(layer_name=layer, tensor=torch.ones(2), tensor_name=name)
        # another call site, and calls that are not due still count as called
        debug_api.log_tensor_stats(layer_name="a", tensor=torch.ones(2), tensor_name="activation", iteration=1)
        debug_api.step()
    debug_api.end_debug()
    called = [m for _, m in read_messages(log_dir) if m.endswith(": Called")]
    assert sorted(called) == sorted(
        f"LAYER={layer}: Feature=LogTensorStats, API=log_tensor_stats, TENSOR={name}: Called"
        for layer in ("a", "b")
        for name in ("activation", "gradient")
    )
    for layer in ("a", "b"):
        line = f"LAYER={layer}: Feature=LogTensorStats, API=log_tensor_stats, TENSOR=activation: Called"
        assert called.count(line) == 1


def test_called_message_is_written_again_after_reinitialize(log_dir, monkeypatch):
    monkeypatch.setenv("NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE", "0")
    for _ in range(2):
        debug_api.initialize(config_file=config(), log_dir=log_dir)
        for _ in range(3):
            debug_api.log_tensor_stats(layer_name="l1", tensor=torch.ones(2), tensor_name="activation")
        debug_api.end_debug()
    line = "LAYER=l1: Feature=LogTensorStats, API=log_tensor_stats, TENSOR=activation: Called"
    assert [m for _, m in read_messages(log_dir)].count(line) == 2


def test_custom_logger_replaces_the_file_unless_default_logging_is_enabled(log_dir):
    collect = Collect()
    debug_api.initialize(config_file=config(stats=["max"], freq=2), statistics_logger=collect, log_dir=log_dir)
    tensors = run_steps(4, layer="dec.0")
    debug_api.end_debug()
    assert collect.rows == [("dec.0_activation_max", tensors[i].max().item(), i) for i in (0, 2)]
    assert not stats_log_path(log_dir).exists()


def test_custom_logger_gets_values_of_every_stat_as_floats(log_dir):
    collect = Collect()
    debug_api.initialize(config_file=config(), statistics_logger=collect, log_dir=log_dir)
    t = tensor_for(3)
    debug_api.log_tensor_stats(layer_name="l1", tensor=t, tensor_name="activation", iteration=7)
    debug_api.step()
    ref = expected(t)
    assert [name for name, _, _ in collect.rows] == [f"l1_activation_{s}" for s in SIX]  # config order
    for (_, value, iteration), stat in zip(collect.rows, SIX, strict=True):
        assert isinstance(value, float) and iteration == 7
        assert value == pytest.approx(ref[stat], rel=REL)


def test_statistics_logger_must_be_a_base_logger(log_dir):
    class NotALogger:
        def log_scalar(self, name, value, iteration):
            pass

    with pytest.raises(TypeError, match="BaseLogger"):
        debug_api.initialize(config_file=config(), statistics_logger=NotALogger(), log_dir=log_dir)
    assert debug_api.DEBUG_MANAGER is None


# --- config errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("feature", "message"),
    [
        (
            {"stats": ["mean", "median"]},
            r"key 'block\.LogTensorStats\.stats\.1': unsupported statistic; got 'median'; "
            r"allowed: 'kurtosis', 'l1_norm', 'l2_norm', 'max', 'max_channel', 'mean', 'min', "
            r"'outlier_channel_ratio', 'rms', 'std'",
        ),
        (
            {"stats": ["cur_amax"]},
            r"LogTensorStats\.stats\.0'.*unsupported statistic.*'cur_amax'.*allowed: 'kurtosis', 'l1_norm'",
        ),
        ({"stats": [3]}, r"LogTensorStats\.stats\.0'.*unsupported statistic.*got 3"),
        ({"stats": "mean"}, r"LogTensorStats\.stats'.*non-empty list"),
        ({"stats": []}, r"LogTensorStats\.stats'.*non-empty list.*got \[\]"),
        ({"stats": None}, r"key 'block\.LogTensorStats'.*has no 'stats' list.*allowed: 'kurtosis', 'l1_norm'"),
        ({"freq": 0}, r"key 'block\.LogTensorStats\.freq'.*positive integer.*got 0"),
        ({"freq": -3}, r"LogTensorStats\.freq'.*got -3"),
        ({"freq": "2"}, r"freq'.*got '2'"),
        ({"freq": 1.5}, r"freq'.*got 1\.5"),
        ({"freq": True}, r"freq'.*got True"),
        ({"start_step": -1}, r"key 'block\.LogTensorStats\.start_step'.*non-negative.*got -1"),
        ({"start_step": "0"}, r"start_step'.*got '0'"),
        ({"end_step": -2}, r"LogTensorStats\.end_step'.*got -2"),
        ({"start_end_list": [[3, 1]]}, r"key 'block\.LogTensorStats\.start_end_list\.0'.*got \[3, 1\]"),
        ({"start_end_list": [[2, 2]]}, r"start_end_list\.0'.*start < end.*got \[2, 2\]"),
        ({"start_end_list": [[-1, 4]]}, r"start_end_list\.0'.*got \[-1, 4\]"),
        ({"start_end_list": [[0, 1, 2]]}, r"start_end_list\.0'.*got \[0, 1, 2\]"),
        ({"start_end_list": [[0, 5], [4, 8]]}, r"start_end_list\.1'.*overlaps.*got \[4, 8\]"),
        ({"start_end_list": [[0, -1], [4, 8]]}, r"start_end_list\.1'.*overlaps"),
        ({"start_end_list": [[6, 8], [0, 2]]}, r"start_end_list\.1'.*overlaps"),
        ({"start_end_list": "0-5"}, r"start_end_list'.*list of \[start, end\].*got '0-5'"),
        ({"stat": ["mean"]}, r"LogTensorStats\.stat'.*unknown key.*did you mean 'stats'"),
    ],
)
def test_bad_config_fails_at_initialize(log_dir, feature, message):
    cfg = config(**feature)
    if cfg["block"]["LogTensorStats"].get("stats") is None:
        del cfg["block"]["LogTensorStats"]["stats"]
    with pytest.raises(ConfigError, match=message):
        debug_api.initialize(config_file=cfg, log_dir=log_dir)
    assert debug_api.DEBUG_MANAGER is None


def test_bad_tensors_struct_item_is_located(log_dir):
    cfg = struct_config([{"tensor": "activation", "stats": ["max"]}, {"tensor": "gradient", "stats": ["p99"]}])
    with pytest.raises(ConfigError, match=r"tensors_struct\.1\.stats\.0'.*'p99'"):
        debug_api.initialize(config_file=cfg, log_dir=log_dir)


def test_tensors_struct_item_without_stats_names_the_tensor(log_dir):
    cfg = struct_config([{"tensor": "activation", "stats": ["max"]}, {"tensor": "gradient"}])
    with pytest.raises(ConfigError, match=r"tensors_struct\.1'.*tensor 'gradient' has no 'stats' list"):
        debug_api.initialize(config_file=cfg, log_dir=log_dir)


def test_tensors_struct_item_window_error_is_located_at_the_item(log_dir):
    cfg = struct_config([{"tensor": "activation", "stats": ["max"], "freq": 0}])
    with pytest.raises(ConfigError, match=r"key 'block\.LogTensorStats\.tensors_struct\.0\.freq'.*got 0"):
        debug_api.initialize(config_file=cfg, log_dir=log_dir)
    cfg = struct_config([{"tensor": "activation", "stats": ["max"]}], start_step=-4)
    with pytest.raises(ConfigError, match=r"key 'block\.LogTensorStats\.start_step'.*got -4"):
        debug_api.initialize(config_file=cfg, log_dir=log_dir)


def test_yaml_config_error_names_the_file(log_dir, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "block:\n  enabled: True\n  layers:\n    layer_name_regex_pattern: .*\n  LogTensorStats:\n"
        "    enabled: True\n    tensors: [activation]\n    stats: [mean]\n    freq: 0\n"
    )
    with pytest.raises(ConfigError, match=rf"{path.name}.*key 'block\.LogTensorStats\.freq'.*got 0"):
        debug_api.initialize(config_file=str(path), log_dir=log_dir)


def test_the_num_zeros_family_is_returned_and_logged(log_dir):
    stats = ["num_zeros", "num_zeros%", "NUM_ZEROS[1E-3]", "num_zeros[1e-3]%", "mean"]
    debug_api.initialize(config(stats=stats), log_dir=log_dir)
    x = torch.tensor([0.0, -0.0, 1e-3, -2e-4, 0.5, float("nan"), float("inf"), 7.0])
    returned = debug_api.log_tensor_stats("l1", tensor=x, tensor_name="activation")
    assert {name: value.item() for name, value in returned.items() if "zeros" in name} == {
        "num_zeros": 2.0,
        "num_zeros%": 25.0,
        "num_zeros[1e-3]": 4.0,  # the threshold included; NaN and inf are no zeros
        "num_zeros[1e-3]%": 50.0,
    }
    debug_api.log_tensor_stats("l1", tensor=torch.zeros(2), tensor_name="activation")  # a second call accumulates
    debug_api.step()
    logged = read_stats(log_dir)
    assert logged[("l1_activation_num_zeros", 0)] == 4.0 and logged[("l1_activation_num_zeros[1e-3]", 0)] == 6.0
    assert logged[("l1_activation_num_zeros%", 0)] == 40.0 and logged[("l1_activation_num_zeros[1e-3]%", 0)] == 60.0


def test_only_the_num_zeros_family_still_logs_and_returns(log_dir):
    debug_api.initialize(config(stats=["num_zeros[0.1]"]), log_dir=log_dir)
    returned = debug_api.log_tensor_stats("l1", tensor=torch.tensor([0.05, 0.2, 0.0]), tensor_name="activation")
    assert dict(returned) == {"num_zeros[0.1]": torch.tensor(2.0)}
    debug_api.step()
    assert read_stats(log_dir) == {("l1_activation_num_zeros[0.1]", 0): 2.0}


@pytest.mark.parametrize("entry", ["num_zeros[x]", "num_zeros[-0.5]%", "num_zeros[nan]"])
def test_a_malformed_num_zeros_threshold_names_the_forms(log_dir, entry):
    with pytest.raises(ConfigError) as info:
        debug_api.initialize(config(stats=["min", entry]), log_dir=log_dir)
    message = str(info.value)
    assert message.startswith("config dict: key 'block.LogTensorStats.stats.1': unsupported statistic: the threshold of")
    assert "allowed: 'num_zeros', 'num_zeros%', 'num_zeros[T]', 'num_zeros[T]%'" in message


def test_the_explanation_lists_the_num_zeros_family():
    from nvdlfw_inspect.debug_features.log_tensor_stats import LogTensorStats

    assert "``num_zeros[1e-10]%``" in LogTensorStats.__doc__


def test_num_zeros_of_integer_bool_and_fp8_tensors(log_dir):
    """Tensors torch cannot compare as they are (bool, FP8) are compared as float32, not failed on."""
    debug_api.initialize(config(stats=["num_zeros", "num_zeros[0.3]%"]), log_dir=log_dir)
    tensors = {
        "int": torch.tensor([0, 1, -2, 0]),
        "bool": torch.tensor([True, False, False, True]),
        "fp8": torch.tensor([0.0, -0.0, -1.0, 0.5]).to(torch.float8_e4m3fn),
    }
    for layer, t in tensors.items():
        returned = debug_api.log_tensor_stats(layer, tensor=t, tensor_name="activation")
        assert {name: value.item() for name, value in returned.items()} == {"num_zeros": 2.0, "num_zeros[0.3]%": 50.0}
    debug_api.step()
    logged = read_stats(log_dir)
    assert all(logged[(f"{layer}_activation_num_zeros", 0)] == 2.0 for layer in tensors)
