"""``diagnose --config``: the user's config and the remedies merged into one config that validates and runs
(issue item 7: appending the remedies to a config with the same features for the same layers failed at the
first forward)."""

from __future__ import annotations

import re

import pytest
import torch
import yaml
from planted_runs import TOKENS, WIDTH, nan_run, planted_run, stats_config

import lowprec
import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.cli import main
from nvdlfw_inspect.config_manager import ConfigManager, find_config_errors
from nvdlfw_inspect.diagnose import config as remedy_config
from nvdlfw_inspect.diagnose import diagnose
from nvdlfw_inspect.diagnose.merge import merge
from nvdlfw_inspect.diagnose.model import Remedy
from nvdlfw_inspect.errors import ConfigError
from nvdlfw_inspect.reading import run_layers
from nvdlfw_inspect.registry import Registry

LAYERS = ["model.clean", "model.deep", "model.grow", "model.shrink", "model.wide"]
WATCH = (("start_step", 3), ("end_step", 5), ("freq", 1))


def user_config() -> dict:
    """The issue's config: statistics of every layer, and the user's own DisableFP8GEMM on a regex."""
    return {
        "all_linear_stats": stats_config()["statistics"],
        "keep_fp32": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": "deep|grow"},
            "transformer_engine": {"DisableFP8GEMM": {"enabled": True, "gemms": ["fprop"]}},
        },
    }


def remedies() -> tuple[dict, dict]:
    return remedy_config.build(
        [
            Remedy("LogTensorStats", None, (), None, "watch", WATCH),
            Remedy("DisableFP8GEMM", "model.deep", ("dgrad", "wgrad"), None, "deep is out of range"),
            Remedy("PerTensorScaling", "model.grow", ("fprop", "wgrad"), "activation", "grow overflows"),
        ]
    )


@pytest.fixture
def lowprec_features(tmp_path):
    debug_api.initialize(config_file="", feature_dirs=[lowprec.FEATURE_DIR], log_dir=str(tmp_path / "scratch"))
    yield
    debug_api.end_debug()


def routed(config: dict, tmp_path) -> dict[str, dict]:
    """Each layer's features as routing sees them under ``config``."""
    debug_api.end_debug()
    debug_api.initialize(config_file=config, feature_dirs=[lowprec.FEATURE_DIR], log_dir=str(tmp_path / "routed"))
    return {layer: ConfigManager.get_config_for_layer(layer).get("transformer_engine", {}) for layer in LAYERS}


def test_appending_the_remedies_fails_and_the_merged_config_routes_the_union(lowprec_features, tmp_path):
    config, reasons = remedies()
    appended = {**user_config(), **config}
    assert any("both configure" in str(e) for e in find_config_errors(appended, Registry.data, Registry.unusable, LAYERS))

    merged, notes = merge(user_config(), config, LAYERS, reasons)
    assert find_config_errors(merged, Registry.data, Registry.unusable, LAYERS) == []
    features = routed(merged, tmp_path)
    assert features["model.deep"]["DisableFP8GEMM"]["gemms"] == ["fprop", "dgrad", "wgrad"]  # the user's and the remedy's
    assert features["model.grow"]["DisableFP8GEMM"]["gemms"] == ["fprop"]  # the user's, which wins over the scaling
    assert features["model.grow"]["PerTensorScaling"] == {"enabled": True, "gemms": ["wgrad"], "tensors": ["activation"]}
    assert "DisableFP8GEMM" not in features["model.clean"]
    for layer in LAYERS:  # every layer logs the user's statistics and the watch's, in the watch's window
        stats = features[layer]["LogTensorStats"]
        assert (stats["start_step"], stats["end_step"], stats["freq"]) == (3, 5, 1), layer
        assert stats["tensors_struct"][0] == {"tensor": "activation", "stats": ["max", "cur_amax", "dynamic_range", "min"]}
        assert {"tensor": "output", "stats": ["min", "max"]} in stats["tensors_struct"]
        assert features[layer]["LogFp8TensorStats"] == stats_config()["statistics"]["transformer_engine"]["LogFp8TensorStats"]
    assert "diagnose_watch_nonfinite" not in merged and "watch" in notes[""][0]
    assert "logged in that window only" in notes["all_linear_stats"][0]
    assert "now leaves that name out" in notes["keep_fp32"][0] and "selects none of the run's" in notes["keep_fp32"][-1]
    assert notes["diagnose_model_deep"][0] == "model.deep: deep is out of range"
    assert "features of your section keep_fp32" in notes["diagnose_model_deep"][1]


