"""Statistics across 2 processes on gloo: the logged values equal those of the concatenated tensor."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from logreader import read_stats, stats_log_path
from statref import SIX, reference_stats

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import dist_workers  # noqa: E402


def reference(t: torch.Tensor) -> dict[str, float]:
    return reference_stats(t, SIX)


def spawn(body: str, world: int, tmp_path: Path) -> Path:
    log_dir, errors = tmp_path / "logs", tmp_path / "errors"
    errors.mkdir()
    args = (world, str(tmp_path / "init"), str(log_dir), str(errors), body)
    try:
        mp.start_processes(_entry, args=args, nprocs=world, start_method="spawn", join=True)
    except Exception as failure:
        details = "\n".join(p.read_text() for p in sorted(errors.iterdir()))
        raise AssertionError(f"a worker failed:\n{details}") from failure
    return log_dir


def _entry(rank: int, *args) -> None:
    sys.path.insert(0, str(HERE))
    import dist_workers as workers

    workers.run(rank, *args)


def check(stats: dict, layer: str, want: dict[str, float]) -> None:
    for stat, value in want.items():
        # the file keeps 4 decimals
        assert stats[(f"{layer}_activation_{stat}", 0)] == pytest.approx(value, rel=1e-6, abs=6e-5), (layer, stat)


def test_base_log_tensor_stats_reduces_partials_over_ranks(tmp_path):
    log_dir = spawn("base_log_tensor_stats", 2, tmp_path)
    tensors = [dist_workers.rank_tensor(r) for r in range(2)]
    together = reference(torch.cat(tensors))
    per_rank = [read_stats(log_dir, rank) for rank in range(2)]

    # no group anywhere: reduced over the default group, logged on the last rank only
    check(per_rank[1], "default", together)
    assert not any(name.startswith("default_") for name, _ in per_rank[0])
    # an explicit group, by kwarg or set globally: every member logs the concatenation's statistics
    for rank in range(2):
        check(per_rank[rank], "kwarg", together)
        check(per_rank[rank], "global", together)
        # skip_reduction: each rank its own tensor
        check(per_rank[rank], "skipped", reference(tensors[rank]))
    assert stats_log_path(log_dir, 0).exists() and stats_log_path(log_dir, 1).exists()
