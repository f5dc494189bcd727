"""LogFp8TensorStats: every stat of the layer's own recipe and of the what-if recipes against float64
references (written here and in tests/references/blockref.py), with FP8 and high-precision plans,
micro-batches and config errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from blockref import block_ref, fp8_round, mxfp8_ref
from collecting import Collect
from debugrun import CURRENT, make_linear, section, start, train_step

import lowprec
import nvdlfw_inspect.api as debug_api
from lowprec.formats.elements import E4M3, E5M2, FP8Format
from nvdlfw_inspect.errors import ConfigError

DELAYED = lowprec.DelayedScaling()
EXAMPLES_FP8 = Path(__file__).parents[3] / "examples" / "configs" / "seed002_fp8_stats.yaml"


def wide(shape, seed: int) -> torch.Tensor:
    """Values spread over many binades, so some underflow in FP8."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 3)


def per_tensor_ref(x: torch.Tensor, fmt: FP8Format, scale: float) -> dict[str, float]:
    x = x.double()
    q = fp8_round(x * scale, fmt)
    return {
        "underflows%": 100 * ((x != 0) & (q == 0)).sum().item() / x.numel(),
        "overflows%": 100 * (x.abs() > fmt.max / scale).sum().item() / x.numel(),
        "mse": (x - q / scale).square().mean().item(),
        "scale_inv_min": 1 / scale,
        "scale_inv_max": 1 / scale,
    }


def current_scale(x: torch.Tensor, fmt: FP8Format) -> float:
    return torch.tensor(fmt.max / x.abs().max().item(), dtype=torch.float32).item()


