"""Ranks out of step at ``debug_api.step()`` (2 gloo processes): an error naming the ranks and their
iterations instead of silently mixing steps, and a timeout naming a rank that never comes instead of a hang."""

from __future__ import annotations

from pathlib import Path

import pytest
import spawning
import torch
import torch.distributed as dist
from logreader import read_stats

import nvdlfw_inspect.api as debug_api

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)

WORKERS = Path(__file__).resolve().parents[1] / "dist_workers.py"  # shared with test_distributed.py
WORLD = 2


def spawn(body: str, tmp_path: Path) -> Path:
    return spawning.spawn(WORKERS, body, WORLD, tmp_path)


def test_a_rank_that_skips_step_makes_every_rank_raise_naming_ranks_and_iterations(tmp_path):
    log_dir = spawn("out_of_step", tmp_path)
    outcomes = [torch.load(log_dir / f"outcomes{rank}.pt") for rank in range(WORLD)]

    # step 0 agrees; at the next step() rank 0 flushes iteration 1, rank 1 (which skipped) iteration 2
    assert [error is None for _, error in outcomes[0]] == [True, False, False]
    assert [step for step, _ in outcomes[0][:2]] == [0, 1]
    assert [step for step, _ in outcomes[1][:2]] == [0, 2]
    for rank in range(WORLD):
        skipped = outcomes[rank][1][1]
        assert "newest iteration 1 on ranks [0]; iteration 2 on ranks [1]" in skipped
        assert "skipped or repeated debug_api.step()" in skipped
    # only the group out of step loses its statistics: a rank's own ones of that step are logged
    assert ("local_activation_mean", 1) in read_stats(log_dir, 0)
    assert {("local_activation_mean", 1), ("local_activation_mean", 2)} <= read_stats(log_dir, 1).keys()
    assert not any(name.startswith("a_") and iteration > 0 for name, iteration in read_stats(log_dir, 0))
    # the error leaves each rank consistent: the next step() compares the ranks' iteration counters
    assert [error is None for _, error in outcomes[1]] == [True, False, False]
    for rank in range(WORLD):
        counters = outcomes[rank][2][1]
        assert "out of step across the ranks [0, 1]" in counters
        assert "iteration 2 on ranks [0]; iteration 7 on ranks [1]" in counters


def test_a_rank_that_never_steps_is_named_within_the_collective_timeout(tmp_path):
    log_dir = spawn("silent_rank", tmp_path)
    result = torch.load(log_dir / "silent0.pt")

    assert result["error"] is not None, "step() returned although rank 1 never took part"
    assert "ranks [1] did not answer" in result["error"]
    assert "waited 3 s (collective_timeout)" in result["error"]
    assert 3.0 <= result["seconds"] < 8.0


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "3"])
def test_collective_timeout_must_be_a_positive_number_of_seconds(tmp_path, bad):
    with pytest.raises(ValueError, match=r"collective_timeout must be a positive number of seconds .* got"):
        debug_api.initialize(log_dir=str(tmp_path), collective_timeout=bad)
    assert debug_api.DEBUG_MANAGER is None
    debug_api.initialize(log_dir=str(tmp_path), collective_timeout=2.5)
    assert debug_api.DEBUG_MANAGER.collective_timeout == 2.5
