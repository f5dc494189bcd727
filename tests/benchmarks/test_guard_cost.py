"""benchmarks/guard_cost.py's paired ratio: one ratio per pair of steps of the guarded and the unselected model, with
their page faults, and a clear error for too few pairs (tiny model here)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import guard_cost  # noqa: E402


def test_each_pair_gives_one_ratio_and_their_quartiles_are_ordered(tmp_path):
    args = argparse.Namespace(device="cpu", width=16, depth=2, tokens=8, dtype="float32")
    paired = guard_cost.paired_ratios(guard_cost.Bench(args), args, 5, str(tmp_path))
    assert len(paired.ratios) == 5 and all(math.isfinite(r) and r > 0 for r in paired.ratios)
    summary = guard_cost.summary(paired)
    assert summary["pairs"] == 5 and summary["q1"] <= summary["median"] <= summary["q3"]
    faults = summary["page_faults_per_step"]
    assert faults.keys() == {"guarded", "other"} and all(count >= 0 for count in faults.values())


def test_page_faults_count_memory_touched_first():
    """The count the paired table reports: a fresh 64 MiB buffer (beyond malloc's heap: mapped anew) written through
    faults in its pages."""
    from harness import page_faults

    before = page_faults()
    buffer = torch.empty(64 << 20, dtype=torch.uint8)
    buffer.fill_(1)
    assert page_faults() - before >= (64 << 20) // (2 << 20)  # at least one per 2 MiB huge page (4 KiB pages: 16,384)


def test_fewer_than_two_pairs_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["guard_cost.py", "--device", "cpu", "--pairs", "1"])
    with pytest.raises(SystemExit) as exit_:
        guard_cost.main()
    assert exit_.value.code == 2
    assert "--pairs must be at least 2 (quartiles need two ratios), got 1" in capsys.readouterr().err
