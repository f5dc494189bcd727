"""The demo: a small GPT on Python's help texts learns in emulated FP8, logs its statistics and writes
the report; the command line runs it too, also under a precision plan."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from demo_plan import HIGH_PRECISION, QUANTIZED, check_planned_formats, write_plan

import nvdlfw_inspect
from lowprec.cli import main
from lowprec.demo import DEMO_CONFIG, PLAN_CONFIG, TimeLeft, choose_threads, command, corpus, read_losses, run_demo
from lowprec.plan import load_plan
from nvdlfw_inspect.reading import iter_statistics, read_routing


def test_corpus_is_real_text():
    text = corpus()
    assert len(text) > 300_000 and bytes(text[:2000].tolist()).decode("utf-8", "ignore").count(" ") > 200


def test_demo_learns_logs_and_reports(tmp_path, capsys):
    result = run_demo(steps=30, size="tiny", log_dir=tmp_path)
    assert result["last_loss"] < result["first_loss"] - 1.0  # from ~ln(256)=5.5 towards byte statistics
    assert math.isclose(result["first_loss"], math.log(256), rel_tol=0.1)
    frame = nvdlfw_inspect.read_stats(tmp_path)
    assert set(frame.iteration.unique()) == {0, 5, 10, 15, 20, 25}
    assert {"max", "std", "dynamic_range", "underflows%", "overflows%", "mse", "mxfp8_underflows%"} == set(frame.stat)
    assert "gpt.layers.1.layernorm_mlp.fc2" in set(frame.layer)
    plan = (tmp_path / "nvdlfw_inspect_logs" / "nvdlfw_inspect_globalrank-0.log").read_text()
    assert "gpt.head: Tensor: gradient, gemm wgrad - High precision" in plan
    assert "gpt.head: Tensor: gradient, gemm dgrad - FP8 quantization" in plan
    head = {(r.gemm, r.tensor): (r.decision, r.feature) for r in read_routing(tmp_path) if r.layer == "gpt.head"}
    assert head[("wgrad", "gradient")] == ("high_precision", "DisableFP8GEMM") and head[("dgrad", "gradient")] == ("fp8", None)
    assert '"feature":"DisableFP8GEMM"' in result["report"].read_text()  # in the report's precision map
    assert result["report"].read_text().startswith("<!DOCTYPE html>")
    out = capsys.readouterr().out
    assert f"report:     {result['report']}" in out
    assert f"records:    {tmp_path / 'nvdlfw_inspect_statistics_jsonl'}" in out
    assert {p.suffix for p in result["statistics"].iterdir()} == {".log"}


def test_demo_says_its_threads_restores_them_and_prints_a_next_step_that_runs(tmp_path, capsys, monkeypatch):
    """The last line is the command to run next, as this shell can run it (here the PATH finds no command)."""
    monkeypatch.setenv("PATH", "")
    before = torch.get_num_threads()
    run_demo(steps=2, size="tiny", log_dir=tmp_path / "logs", threads=1)
    assert torch.get_num_threads() == before
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "threads: 1 (as given; --threads N or OMP_NUM_THREADS=N to choose)"
    assert lines[-2].startswith("next:       ") and lines[-2].endswith("  (findings, and your config with their fixes)")
    step = lines[-2].removeprefix("next:       ").split("  (")[0]
    assert step == f"{command()} diagnose {tmp_path / 'logs'} --config {DEMO_CONFIG}" and not step.startswith("nvdlfw-inspect ")
    rerun = f"{command()} demo --config {tmp_path / 'logs' / 'diagnose_config.yaml'} --log-dir {tmp_path / 'logs_fixed'}"
    assert lines[-1].startswith(f"then:       {rerun} --steps 2 --size tiny  (the same run with the fixes")
    env = {**os.environ, "PATH": os.defpath}
    # run where the demo ran (the printed path may be relative to it, as ``.venv/bin/nvdlfw-inspect`` is)
    result = subprocess.run(step, shell=True, cwd=os.getcwd(), env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and f"findings in {tmp_path / 'logs'}" in result.stdout, result.stderr
    assert (tmp_path / "logs" / "diagnose_config.yaml").is_file()


def test_threads_an_explicit_count_wins_then_omp_num_threads_then_the_free_cores(monkeypatch):
    """torch's default (a thread per core) beside busy processes oversubscribes the cores: count only the free ones."""
    assert choose_threads(3) == (3, "as given")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert choose_threads() == (torch.get_num_threads(), "OMP_NUM_THREADS=1")
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    for load, threads in [(0.2, 2), (1.0, 1), (2.1, 1), (40.0, 1)]:
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        assert choose_threads() == (threads, f"2 cores, load {load:.1f}")
    monkeypatch.delattr(os, "getloadavg")
    assert choose_threads() == (2, "2 cores, load unknown")
    with pytest.raises(ValueError, match="threads must be a positive integer, got 0"):
        choose_threads(0)


