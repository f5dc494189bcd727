"""benchmarks/report_scale.py: its synthetic run is one the diagnosis reads as planted, and it measures a whole
command in a process of its own (a small run here)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import report_scale  # noqa: E402

from nvdlfw_inspect.diagnose import diagnose  # noqa: E402


def test_the_synthetic_run_holds_its_planted_problems_and_the_command_is_measured(tmp_path):
    report_scale.write_synthetic_log(tmp_path, layers=12, steps=10)
    findings = {(f.layer, f.tensor, f.kind) for f in diagnose(tmp_path).findings}
    assert ("model.layers.6.mlp.fc1", "activation", "nonfinite") in findings  # the NaN planted in the middle layer
    assert ("model.layers.7.mlp.fc1", "activation", "underflow") in findings  # 20 times its peers' underflow
    seconds, peak_mib = report_scale.command_cost("diagnose", str(tmp_path))
    assert seconds > 0 and 50 < peak_mib < 4096
    assert (tmp_path / "diagnose_config.yaml").is_file()
