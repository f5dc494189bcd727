"""benchmarks/guard_cost.py's paired ratio: one ratio per pair of steps of the guarded and the unselected model, and
a clear error for too few pairs (tiny model here)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import guard_cost  # noqa: E402


def test_each_pair_gives_one_ratio_and_their_quartiles_are_ordered(tmp_path):
    args = argparse.Namespace(device="cpu", width=16, depth=2, tokens=8, dtype="float32")
    ratios = guard_cost.paired_ratios(guard_cost.Bench(args), args, 5, str(tmp_path))
    assert len(ratios) == 5 and all(math.isfinite(r) and r > 0 for r in ratios)
    summary = guard_cost.quartiles(ratios)
    assert summary["pairs"] == 5 and summary["q1"] <= summary["median"] <= summary["q3"]


def test_fewer_than_two_pairs_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["guard_cost.py", "--device", "cpu", "--pairs", "1"])
    with pytest.raises(SystemExit) as exit_:
        guard_cost.main()
    assert exit_.value.code == 2
    assert "--pairs must be at least 2 (quartiles need two ratios), got 1" in capsys.readouterr().err
