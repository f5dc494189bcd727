"""The report's top ("First signs"): the run's first non-finite value (NonfiniteGuard's record in the debug log, else
the first statistic logged as NaN or inf) and every early warning (diagnose's growth findings) with where it began,
from the logs of planted runs, rendered in a real headless browser; "Most at risk" marks the growth findings."""

from __future__ import annotations

import argparse
import io
import json
import re
import warnings

import pytest
from browser import CHROMIUM, dom
from planted_trends import growing_channel_run

from nvdlfw_inspect.diagnose import diagnose
from nvdlfw_inspect.diagnose.command import add_arguments, run
from nvdlfw_inspect.diagnose.findings import GROWTH_KINDS
from nvdlfw_inspect.reading import (
    AppendedRunsWarning,
    NonfiniteRecord,
    SkippedRecordsWarning,
    iter_statistics,
    read_nonfinite,
    read_routing,
)
from nvdlfw_inspect.report import report_data, write_report

needs_browser = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (scripts/test.sh installs it)")


def planted(tmp_path_factory, name: str, **options):
    log_dir = tmp_path_factory.mktemp(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the guard's warnings, one per poisoned step
        growing_channel_run(log_dir, **options)
    return log_dir


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """The growing-channel run (growth from iteration 6, NaN from 20) with NonfiniteGuard."""
    return planted(tmp_path_factory, "guarded", guard=True)


@pytest.fixture(scope="module")
def unguarded(tmp_path_factory):
    return planted(tmp_path_factory, "unguarded")


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    return planted(tmp_path_factory, "healthy", growth=1.0)


def top(html: str) -> tuple[str, list[str], str]:
    """The page's first section as text: the first non-finite value, the early warnings' note and items."""
    section = re.search(r'<section id="first-signs">(.*?)</section>', html, re.S).group(1)
    text = lambda fragment: re.sub(r"<[^>]+>", "", fragment)  # noqa: E731
    first = text(re.search(r'<p id="first-nonfinite"[^>]*>(.*?)</p>', section).group(1))
    note = text(re.search(r'<p id="early-warnings-note">(.*?)</p>', section).group(1))
    return first, [text(item) for item in re.findall(r"<li[^>]*>(.*?)</li>", section)], note


def test_the_guard_leaves_a_record_in_the_debug_log_that_reads_back(guarded):
    records = read_nonfinite(guarded)
    assert records[0] == NonfiniteRecord(0, 20, "model.fc2", "fprop", "output", 0)  # as its warning named it
    assert [r.iteration for r in records] == list(range(20, 30))  # one per poisoned step
    log = (guarded / "nvdlfw_inspect_logs" / "nvdlfw_inspect_globalrank-0.log").read_text()
    assert "NonfiniteGuard: non-finite values (NaN or inf) at step 20: first in layer model.fc2, tensor output" in log
    data = report_data(iter_statistics(guarded), "t", routing=read_routing(guarded), nonfinite=records)
    assert data["first_nonfinite"] == {
        "source": "guard",
        "rank": 0,
        "iteration": 20,
        "layer": "model.fc2",
        "gemm": "fprop",
        "tensor": "output",
        "micro_batch": 0,
    }


def test_a_run_without_the_guard_writes_no_record_and_the_statistics_name_the_first(unguarded):
    assert read_nonfinite(unguarded) == []
    data = report_data(iter_statistics(unguarded), "t")
    assert data["first_nonfinite"] == {
        "source": "statistics",
        "layer": "model.fc2",
        "tensor": "output",
        "stat": "kurtosis",
        "iteration": 20,
        "rank": 0,
    }


def test_early_warnings_are_every_growth_finding_the_earliest_first(unguarded):
    data = report_data(iter_statistics(unguarded), "t")
    growths = [f for f in diagnose(unguarded).findings if f.kind in GROWTH_KINDS]
    warnings_ = data["early_warnings"]
    assert len(warnings_) == len(growths) > 3
    assert {(w["layer"], w["tensor"], w["kind"], w["iteration"]) for w in warnings_} == {
        (f.layer, f.tensor, f.kind, f.first_iteration) for f in growths
    }
    assert warnings_[:2] == [
        {"layer": "model.fc1", "tensor": "activation", "kind": "kurtosis_growth", "stat": "kurtosis", "iteration": 6},
        {
            "layer": "model.fc1",
            "tensor": "activation",
            "kind": "outlier_channel_growth",
            "stat": "outlier_channel_ratio",
            "iteration": 6,
        },
    ]
    assert [w["iteration"] for w in warnings_] == sorted(w["iteration"] for w in warnings_)


def test_most_at_risk_marks_growth_findings_with_their_kind_and_onset(unguarded):
    """Before the loss diverged (iterations < 17), the growing channel's row is marked by its early warnings."""
    data = report_data((s for s in iter_statistics(unguarded) if s.iteration < 17), "t")
    (row,) = [r for r in data["risks"] if (r["layer"], r["tensor"]) == ("model.fc1", "activation")]
    assert row["problem"] and row["status"] == [
        "kurtosis: early warning, kurtosis_growth from iteration 6",
        "outlier_channel_ratio: early warning, outlier_channel_growth from iteration 6",
        "scale_inv_max: early warning, scale_drift from iteration 12",
    ]


@needs_browser
def test_the_page_opens_with_the_guards_first_nonfinite_and_the_early_warnings(guarded, tmp_path):
    html, errors = dom(write_report(guarded, tmp_path / "report.html"))
    assert errors == []
    assert html.index('id="first-signs"') < html.index("<h2>Diagnosis</h2>") < html.index("<h2>Layers</h2>")
    first, items, note = top(html)
    assert (
        first
        == "First non-finite value (NonfiniteGuard): model.fc2 output of the fprop GEMM, micro-batch 0, at step 20 (rank 0)."
    )
    assert note.startswith("13 early warnings (a statistic that grows over its start, before the loss shows it)")
    assert items[:3] == [
        "model.fc1 activation: kurtosis grows (kurtosis_growth, kurtosis) from iteration 6",
        "model.fc1 activation: an outlier channel grows (outlier_channel_growth, outlier_channel_ratio) from iteration 6",
        "model.fc1 activation: the scale drifts up (scale_drift, scale_inv_max) from iteration 12",
    ]
    assert len(items) == 13
    body = re.search(r'<table id="risks">.*?<tbody>(.*?)</tbody>', html).group(1)
    assert '<td class="bad"><div>kurtosis: early warning, kurtosis_growth from iteration 17</div>' in body


@needs_browser
def test_without_the_guard_the_page_names_the_first_statistic_logged_as_nan_or_inf(unguarded, tmp_path):
    html, errors = dom(write_report(unguarded, tmp_path / "report.html"))
    first, items, _ = top(html)
    assert errors == [] and len(items) == 13
    assert first == (
        "First non-finite value (the first statistic logged as NaN or inf): model.fc2 output kurtosis, at iteration 20 (rank 0)."
    )


@needs_browser
def test_a_healthy_run_says_there_is_none_of_either_in_one_line(healthy, tmp_path):
    html, errors = dom(write_report(healthy, tmp_path / "report.html"))
    assert errors == [] and top(html) == ("No non-finite value logged.", [], "No early warning.")


def test_a_record_that_does_not_parse_is_skipped_and_named_and_another_ranks_is_read(tmp_path):
    logs = tmp_path / "nvdlfw_inspect_logs"
    logs.mkdir()
    line = "2026-01-01 00:00:00,000 - INFO - NonfiniteGuard record: "
    other = {"layer": None, "gemm": None, "tensor": None, "micro_batch": None, "iteration": 4, "rank": 1}
    (logs / "nvdlfw_inspect_globalrank-1.log").write_text(
        f"{line}{json.dumps(other)}\n{line}{{not json\n2026-01-01 00:00:00,000 - INFO - something else\n"
    )
    with pytest.warns(SkippedRecordsWarning, match=r"globalrank-1.log:2: skipped 1 line holding no NonfiniteGuard record"):
        records = read_nonfinite(tmp_path)
    assert records == [NonfiniteRecord(1, 4, None, None, None, None)]
    assert read_nonfinite(tmp_path / "missing") == []


@needs_browser
def test_a_guard_record_of_another_ranks_nan_is_said_so(tmp_path):
    from nvdlfw_inspect.reading import Statistic
    from nvdlfw_inspect.report import render

    record = NonfiniteRecord(1, 4, None, None, None, None)
    page = tmp_path / "other.html"
    page.write_text(render(report_data([Statistic(1, "l", "activation", "max", 4, 1.0)], "t", nonfinite=[record])))
    html, errors = dom(page)
    assert errors == [] and top(html)[0] == (
        "First non-finite value (NonfiniteGuard): step 4, on another rank of the reduction group (rank 1's tensors were finite)."
    )


def test_diagnose_prints_the_guards_first_record_and_puts_it_in_its_json(guarded, healthy, tmp_path):
    def diagnosed(log_dir, *flags) -> str:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        out = io.StringIO()
        run(parser.parse_args([str(log_dir), "--output", str(tmp_path / "remedies.yaml"), *flags]), out)
        return out.getvalue()

    printed = diagnosed(guarded).splitlines()
    assert printed[1] == (
        "first non-finite value (NonfiniteGuard): step 20, rank 0: layer model.fc2, tensor output of the fprop GEMM, "
        "micro-batch 0"
    )
    record = json.loads(diagnosed(guarded, "--json"))["first_nonfinite"]
    assert record == {"rank": 0, "iteration": 20, "layer": "model.fc2", "gemm": "fprop", "tensor": "output", "micro_batch": 0}
    assert "NonfiniteGuard" not in diagnosed(healthy) and json.loads(diagnosed(healthy, "--json"))["first_nonfinite"] is None


def test_records_of_runs_appended_to_one_log_are_said_once(tmp_path):
    logs = tmp_path / "nvdlfw_inspect_logs"
    logs.mkdir()
    line = "2026-01-01 00:00:00,000 - INFO - NonfiniteGuard record: "
    steps = [7, 8, 2, 3, 1]  # a run poisoned at 7 and 8, then two more appended (NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE=0)
    record = {"layer": "l", "gemm": "fprop", "tensor": "output", "micro_batch": 0, "rank": 0}
    (logs / "nvdlfw_inspect_globalrank-0.log").write_text(
        "".join(f"{line}{json.dumps(record | {'iteration': s})}\n" for s in steps)
    )
    with pytest.warns(AppendedRunsWarning, match=r"steps go back from 8 to 2 at line 3") as caught:
        records = read_nonfinite(tmp_path)
    assert [r.iteration for r in records] == steps and len(caught) == 1