def test_demo_from_the_command_line(tmp_path, capsys):
    assert main(["demo", "--steps", "3", "--size", "tiny", "--log-dir", str(tmp_path), "--config", str(DEMO_CONFIG)]) == 0
    assert (tmp_path / "report.html").exists()
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--steps", "0", "--log-dir", str(tmp_path)])
    assert exit_info.value.code == 2 and "must be a positive integer, got 0" in capsys.readouterr().err


def test_a_demo_under_a_plan_trains_each_layer_in_its_format_with_statistics_that_suit_them(tmp_path, capsys):
    """Without a config of its own the run logs tensor statistics of every layer and, in each layer's own format,
    quantization statistics of the layers the plan quantizes; the plan is printed first, returned, and kept in the
    command to run next."""
    plan = write_plan(tmp_path)
    log_dir = tmp_path / "logs"
    result = run_demo(steps=2, size="tiny", log_dir=log_dir, plan=plan, threads=1)
    assert result["plan"] == load_plan(plan).describe() and len(result["losses"]) == 2
    assert math.isclose(result["first_loss"], math.log(256), rel_tol=0.1)
    out = capsys.readouterr().out.splitlines()
    assert out[1] == f"plan:       precision plan file {str(plan)!r} (lowprec format), first matching rule wins:"
    assert out[2].startswith("  #0 last block and head in high precision: fprop: high_precision,")
    assert "autocast:   DelayedScaling() (the layers the plan leaves to the autocast)" in out
    assert f"in high precision: {', '.join(HIGH_PRECISION)}" in out
    assert f"config:     {log_dir / PLAN_CONFIG}  (statistics suited to the plan's formats)" in out
    assert out[-1].split("  (")[0].endswith(f"--steps 2 --size tiny --plan {plan}")
    run_demo(steps=1, size="tiny", log_dir=tmp_path / "object", plan=load_plan(plan), threads=1)
    assert capsys.readouterr().out.splitlines()[-1] == (
        "note:       these commands run without the plan, given as no file: write it to a YAML file for --plan"
    )
    check_planned_formats(log_dir)
    logged = {(record.layer, record.stat) for record in iter_statistics(log_dir)}
    assert {layer for layer, stat in logged if stat in ("underflows%", "mse")} == set(QUANTIZED)
    assert {layer for layer, stat in logged if stat == "std"} == set(QUANTIZED + HIGH_PRECISION)
    assert result["report"].is_file()


