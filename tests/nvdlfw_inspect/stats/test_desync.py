"""Ranks out of step at ``debug_api.step()`` (2 gloo processes): an error naming the ranks and their
iterations instead of silently mixing steps, and a timeout naming a rank that never comes instead of a hang."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import spawning
import torch
from logreader import read_stats

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.errors import DistributedDesyncWarning
from nvdlfw_inspect.stats.desync import OwnGroup

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dist_workers  # noqa: E402

pytestmark = spawning.needs_gloo

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


def test_a_rank_that_goes_away_is_named_once_and_the_survivor_logs_its_own_statistics(tmp_path):
    log_dir = spawning.spawn(WORKERS, "lost_rank", WORLD, tmp_path, limit_s=60)
    saved = torch.load(log_dir / "lost0.pt")

    assert [error for _, error, _ in saved["outcomes"]] == [None] * 6, "a lost rank is said, not raised: training goes on"
    assert max(seconds for _, _, seconds in saved["outcomes"]) < 2.0  # no step waits a timeout for a rank that is gone
    lost = [message for message in saved["warnings"] if "went away" in message]
    assert len(lost) == 1, saved["warnings"]
    assert "the ranks [1] of the statistics reduction group [0, 1] went away at iteration 2" in lost[0]
    assert "this rank logs its own statistics of that group only" in lost[0]
    debug_log = (log_dir / "nvdlfw_inspect_logs" / "nvdlfw_inspect_globalrank-0.log").read_text()
    assert lost[0] in debug_log
    stats = read_stats(log_dir, 0)
    for iteration in range(6):
        tensors = [dist_workers.rank_tensor(rank) + iteration for rank in (range(WORLD) if iteration < 2 else [0])]
        assert stats[("a_activation_mean", iteration)] == pytest.approx(torch.cat(tensors).double().mean().item(), abs=6e-5)


def test_a_late_rank_costs_one_step_of_statistics_and_the_trainings_collectives_go_on(tmp_path):
    log_dir = spawning.spawn(WORKERS, "late_rank", WORLD, tmp_path, limit_s=60)
    saved = [torch.load(log_dir / f"late{rank}.pt") for rank in range(WORLD)]

    for rank in range(WORLD):
        assert saved[rank]["sums"] == [3.0] * 4, "the training's own collectives after the statistics timed out"
        errors = [error for _, error in saved[rank]["outcomes"]]
        assert errors[0] is None and errors[2:] == [None, None], errors
    assert "ranks [1] did not answer" in saved[0]["outcomes"][1][1]
    late = saved[1]["outcomes"][1][1]
    assert "ranks [0] gave up waiting for this rank (1) at iteration 1" in late, late
    assert "did not answer" not in late
    for rank in range(WORLD):
        stats = read_stats(log_dir, rank)
        for iteration in (0, 2, 3):
            every = torch.cat([dist_workers.rank_tensor(r) + iteration for r in range(WORLD)]).double()
            assert stats[("a_activation_mean", iteration)] == pytest.approx(every.mean().item(), abs=6e-5)
        assert ("a_activation_mean", 1) not in stats


def test_a_group_that_cannot_be_set_up_is_said_once_and_reduces_nothing():
    group = OwnGroup([0, 1], session=0)  # no default process group here: its gloo group cannot be set up
    said = r"the statistics reduction group over the ranks \[0, 1\] could not be set up \(.+\): from iteration 3 on"
    with pytest.warns(DistributedDesyncWarning, match=said):
        assert group.run(lambda rows: iter(()), None, 3, timeout=5) is None  # the caller logs its own rows
    assert group.lost
    assert group.run(lambda rows: iter(()), None, 4, timeout=5) is None


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "3"])
def test_collective_timeout_must_be_a_positive_number_of_seconds(tmp_path, bad):
    with pytest.raises(ValueError, match=r"collective_timeout must be a positive number of seconds .* got"):
        debug_api.initialize(log_dir=str(tmp_path), collective_timeout=bad)
    assert debug_api.DEBUG_MANAGER is None
    debug_api.initialize(log_dir=str(tmp_path), collective_timeout=2.5)
    assert debug_api.DEBUG_MANAGER.collective_timeout == 2.5
