"""The first hour, end to end: the demo exhibits a real precision problem (attention logit growth makes the
gradient into a QKV projection span more binades than E5M2 holds), the report ranks it first and agrees with
the diagnosis, diagnose writes one config merged with the demo's, and the commands the demo printed re-run it
with the fix, after which the problem is gone and diagnose says the remedy worked."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from browser import CHROMIUM, dom

from lowprec.cli import main
from lowprec.demo import DEMO_CONFIG, next_steps, run_demo
from nvdlfw_inspect.diagnose import diagnose
from nvdlfw_inspect.report import write_report

STEPS = 80  # the problem begins at iteration 30 and persists; 300 steps show it in two more layers
QKV = "gpt.layers.1.self_attention.layernorm_qkv"
HEAD = "gpt.head"


def needs_browser() -> None:
    if CHROMIUM is None:
        pytest.skip("Chromium is not installed (scripts/test.sh installs it)")


def test_the_loop_from_the_demo_to_its_fixed_rerun(tmp_path, subtests, capsys):
    """The demo and the rerun it prints each train for about a minute on a CPU: this one test runs each once and
    checks every stage of the loop in a subtest (module fixtures shared by several tests would train again on
    every xdist worker that got one of them)."""
    demo_run = tmp_path / "demo_logs"
    run_demo(steps=STEPS, log_dir=demo_run, threads=1)
    with subtests.test("diagnose ranks the exhibited problem first and fixes it in high precision"):
        check_diagnose_ranks_the_exhibited_problem_first_and_fixes_it_in_high_precision(demo_run)
    with subtests.test("the page shows the problem first, agrees with the diagnosis and maps the head"):
        check_the_page_shows_the_problem_first_agrees_with_the_diagnosis_and_maps_the_head(demo_run, tmp_path)
    fixed_run = rerun_as_printed(demo_run)
    with subtests.test("the merged config validates and the rerun shows the problem gone"):
        check_the_merged_config_validates_and_the_rerun_shows_the_problem_gone(demo_run, fixed_run, capsys)
    with subtests.test("the page of the rerun shows the remedy in place and worked"):
        check_the_page_of_the_rerun_shows_the_remedy_in_place_and_worked(fixed_run, tmp_path)


def rerun_as_printed(demo_run: Path) -> Path:
    """The two commands the demo printed after ``next:`` and ``then:``, run as printed; the rerun's log directory."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for line in next_steps(demo_run, DEMO_CONFIG, STEPS, "small"):
        step = line.split(None, 1)[1].split("  (")[0]
        result = subprocess.run(step, shell=True, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, (step, result.stdout[-2000:], result.stderr[-2000:])
    return demo_run.with_name("demo_logs_fixed")


def rows(html: str, table: str) -> list[list[str]]:
    """The text of each cell of each body row of the table ``table``."""
    body = re.search(rf'<table id="{table}"[^>]*>.*?<tbody>(.*?)</tbody>', html, re.S).group(1)
    return [
        [re.sub(r"<[^>]+>", " ", cell).split() for cell in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
        for row in re.findall(r"<tr[^>]*>(.*?)</tr>", body, re.S)
    ]


def check_diagnose_ranks_the_exhibited_problem_first_and_fixes_it_in_high_precision(demo_run: Path) -> None:
    diagnosis = diagnose(demo_run)
    top = diagnosis.findings[0]
    assert (top.layer, top.tensor, top.kind, top.stat) == (QKV, "gradient", "underflow", "underflows%")
    assert top.summary.persistent > 1 and top.context["dynamic_range"] > 31.8  # wider than E5M2 holds
    (remedy,) = top.remedies
    assert (remedy.feature, remedy.gemms) == ("DisableFP8GEMM", ("dgrad", "wgrad"))
    assert "beyond every FP8 format's range" in remedy.reason
    assert diagnosis.in_place == []  # the head's wgrad alone in high precision: its tensors' other GEMMs are FP8


def check_the_page_shows_the_problem_first_agrees_with_the_diagnosis_and_maps_the_head(demo_run: Path, tmp_path: Path) -> None:
    needs_browser()
    html, errors = dom(write_report(demo_run, tmp_path / "demo_report.html"))
    assert errors == []
    first = re.search(r'<ol id="findings">\s*<li[^>]*>(.*?)</li>', html, re.S).group(1)
    assert f'{QKV}</a><span class="format"> (FP8 delayed scaling)</span> gradient: <b>' in first
    assert "(underflows%) from iteration" in first
    findings = [(f.layer, f.tensor) for f in diagnose(demo_run).findings]
    risks = rows(html, "risks")
    problems = [(row[0][0], row[1][0]) for row in risks if ": problem" in " ".join(row[-1])]
    assert problems == findings and (risks[0][0][0], risks[0][1][0]) == (QKV, "gradient")  # statuses = diagnosis
    head = next(row for row in rows(html, "precision-map") if row[0] == [HEAD])
    assert " ".join(head[3]).startswith("high precision \u2014 DisableFP8GEMM")  # wgrad: the demo config's choice
    assert " ".join(head[1]) == "FP8 delayed scaling" and " ".join(head[2]) == "FP8 delayed scaling"


def check_the_merged_config_validates_and_the_rerun_shows_the_problem_gone(demo_run: Path, fixed_run: Path, capsys) -> None:
    merged = demo_run / "diagnose_config.yaml"
    text = merged.read_text()
    assert "gemm_input_statistics:" in text and "head_wgrad_in_high_precision:" in text  # the demo's own sections
    assert main(["validate", str(merged), "--layers-from", str(demo_run)]) == 0
    after = diagnose(fixed_run)
    assert (QKV, "gradient") not in {(f.layer, f.tensor) for f in after.findings}
    in_place = {(e.layer, e.tensor): e for e in after.in_place}
    entry = in_place[(QKV, "gradient")]
    assert (entry.feature, entry.gemms, entry.since, entry.verdict) == ("DisableFP8GEMM", ("dgrad", "wgrad"), 0, "worked")
    assert main(["diagnose", str(fixed_run)]) == 0
    printed = capsys.readouterr().out
    assert f"- {QKV} gradient: DisableFP8GEMM on dgrad and wgrad since iteration 0: worked" in printed


def check_the_page_of_the_rerun_shows_the_remedy_in_place_and_worked(fixed_run: Path, tmp_path: Path) -> None:
    needs_browser()
    html, errors = dom(write_report(fixed_run, tmp_path / "fixed_report.html"))
    assert errors == []
    in_place = re.search(r'<div id="in-place">(.*?)</div>\s*<details', html, re.S).group(1)
    assert f"{QKV}</a> gradient: <b>worked</b>" in in_place
    qkv = next(row for row in rows(html, "precision-map") if row[0] == [QKV])
    assert [" ".join(cell) for cell in qkv[1:]] == [
        "FP8 delayed scaling",
        "high precision \u2014 DisableFP8GEMM",
        "high precision \u2014 DisableFP8GEMM",
    ]
