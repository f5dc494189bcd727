"""The HTML report: its data from real and synthetic runs (several ranks, NaN and inf), and the page in
a real headless browser: it loads without console errors and draws its charts."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from browser import CHROMIUM, dom, screenshot
from planted_runs import mixed_formats_run, nan_run, outlier_channel_run, planted_run, scaled_weight_run

import lowprec
import nvdlfw_inspect
import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect import reading
from nvdlfw_inspect.diagnose import Thresholds
from nvdlfw_inspect.reading import RoutingRecord, Statistic, iter_statistics, read_routing, split_name
from nvdlfw_inspect.report import heatmap_kind, natural_order, render, report_data, write_report

needs_browser = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (scripts/test.sh installs it)")


def train(log_dir: Path, steps: int = 12, fp8_stats: bool = True) -> None:
    """A two-layer FP8 model logging tensor and (unless ``fp8_stats`` is False) FP8 statistics; fc2's input
    blows up at step 7."""
    features = {
        "LogTensorStats": {"enabled": True, "tensors": ["activation", "gradient"], "stats": ["max", "dynamic_range"]},
        "LogFp8TensorStats": {"enabled": fp8_stats, "tensors": ["activation"], "stats": ["underflows%"]},
    }
    config = {"all": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "transformer_engine": features}}
    debug_api.initialize(config_file=config, feature_dirs=[lowprec.FEATURE_DIR], log_dir=str(log_dir))
    torch.manual_seed(0)
    fc1, fc2 = lowprec.Linear(16, 32, name="model.fc1"), lowprec.Linear(32, 8, name="model.fc2")
    for step in range(steps):
        with lowprec.fp8_autocast():
            hidden = fc1(torch.randn(8, 16))
            if step == 7:
                hidden = hidden * math.inf
            fc2(hidden).sum().backward()
        debug_api.step()
    debug_api.end_debug()


def test_structured_records_and_read_stats(log_dir):
    train(log_dir)
    records = [json.loads(line) for line in (log_dir / "nvdlfw_inspect_statistics_jsonl").glob("*.jsonl").__next__().open()]
    assert {"layer", "tensor", "stat", "iteration", "value", "rank"} == set(records[0])
    assert any(r["value"] == "inf" for r in records)  # strict JSON: infinities as strings
    frame = nvdlfw_inspect.read_stats(log_dir)
    assert list(frame.columns) == ["rank", "layer", "tensor", "stat", "iteration", "value"]
    assert len(frame) == len(records) == 12 * (2 * 2 * 2 + 2)
    row = frame[(frame.layer == "model.fc2") & (frame.tensor == "activation") & (frame.stat == "max") & (frame.iteration == 7)]
    assert row.value.item() == math.inf
    text = {(s.layer, s.tensor, s.stat, s.iteration): s.value for s in iter_statistics(log_dir)}
    assert text[("model.fc1", "activation", "underflows%", 3)] >= 0


def test_text_logs_alone_are_read_too(log_dir):
    train(log_dir, steps=2)
    for path in (log_dir / "nvdlfw_inspect_statistics_jsonl").glob("*.jsonl"):
        path.unlink()
    stats = list(iter_statistics(log_dir))
    assert {(s.layer, s.tensor) for s in stats} == {(f"model.fc{i}", t) for i in (1, 2) for t in ("activation", "gradient")}
    assert split_name("decoder.1.mlp.fc1_gradient_fp8_current_scaling_mse") == (
        "decoder.1.mlp.fc1",
        "gradient",
        "fp8_current_scaling_mse",
    )
    assert split_name("custom_name") == ("custom_name", "", "")


def test_report_data_groups_series_and_ranks_risks():
    stats = [Statistic(r, "l0", "activation", "underflows%", it, float(it * (r + 1))) for r in (0, 1) for it in range(5)]
    stats += [Statistic(0, "l1", "gradient", "dynamic_range", it, [3.0, math.nan, math.inf, 1.0, 2.0][it]) for it in range(5)]
    stats += [Statistic(0, "l2", "weight", "max", 0, 1.0), Statistic(0, "l2", "weight", "min", 0, 1 / 3)]
    data = report_data(stats, "t")
    assert data["layers"] == ["l0", "l1", "l2"] and data["ranks"] == [0, 1]
    assert natural_order(["m.10.fc", "m.9.fc", "m.1.fc2", "m.1.fc10"]) == ["m.1.fc2", "m.1.fc10", "m.9.fc", "m.10.fc"]
    assert data["iterations"] == [[0, 1, 2, 3, 4], [0]]  # shared by the series that have them
    series = {(s["layer"], s["tensor"], s["stat"], s["rank"]): s for s in data["series"]}
    assert [s["it"] for s in data["series"]] == [0, 0, 0, 1, 1]
    assert series[(2, "weight", "min", 0)]["v"] == [0.333333]  # six significant digits
    assert series[(0, "activation", "underflows%", 1)]["v"] == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert series[(1, "gradient", "dynamic_range", 0)]["v"] == [3.0, None, "inf", 1.0, 2.0]
    assert series[(1, "gradient", "dynamic_range", 0)]["direction"] == "backward"
    assert series[(2, "weight", "max", 0)]["heatmap"] is None
    risks = [(r["layer"], r["tensor"], sorted(r["stats"]), r["nonfinite"], r["status"]) for r in data["risks"]]
    assert risks == [  # NaN or inf first; only logged statistics (l2 logs no underflows%: no row, no zero)
        ("l1", "gradient", ["dynamic_range"], 1, []),
        ("l0", "activation", ["underflows%"], None, ["underflows%: problem"]),
    ]
    assert data["risks"][1]["stats"]["underflows%"]["persistent"] == 8.0
    assert [f["kind"] for f in data["findings"]] == ["nonfinite", "underflow"]
    assert heatmap_kind("fp8_current_scaling_underflows%_columnwise") == "underflows%"
    assert (
        heatmap_kind("dynamic_range") == "dynamic_range"
        and heatmap_kind("max_blockwise_dynamic_range_block_size_32_dims_1") is None
    )


def test_the_end_of_run_of_a_tensor_that_ends_in_nan_is_nan(tmp_path):
    nan_run(tmp_path / "run", nan_step=6)
    rows = {(r["layer"], r["tensor"]): r for r in report_data(iter_statistics(tmp_path / "run"), "t")["risks"]}
    broken = rows[("model.fc2", "activation")]
    assert broken["nonfinite"] == 6 and broken["stats"]["dynamic_range"]["persistent"] is None  # NaN, as the page reads it
    assert broken["stats"]["dynamic_range"]["worst"] > 0  # its finite values, as before
    assert rows[("model.fc1", "activation")]["stats"]["dynamic_range"]["persistent"] > 0  # fc1 stays finite


@needs_browser
def test_the_page_shows_nan_at_the_end_of_run_of_a_tensor_that_ends_in_nan(tmp_path):
    nan_run(tmp_path / "run", nan_step=6)
    html, errors = dom(write_report(tmp_path / "run", tmp_path / "report.html"))
    assert errors == [] and '<td class="bad"><div>NaN</div>' in html  # its JSON null read back as NaN, marked


def test_render_is_self_contained_and_escapes():
    data = report_data([Statistic(0, "</script><b>", "activation", "max", 0, 1.0)], "a <title>")
    page = render(data)
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page
    assert "<b>" not in page.split('<script id="data"', 1)[0] and "&lt;title&gt;" in page
    payload = page.split('<script id="data" type="application/json">', 1)[1].split("</script>", 1)[0]
    assert json.loads(payload.replace("<\\/", "</"))["layers"] == ["</script><b>"]


def test_multi_rank_run(log_dir, tmp_path):
    train(log_dir, steps=3)
    stats_dir = log_dir / "nvdlfw_inspect_statistics_jsonl"
    rank1 = [json.loads(line) | {"rank": 1, "value": 5.0} for line in (stats_dir / "nvdlfw_inspect_globalrank-0.jsonl").open()]
    (stats_dir / "nvdlfw_inspect_globalrank-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rank1))
    frame = nvdlfw_inspect.read_stats(log_dir)
    assert sorted(frame["rank"].unique()) == [0, 1] and (frame[frame["rank"] == 1].value == 5.0).all()
    out = write_report(log_dir, tmp_path / "r.html")
    assert '"ranks":[0,1]' in out.read_text()


def test_errors_name_the_problem(log_dir):
    with pytest.raises(FileNotFoundError, match="no statistics in"):
        write_report(log_dir)
    stats_dir = log_dir / "nvdlfw_inspect_statistics_jsonl"
    stats_dir.mkdir(parents=True)
    (stats_dir / "nvdlfw_inspect_globalrank-0.jsonl").write_text('{"layer": "a"}\n')
    with (
        pytest.warns(reading.SkippedRecordsWarning, match=r"globalrank-0.jsonl:1: skipped 1 line .*no field 'tensor'"),
        pytest.raises(ValueError, match="no statistics were logged in"),
    ):
        write_report(log_dir)


def test_records_are_parsed_in_chunks_and_a_bad_line_is_skipped_and_named(log_dir, monkeypatch):
    monkeypatch.setattr(reading, "RECORDS_PER_PARSE", 3)
    path = log_dir / "nvdlfw_inspect_statistics_jsonl" / "nvdlfw_inspect_globalrank-2.jsonl"
    path.parent.mkdir(parents=True)
    good = [{"layer": "l", "tensor": "activation", "stat": "max", "iteration": i, "value": i / 2} for i in range(7)]
    path.write_text("".join(json.dumps(r) + "\n" for r in good[:4]) + "\n" + "".join(json.dumps(r) + "\n" for r in good[4:]))
    assert [(s.rank, s.iteration, s.value) for s in iter_statistics(log_dir)] == [(2, i, i / 2) for i in range(7)]
    with path.open("a") as file:
        file.write('{"layer": "l", "tensor": "activation", "stat": "max", "iteration": "x", "value": 1}\n')
    with pytest.warns(reading.SkippedRecordsWarning, match=r"globalrank-2.jsonl:9: skipped 1 line .*iteration is 'x'"):
        assert len(list(iter_statistics(log_dir))) == 7


@needs_browser
def test_page_loads_without_console_errors_and_draws(log_dir, tmp_path):
    train(log_dir)
    page = write_report(log_dir, tmp_path / "report.html")
    html, errors = dom(page)
    assert errors == []
    assert 'data-ready="true"' in html
    assert re.search(r'<path d="M[\d.]+,[\d.]+L', html)  # line charts drawn
    assert html.count("<canvas") >= 3  # heatmaps: activation dynamic_range and underflows%, gradient dynamic_range
    assert '<a href="#layer-1">model.fc2</a>' in html  # the risk table links the layer with inf first
    assert html.index("model.fc2</a>") < html.index("model.fc1</a>")
    labels = re.search(r'<div class="row-labels">(.*?)</div></div>', html).group(1)  # heatmap rows named
    assert re.findall(r'title="([^"]+)"', labels) == ["model.fc1", "model.fc2"]
    assert '<div class="axis"><span>iteration 0</span><span>11</span></div>' in html


@needs_browser
def test_screenshot_shows_the_report(log_dir, tmp_path):
    from PIL import Image

    train(log_dir)
    page = write_report(log_dir, tmp_path / "report.html")
    shot = tmp_path / "shot.png"
    assert screenshot(page, shot) == []
    image = Image.open(shot).convert("RGB")
    assert image.size == (1300, 1800)
    colors = image.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 50  # text, lines and heatmap cells, not a blank page
    assert any(calm_green(color) for _, color in colors)  # the heatmaps: every value within its threshold


@needs_browser
def test_a_run_without_fp8_statistics_says_what_was_not_measured(log_dir, tmp_path):
    train(log_dir, steps=4, fp8_stats=False)
    html, errors = dom(write_report(log_dir, tmp_path / "report.html"))
    assert errors == []
    summary = re.search(r'<p id="diagnosis-summary">(.*?)</p>', html).group(1)
    assert summary.startswith("No NaN or inf, and nothing persists over its threshold among what was logged (")
    assert summary.endswith(
        "Not measured: underflows% and overflows% were not logged: add LogFp8TensorStats to measure them (overflows% exists "
        "under delayed scaling only); underflow judged from dynamic_range alone, overflow not checked."
    )


ALARM = (128, 0, 38)  # the heatmaps' alarm colour: the largest value over the threshold


def calm_green(rgb: tuple[int, int, int]) -> bool:
    """A colour of the heatmaps' calm scale, (247, 252, 245) to (161, 217, 155), away from its white end."""
    r, g, b = rgb
    s = (247 - r) / 86
    return 0.2 < s <= 1 and abs(g - (252 - 35 * s)) <= 2 and abs(b - (245 - 90 * s)) <= 2


