"""The ``nvdlfw-inspect`` command: every subcommand, its output and its exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nvdlfw_inspect.cli import main

ROOT = Path(__file__).resolve().parents[2]
SEED_CONFIGS = sorted((ROOT / "examples" / "configs").glob("seed*.yaml"))


def test_validate_accepts_the_seed_configs(capsys):
    for path in SEED_CONFIGS:
        assert main(["validate", str(path)]) == 0
        assert capsys.readouterr().out.strip() == f"{path}: valid"


def test_validate_reports_every_error_with_file_line_and_key_path(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(
        "good:\n"
        "  enabled: True\n"
        "  layers: {layer_name_regex_pattern: .*}\n"
        "  transformer_engine:\n"
        "    LogTensorStats: {enabled: True, tensors: [activation], stats: [max]}\n"
        "bad_stat:\n"
        "  enabled: True\n"
        "  layers: {layer_name_regex_pattern: .*}\n"
        "  transformer_engine:\n"
        "    LogTensorStats:\n"
        "      enabled: True\n"
        "      tensors: [activation]\n"
        "      stats: [max, maximum]\n"
        "bad_feature:\n"
        "  enabled: True\n"
        "  layers: {layer_name_regex_pattern: .*}\n"
        "  transformer_engine:\n"
        "    DisableFP8Gem: {enabled: True, gemms: [fprop]}\n"
    )
    assert main(["validate", str(config)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"{config}:13: ") and "bad_stat.transformer_engine.LogTensorStats.stats.1" in err[0]
    assert "unsupported statistic; got 'maximum'" in err[0] and "did you mean 'max'?" in err[0]
    assert err[1].startswith(f"{config}:18: ") and "DisableFP8Gem" in err[1] and "did you mean 'DisableFp8Gemm'?" in err[1]
    assert err[2] == f"{config}: 2 errors"


def test_validate_user_errors(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "missing.yaml")]) == 1
    assert "config file not found" in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1,\n")
    assert main(["validate", str(broken)]) == 1
    assert "not valid YAML" in capsys.readouterr().err


def test_list_and_explain_features(capsys):
    assert main(["list-features"]) == 0
    names = capsys.readouterr().out.split()
    assert {"base.LogTensorStats", "transformer_engine.LogFp8TensorStats", "transformer_engine.FakeQuant"} <= set(names)
    assert main(["explain", "LogFp8TensorStats"]) == 0
    assert "underflows%" in capsys.readouterr().out
    assert main(["explain", "NoSuchFeature"]) == 1
    assert "unknown feature 'NoSuchFeature'" in capsys.readouterr().err


def test_usage_errors_exit_2():
    for argv in ([], ["frobnicate"], ["validate"], ["demo", "--steps", "many"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2


def test_report_command(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 1
    assert "no statistics in" in capsys.readouterr().err


def test_installed_entry_point_runs():
    result = subprocess.run([sys.executable, "-m", "nvdlfw_inspect.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "validate" in result.stdout and "demo" in result.stdout