@pytest.mark.parametrize("pattern", ["b", r"a\.b", "^a", r"\.b$", "(?i)A.B", r"(a)\.\1?b", "x|a"])
def test_a_regex_leaves_out_the_layer_and_selects_the_others_as_before(pattern):
    names = ["a.b", "xa.b", "a.bc", "b", "ab", "a.b\n", "A.B", "x"]
    user = {
        "s": {"enabled": True, "layers": {"layer_name_regex_pattern": pattern}, "transformer_engine": {"LogFp8TensorStats": {}}}
    }
    remedy = {"r": {"enabled": True, "layers": {"exact_layer_names": ["a.b"]}, "transformer_engine": {"LogFp8TensorStats": {}}}}
    merged, _ = merge(user, remedy, names)
    after = re.compile(merged["s"]["layers"]["layer_name_regex_pattern"])
    assert [n for n in names if after.search(n)] == [n for n in names if n != "a.b" and re.search(pattern, n)]


def test_layer_types_and_exact_names_are_rewritten_and_said(lowprec_features, tmp_path):
    user = {
        "by_type": {
            "enabled": True,
            "layers": {"layer_types": ["grow", "linear"]},
            "transformer_engine": {"LogTensorStats": {"enabled": True, "tensors": ["weight"], "stats": ["max"]}},
        },
        "named": {
            "enabled": True,
            "layers": {"exact_layer_names": ["model.deep"]},
            "transformer_engine": {"DisableFP8GEMM": {"enabled": True, "gemms_struct": [{"gemm": "fprop"}]}},
        },
    }
    config, reasons = remedies()
    merged, notes = merge(user, config, LAYERS, reasons)
    assert merged["by_type"]["layers"] == {"exact_layer_names": ["model.grow"]}
    assert "no longer selected" in notes["by_type"][0]
    assert merged["named"]["enabled"] is False and notes["named"][0].startswith("Disabled: model.deep left it")
    assert merged["diagnose_watch_nonfinite"]["layers"] == {"exact_layer_names": [n for n in LAYERS if n != "model.grow"]}
    features = routed(merged, tmp_path)
    assert features["model.deep"]["DisableFP8GEMM"]["gemms"] == ["fprop", "dgrad", "wgrad"]
    assert features["model.grow"]["LogTensorStats"]["start_step"] == 3


def test_pairs_are_united_and_the_remedys_options_win():
    user = {
        "s": {
            "enabled": True,
            "layers": {"exact_layer_names": ["L", "M"]},
            "transformer_engine": {
                "FakeQuant": {"enabled": True, "quant_format": "FP8E4M3", "gemms": ["fprop", "dgrad"], "tensors": ["weight"]}
            },
        }
    }
    remedy = {
        "r": {
            "enabled": True,
            "layers": {"exact_layer_names": ["L"]},
            "transformer_engine": {
                "FakeQuant": {"enabled": True, "quant_format": "FP8E5M2", "gemms": ["fprop"], "tensors": ["weight"]}
            },
        }
    }
    merged, notes = merge(user, remedy, ["L", "M"])
    assert merged["s"]["layers"] == {"exact_layer_names": ["M"]}
    assert merged["r"]["transformer_engine"]["FakeQuant"] == {
        "enabled": True,
        "gemms_struct": [
            {"gemm": "fprop", "tensors_struct": [{"tensor": "weight", "quant_format": "FP8E5M2"}]},
            {"gemm": "dgrad", "tensors_struct": [{"tensor": "weight", "quant_format": "FP8E4M3"}]},
        ],
    }
    assert "the remedy's options {'quant_format': 'FP8E5M2'} replace yours" in notes["s"][0]


def comments(path) -> str:
    """The comment lines of a YAML file as one line of text."""
    return " ".join(line.lstrip("# ") for line in path.read_text().splitlines() if line.startswith("#"))


def rerun(config_path, steps: int = 4) -> None:
    """Two chained lowprec layers, as ``nan_run``'s, trained under ``config_path``."""
    log_dir = str(config_path.parent / f"{config_path.stem}_run")
    debug_api.initialize(config_file=str(config_path), feature_dirs=[lowprec.FEATURE_DIR], log_dir=log_dir)
    torch.manual_seed(0)
    fc1, fc2 = lowprec.Linear(WIDTH, WIDTH, name="model.fc1"), lowprec.Linear(WIDTH, WIDTH, name="model.fc2")
    try:
        for _ in range(steps):
            with lowprec.fp8_autocast(fp8_recipe=lowprec.DelayedScaling()):
                fc2(fc1(torch.randn(TOKENS, WIDTH))).float().sum().backward()
            debug_api.step()
    finally:
        debug_api.end_debug()


