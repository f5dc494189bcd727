"""``nvdlfw-inspect compare``: the demo GPT trained once per recipe from one seed, and the page comparing
the runs (its embedded data is what the runs logged), a precision plan's run among them."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from browser import CHROMIUM, screenshot
from demo_plan import HIGH_PRECISION, QUANTIZED, check_planned_formats, write_plan
from full_disk import NO_SPACE, fill_disk

from lowprec.cli import main
from lowprec.compare import RECIPES, compare_formats, parse_recipes, statistics_config
from lowprec.compare.outliers import outliers, settled
from lowprec.compare.page import nice_ticks, tick_label
from lowprec.compare.runs import CONFIG
from lowprec.demo import read_losses, run_demo
from lowprec.plan import load_plan
from nvdlfw_inspect.files import WriteError
from nvdlfw_inspect.reading import Statistic, iter_statistics, read_routing

STEPS, SEED = 4, 3


def page_data(page: Path) -> dict:
    match = re.search(r'<script type="application/json" id="compare-data">(.*?)</script>', page.read_text(), re.S)
    return json.loads(match.group(1))


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("compare")
    page = compare_formats(["bf16", "delayed", "nvfp4"], steps=STEPS, size="tiny", out=out, seed=SEED, device="cpu")
    return page, page_data(page)


def test_the_page_holds_every_runs_logged_losses(compared):
    page, data = compared
    assert page.name == "compare.html" and page.read_text().startswith("<!DOCTYPE html>")
    assert [run["name"] for run in data["runs"]] == ["bf16", "delayed", "nvfp4"]
    for run in data["runs"]:
        assert run["loss"] == read_losses(page.parent / run["name"]) and len(run["loss"]) == STEPS
        assert (page.parent / run["report"]).is_file()
    first = [run["loss"][0] for run in data["runs"]]
    assert max(first) - min(first) < 0.02 * min(first)  # same weights, same batch: only the format differs
    text = page.read_text()
    assert text.count("<polyline") == 5  # the losses, and the others' differences from bf16's
    assert "rotate(-90 14" in text and '">loss</text>' in text and '">loss - bf16 loss</text>' in text  # axis names


def page_dir(compared) -> Path:
    return compared[0].parent


def test_the_page_is_offline(compared):
    text = compared[0].read_text()
    assert "<script src" not in text and "<link" not in text
    assert set(re.findall(r"https?://[^\"' ]+", text)) <= {"http://www.w3.org/2000/svg"}


def test_each_format_ranks_what_it_logged(compared):
    runs = {run["name"]: run for run in compared[1]["runs"]}
    assert runs["bf16"]["outliers"] == {}
    assert set(runs["delayed"]["outliers"]) == {"underflows%", "overflows%", "relative mse"}
    assert set(runs["nvfp4"]["outliers"]) == {"underflows%", "relative mse"}  # its own casts, nvfp4_ stripped
    assert runs["nvfp4"]["stats"] == ["underflows%", "mse"]
    assert "LogNvfp4TensorStats" in (page_dir(compared) / "nvfp4" / CONFIG).read_text()
    rows = runs["delayed"]["outliers"]["underflows%"]
    assert 0 < len(rows) <= 5 and [row["settled"] for row in rows] == sorted((row["settled"] for row in rows), reverse=True)


def test_the_same_seed_gives_the_plain_demos_loss(compared, tmp_path):
    config = tmp_path / "stats.yaml"
    config.write_text(yaml.safe_dump(statistics_config(RECIPES["bf16"], 5)))
    bf16 = next(run for run in compared[1]["runs"] if run["name"] == "bf16")
    common = {"steps": STEPS, "size": "tiny", "config": config, "device": "cpu", "recipe": None, "seed": SEED}
    plain = run_demo(log_dir=tmp_path / "plain", autocast=torch.bfloat16, **common)
    assert plain["losses"] == bf16["loss"]
    fp32 = run_demo(log_dir=tmp_path / "fp32", **common)  # no autocast: the same start, bf16's rounding apart
    assert fp32["losses"] != bf16["loss"] and abs(fp32["losses"][0] - bf16["loss"][0]) < 0.01 * fp32["losses"][0]
    with pytest.raises(ValueError, match=r"autocast must be None, torch.bfloat16 or torch.float16, got torch.float64"):
        run_demo(log_dir=tmp_path / "bad", autocast=torch.float64, **common)
    other = run_demo(steps=2, size="tiny", config=config, log_dir=tmp_path / "other", device="cpu", recipe=None, seed=SEED + 1)
    assert other["losses"] != bf16["loss"][:2]


@pytest.mark.parametrize(
    ("names", "message"),
    [
        ("bf16,fp9", r"unknown recipe 'fp9'; known: bf16, fp32, delayed, current, mxfp8, block, nvfp4"),
        (["fp9", "x"], r"unknown recipes 'fp9', 'x'"),
        ("delayed,delayed", r"recipe given twice: delayed"),
        ("", r"recipes must be names from"),
        ("bf16,", r"recipes must be names from"),
    ],
)
def test_bad_recipe_names_are_clear_errors(tmp_path, names, message):
    with pytest.raises(ValueError, match=message):
        parse_recipes(names)
    with pytest.raises(ValueError, match=message):
        compare_formats(names, steps=1, out=tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything ran


def test_the_command_line(tmp_path, capsys):
    before = torch.get_num_threads()
    args = ["--recipes", "current", "--steps", "2", "--out", str(tmp_path)]
    assert main(["compare", *args, "--device", "cpu", "--threads", "1"]) == 0
    out = capsys.readouterr().out.splitlines()  # the threads chosen once for every run, then each run, then the page
    assert out[0].startswith("threads: 1 (as given;") and out[-1] == f"page: {tmp_path / 'compare.html'}"
    assert torch.get_num_threads() == before
    assert main(["compare", *args]) == 1  # runs already there
    assert "already holds runs of current" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--recipes", "bf16,fp9"])
    assert exit_info.value.code == 2 and "argument --recipes: unknown recipe 'fp9'" in capsys.readouterr().err


def test_outliers_rank_the_settled_value_and_relate_mse_to_the_variance():
    assert settled({0: 90.0, 1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 5.0, 6: 6.0, 7: 7.0}) == 6.5  # last quarter: 6, 7
    stats = [
        Statistic(0, layer, "gradient", "nvfp4_underflows%", it, value)
        for layer, value in (("a", 1.0), ("b", 3.0))
        for it in range(4)
    ]
    stats += [Statistic(0, "a", "activation", "nvfp4_mse", 0, 0.5), Statistic(0, "a", "activation", "std", 0, 2.0)]
    ranked = outliers(stats, "nvfp4_")
    assert [row["layer"] for row in ranked["underflows%"]] == ["b", "a"]
    assert ranked["relative mse"] == [
        {"layer": "a", "tensor": "activation", "settled": 0.125, "worst": 0.125, "worst_iteration": 0}
    ]


def test_a_recipe_that_fails_costs_only_itself(tmp_path, monkeypatch, capsys):
    """bf16's directory is on a full disk: its config cannot be written, bf16 is named with its error, current
    still runs."""
    fill_disk(monkeypatch, lambda path: path.parent.name == "bf16")
    page = compare_formats(["bf16", "current"], steps=2, size="tiny", out=tmp_path, seed=SEED, device="cpu")
    config = tmp_path / "bf16" / CONFIG
    error = f"WriteError: cannot write the config to '{config}': {NO_SPACE}"
    assert f"bf16: failed: {error}" in capsys.readouterr().out
    data = page_data(page)
    assert data["failed"] == [{"name": "bf16", "label": RECIPES["bf16"].label, "error": error}]
    assert [run["name"] for run in data["runs"]] == ["current"] and len(data["runs"][0]["loss"]) == 2
    assert "<h2>Failed recipes</h2>" in page.read_text() and not config.exists()


def test_the_cost_of_a_step_is_the_process_cpu_time_not_the_wall_time(compared, monkeypatch):
    """Wall time under load ranked the recipes wrongly (NVFP4 looked fastest on a busy machine): on the CPU each
    run's cost is its process's CPU time per step, which other processes do not inflate, and the page says so."""
    page, data = compared
    assert all(run["step_clock"] == "process CPU time" and run["step_ms"] > 0 for run in data["runs"])
    text = page.read_text()
    assert "<th>ms per step</th>" in text and "process CPU time per training step" in text
    import lowprec.demo as demo

    ticks = iter(range(0, 10**6, 7))  # a CPU clock that advances 7 s a call: the step cost must come from it
    monkeypatch.setattr(demo.time, "process_time", lambda: next(ticks))
    result = demo.run_demo(steps=2, size="tiny", log_dir=page.parent / "clocked", seed=SEED, threads=1)
    assert result["step_ms"] == 3500.0 and result["step_clock"] == "process CPU time"


def test_the_verdict_table_judges_each_format_by_its_own_threshold(compared):
    """NVFP4's gradients settle at ~20% underflow: over FP8's 1%, under NVFP4's calibrated 25.1%, which the table
    names with where it comes from; delayed scaling's overflows are red, with the count."""
    page, data = compared
    text = page.read_text()
    verdict = re.search(r"<h2>Verdict</h2><table>(.*?)</table>", text).group(1)
    rows = dict(re.findall(r"<tr><td>(\w+)</td>(.*?)</tr>", verdict))
    assert set(rows) == {"bf16", "delayed", "nvfp4"} and "reference" in rows["bf16"] and "not logged" in rows["bf16"]
    nvfp4 = data["runs"][2]["over_thresholds"]["underflows%"]
    assert 1.0 < nvfp4["worst"] < 25.1 and nvfp4["over"] == 0
    assert nvfp4["thresholds"] == {"NVFP4": {"pct": 25.1, "source": "calibrated: well-behaved data gives up to 12.5%, x2"}}
    assert f'<td class="ok">0 of {nvfp4["of"]} tensors over 25.1%' in rows["nvfp4"]
    assert "NVFP4: 25.1% (calibrated" in rows["nvfp4"] and "judged by each tensor by its own layer&#x27;s format" in rows["nvfp4"]
    delayed = data["runs"][1]["over_thresholds"]
    assert delayed["underflows%"]["thresholds"]["FP8 delayed scaling"]["pct"] == 1.0
    assert delayed["overflows%"]["over"] > 0
    assert (
        f'<td class="over">{delayed["overflows%"]["over"]} of {delayed["overflows%"]["of"]} tensors over 0.1%' in rows["delayed"]
    )
    gap = data["runs"][2]["last_loss"] - data["runs"][0]["last_loss"]
    assert f"{gap:+.4f}" in rows["nvfp4"]


