"""The plan search (``lowprec.plan.search``) and its cost model (``lowprec.plan.cost``): exact at every front point
(checked against every plan of small instances), deterministic, a sensitive layer kept wide, and the plan it writes
loads and gives each GEMM its format."""

from __future__ import annotations

import itertools
import random

import pytest

from lowprec.plan import load_plan, named_recipe
from lowprec.plan.cost import FORMAT_BITS, formats_on, gemm_cost, gemm_shares
from lowprec.plan.search import GEMMS, Option, Unit, full_front, hull, plan_of, search


def test_the_hull_keeps_what_removes_damage_at_a_falling_rate():
    options = [
        Option("bf16", 1.0, 0.0),
        Option("mxfp8", 0.5, 1.0),
        Option("mxfp6", 0.45, 1.8),  # between nvfp4 and mxfp8 in cost, above their line (1.6 there): not convex
        Option("nvfp4", 0.25, 4.0),
        Option("current", 0.5, 2.0),  # dominated by mxfp8
    ]
    assert [o.format for o in hull(options)] == ["nvfp4", "mxfp8", "bf16"]
    with pytest.raises(ValueError, match="non-negative"):
        hull([Option("x", 1.0, -1.0)])


def random_units(seed: int, layers: int = 4) -> dict[Unit, list[Option]]:
    rng = random.Random(seed)
    units = {}
    for index in range(layers):
        options = [Option("bf16", 1.0, 0.0)]
        options += [Option(name, rng.uniform(0.1, 0.9), rng.uniform(0.0, 5.0)) for name in ("a", "b")]
        units[Unit(f"layer{index}", "fprop")] = options
    return units


@pytest.mark.parametrize("seed", range(6))
def test_every_front_point_is_the_cheapest_plan_of_its_damage(seed):
    units = random_units(seed)
    hulls = {unit: hull(options) for unit, options in units.items()}
    plans = [dict(zip(hulls, choice, strict=True)) for choice in itertools.product(*hulls.values())]
    front = full_front(units)
    assert [p.cost for p in front] == sorted(p.cost for p in front)  # cheapest first, damage falling
    assert [p.damage for p in front] == sorted((p.damage for p in front), reverse=True)
    for point in front:
        best = min(
            sum(o.cost for o in plan.values()) for plan in plans if sum(o.damage for o in plan.values()) <= point.damage + 1e-12
        )
        assert point.cost == pytest.approx(best)
        result = search(units, point.damage + 1e-12)
        assert result.cost == pytest.approx(point.cost) and result.within_budget


def test_a_budget_between_points_takes_the_next_point_and_nothing_fits_a_budget_below_the_last():
    units = random_units(0)
    front = full_front(units)
    middle = (front[1].damage + front[2].damage) / 2
    result = search(units, middle)
    assert (result.cost, result.damage) == (pytest.approx(front[2].cost), pytest.approx(front[2].damage))
    everything_wide = search(units, -0.0)
    assert everything_wide.within_budget and everything_wide.damage == 0  # bf16 everywhere: no damage
    cheapest = search({Unit("l", "fprop"): [Option("nvfp4", 0.3, 2.0)]}, 1.0)
    assert not cheapest.within_budget and cheapest.damage == 2.0


def test_the_search_is_deterministic_and_keeps_a_sensitive_layer_wide():
    units = {}
    for index in range(20):
        sensitive = index == 7
        for gemm in GEMMS:
            units[Unit(f"model.layers.{index}", gemm)] = [
                Option("nvfp4", 0.28, 50.0 if sensitive else 0.1),
                Option("mxfp8", 0.52, 5.0 if sensitive else 0.02),
                Option("bf16", 1.0, 0.0),
            ]
    result = search(units, budget=6.0)  # the sensitive layer alone in nvfp4 damages 150, all others 5.7
    assert result == search(dict(reversed(list(units.items()))), budget=6.0)  # the order given does not matter
    formats = result.formats()
    assert formats["model.layers.7"] == dict.fromkeys(GEMMS, "bf16")
    assert all(formats[f"model.layers.{i}"] == dict.fromkeys(GEMMS, "nvfp4") for i in range(20) if i != 7)
    assert result.damage == pytest.approx(0.1 * 3 * 19) and result.within_budget


def test_the_plan_written_loads_and_gives_each_gemm_its_format():
    formats = {
        "gpt.layers.0.fc1": dict.fromkeys(GEMMS, "nvfp4"),
        "gpt.layers.0.fc2": {"fprop": "nvfp4", "dgrad": "mxfp8", "wgrad": "mxfp8"},
        "gpt.layers.1.fc1": dict.fromkeys(GEMMS, "nvfp4"),
        "gpt.head": dict.fromkeys(GEMMS, "bf16"),
    }
    written = plan_of(formats)
    assert written["default"] == "nvfp4" and [rule["name"] for rule in written["rules"]] == [
        "search: gpt.layers.0.fc2",
        "search: gpt.head",
    ]
    plan = load_plan(written)
    for layer, gemms in formats.items():
        recipes = plan.resolve(layer).gemm_recipes(True, None)
        for gemm, fmt in gemms.items():
            expected = None if fmt == "bf16" else named_recipe(fmt)
            assert recipes.of(gemm) == expected, (layer, gemm)


def test_the_cost_is_the_bits_read_times_the_flops_share_or_the_time_on_a_named_gpu():
    shares = gemm_shares({"attn": 3 * 64 * 64, "fc1": 64 * 256, "fc2": 256 * 64})
    assert sum(shares.values()) == pytest.approx(1.0) and shares["fc1"] == pytest.approx(16384 / 45056)
    assert FORMAT_BITS["nvfp4"] == 4.5 and FORMAT_BITS["mxfp8"] == 8.25 and FORMAT_BITS["mxfp4"] == 4.25
    assert gemm_cost(0.5, "bf16") == 0.5 and gemm_cost(0.5, "nvfp4") == pytest.approx(0.5 * 4.5 / 16)
    assert gemm_cost(0.5, "nvfp4", gpu="b200") == 0.125 and gemm_cost(0.5, "current", gpu="h100") == 0.25
    # Transformer Engine's measured B300 / H200 NVL milliseconds, per direction: NVFP4 fprop 1.932 vs BF16 4.196
    assert gemm_cost(0.5, "nvfp4", gpu="b300", gemm="fprop") == pytest.approx(0.5 * 1.932 / 4.196)
    assert gemm_cost(1.0, "block", gpu="h200", gemm="wgrad") == pytest.approx(7.821 / 10.548)
    assert formats_on("b300", ["nvfp4", "mxfp6_e2m3", "block", "bf16"]) == ["nvfp4", "bf16"]  # not measured there
    assert formats_on("h100", ["nvfp4", "mxfp8", "current", "bf16"]) == ["current", "bf16"]
    assert formats_on(None, ["nvfp4", "bf16"]) == ["nvfp4", "bf16"]
    with pytest.raises(ValueError, match="no published speedups for GPU 'tpu'"):
        formats_on("tpu", ["bf16"])
    with pytest.raises(ValueError, match="unknown format fp3"):
        formats_on(None, ["fp3"])
