"""scripts/gpu_check.sh runs its whole plan here, on the CPU at tiny sizes, so that the plan meant for a
lent GPU cannot rot: every step runs and every target row is filled."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402
from cuda_marks import files_with_cuda_tests  # noqa: E402

# A line of each benchmark's tables in benchmarks.log
TABLE_LINES = {
    "real_model": ["stats freq 10", "sync ops*/step"],
    "stats_overhead": ["ours-stats", "ours-early", "compute_partials + M3, M4", "column_amax"],
    "engine": ["lowprec FP8 current compiled", "delayed cast + transpose"],
    "formats": ["training step per recipe", "GB/s read"],
    "host_cost": ["log_tensor_stats"],
    "guard_cost": ["guard only", "extra ops per guarded tensor", "extra Python calls per guarded tensor"],
}


def table_rows(summary: str, heading: str) -> list[list[str]]:
    """The body rows of the markdown table under ``heading``, as cells."""
    lines = summary.split(heading, 1)[1].strip().splitlines()
    rows = []
    for line in lines[2:]:  # after the header and its separator
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


def test_the_cpu_plan_runs_every_step_and_fills_every_target(tmp_path):
    pytest.importorskip("transformers")  # benchmarks/real_model.py builds a transformers Llama
    out = tmp_path / "out"
    tiny = ["--tiny"] if torch.cuda.is_available() else []  # without CUDA, the plan goes tiny by itself
    # The plan's `pytest -m cuda` collects only the files that can hold cuda tests: collecting the other ~120
    # (each rewritten for assertions in a fresh process) takes half a minute on a CPU, and the suite collects them.
    # One thread per benchmark: the tiny models gain nothing from more, and xdist's other workers want the cores.
    env = dict(
        os.environ, PYTHON=sys.executable, PYTEST_ADDOPTS=shlex.join(files_with_cuda_tests(ROOT / "tests")), OMP_NUM_THREADS="1"
    )
    command = ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out), *tiny]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    if not tiny:
        assert "no CUDA device: running the CPU plan at tiny sizes" in result.stdout
    assert sorted(path.name for path in out.iterdir()) == [
        "benchmarks.log",
        "environment.txt",
        "pytest_cuda.log",
        "results.json",
        "summary.md",
    ]

    summary = (out / "summary.md").read_text()
    assert "FAILED" not in summary, summary
    steps = {row[0]: row[1] for row in table_rows(summary, "## Steps")}
    assert steps["pytest"] == "ok" and all(steps[name] == "ok" for name in TABLE_LINES)
    rows = table_rows(summary, "## Targets (H100, eager unless said)")
    assert [row[0] for row in rows] == [target.measure for target in gpu_check.TARGETS]
    for measure, measured, _, verdict in rows:
        assert verdict == gpu_check.TINY_VERDICT, (measure, verdict)
        assert re.match(r"\d", measured), (measure, measured)  # a number first, then what it is
        # the optional comparisons: a number, or why there is none
        for part in re.findall(r"(?:reference 0\.2\.2|torchao):? (.*)", measured):
            assert re.match(r"\d|not measured \(\w.+\)", part), (measure, measured)

    results = json.loads((out / "results.json").read_text())
    assert results["mode"] == "tiny" and len(results["targets"]) == len(gpu_check.TARGETS)
    counts = results["cuda_tests"]["counts"]
    if not torch.cuda.is_available():  # every test marked cuda skips here, and there are some
        assert counts["passed"] == counts["failed"] == counts["errors"] == 0 and counts["skipped"] > 0
    assert re.search(r"CUDA tests: .*\d+ (passed|skipped)", summary)
    for name, benchmark in results["benchmarks"].items():
        assert benchmark["benchmark"] == name and benchmark["device"] == "cpu" and benchmark["measures"]

    log = (out / "benchmarks.log").read_text()
    for name, lines in TABLE_LINES.items():
        assert all(line in log for line in lines), name


def running(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_step_past_its_allowance_is_ended_with_the_processes_it_started(tmp_path):
    plan = gpu_check.Plan(tmp_path, tiny=True, work=tmp_path, budget=60, deadline=0)
    pid_file = tmp_path / "pid"
    start_and_sleep = (
        "import pathlib, subprocess, sys, time; "
        "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"pathlib.Path({str(pid_file)!r}).write_text(str(worker.pid)); time.sleep(60)"
    )
    step = gpu_check.run_step(plan, "sleeper", [sys.executable, "-c", start_and_sleep], 3.0, tmp_path / "log", dict(os.environ))
    assert step.status == "timed out after 3 s" and step.seconds < 30
    assert "----- sleeper: timed out after 3 s" in (tmp_path / "log").read_text()
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while running(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(worker)


def test_without_an_output_folder_it_says_how_to_call_it():
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "usage: scripts/gpu_check.sh OUT_DIR" in result.stderr


def test_a_reference_folder_without_the_reference_is_refused_with_the_reason(tmp_path, monkeypatch):
    import harness

    monkeypatch.setenv(harness.REFERENCE_PATH_VARIABLE, str(tmp_path))  # holds no nvdlfw_inspect
    python, reason = harness.reference_python()
    assert python is None and harness.REFERENCE_PATH_VARIABLE in reason and "imports from" in reason
    monkeypatch.setenv(harness.REFERENCE_PATH_VARIABLE, "")
    assert harness.reference_python() == (None, f"{harness.REFERENCE_PATH_VARIABLE} is empty: no reference to time")