@pytest.mark.parametrize(
    ("low", "high", "ticks", "labels"),
    [
        (0.0123, 0.0567, [0.0, 0.02, 0.04, 0.06], ["0", "0.02", "0.04", "0.06"]),
        (-0.03, 0.05, [-0.04, -0.02, 0.0, 0.02, 0.04, 0.06], ["-0.04", "-0.02", "0", "0.02", "0.04", "0.06"]),
        (2.31, 5.47, [2.0, 3.0, 4.0, 5.0, 6.0], ["2", "3", "4", "5", "6"]),
    ],
)
def test_axes_have_round_ticks_and_zero_is_labelled(low, high, ticks, labels):
    got, first, last = nice_ticks(low, high)
    assert got == pytest.approx(ticks) and (first, last) == pytest.approx((ticks[0], ticks[-1]))
    assert [tick_label(value, got[1] - got[0]) for value in got] == labels


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (scripts/test.sh installs it)")
def test_a_person_sees_the_cells_over_threshold_in_red(compared, tmp_path):
    """In the browser: every verdict cell over its threshold, delayed scaling's overflows among them, has the alarm
    background, drawn as one band per cell."""
    from PIL import Image

    page, data = compared
    shot = tmp_path / "compare.png"
    assert screenshot(page, shot, 1300, 900) == []
    image = Image.open(shot).convert("RGB")
    alarm = (0xFD, 0xE0, 0xDC)  # td.over's background
    rows = sorted({y for y in range(image.height) for x in range(0, image.width, 8) if image.getpixel((x, y)) == alarm})
    bands = 1 + sum(1 for a, b in zip(rows, rows[1:], strict=False) if b - a > 1) if rows else 0
    over = [run["name"] for run in data["runs"] if any(v.get("over") for v in run.get("over_thresholds", {}).values())]
    assert "delayed" in over and bands == page.read_text().count('<td class="over">') >= len(over)