def heatmap_page(tmp_path: Path, name: str, tensor: str, largest: float) -> Path:
    """A page with one overflows% heatmap: four layers over 40 iterations, every value in [0, ``largest``]."""
    stats = [
        Statistic(0, f"l{layer}", tensor, "overflows%", i, largest * ((i + layer) % 7) / 6)
        for layer in range(4)
        for i in range(40)
    ]
    page = tmp_path / f"{name}.html"
    page.write_text(render(report_data(stats, name)))
    return page


def test_heatmap_series_carry_the_thresholds_of_the_diagnosis():
    stats = [Statistic(0, "l", t, s, 0, 1.0) for t, s in [("gradient", "overflows%"), ("output", "dynamic_range")]]
    stats += [
        Statistic(0, "l", "activation", s, 0, 1.0) for s in ("underflows%", "dynamic_range", "fp8_current_scaling_underflows%")
    ]
    thresholds = Thresholds(underflow_pct=2.5, overflow_pct=0.5, fp8_format="E5M2")
    series = {(s["tensor"], s["stat"]): s["threshold"] for s in report_data(stats, "t", thresholds)["series"]}
    assert series == {
        ("gradient", "overflows%"): 0.5,
        ("activation", "underflows%"): 2.5,
        ("activation", "dynamic_range"): thresholds.range_limit("activation"),  # E5M2's range
        ("output", "dynamic_range"): None,  # GEMM outputs stay in high precision: no threshold
        ("activation", "fp8_current_scaling_underflows%"): None,  # a what-if recipe: not judged
    }


