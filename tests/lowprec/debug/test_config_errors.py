"""Config errors of the statistics and GEMM features: a misspelt statistic gets a "did you mean" in every
feature, and independent mistakes of one feature are reported together."""

from __future__ import annotations

import pytest
from debugrun import section, start

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