def test_a_real_full_disk_is_named_and_each_recipe_still_prints_its_losses(small_tmpfs, capsys):
    """On a full tmpfs the fp32 recipe trained and was then said to have "failed: no statistics were logged ...
    lowprec layers call the debug API of namespace transformer_engine": the config blamed for what the disk did.
    Each recipe that trained prints its loss line, the disk is named, the next recipe runs; the page cannot be
    written either, which is said naming it."""
    out = small_tmpfs("128k")
    with pytest.raises(WriteError, match=rf"cannot write the comparison page to '{re.escape(str(out))}/compare.html'"):
        compare_formats(["fp32", "bf16"], steps=2, size="tiny", out=out, seed=SEED, device="cpu", threads=1)
    printed = capsys.readouterr().out
    assert "no statistics were logged" not in printed and "transformer_engine" not in printed
    for name in ("fp32", "bf16"):
        assert re.search(rf"^{name}: loss \d+\.\d+ -> \d+\.\d+ \(\d+ ms of process CPU time per step\)$", printed, re.M)
        said = re.search(rf"^{name}: not compared: (.*)$", printed, re.M).group(1)
        assert f"{out / name}" in said and NO_SPACE in said and f"the file system at {out}" in said


def test_a_plan_runs_beside_the_recipes_on_the_same_page(tmp_path, capsys):
    """The plan's run starts from the recipes' weights and batches, trains each layer in the plan's format (the others,
    here none, in high precision), and its statistics describe each quantized layer's own format; the page draws it with
    the others and shows the plan and every layer's recipe per GEMM."""
    plan = write_plan(tmp_path)
    page = compare_formats(["fp32"], steps=3, size="tiny", out=tmp_path / "out", seed=SEED, device="cpu", threads=1, plan=plan)
    data = page_data(page)
    fp32, planned = data["runs"]
    assert (planned["name"], planned["label"], planned["stats"]) == ("plan", "plan: plan.yaml", ["underflows%", "mse"])
    assert data["title"] == "Formats compared: fp32, plan: plan.yaml"
    assert planned["loss"] == read_losses(page.parent / "plan") and len(planned["loss"]) == 3
    assert abs(planned["loss"][0] - fp32["loss"][0]) < 0.01 * fp32["loss"][0] and planned["loss"] != fp32["loss"]
    check_planned_formats(page.parent / "plan")
    underflows = {r.layer for r in iter_statistics(page.parent / "plan") if r.stat == "underflows%"}
    assert underflows == set(QUANTIZED)  # no quantization statistics for the layers in high precision
    assert {row["layer"] for row in planned["outliers"]["underflows%"]} <= set(QUANTIZED)
    assert planned["plan"]["autocast"] == "high_precision"
    assert planned["plan"]["layers"]["gpt.layers.0.self_attention.proj"] == {
        "fprop": "MXFP8BlockScaling()",
        "dgrad": "MXFP8BlockScaling()",
        "wgrad": "Float8CurrentScaling()",
    }
    assert planned["plan"]["layers"]["gpt.layers.0.layernorm_mlp.fc2"]["wgrad"] == (
        "NVFP4BlockScaling(disable_stochastic_rounding=True)"
    )
    assert all(set(planned["plan"]["layers"][layer].values()) == {"high_precision"} for layer in HIGH_PRECISION)
    text = page.read_text()
    assert text.count("<polyline") == 3 and "<h2>Precision plan: plan.yaml</h2>" in text  # losses, plan - fp32
    assert html.escape(load_plan(plan).describe()) in text
    assert "<tr><td>gpt.head</td><td>high_precision</td><td>high_precision</td><td>high_precision</td></tr>" in text
    printed = capsys.readouterr().out.splitlines()
    assert printed[-2].startswith("plan: loss ") and printed[-1].startswith("plan: final loss ")
    assert "vs high precision (fp32)" in printed[-1]
    assert planned["judged_by"] == "each tensor by its own layer's format (routing records)"
    assert "NVFP4" in planned["over_thresholds"]["underflows%"]["thresholds"]  # its NVFP4 layers by NVFP4's threshold