@needs_browser
def test_heatmaps_are_coloured_against_the_thresholds_across_the_page(tmp_path):
    from PIL import Image

    colours = {}
    for name, tensor, largest in [("calm", "activation", 0.0099), ("over", "gradient", 5.0)]:  # overflows% threshold: 0.1
        shot = tmp_path / f"{name}.png"
        assert screenshot(heatmap_page(tmp_path, name, tensor, largest), shot) == []
        colours[name] = Image.open(shot).convert("RGB")
    calm = colours["calm"].getcolors(maxcolors=1 << 20)
    assert ALARM not in {c for _, c in calm}  # 10x under its threshold: not the alarm colour (it was the map's maximum)
    assert any(calm_green(color) for _, color in calm)
    over = colours["over"]
    alarm = [x for x in range(over.width) for y in range(0, over.height, 4) if over.getpixel((x, y)) == ALARM]
    assert alarm and max(alarm) - min(alarm) > over.width / 2  # drawn, and across the page's width


@needs_browser
def test_the_page_lists_a_tensor_unlike_its_peers(tmp_path):
    stats = [
        Statistic(0, f"model.layers.{layer}.fc", "weight", "cur_amax", i, (851.0 if layer == 2 else 0.08) * (1 + 0.01 * i))
        for layer in range(4)
        for i in range(8)
    ]
    page = tmp_path / "peers.html"
    page.write_text(render(report_data(stats, "peers")))
    html, errors = dom(page)
    findings = re.search(r'<ol id="findings">(.*?)</ol>', html).group(1)
    assert errors == [] and "model.layers.2.fc</a> weight: <b>unlike its peers</b>" in findings
    assert "3 peers (model.layers.*.fc)" in findings and "model.layers.0.fc" not in findings


