"""benchmarks/malloc_faults.py at a tiny size: both malloc settings run, each in a process of its own, and the table
reports their page faults and step times."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_both_settings_are_measured_in_their_own_processes():
    command = [sys.executable, str(ROOT / "benchmarks" / "malloc_faults.py"), "--width", "16", "--depth", "2"]
    command += ["--tokens", "8", "--steps", "2", "--rounds", "2", "--threads", "1"]
    table = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "MALLOC_MMAP_THRESHOLD_=33554432, MALLOC_TRIM_THRESHOLD_=1073741824" in table
    for variant in ("default", "pinned"):
        row = re.search(rf"^\| {variant} \| ([0-9.]+) \| ([0-9.]+) \| (.+) \|$", table, re.MULTILINE)
        assert row is not None, table
        assert float(row.group(2)) > 0
        assert len(row.group(3).split("; ")) == 2  # one process per round
    ratios = re.search(r"pinned / default, per round: (.+)$", table, re.MULTILINE).group(1).split(", ")
    assert len(ratios) == 2 and all(float(ratio) > 0 for ratio in ratios)