@pytest.mark.parametrize(
    ("plan", "recipe", "message"),
    [
        ({"rules": [{"layers": {"layer_name_regex_pattern": "gpt"}, "recipe": "bf16"}]}, None, "quantizes no GEMM of the demo"),
        ({"rules": []}, None, r"under an autocast of high_precision: .* \(plan_recipe, --plan-recipe\)"),
        ({"rules": []}, "bf16", r"the plan run's autocast recipe must be one of delayed, current, .*got 'bf16'"),
        (None, "nvfp4", r"plan_recipe='nvfp4' is the autocast recipe of a plan's run: give the plan too"),
        ({"rules": [{"layers": {"layer_types": ["linear"]}, "recipe": "fp9"}]}, None, r"key 'rules\.0\.recipe': unknown recipe"),
    ],
)
def test_a_plan_that_cannot_run_is_refused_before_any_run(tmp_path, plan, recipe, message):
    with pytest.raises(ValueError, match=message):
        compare_formats(["fp32"], steps=1, out=tmp_path / "out", plan=plan, plan_recipe=recipe)
    assert not (tmp_path / "out").exists()


def test_a_megatron_plan_runs_under_the_recipe_it_overrides(tmp_path):
    """Megatron's configs replace a quantizing autocast's recipe only: under --plan-recipe the layers its matcher
    selects run its NVFP4, the others the autocast's MXFP8."""
    megatron = tmp_path / "megatron.yaml"
    megatron.write_text(
        "configs:\n  fp4:\n    transformer_engine_config_type: TEQuantizationParams\n"
        "    training_recipe: {fp4_quantization_recipe: nvfp4}\n"
        "matchers:\n  mlp:\n    config: fp4\n    type: glob\n    pattern: '*layernorm_mlp*'\n    enabled: true\n"
    )
    with pytest.raises(ValueError, match="quantizes no GEMM of the demo GPT under an autocast of high_precision"):
        compare_formats(["fp32"], steps=1, out=tmp_path / "refused", plan=megatron)
    out = tmp_path / "out"
    assert (
        main(
            [
                "compare",
                "--recipes",
                "fp32",
                "--steps",
                "1",
                "--out",
                str(out),
                "--threads",
                "1",
                "--device",
                "cpu",
                "--plan",
                str(megatron),
                "--plan-recipe",
                "mxfp8",
            ]
        )
        == 0
    )
    planned = page_data(out / "compare.html")["runs"][1]["plan"]
    assert planned["autocast"] == "MXFP8BlockScaling()"
    formats = {(r.layer, r.gemm): r.format for r in read_routing(out / "plan")}
    assert formats[("gpt.layers.1.layernorm_mlp.fc1", "wgrad")] == "nvfp4"
    assert formats[("gpt.head", "fprop")] == formats[("gpt.layers.0.self_attention.proj", "dgrad")] == "mxfp8"