def routing_run(log_dir: Path) -> None:
    """Iterations 0-1 without a recipe, 2-3 under one; fc1's wgrad in high precision (DisableFP8GEMM), fc2's fprop
    activation fake-quantized; fc0 logs statistics only."""
    sections = {
        "stats": {"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max"]}},
        "fc1": {"DisableFP8GEMM": {"enabled": True, "gemms": ["wgrad"]}},
        "fc2": {"FakeQuant": {"enabled": True, "gemms": ["fprop"], "tensors": ["activation"], "quant_format": "FP8E4M3"}},
    }
    selects = {"stats": ".*", "fc1": "fc1", "fc2": "fc2"}
    config = {
        name: {"enabled": True, "layers": {"layer_name_regex_pattern": selects[name]}, "transformer_engine": features}
        for name, features in sections.items()
    }
    debug_api.initialize(config_file=config, feature_dirs=[lowprec.FEATURE_DIR], log_dir=str(log_dir))
    torch.manual_seed(0)
    layers = [lowprec.Linear(8, 8, name=f"model.fc{i}") for i in (2, 0, 1)]  # model order, not name order
    for step in range(4):
        with lowprec.fp8_autocast(enabled=step >= 2):
            x = torch.randn(4, 8)
            for layer in layers:
                x = layer(x)
        x.sum().backward()
        debug_api.step()
    debug_api.end_debug()


