"""Each tensor judged by its format's own underflow threshold: a healthy NVFP4 (or MXFP8) run, Gaussian data through
a few layers, has no underflow finding, while its damaged twin (one layer fed a tensor with an outlier channel in
every block) is found, named with its format, its mechanism and the threshold used; the calibrated table holds what
``benchmarks/calibrate_formats.py`` measures; ``--format-underflow-pct`` overrides one format's threshold."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

import lowprec
import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.cli import main
from nvdlfw_inspect.diagnose import Thresholds, diagnose
from nvdlfw_inspect.diagnose.thresholds import (
    CALIBRATED_SATURATED_BLOCKS_PCT,
    CALIBRATED_UNDERFLOW_BLOCKS_PCT,
    CALIBRATED_UNDERFLOW_PCT,
    CALIBRATED_WORST_BLOCK_ERR,
    CALIBRATION_MARGIN,
    FORMAT_SATURATED_BLOCKS_PCT,
    FORMAT_UNDERFLOW_BLOCKS_PCT,
    FORMAT_UNDERFLOW_PCT,
    FORMAT_WORST_BLOCK_ERR,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import calibrate_formats  # noqa: E402

WIDTH, TOKENS, STEPS = 64, 32, 5
LAYERS = ("a", "b", "c")
STATS = {"LogFp8TensorStats": {"enabled": True, "tensors": ["activation", "gradient", "weight"], "stats": ["underflows%"]}}


def run(log_dir: Path, recipe: lowprec.Recipe, damaged: float | None) -> None:
    """Three independent layers under ``recipe``, fed N(0, 1) activations and gradients; with ``damaged``, layer
    ``model.c``'s activation has one channel in each block of 16 ``damaged`` times the others, so each block's scale is
    set by it and the rest of the block flushes to zero."""
    config = {"losses": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "transformer_engine": STATS}}
    debug_api.initialize(config_file=config, feature_dirs=[lowprec.FEATURE_DIR], log_dir=str(log_dir))
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    layers = {name: lowprec.Linear(WIDTH, WIDTH, name=f"model.{name}") for name in LAYERS}
    try:
        for _ in range(STEPS):
            inputs = {name: torch.randn(TOKENS, WIDTH, generator=gen) for name in LAYERS}
            if damaged is not None:
                inputs["c"][:, ::16] *= damaged
            with lowprec.autocast(recipe=recipe):
                outputs = [layers[name](inputs[name]) for name in LAYERS]
            torch.autograd.backward(outputs, [torch.randn(TOKENS, WIDTH, generator=gen) for _ in LAYERS])
            debug_api.step()
    finally:
        debug_api.end_debug()


def underflows(diagnosis) -> list[tuple[str, str]]:
    return [(f.layer, f.tensor) for f in diagnosis.findings if f.kind == "underflow"]


@pytest.mark.parametrize(
    ("recipe", "label", "name", "outlier", "mechanism"),
    [
        (
            lowprec.NVFP4BlockScaling(),
            "nvfp4",
            "NVFP4",
            1e3,
            "a scale per block of 16 values (E4M3 scales, 16 x 16 of a weight, and a per-tensor FP32 scale; E2M1 elements)",
        ),
        (lowprec.MXFP8BlockScaling(), "mxfp8", "MXFP8", 1e7, "a scale per block of 32 values (E8M0 power-of-two scales)"),
    ],
    ids=["nvfp4", "mxfp8"],
)
def test_a_healthy_run_has_no_underflow_finding_and_its_damaged_twin_does(tmp_path, recipe, label, name, outlier, mechanism):
    run(tmp_path / "healthy", recipe, None)
    healthy = diagnose(tmp_path / "healthy")
    assert underflows(healthy) == []
    if label == "nvfp4":  # its healthy underflows% is several %: over the 1% of FP8, under its own threshold
        assert underflows(diagnose(tmp_path / "healthy", format_underflow_pct={"nvfp4": 1.0})) != []

    run(tmp_path / "damaged", recipe, outlier)
    damaged = diagnose(tmp_path / "damaged")
    assert underflows(damaged) == [("model.c", "activation")]
    (finding,) = [f for f in damaged.findings if f.kind == "underflow"]
    threshold = FORMAT_UNDERFLOW_PCT.get(label, 1.0)
    assert finding.summary.threshold == threshold and finding.summary.persistent > 90
    assert finding.message.startswith(f"non-zero values flush to zero in {name}, which has {mechanism}: over {threshold:g}%")
    calibrated = CALIBRATED_UNDERFLOW_PCT[label]
    source = (
        f"calibrated: well-behaved data gives up to {calibrated:.3g}%, x{CALIBRATION_MARGIN:g}"
        if label in FORMAT_UNDERFLOW_PCT
        else f"underflow_pct; well-behaved data gives up to {calibrated:.3g}%"
    )
    assert finding.message.endswith(f"; {name}'s threshold {threshold:g}% ({source})")


def test_the_calibrated_table_holds_what_the_script_measures():
    """A small sample of every format (one shape, one seed) stays under the table's share of its threshold: its
    underflows% is within 25% of the calibrated largest (the script's samples at another shape) and under the
    threshold; the thresholds are the script's rule applied to the table."""
    table = calibrate_formats.calibrate(shapes=((256, 256),), seeds=1)
    assert set(table) == set(CALIBRATED_UNDERFLOW_PCT) == set(calibrate_formats.RECIPE_OF)
    for label, rows in table.items():
        measured = max(row["under_max"] for row in rows.values())
        calibrated = CALIBRATED_UNDERFLOW_PCT[label]
        assert measured <= calibrated * 1.25 + 0.05, label
        assert measured < Thresholds().underflow_threshold(label), label
        rule = max(calibrate_formats.FLOOR, CALIBRATION_MARGIN * calibrated)
        assert Thresholds().underflow_threshold(label) == pytest.approx(rule, abs=0.1), label
        assert (label in FORMAT_UNDERFLOW_PCT) == (rule > calibrate_formats.FLOOR), label
        assert ("blocks_max" in next(iter(rows.values()))) == (label in CALIBRATED_UNDERFLOW_BLOCKS_PCT), label
        for key, calibrated_per_block in (
            ("blocks", CALIBRATED_UNDERFLOW_BLOCKS_PCT),
            ("saturated", CALIBRATED_SATURATED_BLOCKS_PCT),
            ("worst", CALIBRATED_WORST_BLOCK_ERR),
        ):
            if label in CALIBRATED_UNDERFLOW_BLOCKS_PCT:  # a block format: its per-block values, 0 where none saturate
                measured = max(row[f"{key}_max"] for row in rows.values())
                assert measured <= calibrated_per_block.get(label, 0.0) * 1.25 + 0.05, (label, key)
    for label, calibrated in CALIBRATED_UNDERFLOW_BLOCKS_PCT.items():  # the script's rules applied to the table
        assert FORMAT_UNDERFLOW_BLOCKS_PCT[label] == max(1.0, math.ceil(CALIBRATION_MARGIN * calibrated * 10 - 1e-9) / 10)
        assert (
            FORMAT_WORST_BLOCK_ERR[label] == math.ceil(CALIBRATION_MARGIN * CALIBRATED_WORST_BLOCK_ERR[label] * 100 - 1e-9) / 100
        )
    for label, calibrated in CALIBRATED_SATURATED_BLOCKS_PCT.items():
        assert FORMAT_SATURATED_BLOCKS_PCT[label] == math.ceil((100 - (100 - calibrated) / CALIBRATION_MARGIN) * 10 - 1e-9) / 10


def test_a_user_threshold_for_a_format_wins_and_underflow_pct_stays_the_fp8_one():
    t = Thresholds(underflow_pct=5, format_underflow_pct={"nvfp4": 40})
    assert t.underflow_threshold("nvfp4") == 40 and t.underflow_threshold("mxfp4") == FORMAT_UNDERFLOW_PCT["mxfp4"]
    assert t.underflow_threshold("fp8_delayed_scaling") == t.underflow_threshold("mxfp8") == t.underflow_threshold(None) == 5
    assert t.as_dict()["format_underflow_pct"] == {"nvfp4": 40} and hash(t) == hash(
        Thresholds(5, format_underflow_pct={"nvfp4": 40})
    )
    with pytest.raises(ValueError, match="format_underflow_pct: unknown format 'fp4'; known: fp8_delayed_scaling"):
        Thresholds(format_underflow_pct={"fp4": 3})
    with pytest.raises(ValueError, match=r"the threshold of nvfp4 is a percentage in \[0, 100\), got 100"):
        Thresholds(format_underflow_pct={"nvfp4": 100})


def test_the_command_line_takes_format_thresholds(tmp_path, capsys):
    run(tmp_path, lowprec.NVFP4BlockScaling(), None)
    assert main(["diagnose", str(tmp_path), "-o", str(tmp_path / "fix.yaml"), "--format-underflow-pct", "nvfp4=1"]) == 0
    printed = capsys.readouterr().out
    assert "underflow by format mxfp6_e3m2 > " in printed.splitlines()[0] and "nvfp4 > 1%" in printed.splitlines()[0]
    assert "NVFP4's threshold 1% (given for the format (format_underflow_pct))" in printed
    with pytest.raises(SystemExit):
        main(["diagnose", str(tmp_path), "--format-underflow-pct", "nvfp4"])
    assert "expected FORMAT=PCT (nvfp4=30), got 'nvfp4'" in capsys.readouterr().err
