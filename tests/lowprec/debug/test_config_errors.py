"""Config errors of the statistics and GEMM features: a misspelt statistic gets a "did you mean" in every
feature, and independent mistakes of one feature are reported together."""

from __future__ import annotations

import re

import pytest
from debugrun import section, start

import lowprec
import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect import cli, feature_loading
from nvdlfw_inspect.errors import ConfigError


def base_stats(stats: list) -> dict:
    """A section with the base namespace's LogTensorStats, which takes no namespace key."""
    return {
        "sec": {
            "enabled": True,
            "layers": {"layer_types": ["linear"]},
            "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": stats},
        }
    }


def te(feature: str, stats: list) -> dict:
    return section({feature: {"enabled": True, "tensors": ["activation"], "stats": stats}})


@pytest.mark.parametrize(
    ("config", "key", "hint"),
    [
        (base_stats(["max", "maximum"]), "sec.LogTensorStats.stats.1", "max"),
        (te("LogTensorStats", ["dynamic_rang"]), "sec.transformer_engine.LogTensorStats.stats.0", "dynamic_range"),
        (te("LogFp8TensorStats", ["underflow%"]), "sec.transformer_engine.LogFp8TensorStats.stats.0", "underflows%"),
        (te("LogFp8TensorStats", ["mxfp8_underflow%"]), "sec.transformer_engine.LogFp8TensorStats.stats.0", "mxfp8_underflows%"),
        (
            te("LogFp8TensorStats", ["fp8_current_scaling_scale_inv_mn"]),
            "sec.transformer_engine.LogFp8TensorStats.stats.0",
            "fp8_current_scaling_scale_inv_min",
        ),
    ],
)
def test_every_statistics_feature_suggests_the_statistic_meant(log_dir, config, key, hint):
    with pytest.raises(ConfigError, match=f"key '{key}': unsupported statistic.*; did you mean '{hint}'\\?$"):
        start(config, log_dir)


def test_initialize_raises_the_first_error_and_notes_the_others(log_dir):
    config = section(
        {
            "LogFp8TensorStats": {
                "enabled": True,
                "tensors": ["activation", "output"],
                "stats": ["underflow%", "mse"],
                "freq": -1,
            },
            "FakeQuant": {
                "enabled": True,
                "gemms_struct": [{"gemm": "fprop", "tensors": ["activation"]}, {"gemm": "xgrad", "tensors": ["weight"]}],
                "margin": -1,
            },
        }
    )
    with pytest.raises(ConfigError) as info:
        start(config, log_dir)
    assert "key 'sec.transformer_engine.LogFp8TensorStats.tensors.1': tensor not supported" in str(info.value)
    (note,) = info.value.__notes__
    lines = note.splitlines()
    assert lines[0] == "6 more errors in the config:"
    for key in (
        "LogFp8TensorStats.stats.0': unsupported statistic",
        "LogFp8TensorStats.freq': must be a positive integer",
        "FakeQuant.gemms_struct.0': FakeQuant needs 'quant_format'",
        "FakeQuant.gemms_struct.1': FakeQuant needs 'quant_format'",
        "FakeQuant.gemms_struct.1.gemm': unknown GEMM",
        "FakeQuant.margin': must be a non-negative integer",  # a feature-level key, reported once
    ):
        assert sum(f"key 'sec.transformer_engine.{key}" in line for line in lines[1:]) == 1, key


def test_a_transformer_engine_config_without_lowprec_loaded_names_the_fix(tmp_path, monkeypatch, capsys):
    """Without lowprec's feature directory (lowprec not imported, or nvdlfw_inspect's own command line) the error
    says how to load it; doing what it says makes the same config valid."""
    monkeypatch.setattr(feature_loading, "_default_feature_dirs", [])  # as if lowprec had not been imported
    path = tmp_path / "te.yaml"
    path.write_text(
        "sec:\n  enabled: true\n  layers: {layer_types: [linear]}\n  transformer_engine:\n    DisableFP8GEMM:\n"
        "      enabled: true\n      gemms: [wgrad]\n"
    )
    fix = "pass feature_dirs=[lowprec.FEATURE_DIR] to initialize, or `import lowprec` before it"
    with pytest.raises(ConfigError, match=re.escape(fix)):
        debug_api.initialize(config_file=str(path), log_dir=tmp_path / "logs")
    assert cli.main(["validate", str(path)]) == 1
    assert "--feature-dirs DIR with the DIR that `python -c 'import lowprec; print(lowprec.FEATURE_DIR)'` prints" in (
        capsys.readouterr().err
    )
    assert cli.main(["validate", str(path), "--feature-dirs", str(lowprec.FEATURE_DIR)]) == 0
    debug_api.initialize(config_file=str(path), feature_dirs=[lowprec.FEATURE_DIR], log_dir=tmp_path / "logs")


def test_an_unknown_namespace_shaped_key_names_feature_dirs(tmp_path):
    config = {"sec": {"enabled": True, "layers": {"layer_types": ["linear"]}, "my_ns": {"MyFeature": {"enabled": True}}}}
    with pytest.raises(ConfigError, match=re.escape("(if it is a namespace, pass the directory of its features")):
        start(config, tmp_path)


def test_a_transformer_engine_feature_written_directly_in_a_section_names_its_namespace(tmp_path):
    """``LogFp8TensorStats`` beside ``layers`` is no "did you mean 'LogTensorStats'?" (the base feature, which lowprec's
    layers do not call): the error says to write it under ``transformer_engine:``."""
    fp8_stats = {"enabled": True, "tensors": ["activation"], "stats": ["underflows%"], "freq": 1}
    config = {"sec": {"enabled": True, "layers": {"layer_types": ["linear"]}, "LogFp8TensorStats": fp8_stats}}
    with pytest.raises(ConfigError) as info:
        start(config, tmp_path)
    assert str(info.value) == (
        "config dict: key 'sec.LogFp8TensorStats': LogFp8TensorStats is a feature of namespace 'transformer_engine', "
        "not of the base namespace: write it under 'transformer_engine:' in the section (transformer_engine: "
        "{LogFp8TensorStats: {enabled: True, ...}}); got 'LogFp8TensorStats'"
    )
    config["sec"]["freq"] = 10  # and an option beside it points to a feature of the section
    config["sec"]["transformer_engine"] = {"LogFp8TensorStats": config["sec"].pop("LogFp8TensorStats")}
    with pytest.raises(ConfigError, match=re.escape("e.g. 'transformer_engine.LogFp8TensorStats.freq'")):
        start(config, tmp_path)