def test_precision_map_data_from_routing_records():
    def record(rank, layer, gemm, tensor, decision, feature=None, recipe=True, iteration=0):
        return RoutingRecord(rank, layer, gemm, tensor, decision, feature, recipe, iteration)

    records = [
        record(0, "b", "fprop", "activation", "fp8"),
        record(0, "b", "fprop", "weight", "fp8"),
        record(0, "b", "fprop", "output", "modified", "Scale"),
        record(0, "b", "fprop", "weight", "high_precision", "Off", iteration=5),
        record(0, "b", "fprop", "output", "high_precision", iteration=7),  # no longer modified
        record(1, "a", "wgrad", "gradient", "high_precision", recipe=False),
        record(2, "a", "wgrad", "gradient", "fp8"),
    ]
    data = report_data([Statistic(0, "b", "activation", "max", 0, 1.0)], "t", routing=records)["precision_map"]
    assert data["gemms"] == ["fprop", "dgrad", "wgrad"] and data["layers"] == ["b", "a"]  # first written first
    fp8 = {"decision": "fp8", "feature": None, "recipe": True}
    modified = {"decision": "modified", "feature": "Scale", "recipe": True}
    off = {"decision": "high_precision", "feature": "Off", "recipe": True}
    assert data["cells"][0] == [
        [
            {"from": 0, "parts": [{"tensor": "activation"} | fp8, {"tensor": "weight"} | fp8, {"tensor": "output"} | modified]},
            {"from": 5, "parts": [{"tensor": "activation"} | fp8, {"tensor": "weight"} | off, {"tensor": "output"} | modified]},
            {"from": 7, "parts": [{"tensor": "activation"} | fp8, {"tensor": "weight"} | off]},
        ],
        [],
        [],
    ]
    no_recipe = {"tensor": "gradient", "decision": "high_precision", "feature": None, "recipe": False}
    assert data["cells"][1] == [[], [], [{"from": 0, "parts": [no_recipe]}]]  # rank 1's, the lowest rank recording it
    assert data["ranks_differ"] == ["a"]
    assert report_data([Statistic(0, "b", "activation", "max", 0, 1.0)], "t")["precision_map"]["layers"] == []


