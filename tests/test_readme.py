"""The README's quick start runs as written and logs what it says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from logreader import read_stats

README = Path(__file__).resolve().parents[1] / "README.md"


def quick_start_code() -> str:
    text = README.read_text()
    section = text.split("## Quick start", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_quick_start_runs_as_written(tmp_path):
    result = subprocess.run([sys.executable, "-c", quick_start_code()], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    printed = result.stdout.strip().splitlines()
    assert [line.split(" ", 1)[0] for line in printed] == ["0", "1", "2"]
    stats = read_stats(tmp_path / "quickstart_logs")
    assert {iteration for _, iteration in stats} == {0, 1, 2}
    assert len(stats) == 18
    assert all(name.startswith("model.fc1_activation_") for name, _ in stats)
    std = stats[("model.fc1_activation_std", 0)]
    assert 0.9 < std < 1.1  # torch.randn


def test_lowprec_snippet_runs_as_written(tmp_path):
    section = README.read_text().split("## FP8 layers: `lowprec`", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    code += "\nassert y.shape == (16, 32) and x.grad.shape == (16, 64) and layer.weight.grad is not None\n"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_read_stats_snippet_runs_on_a_demo_run(tmp_path, monkeypatch):
    from lowprec.demo import run_demo

    run_demo(steps=6, size="tiny", log_dir=tmp_path / "demo_logs")
    section = README.read_text().split("## Reading a run", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(code, namespace)
    worst = namespace["worst"]
    assert len(worst) == 5 and list(worst.index.names) == ["layer", "tensor"]
    assert (worst.values >= 0).all() and worst.is_monotonic_decreasing


def test_convert_snippet_runs_as_written(tmp_path):
    section = README.read_text().split("### Converting an existing model", 1)[1]
    config = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "convert_config.yaml").write_text(config)
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "8 layers converted" in result.stdout and "skipped lm_head (Linear): filtered out" in result.stdout
    stats = read_stats(tmp_path / "convert_logs")
    names = {f"model.transformer.h.{i}.attn.c_attn_activation_{stat}" for i in (0, 1) for stat in ("max", "l2_norm")}
    assert set(stats) == {(name, iteration) for name in names for iteration in range(3)}