def test_command_line_writes_one_config_that_validates_and_runs(tmp_path, capsys):
    """The issue's scenario: a run with a NaN under a config with statistics of every layer."""
    nan_run(tmp_path / "run", steps=6, nan_step=3)
    user = tmp_path / "mine.yaml"
    user.write_text(yaml.safe_dump({"all_linear_stats": {**stats_config()["statistics"], "layers": {"layer_types": ["fc"]}}}))
    dirs = ["--feature-dirs", str(lowprec.FEATURE_DIR)]

    plain = tmp_path / "plain.yaml"
    assert main(["diagnose", str(tmp_path / "run"), "-o", str(plain), *dirs]) == 0
    assert "--config YOUR.yaml" in capsys.readouterr().out
    header = comments(plain)
    assert "appending this file to a config that configures the same features" in header and "--config" in header
    appended = tmp_path / "appended.yaml"
    appended.write_text(user.read_text() + plain.read_text())
    with pytest.raises(ConfigError, match="both configure"):  # what the issue hit at the first forward
        rerun(appended)

    out = tmp_path / "merged.yaml"
    assert main(["diagnose", str(tmp_path / "run"), "--config", str(user), "-o", str(out), *dirs]) == 0
    assert f"config: {out} (your {user} with the remedies merged in: it replaces yours" in capsys.readouterr().out
    text = comments(out)
    assert "It replaces your config for this re-run" in text and "logged in that window only" in text
    assert main(["validate", str(out), "--layers-from", str(tmp_path / "run"), *dirs]) == 0
    rerun(out)
    assert run_layers(tmp_path / "merged_run") == ["model.fc1", "model.fc2"]


def test_command_line_names_a_bad_user_config(tmp_path, capsys):
    planted_run(tmp_path / "run", steps=4)
    bad = tmp_path / "bad.yaml"
    bad.write_text("s:\n  enabled: True\n  layers: {layer_name_regex_pattern: '('}\n")
    assert main(["diagnose", str(tmp_path / "run"), "--config", str(bad), "--feature-dirs", str(lowprec.FEATURE_DIR)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{bad}:3: config file '{bad}': key 's.layers.layer_name_regex_pattern': invalid regular")
    assert main(["diagnose", str(tmp_path / "run"), "--config", str(tmp_path / "none.yaml")]) == 1
    assert "config file not found" in capsys.readouterr().err
    assert not (tmp_path / "run" / "diagnose_config.yaml").exists()


def test_the_diagnosis_of_a_planted_run_merges_with_the_users_config(tmp_path):
    planted_run(tmp_path / "run", steps=8)
    diagnosis = diagnose(tmp_path / "run")
    config, reasons = remedy_config.build(r for f in diagnosis.findings for r in f.remedies)
    merged, _ = merge(user_config(), config, run_layers(tmp_path / "run"), reasons)
    features = routed(merged, tmp_path)
    assert features["model.deep"]["DisableFP8GEMM"]["gemms"] == ["fprop", "dgrad", "wgrad"]
    assert set(features["model.grow"]) == {"DisableFP8GEMM", "PerTensorScaling", "LogTensorStats", "LogFp8TensorStats"}
    assert set(features["model.wide"]) == {"FakeQuant", "LogTensorStats", "LogFp8TensorStats"}


def test_a_precision_plan_in_the_users_config_is_kept_as_it_is():
    """One file for a run holds the debug sections and lowprec's precision plan: the merge leaves the plan alone."""
    plan = {"rules": [{"layers": {"layer_name_regex_pattern": "deep"}, "recipe": "nvfp4"}]}
    user = {
        "s": {"enabled": True, "layers": {"layer_name_regex_pattern": "model"}, "transformer_engine": {"LogFp8TensorStats": {}}},
        "precision_plan": plan,
    }
    remedy = {
        "r": {"enabled": True, "layers": {"exact_layer_names": ["model.deep"]}, "transformer_engine": {"LogFp8TensorStats": {}}}
    }
    merged, _ = merge(user, remedy, LAYERS)
    assert merged["precision_plan"] == plan
    after = re.compile(merged["s"]["layers"]["layer_name_regex_pattern"])  # the sections merged as without a plan
    assert [name for name in LAYERS if after.search(name)] == [name for name in LAYERS if name != "model.deep"]