@needs_browser
def test_the_page_maps_what_each_gemm_consumed(log_dir, tmp_path):
    routing_run(log_dir)
    html, errors = dom(write_report(log_dir, tmp_path / "report.html"))
    assert errors == []
    table = re.search(r'<table id="precision-map">.*?<tbody>(.*?)</tbody>', html).group(1)
    rows = {}
    for row in re.findall(r"<tr>(.*?)</tr>", table):
        name, *cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
        rows[re.sub(r"<[^>]+>", "", name)] = [re.findall(r'<div class="(route [\w-]+|sub)">(.*?)</div>', cell) for cell in cells]
    assert list(rows) == ["model.fc2", "model.fc0", "model.fc1"]
    plain = [("route route-norecipe", "high precision (no recipe)"), ("sub", "from iteration 0")]
    plain += [("route route-fp8", "FP8 delayed scaling"), ("sub", "from iteration 2")]
    assert rows["model.fc0"] == [plain] * 3
    wgrad_off = plain[:2] + [("route route-hp", "high precision \u2014 DisableFP8GEMM"), ("sub", "from iteration 2")]
    assert rows["model.fc1"] == [plain, plain, wgrad_off]
    assert rows["model.fc2"][0] == [
        ("route route-modified", "activation: FakeQuant"),
        ("route route-norecipe", "weight: high precision (no recipe)"),
        ("sub", "from iteration 0"),
        ("route route-modified", "activation: FakeQuant"),
        ("route route-hp", "weight: high precision \u2014 FakeQuant"),
        ("sub", "from iteration 2"),
    ]
    assert rows["model.fc2"][1:] == [plain, plain]
    assert '<div id="precision-legend" class="legend"><span class="route route-fp8">FP8' in html


@needs_browser
def test_a_run_without_routing_records_says_so(log_dir, tmp_path):
    routing_run(log_dir)
    for path in (log_dir / "nvdlfw_inspect_routing_jsonl").iterdir():
        path.unlink()
    html, errors = dom(write_report(log_dir, tmp_path / "report.html"))
    assert errors == []
    note = re.search(r'<p class="note" id="precision-note">(.*?)</p>', html).group(1)
    assert note.startswith("No routing records in this run") and '<table id="precision-map" hidden="">' in html


@needs_browser
@pytest.mark.parametrize(
    "plant, expected",
    [
        (nan_run, ("model.fc2", "FP8 delayed scaling", "activation", "NaN or inf")),
        (outlier_channel_run, ("model.proj", "FP8 delayed scaling", "activation", "underflow")),
        (scaled_weight_run, ("model.layers.2.0", "FP8 current scaling", "weight", "unlike its peers")),
        (planted_run, ("model.grow", "FP8 delayed scaling", "activation", "overflow")),
    ],
)
def test_each_planted_problem_heads_the_page(tmp_path, plant, expected):
    """What a person sees first on the page of each planted run is the problem planted in it, in its layer's format."""
    plant(tmp_path / "run")
    html, errors = dom(write_report(tmp_path / "run", tmp_path / "report.html"))
    first = re.search(r'<ol id="findings">\s*<li[^>]*>(.*?)</li>', html, re.S).group(1)
    layer, fmt, tensor, kind = expected
    assert errors == [] and f'{layer}</a><span class="format"> ({fmt})</span> {tensor}: <b>{kind}</b>' in first


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("mixed")
    mixed_formats_run(log_dir)
    return log_dir