def test_the_demo_command_takes_a_plan_held_by_its_debug_config_and_refuses_a_bad_one(tmp_path, capsys):
    sections = (
        "tensor_statistics:\n  enabled: True\n  layers: {layer_name_regex_pattern: 'gpt\\..*'}\n  transformer_engine:\n"
        "    LogTensorStats: {enabled: True, tensors: [activation], stats: [max], freq: 1}\n"
    )
    config = write_plan(tmp_path, sections)
    args = ["demo", "--steps", "2", "--size", "tiny", "--log-dir", str(tmp_path / "logs"), "--threads", "1"]
    assert main([*args, "--config", str(config), "--plan", str(config)]) == 0
    check_planned_formats(tmp_path / "logs")
    assert not (tmp_path / "logs" / PLAN_CONFIG).exists()  # the given config's statistics
    bad = tmp_path / "bad.yaml"
    bad.write_text("precision_plan:\n  rules:\n    - layers: {layer_types: [linear]}\n      recipe: fp9\n")
    assert main(["demo", "--plan", str(bad), "--log-dir", str(tmp_path / "bad_logs")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-2].startswith(f"{bad}:4: precision plan file {str(bad)!r}: key 'precision_plan.rules.0.recipe': unknown recipe")
    assert err[-1] == f"{bad}: 1 error" and not (tmp_path / "bad_logs").exists()  # refused before anything started


def test_a_config_that_logs_nothing_says_why_in_one_line(tmp_path, capsys):
    """The Quick start's form (``LogTensorStats`` in the section: the ``base`` namespace) reaches no lowprec layer;
    after training the demo says so, and where the warnings and losses are, instead of a traceback."""
    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "mlp_stats.yaml"
    assert main(["demo", "--steps", "1", "--size", "tiny", "--log-dir", str(tmp_path), "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert "section 'hidden_layer_inputs' configures ['LogTensorStats'] of namespace 'base'" in err
    (line,) = [line for line in err.splitlines() if line.startswith("nvdlfw-inspect demo: ")]
    assert line.startswith("nvdlfw-inspect demo: no statistics were logged in 1 step: no feature of the config ")
    assert "gpt.layers.<i>.layernorm_mlp.fc1" in line and "go under 'transformer_engine:'" in line
    assert f"the losses are in {str(tmp_path / 'loss.json')!r}" in line
    assert len(read_losses(tmp_path)) == 1 and not (tmp_path / "report.html").exists()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"size": "huge"}, r"size must be one of \['tiny', 'small', 'base'\], got 'huge'"),
        ({"steps": 0}, "steps must be a positive integer, got 0"),
        ({"steps": True}, "steps must be a positive integer, got True"),
        ({"seed": -1}, "seed must be a non-negative integer, got -1"),
        ({"threads": 0}, "threads must be a positive integer, got 0"),
        ({"learning_rate": 0.0}, "learning_rate must be a positive number, got 0.0"),
        ({"learning_rate": float("inf")}, "learning_rate must be a positive number, got inf"),
        ({"learning_rate": "1e-2"}, "learning_rate must be a positive number, got '1e-2'"),
        ({"device": "tpu"}, "device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
        ({"device": "cuda:99"}, "device 'cuda:99': torch sees (no CUDA GPU|[0-9]+ CUDA GPU)"),
    ],
)
def test_bad_demo_arguments_are_clear_errors(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        run_demo(log_dir=tmp_path, **kwargs)
    assert not (tmp_path / "nvdlfw_inspect_logs").exists()  # refused before anything started


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a CPU-only machine gives")
def test_demo_on_cuda_without_a_gpu_is_a_one_line_error(tmp_path, capsys):
    assert main(["demo", "--device", "cuda", "--log-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("nvdlfw-inspect demo: device 'cuda': torch sees no CUDA GPU (torch ") and err.endswith("; use 'cpu'\n")
    assert main(["compare", "--device", "cuda", "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith("nvdlfw-inspect compare: device 'cuda': torch sees no CUDA GPU")
    assert not any(tmp_path.iterdir())  # refused before anything started


def test_time_left_shrugs_off_one_slow_step_and_follows_a_lasting_change():
    steady, stalled = TimeLeft(), TimeLeft()
    for seconds in [0.1, 0.1, 0.1, 0.1, 0.2] * 6:  # every fifth step logs statistics and takes twice as long
        steady.add(seconds)
        stalled.add(seconds)
    assert steady.seconds(100) == pytest.approx(12.0)  # the mean step, slow ones included
    stalled.add(30.0)  # one step stalled by another process
    assert stalled.seconds(100) == pytest.approx(12.0, rel=0.1)
    for _ in range(16):  # the machine stays busy
        stalled.add(0.5)
    assert stalled.seconds(100) > 30
    assert TimeLeft().seconds(100) == 0.0


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_dev_extra_holds_what_the_demo_installs():
    """scripts/env.sh skips the demo's installation after the tests' one."""
    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    names = {extra: {re.match(r"[\w.-]+", requirement).group() for requirement in extras[extra]} for extra in ("demo", "dev")}
    assert names["demo"] <= names["dev"]
