"""The report ranks on what persists, marks warm-up transients, shows only what was logged, gives its
heatmaps a colour scale, and opens with the same diagnosis as ``nvdlfw-inspect diagnose``."""

from __future__ import annotations

import html
import re

import pytest
import yaml
from browser import CHROMIUM, dom
from planted_runs import planted_run

from nvdlfw_inspect.diagnose import Thresholds, diagnose, diagnose_statistics
from nvdlfw_inspect.reading import Statistic
from nvdlfw_inspect.report import render, report_data, write_report

needs_browser = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (scripts/test.sh installs it)")


def series(layer: str, tensor: str, stat: str, values: list[float], every: int = 5) -> list[Statistic]:
    return [Statistic(0, layer, tensor, stat, i * every, float(v)) for i, v in enumerate(values)]


def issue_run() -> list[Statistic]:
    """The issue's run: maxima of 92.66% and 88% at iteration 0 (delayed scaling's scale still 1), at most
    0.24% later; and one layer whose gradient keeps losing 2%."""
    stats = series("gpt.head", "gradient", "underflows%", [92.66] + [0.24, 0.0, 0.1] * 4)
    stats += series("gpt.layers.0.self_attention.layernorm_qkv", "gradient", "underflows%", [88.0] + [0.1] * 12)
    stats += series("gpt.layers.0.layernorm_mlp.fc1", "gradient", "underflows%", [70.0] + [2.0] * 12)
    return stats


def test_risks_rank_on_what_persists_and_mark_warm_up_transients():
    data = report_data(issue_run(), "t")
    rows = [(r["layer"], r["problem"], r["status"]) for r in data["risks"]]
    assert rows == [
        ("gpt.layers.0.layernorm_mlp.fc1", True, ["underflows%: problem"]),
        ("gpt.head", False, ["underflows%: warm-up transient"]),  # ends at 0.1 like the next: then by name
        ("gpt.layers.0.self_attention.layernorm_qkv", False, ["underflows%: warm-up transient"]),
    ]
    head = data["risks"][1]["stats"]["underflows%"]
    assert head == {
        "persistent": 0.1,
        "threshold": 1.0,
        "above": 0.0,
        "worst": 0.24,  # after warm-up
        "worst_iteration": 5,
        "warmup_only": False,
        "warmup_worst": 92.66,  # set aside: the page names it after the worst
        "warmup_worst_iteration": 0,
    }
    assert data["warmup_end"] == 1  # the heatmaps' colour scales start at iteration 1
    assert [(f["layer"], f["kind"], f["first_iteration"]) for f in data["findings"]] == [
        ("gpt.layers.0.layernorm_mlp.fc1", "underflow", 5)
    ]
    assert yaml.safe_load(data["config_yaml"]) == diagnose_statistics(issue_run()).config


def test_a_wide_range_whose_loss_is_measured_is_a_caution_not_a_problem():
    stats = series("l", "gradient", "dynamic_range", [40.0] * 8) + series("l", "gradient", "underflows%", [0.1] * 8)
    data = report_data(stats, "t")
    (row,) = data["risks"]
    caution = "dynamic_range: caution, beyond the format's range (underflows% measures the loss)"
    assert (row["problem"], row["caution"], row["status"]) == (False, True, [caution]) and data["findings"] == []
    (row,) = report_data(stats[:8], "t")["risks"]
    assert (row["problem"], row["caution"], row["status"]) == (True, False, ["dynamic_range: problem"])


def test_a_tensor_over_only_in_warm_up_is_no_caution_and_ranks_below_the_real_problem():
    """Issue 36: the first iterations dominated the table. A tensor over its thresholds at iteration 0 alone (its
    dynamic range too) is a warm-up transient, below a tensor whose loss persists; a run all warm-up shows its values."""
    stats = series("spike", "gradient", "dynamic_range", [40.0] + [10.0] * 7)
    stats += series("spike", "gradient", "underflows%", [95.0] + [0.1] * 7)
    stats += series("real", "activation", "underflows%", [0.0] * 3 + [4.0] * 5)
    data = report_data(stats, "t")
    assert [(r["layer"], r["problem"], r["caution"], r["status"]) for r in data["risks"]] == [
        ("real", True, False, ["underflows%: problem"]),
        ("spike", False, False, ["dynamic_range: warm-up transient", "underflows%: warm-up transient"]),
    ]
    spike = data["risks"][1]["stats"]
    assert (spike["dynamic_range"]["worst"], spike["dynamic_range"]["warmup_worst"]) == (10.0, 40.0)
    assert (spike["underflows%"]["worst"], spike["underflows%"]["warmup_worst"]) == (0.1, 95.0)
    late = report_data([Statistic(0, "l", "gradient", "underflows%", 10 + i, v) for i, v in enumerate([9.0, 0.5])], "t")
    assert late["warmup_end"] == 11  # counted from the run's first iteration
    everything = report_data(stats, "t", Thresholds(warmup=40))  # no longer than its warm-up: its values, said so
    row = next(r for r in everything["risks"] if r["layer"] == "spike")
    spike = row["stats"]["dynamic_range"]
    assert (spike["worst"], spike["worst_iteration"], spike["warmup_only"], spike["warmup_worst"]) == (40.0, 0, True, None)
    assert row["status"] == ["dynamic_range: transient", "underflows%: transient"]  # the warm-up is all there is
    assert everything["caution"].startswith("every statistic is from iterations 0 to 35, all in the warm-up")