def test_the_risk_table_and_thresholds_follow_each_layers_format(mixed_run):
    """Under a precision plan: each row names its layer's format; a dynamic range is judged against the FP8 element's
    range in the per-tensor FP8 layer only, and shown without a threshold in the others."""
    data = report_data(iter_statistics(mixed_run), "t", routing=read_routing(mixed_run))
    rows = {(r["layer"], r["tensor"]): r for r in data["risks"]}
    assert {key: r["format"] for key, r in rows.items() if key[1] != "weight"} == {
        ("model.fp8", "activation"): "FP8 current scaling",
        ("model.fp8", "gradient"): "FP8 current scaling",
        ("model.nvfp4", "activation"): "NVFP4",
        ("model.nvfp4", "gradient"): "NVFP4",
        ("model.mixed", "activation"): "MXFP8 in fprop, NVFP4 in wgrad",
        ("model.mixed", "gradient"): "NVFP4",
        ("model.hp", "activation"): "high precision",
        ("model.hp", "gradient"): "high precision",
    }
    ranges = {key: r["stats"]["dynamic_range"]["threshold"] for key, r in rows.items()}
    assert ranges[("model.fp8", "activation")] == 17.8074 and ranges[("model.fp8", "gradient")] == 31.8074  # HYBRID
    assert all(limit is None for (layer, _), limit in ranges.items() if layer != "model.fp8")  # block formats, high precision
    assert rows[("model.mixed", "gradient")]["stats"]["dynamic_range"]["persistent"] > 39  # shown: beyond E5M2, not judged
    assert rows[("model.mixed", "gradient")]["status"] == []
    thresholds = {
        (data["layers"][s["layer"]], s["tensor"]): s["threshold"] for s in data["series"] if s["stat"] == "dynamic_range"
    }
    assert thresholds == {key: None if limit is None else pytest.approx(limit, abs=1e-4) for key, limit in ranges.items()}
    # ranked on the end of the run against each format's threshold: NVFP4's ~75% is 3x its 25.1%, the others' ~26% 26x 1%
    assert [f["format_name"] for f in data["findings"]] == ["MXFP8 in fprop, NVFP4 in wgrad", "FP8 current scaling", "NVFP4"]
    assert rows[("model.nvfp4", "activation")]["stats"]["underflows%"]["threshold"] == 25.1
    assert rows[("model.fp8", "activation")]["stats"]["underflows%"]["threshold"] == 1
    assert data["skipped"].endswith(
        "model.mixed (MXFP8, NVFP4), model.nvfp4 (NVFP4); nor to high precision (no recipe casts it): model.hp"
    )


@needs_browser
def test_the_page_names_each_layers_format(mixed_run, tmp_path):
    html, errors = dom(write_report(mixed_run, tmp_path / "report.html"), height=4000)
    assert errors == []
    findings = re.search(r'<ol id="findings">(.*?)</ol>', html).group(1)
    heads = re.findall(r'<a href="#layer-\d+">([^<]+)</a><span class="format"> \(([^<]+)\)</span> (\w+): <b>', findings)
    assert heads == [
        ("model.mixed", "MXFP8 in fprop, NVFP4 in wgrad", "activation"),
        ("model.fp8", "FP8 current scaling", "activation"),
        ("model.nvfp4", "NVFP4", "activation"),
    ]
    summary = re.search(r'<p id="diagnosis-summary">(.*?)</p>', html).group(1)
    assert (
        "Skipped: the checks of a per-tensor FP8 scale" in summary
        and "nor to high precision (no recipe casts it): model.hp." in summary
    )
    body = re.search(r'<table id="risks">.*?<tbody>(.*?)</tbody>', html).group(1)
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", body)]
    assert [re.sub(r"<[^>]+>", "", row[0]) for row in cells[:3]] == ["model.mixed", "model.fp8", "model.nvfp4"]
    assert [row[2] for row in cells[:3]] == ["MXFP8 in fprop, NVFP4 in wgrad", "FP8 current scaling", "NVFP4"]
    assert "not judged: no per-tensor FP8 scale; worst" in cells[2][5] and "over 17.807 in 100%" in cells[1][5]
    legends = dict(re.findall(r'<div class="caption">([^<]*)</div><div class="legend">(.*?)</div>', html))
    assert "(no threshold: its layers' formats differ)" in legends["activation dynamic_range"]
    # underflows% too: NVFP4's calibrated threshold is not the 1% of the FP8 layers
    assert "(no threshold: its layers' formats differ)" in legends["activation underflows%"]
