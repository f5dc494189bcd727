"""The installed ``nvdlfw-inspect`` command (``lowprec.cli``): the framework's command line with lowprec's
``transformer_engine`` features and the ``demo``."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

from lowprec.cli import main

ROOT = Path(__file__).resolve().parents[2]
SEED_CONFIGS = sorted((ROOT / "examples" / "configs").glob("seed*.yaml"))


def test_the_installed_command_is_lowprecs():
    scripts = re.search(r"^\[project\.scripts\]\n(.*?)\n\n", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    assert scripts.group(1) == 'nvdlfw-inspect = "lowprec.cli:main"'  # the framework's cli.py knows no lowprec
    result = subprocess.run([sys.executable, "-m", "lowprec.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert all(command in result.stdout for command in ("validate", "list-features", "explain", "report", "diagnose", "demo"))


def test_validate_accepts_the_seed_configs(capsys):
    for path in SEED_CONFIGS:
        assert main(["validate", str(path)]) == 0
        assert capsys.readouterr().out.strip() == f"{path}: valid"


def test_validate_lists_six_independent_mistakes_in_one_run(tmp_path, capsys):
    config = tmp_path / "six.yaml"
    config.write_text(
        textwrap.dedent(
            """\
            stats:
              enabled: True
              layers: {layer_type: [fc1]}
              transformer_engine:
                LogTensorStats:
                  enabled: True
                  tensors: [activation, gradiant]
                  stats: [max, maximum]
                LogFp8TensorStats:
                  enabled: True
                  tensors: [activation]
                  stats: [underflow%, mxfp8_mse]
                  freq: 0
            fix:
              enabled: True
              layers: {layer_name_regex_pattern: .*fc2}
              transformer_engine:
                DisableFP8Gem: {enabled: True, gemms: [fprop]}
            """
        )
    )
    assert main(["validate", str(config)]) == 1
    err = capsys.readouterr().err.splitlines()
    expected = [
        (3, "stats.layers.layer_type", "did you mean 'layer_types'?"),
        (7, "stats.transformer_engine.LogTensorStats.tensors.1", "did you mean 'gradient'?"),
        (8, "stats.transformer_engine.LogTensorStats.stats.1", "did you mean 'max'?"),
        (12, "stats.transformer_engine.LogFp8TensorStats.stats.0", "did you mean 'underflows%'?"),
        (13, "stats.transformer_engine.LogFp8TensorStats.freq", "must be a positive integer"),
        (18, "fix.transformer_engine.DisableFP8Gem", "did you mean 'DisableFp8Gemm'?"),
    ]
    assert err[-1] == f"{config}: 6 errors" and len(err) == 7
    for line, (number, key_path, what) in zip(err, expected, strict=False):
        assert line.startswith(f"{config}:{number}: ") and f"key '{key_path}'" in line and what in line, line


def test_list_and_explain_features(capsys):
    assert main(["list-features"]) == 0
    names = capsys.readouterr().out.split()
    assert {"base.LogTensorStats", "transformer_engine.LogFp8TensorStats", "transformer_engine.FakeQuant"} <= set(names)
    assert main(["explain", "LogFp8TensorStats"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("transformer_engine.LogFp8TensorStats\n  Logs quantization statistics")
    assert "underflows%" in out and "`" not in out
    assert main(["explain", "LogTensorStats"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("LogTensorStats is in 2 namespaces: base.LogTensorStats, transformer_engine.LogTensorStats")
    assert "\nbase.LogTensorStats\n" in out and "\ntransformer_engine.LogTensorStats\n" in out
    assert main(["explain", "NoSuchFeature"]) == 1
    assert "unknown feature 'NoSuchFeature'" in capsys.readouterr().err


def test_a_bad_demo_config_is_reported_once_and_starts_nothing(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(
        "a:\n  enabled: True\n  layers: {layer_types: [fc1]}\n  transformer_engine:\n"
        "    LogFp8TensorStats: {enabled: True, tensors: [activation], stats: [underflow%]}\n"
    )
    log_dir = tmp_path / "logs"
    assert main(["demo", "--config", str(config), "--log-dir", str(log_dir), "--steps", "1", "--size", "tiny"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("underflow%") == 1 and "initialize failed" not in captured.err
    assert captured.err.startswith(f"{config}:5: ") and "did you mean 'underflows%'?" in captured.err
    assert not log_dir.exists()
    assert main(["demo", "--config", str(tmp_path / "missing.yaml"), "--log-dir", str(log_dir)]) == 1
    assert capsys.readouterr().err == f"nvdlfw-inspect demo: config file not found: {str(tmp_path / 'missing.yaml')!r}\n"
    assert not log_dir.exists()