def block_scaling_ref(x2d: torch.Tensor, fmt: FP8Format) -> dict[str, float]:
    r, c = x2d.shape
    tiles = x2d.double().reshape(r // 128, 128, c // 128, 128)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    scale = torch.pow(2.0, torch.floor(torch.log2(fmt.max / amax)))
    scales = scale.expand_as(tiles).reshape(r, c)
    return block_ref(x2d, fmt, scales, 1 / scale.reshape(-1))


def fp8_config(stats: list, tensors=("activation", "gradient", "weight"), **extra) -> dict:
    return section({"LogFp8TensorStats": {"enabled": True, "tensors": list(tensors), "stats": stats, **extra}})


def run(config: dict, log_dir, steps: list[tuple], recipe=CURRENT, fp8: bool = True, layer=None) -> dict:
    """Train ``layer`` one step per entry of ``steps`` (``(x, dy)`` pairs); returns the logged values."""
    collect = Collect()
    start(config, log_dir, statistics_logger=collect)
    layer = layer or make_linear(in_f=256, out_f=128)
    for x, dy in steps:
        train_step(layer, x, dy, recipe=recipe, fp8=fp8)
        debug_api.step()
    debug_api.end_debug()
    return collect.values


BARE = ["underflows%", "mse", "scale_inv_min", "scale_inv_max"]


def test_own_current_scaling_recipe_for_every_input_tensor(log_dir):
    x, dy = wide((128, 256), 0), wide((128, 128), 1)
    layer = make_linear(in_f=256, out_f=128)
    w = layer.weight.detach().clone()
    got = run(fp8_config(BARE), log_dir, [(x, dy)], layer=layer)
    for name, tensor, fmt in (("activation", x, E4M3), ("weight", w, E4M3), ("gradient", dy, E5M2)):
        expected = per_tensor_ref(tensor, fmt, current_scale(tensor, fmt))
        assert expected["underflows%"] > 0 or name == "weight"
        for stat in BARE:
            assert got[(f"lin_{name}_{stat}", 0)] == pytest.approx(expected[stat], rel=1e-5, abs=1e-12), (name, stat)


def test_what_if_recipes_whatever_the_run_uses(log_dir):
    x, dy = wide((128, 256), 2), wide((128, 128), 3)
    stats = [
        "fp8_current_scaling_underflows%",
        "fp8_current_scaling_mse",
        "mxfp8_underflows%",
        "mxfp8_mse",
        "mxfp8_scale_inv_min",
        "mxfp8_scale_inv_max",
        "mxfp8_underflows%_columnwise",
        "mxfp8_mse_columnwise",
        "mxfp8_scale_inv_max_columnwise",
        "fp8_block_scaling_underflows%",
        "fp8_block_scaling_mse",
        "fp8_block_scaling_scale_inv_min",
        "fp8_block_scaling_scale_inv_max",
    ]
    for recipe, fp8 in ((DELAYED, True), (CURRENT, False)):  # another recipe, and no FP8 at all
        got = run(fp8_config(stats, tensors=["activation"]), log_dir, [(x, dy)], recipe=recipe, fp8=fp8)
        current = per_tensor_ref(x, E4M3, current_scale(x, E4M3))
        for name in ("underflows%", "mse"):
            assert got[(f"lin_activation_fp8_current_scaling_{name}", 0)] == pytest.approx(current[name], rel=1e-5)
        for columnwise, suffix in ((False, ""), (True, "_columnwise")):
            mx = mxfp8_ref(x, E4M3, columnwise)
            for name in ("underflows%", "mse", "scale_inv_min", "scale_inv_max"):
                key = (f"lin_activation_mxfp8_{name}{suffix}", 0)
                if key in got:
                    assert got[key] == pytest.approx(mx[name], rel=1e-5), key
        block = block_scaling_ref(x, E4M3)
        for name in ("underflows%", "mse", "scale_inv_min", "scale_inv_max"):
            assert got[(f"lin_activation_fp8_block_scaling_{name}", 0)] == pytest.approx(block[name], rel=1e-5), name
        assert got[("lin_activation_mxfp8_underflows%", 0)] < got[("lin_activation_fp8_current_scaling_underflows%", 0)]


def test_delayed_scaling_overflows_follow_the_amax_history(log_dir):
    x0 = wide((128, 256), 4) * 50  # step 0 casts with scale 1: everything above 448 overflows
    x1 = wide((128, 256), 5) * 200
    dy = wide((128, 128), 6)
    stats = ["overflows%", "underflows%", "fp8_delayed_scaling_overflows%"]
    got = run(fp8_config(stats, tensors=["activation"]), log_dir, [(x0, dy), (x1, dy)], recipe=DELAYED)
    scale1 = torch.tensor(448.0 / x0.abs().max().item(), dtype=torch.float32).item()  # history "max" of step 0
    for it, x, scale in ((0, x0, 1.0), (1, x1, scale1)):
        expected = per_tensor_ref(x, E4M3, scale)
        assert expected["overflows%"] > 0
        assert got[("lin_activation_overflows%", it)] == pytest.approx(expected["overflows%"], rel=1e-6)
        assert got[("lin_activation_underflows%", it)] == pytest.approx(expected["underflows%"], rel=1e-6)
        assert got[("lin_activation_fp8_delayed_scaling_overflows%", it)] == got[("lin_activation_overflows%", it)]


def test_what_if_delayed_scaling_keeps_its_own_history_under_current_scaling(log_dir):
    x0, x1, dy = wide((128, 256), 7) * 50, wide((128, 256), 8) * 200, wide((128, 128), 9)
    stats = ["fp8_delayed_scaling_overflows%", "fp8_delayed_scaling_scale_inv_max"]
    got = run(fp8_config(stats, tensors=["activation"]), log_dir, [(x0, dy), (x1, dy)], recipe=CURRENT)
    scale1 = torch.tensor(448.0 / x0.abs().max().item(), dtype=torch.float32).item()
    for it, x, scale in ((0, x0, 1.0), (1, x1, scale1)):
        expected = per_tensor_ref(x, E4M3, scale)
        assert got[("lin_activation_fp8_delayed_scaling_overflows%", it)] == pytest.approx(expected["overflows%"])
        assert got[("lin_activation_fp8_delayed_scaling_scale_inv_max", it)] == pytest.approx(1 / scale, rel=1e-6)


def test_what_if_delayed_scaling_records_the_amax_of_the_numbers_beside_a_nan(log_dir):
    """The shadow history records the statistics kernel's amax, NaN ignored (TE's ``fmaxf``): the next scale is
    448 / 300, correctly rounded, not the old scale kept because the amax was NaN."""
    g = torch.Generator().manual_seed(3)
    x0, x1, dy = torch.randn(128, 256, generator=g), torch.randn(128, 256, generator=g), torch.randn(128, 128, generator=g)
    x0[0, 0], x0[1, 1] = float("nan"), -300.0
    stats = ["fp8_delayed_scaling_scale_inv_max"]
    got = run(fp8_config(stats, tensors=["activation"]), log_dir, [(x0, dy), (x1, dy)], recipe=CURRENT, fp8=False)
    scale1 = torch.tensor(448.0 / 300.0, dtype=torch.float32)  # float64 quotient rounded once: TE's __fdiv_rn
    assert got[("lin_activation_fp8_delayed_scaling_scale_inv_max", 0)] == 1.0
    assert got[("lin_activation_fp8_delayed_scaling_scale_inv_max", 1)] == pytest.approx(1 / scale1.item(), rel=1e-7)


def test_a_gemm_left_in_fp8_gets_the_stats_of_the_recipe_cast(log_dir):
    """The head of the demo: wgrad in high precision, fprop and dgrad still read the recipe's casts."""
    x, dy = wide((128, 256), 10), wide((128, 128), 11)
    config = fp8_config(BARE, tensors=["activation", "gradient"])
    config["sec"]["transformer_engine"]["DisableFP8GEMM"] = {"enabled": True, "gemms": ["wgrad"]}
    got = run(config, log_dir, [(x, dy)])
    for name, tensor, fmt in (("activation", x, E4M3), ("gradient", dy, E5M2)):
        expected = per_tensor_ref(tensor, fmt, current_scale(tensor, fmt))
        for stat in BARE:
            assert got[(f"lin_{name}_{stat}", 0)] == pytest.approx(expected[stat], rel=1e-5, abs=1e-12), (name, stat)


@pytest.mark.parametrize(
    "plan",
    [{"DisableFP8GEMM": {"enabled": True, "gemms": ["fprop", "dgrad", "wgrad"]}}, {"DisableFP8Layer": {"enabled": True}}],
)
def test_tensors_read_in_high_precision_lose_nothing(log_dir, plan):
    """No GEMM reads the recipe's cast: the statistics describe what the GEMMs read, which loses nothing."""
    x, dy = wide((128, 256), 10), wide((128, 128), 11)
    config = fp8_config([*BARE, "overflows%"], tensors=["activation", "gradient"])
    config["sec"]["transformer_engine"].update(plan)
    got = run(config, log_dir, [(x, dy)], recipe=DELAYED)
    assert per_tensor_ref(x, E4M3, current_scale(x, E4M3))["underflows%"] > 0  # the recipe's cast would lose some
    for name in ("activation", "gradient"):
        for stat, value in (
            ("underflows%", 0.0),
            ("overflows%", 0.0),
            ("mse", 0.0),
            ("scale_inv_min", 1.0),
            ("scale_inv_max", 1.0),
        ):
            assert got[(f"lin_{name}_{stat}", 0)] == value, (name, stat)


def test_a_remedy_in_place_shows_in_the_stats_it_was_chosen_from(log_dir):
    """Under delayed scaling, PerTensorScaling's cast (activation) and FakeQuant's rounded operand (gradient) are
    what the statistics measure, not the recipe's delayed cast."""
    x, dy = wide((128, 256), 20), wide((128, 128), 21)
    config = fp8_config(["underflows%", "mse", "overflows%"], tensors=["activation", "gradient"])
    config["sec"]["transformer_engine"]["PerTensorScaling"] = {
        "enabled": True,
        "gemms": ["fprop", "wgrad"],
        "tensors": ["activation"],
    }
    config["sec"]["transformer_engine"]["FakeQuant"] = {
        "enabled": True,
        "gemms": ["dgrad", "wgrad"],
        "tensors": ["gradient"],
        "quant_format": "FP8E4M3",
    }
    got = run(config, log_dir, [(x, dy)], recipe=DELAYED)
    for name, tensor, fmt in (("activation", x, E4M3), ("gradient", dy, E4M3)):
        expected = per_tensor_ref(tensor, fmt, current_scale(tensor, fmt))
        assert expected["underflows%"] > 1, name  # the delayed recipe's first cast (scale 1) would lose far more
        assert got[(f"lin_{name}_underflows%", 0)] == pytest.approx(expected["underflows%"], rel=1e-6), name
        assert got[(f"lin_{name}_mse", 0)] == pytest.approx(expected["mse"], rel=1e-4), name
        assert got[(f"lin_{name}_overflows%", 0)] == 0.0, name


def test_micro_batches_accumulate_and_weights_count_once(log_dir):
    xs, dys = [wide((64, 256), 12), wide((64, 256), 13)], [wide((64, 128), 14), wide((64, 128), 15)]
    collect = Collect()
    start(fp8_config(["underflows%", "mse"], tensors=["activation", "weight"]), log_dir, statistics_logger=collect)
    layer = make_linear(in_f=256, out_f=128)
    w = layer.weight.detach().clone()
    for x, dy in zip(xs, dys, strict=True):
        train_step(layer, x, dy)
    debug_api.step()
    per_batch = [per_tensor_ref(x, E4M3, current_scale(x, E4M3)) for x in xs]
    assert collect.values[("lin_activation_underflows%", 0)] == pytest.approx(sum(p["underflows%"] for p in per_batch) / 2)
    assert collect.values[("lin_activation_mse", 0)] == pytest.approx(sum(p["mse"] for p in per_batch) / 2, rel=1e-5)
    weight = per_tensor_ref(w, E4M3, current_scale(w, E4M3))
    assert collect.values[("lin_weight_mse", 0)] == pytest.approx(weight["mse"], rel=1e-5)


def test_schedule_and_seed_002_example(log_dir, tmp_path):
    collect = Collect()
    start(EXAMPLES_FP8, log_dir, statistics_logger=collect)
    layer = lowprec.LayerNormLinear(64, 32, name="ln_linear")
    for step in range(12):
        x = wide((16, 64), step) * 100
        with lowprec.fp8_autocast(fp8_recipe=DELAYED):
            layer(x).sum().backward()
        debug_api.step()
    debug_api.end_debug()
    iterations = {it for (name, it) in collect.values if name == "ln_linear_activation_overflows%"}
    assert iterations == set(range(12))
    assert {it for (name, it) in collect.values if name == "ln_linear_gradient_overflows%"} == {0, 5, 10}
    assert {it for (name, it) in collect.values if name == "ln_linear_activation_underflows%"} == set(range(12))
    # the activation is the LayerNorm output: |x| stays far below 448 even at step 0's scale of 1
    assert all(collect.values[("ln_linear_activation_overflows%", it)] == 0.0 for it in range(12))


def test_bare_stats_the_layers_format_cannot_have_are_skipped_and_said_once(log_dir):
    """One config serves a model whose layers run different formats (a precision plan): a statistic without a prefix
    that means nothing for a layer's format is skipped there, said once; the others are logged."""
    x, dy = wide((128, 256), 16), wide((128, 128), 17)
    cases = [
        (["mse", "fp8_current_scaling_mse"], False, "mse of activation of lin not logged: the layer runs in high precision"),
        (["overflows%", "mse"], True, "overflows% of activation of lin not logged: the layer runs fp8_current_scaling: "),
        (["mse_columnwise", "mse"], True, "which has one scale per tensor: its columnwise statistics equal the rowwise"),
        (["scale_inv_std", "mse"], True, "which has one scale per tensor: scale_inv_std describes block scales"),
    ]
    for stats, fp8, said in cases:
        with pytest.warns(UserWarning, match=re.escape(said)):
            got = run(fp8_config(stats, tensors=["activation"]), log_dir, [(x, dy), (x, dy)], fp8=fp8)
        logged = {name for name, _ in got}
        assert logged == {"lin_activation_fp8_current_scaling_mse" if not fp8 else "lin_activation_mse"}, stats
        debug_log = (log_dir / "nvdlfw_inspect_logs" / "nvdlfw_inspect_globalrank-0.log").read_text()
        assert debug_log.count(said) == 1


@pytest.mark.parametrize(
    ("stats", "tensors", "message"),
    [
        (["median"], ["activation"], r"LogFp8TensorStats\.stats\.0'.*unsupported statistic.*'median'"),
        (["fp8_current_scaling_overflows%"], ["activation"], r"stats\.0'.*overflows% exists only under delayed"),
        (["fp8_delayed_scaling_mse_columnwise"], ["activation"], r"stats\.0'.*columnwise statistics equal the rowwise"),
        (["mse", 3], ["activation"], r"stats\.1'.*must be a statistic name"),
        ("mse", ["activation"], r"LogFp8TensorStats\.stats'.*non-empty list"),
        (["mse"], ["output"], r"output"),
    ],
)
def test_config_errors_at_initialize(log_dir, stats, tensors, message):
    with pytest.raises(ConfigError, match=message):
        start(fp8_config(stats, tensors=tensors), log_dir)