def test_the_table_agrees_with_the_diagnosis_row_for_row():
    """The issue's demo page: "nothing persists" above 25 tensors at risk. Problems are exactly the findings, in
    their order, above the cautions; a row's status names the finding's statistic."""
    stats = series("wide", "gradient", "dynamic_range", [40.0] * 8) + series("wide", "gradient", "underflows%", [0.1] * 8)
    stats += series("lossy", "gradient", "underflows%", [0.0] + [3.0] * 7) + series(
        "worse", "activation", "underflows%", [9.0] * 8
    )
    stats += [
        Statistic(0, f"b.{i}.fc", "weight", "cur_amax", j * 5, 900.0 if i == 1 else 0.1) for i in range(3) for j in range(8)
    ]
    data = report_data(stats, "t")
    findings = [(f["layer"], f["tensor"]) for f in data["findings"]]
    problems = [(r["layer"], r["tensor"]) for r in data["risks"] if r["problem"]]
    assert problems == findings == [("worse", "activation"), ("lossy", "gradient"), ("b.1.fc", "weight")]
    assert [r["layer"] for r in data["risks"]] == ["worse", "lossy", "b.1.fc", "wide"]
    assert [r["caution"] for r in data["risks"]] == [False, False, False, True]
    assert data["risks"][2]["status"] == ["cur_amax: problem"] and data["risks"][2]["stats"] == {}


def test_only_logged_statistics_make_rows():
    """A base-namespace run logs no underflows%: no row says 0 for it, and there is no finding."""
    stats = series("model.fc1", "activation", "max", [1, 2, 3]) + series("model.fc1", "activation", "std", [1, 1, 1])
    data = report_data(stats, "t")
    assert data["risks"] == [] and data["findings"] == [] and data["config_yaml"] is None
    with_range = report_data(stats + series("model.fc1", "activation", "dynamic_range", [12, 13, 14]), "t")
    assert [(list(r["stats"]), r["stats"]["dynamic_range"]["threshold"], r["status"]) for r in with_range["risks"]] == [
        (["dynamic_range"], 17.8074, [])
    ]


@needs_browser
def test_page_draws_legends_states_flat_maps_and_zero_charts(tmp_path):
    stats = issue_run()
    stats += series("gpt.head", "gradient", "overflows%", [0.0] * 13)  # all zero: a sentence, not a blank map
    page = tmp_path / "report.html"
    page.write_text(render(report_data(stats, "t")), encoding="utf-8")
    text, errors = dom(page, height=4000)
    assert errors == []
    flat = "gradient overflows%: 0 in every logged cell, within its threshold 0.1 (1 layer, iterations 0 to 60)"
    assert f'<p class="flat">{flat}</p>' in text
    (legend,) = re.findall(r'<div class="legend">(.*?)</div>', text)  # the one drawn heatmap: gradient underflows%
    bar = "<canvas [^>]*></canvas>"  # calm up to the threshold, then warning to alarm up to the largest after warm-up
    warm = r'<span class="swatch"><i [^>]*></i>warm-up \(before iteration 1\): faded, outside the scale</span>'
    assert re.fullmatch(rf"<span>0</span>{bar}<span>threshold 1</span>{bar}<span>2</span>{warm}", legend)
    charts = dict(re.findall(r'<div class="caption">([^<]+)</div><svg[^>]*>(.*?)</svg>', text))
    zero_axis = re.findall(r"<text [^>]*>([^<]*)</text>", charts["gradient overflows%"])
    assert zero_axis[:2] == ["1", "0"]  # 0..1, not -1..1
    assert text.index('id="findings"') < text.index('id="risks"') < text.index('id="heatmaps"')
    assert "underflows%: warm-up transient" in text and "over 1 in 0%; worst 0.24 at 5; warm-up 92.66 at 0" in text
    unknown = '<td class="unlogged" title="no format in the routing records: judged as FP8 (HYBRID)">-</td>'
    assert text.count(unknown) == 3  # no routing records: each row's format is the run-wide one
    page.write_text(render(report_data(stats, "t", Thresholds(warmup=100))), encoding="utf-8")  # all warm-up
    text, errors = dom(page, height=4000)
    assert errors == []
    (legend,) = re.findall(r'<div class="legend">(.*?)</div>', text)
    all_warmup = "<span>every iteration is warm-up \\(before 100\\): its values set the scale</span>"
    assert re.fullmatch(rf"<span>0</span>{bar}<span>threshold 1</span>{bar}<span>92\.66</span>{all_warmup}", legend)
    assert "over 1 in 8%; worst 92.66 at 0 (all warm-up)" in text


@needs_browser
def test_page_opens_with_the_diagnosis(tmp_path):
    log_dir = tmp_path / "run"
    planted_run(log_dir)
    text, errors = dom(write_report(log_dir, tmp_path / "report.html"), height=3000)
    assert errors == []
    diagnosis = diagnose(log_dir)
    findings = re.search(r'<ol id="findings">(.*?)</ol>', text).group(1)
    shown = re.findall(r'<a href="#layer-\d+">([^<]+)</a><span class="format"> \(([^<]+)\)</span> (\w+): <b>', findings)
    assert shown == [(f.layer, "FP8 delayed scaling", f.tensor) for f in diagnosis.findings]
    assert "fix: DisableFP8GEMM on dgrad and wgrad:" in findings
    config = html.unescape(re.search(r'<details id="remedy-config"><summary>.*?</summary><pre>(.*?)</pre>', text, re.S).group(1))
    assert yaml.safe_load(config) == diagnosis.config
    assert text.count('<div class="legend">') == len(re.findall(r'<div class="heatmap">', text))
