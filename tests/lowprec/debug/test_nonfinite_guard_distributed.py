"""NonfiniteGuard on two gloo ranks, the NaN on rank 1: with a reduction group both ranks skip the update (the flag
all-reduced with MAX in the one read); without one, only rank 1 does."""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import spawning  # noqa: E402

pytestmark = spawning.needs_gloo


def reports(body: str, tmp_path: Path) -> list[dict]:
    out_dir = spawning.spawn(HERE / "nonfinite_workers.py", body, 2, tmp_path, limit_s=120)
    return [json.loads((out_dir / f"rank{rank}_{body != 'per_rank'}.json").read_text()) for rank in range(2)]


def test_with_a_reduction_group_both_ranks_skip_the_update(tmp_path):
    rank0, rank1 = reports("reduced", tmp_path)
    assert rank1["raised"]["layer"] == "model.0" and rank1["raised"]["micro_batch"] == 1 and rank1["unchanged"]
    assert "first in layer model.0, tensor gradient" in rank1["poisoned"]
    assert rank0["raised"]["layer"] is None and rank0["unchanged"]
    assert "on another rank of the reduction group" in rank0["raised"]["message"] == rank0["poisoned"]


def test_without_one_only_the_poisoned_rank_skips(tmp_path):
    rank0, rank1 = reports("per_rank", tmp_path)
    assert rank1["raised"]["layer"] == "model.0" and rank1["unchanged"]
    assert rank0 == {"raised": None, "unchanged": False, "poisoned": None}


def test_a_rank_whose_layers_the_guard_does_not_select_still_joins_the_verdict(tmp_path):
    """The session finds the guard in its config, on every rank alike: a rank none of whose tensors reached the guard
    takes part in the reduction (else the other rank would wait for it), and skips the poisoned update with it."""
    rank0, rank1 = reports("one_rank_unguarded", tmp_path)
    assert rank1["raised"]["layer"] == "model.0" and rank1["unchanged"]
    assert rank0["raised"]["layer"] is None and rank0["unchanged"]
    assert "on another rank of the reduction group" in rank0["raised"]["message"]
