"""The distributed helpers without a process group (no collective runs), and statistics across 2 and 3
processes on gloo: the logged values equal those of the concatenated tensor."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from blockref import mx_fake
from logreader import read_stats, stats_log_path
from statref import SIX, reference_stats

from lowprec.formats.elements import E4M3
from nvdlfw_inspect.distributed import (
    gather_along_first_dim,
    gather_tensor_on_last_rank,
    get_distributed_rank,
    get_distributed_world_size,
    is_distributed,
)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import dist_workers  # noqa: E402
import spawning  # noqa: E402


def reference(t: torch.Tensor) -> dict[str, float]:
    return reference_stats(t, SIX)


def spawn(body: str, world: int, tmp_path: Path) -> Path:
    return spawning.spawn(HERE / "dist_workers.py", body, world, tmp_path)


@pytest.fixture
def no_collectives(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("no collective may run without a process group")

    for name in ("all_gather", "gather", "all_reduce", "broadcast", "get_rank", "get_world_size"):
        monkeypatch.setattr(dist, name, forbidden)


def test_single_process_rank_and_world_size(no_collectives):
    assert not is_distributed()
    assert get_distributed_rank() == 0 and get_distributed_world_size() == 1
    group = object()  # any group: without a default group there is one process
    assert get_distributed_rank(group) == 0 and get_distributed_world_size(group) == 1


@pytest.mark.parametrize(
    "t",
    [torch.arange(6.0).reshape(3, 2), torch.ones(4, dtype=torch.bfloat16), torch.arange(12).reshape(2, 3, 2).transpose(0, 2)],
    ids=["2-d", "bf16", "non-contiguous"],
)
def test_single_process_gathers_return_the_input(no_collectives, t):
    before = t.clone()
    gathered, extra = gather_along_first_dim(t)
    assert gathered is t and extra is None
    gathered, extra = gather_along_first_dim(t, process_group=object())
    assert gathered is t and extra is None
    assert gather_tensor_on_last_rank(t) is t
    assert torch.equal(t, before)


# --- statistics across processes -------------------------------------------------------------


def check(stats: dict, layer: str, want: dict[str, float]) -> None:
    for stat, value in want.items():
        # the file keeps 4 decimals
        assert stats[(f"{layer}_activation_{stat}", 0)] == pytest.approx(value, rel=1e-6, abs=6e-5), (layer, stat)


@spawning.needs_gloo
@pytest.mark.parametrize("world", [2, 3])
def test_base_log_tensor_stats_reduces_partials_over_ranks(tmp_path, world):
    log_dir = spawn("base_log_tensor_stats", world, tmp_path)
    tensors = [dist_workers.rank_tensor(r) for r in range(world)]
    together = reference(torch.cat(tensors))
    per_rank = [read_stats(log_dir, rank) for rank in range(world)]

    # no group anywhere: reduced over the default group, logged on the last rank only
    check(per_rank[-1], "default", together)
    for rank in range(world - 1):
        assert not any(name.startswith("default_") for name, _ in per_rank[rank])
    # an explicit group, by kwarg or set globally (two groups, which odd ranks fed first in the other order: the
    # ranks still reduce them in one order): every member logs the concatenation's statistics
    for rank in range(world):
        check(per_rank[rank], "kwarg", together)
        check(per_rank[rank], "global", together)
        # skip_reduction: each rank its own tensor
        check(per_rank[rank], "skipped", reference(tensors[rank]))
    assert all(stats_log_path(log_dir, rank).exists() for rank in range(world))


@spawning.needs_gloo
def test_pipeline_stages_without_a_reduction_group_are_each_logged_on_the_last_rank_of_their_stage(tmp_path):
    world = 3
    log_dir = spawn("pipeline_stages", world, tmp_path)
    stage0 = torch.cat([dist_workers.rank_tensor(rank) for rank in range(world - 1)])
    per_rank = [read_stats(log_dir, rank) for rank in range(world)]

    assert per_rank[0] == {}  # a stage's statistics once, reduced over the stage's ranks
    assert per_rank[1] == {("stage0_activation_mean", 0): pytest.approx(stage0.double().mean().item(), abs=6e-5)}
    assert per_rank[2] == {
        ("stage1_activation_mean", 0): pytest.approx(dist_workers.rank_tensor(2).double().mean().item(), abs=6e-5)
    }
    debug_log = (log_dir / "nvdlfw_inspect_logs" / "nvdlfw_inspect_globalrank-0.log").read_text()
    assert "logged on one rank only, the last rank that logs the same layer and tensor" in debug_log


def fp8_underflows_and_mse(x: torch.Tensor) -> tuple[float, float]:
    """Current-scaling E4M3 underflow count and squared error, in float64."""
    x = x.double()
    scale = torch.tensor(448.0 / x.abs().max().item(), dtype=torch.float32).double()
    q = (x * scale).clamp(-448, 448).float().to(torch.float8_e4m3fn).double()
    return float(((x != 0) & (q == 0)).sum()), float((x - q / scale).square().sum())


@spawning.needs_gloo
@pytest.mark.parametrize("world", [2, 3])
def test_lowprec_statistics_reduce_over_ranks_micro_batches_and_tensor_parallel_weights(tmp_path, world):
    log_dir = spawn("te_stats", world, tmp_path)
    fed = [torch.load(log_dir / f"fed{rank}.pt") for rank in range(world)]
    every_x = torch.cat([x for f in fed for x in f["x"]])
    fp8 = [fp8_underflows_and_mse(x) for f in fed for x in f["x"]]  # one cast per micro-batch and rank
    for rank in range(world):
        stats = read_stats(log_dir, rank)
        for layer in ("tp", "local"):
            for stat, want in reference(every_x).items():
                assert stats[(f"{layer}_activation_{stat}", 0)] == pytest.approx(want, rel=1e-6, abs=6e-5), (rank, stat)
            assert stats[(f"{layer}_activation_underflows%", 0)] == pytest.approx(
                100 * sum(u for u, _ in fp8) / every_x.numel(), abs=6e-5
            )
            assert stats[(f"{layer}_activation_mse", 0)] == pytest.approx(sum(e for _, e in fp8) / every_x.numel(), abs=6e-5)
        shards = torch.cat([f["weights"]["tp"] for f in fed])
        for stat, want in reference(shards).items():  # sharded weights: the whole weight's statistics
            assert stats[(f"tp_weight_{stat}", 0)] == pytest.approx(want, rel=1e-6, abs=6e-5), (rank, stat)
        for stat, want in reference(fed[rank]["weights"]["local"]).items():  # not sharded: per rank
            assert stats[(f"local_weight_{stat}", 0)] == pytest.approx(want, rel=1e-6, abs=6e-5), (rank, stat)


@spawning.needs_gloo
@pytest.mark.parametrize("world", [2, 3])
def test_two_packed_all_reduces_per_step_once_the_ranks_agree_on_the_order(tmp_path, world):
    log_dir = spawn("packed_gather", world, tmp_path)
    every_rank = torch.cat([dist_workers.rank_tensor(r) for r in range(world)])
    for rank in range(world):
        saved = torch.load(log_dir / f"packed{rank}.pt")
        # two all-reduces a step; the first checks that every rank is there and in step, and tells whether the
        # order of the rows must be agreed: at the first step, and when rank 0 has a new request at step 3
        packed = ["all_reduce", "all_reduce"]
        agree = ["all_reduce", "gather_objects", "all_gather", "all_gather", *packed]  # the sizes, then the bytes
        assert saved["calls"] == [agree, packed, packed, agree, packed]
        debug_log = (log_dir / "nvdlfw_inspect_logs" / f"nvdlfw_inspect_globalrank-{rank}.log").read_text()
        others = ", ".join(f"rank {r} lacks 1" for r in range(1, world))  # only0's request (its mean and std)
        assert f"log different requests ({others} of the group's" in debug_log
        logged = saved["logged"]
        for step in range(5):
            want = reference_stats(every_rank + step, ("mean", "std"))
            assert logged[("a_activation_mean", step)] == pytest.approx(want["mean"], rel=1e-6)
            assert logged[("b_activation_std", step)] == pytest.approx(want["std"], rel=1e-6)
        only0 = {key for key in logged if key[0].startswith("only0")}
        if rank == 0:
            assert only0 == {
                ("only0_activation_mean", 3),
                ("only0_activation_std", 3),
                ("only0_activation_mean", 4),
                ("only0_activation_std", 4),
            }
            assert logged[("only0_activation_mean", 4)] == pytest.approx(
                reference_stats(dist_workers.rank_tensor(0), ("mean",))["mean"], rel=1e-6
            )
        else:
            assert only0 == set()


@spawning.needs_gloo
def test_the_num_zeros_family_is_exact_over_micro_batches_and_ranks(tmp_path):
    log_dir = spawn("zeros_stats", 2, tmp_path)
    every = torch.cat([dist_workers.zeros_tensor(rank, mb) for rank in range(2) for mb in range(2)])
    exact = float((every == 0).sum())  # NaN is no zero
    near = float((every.abs() <= 1e-10).sum())  # in the tensor's precision: float32(1e-10) is at the threshold
    for rank in range(2):
        stats = read_stats(log_dir, rank)
        assert stats[("zeros_activation_num_zeros", 0)] == exact == 8
        assert stats[("zeros_activation_num_zeros[1e-10]", 0)] == near == 16
        assert stats[("zeros_activation_num_zeros%", 0)] == pytest.approx(100 * exact / every.numel(), abs=6e-5)
        assert stats[("zeros_activation_num_zeros[1e-10]%", 0)] == pytest.approx(100 * near / every.numel(), abs=6e-5)
        assert stats[("zeros_activation_num_zeros%", 0)] == 40.0  # 8 of 20 values: the NaN counts in the whole
        assert stats[("zeros_activation_max", 0)] == 3.0  # the plain statistics of the same config beside them


def mxfp8_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each 1 x 32 block's relative error and % of its non-zero values flushed, in float64 from ``mx_fake``."""
    xb, qb = x.double().reshape(x.shape[0], -1, 32), mx_fake(x, E4M3).double().reshape(x.shape[0], -1, 32)
    rel = ((qb - xb).square().sum(-1) / xb.square().sum(-1)).sqrt()
    return rel, 100.0 * ((xb != 0) & (qb == 0)).sum(-1) / (xb != 0).sum(-1)


@spawning.needs_gloo
def test_the_worst_and_most_flushed_blocks_are_located_exactly_over_micro_batches_and_ranks(tmp_path):
    """The block that flushes most is the outlier channel's (column block 2) on rank 1, first micro-batch, row 5; the
    worst by relative error is elsewhere; each is located where it was fed, on every rank."""
    log_dir = spawn("block_stats", 2, tmp_path)
    feeds = {(rank, mb): mxfp8_blocks(dist_workers.outlier_tensor(rank, mb)) for rank in range(2) for mb in range(2)}
    rel = torch.stack([r for r, _ in feeds.values()])
    share = torch.stack([s for _, s in feeds.values()])
    _, row, col = (int(i) for i in torch.nonzero(rel == rel.max())[0])
    assert (share == share.max()).sum() == 1 and share.max() == 100 * 31 / 32
    assert [int(i) for i in torch.nonzero(share == share.max())[0]] == [2, 5, 2]  # feed (1, 0): rank 1, first
    assert col != 2 and (rel == rel.max()).sum() == 1
    for rank in range(2):
        stats = read_stats(log_dir, rank)
        # the log writes 4 decimals
        assert stats[("blocks_activation_worst_block_rel_err", 0)] == pytest.approx(rel.max().item(), abs=6e-5)
        assert (stats[("blocks_activation_worst_block_row", 0)], stats[("blocks_activation_worst_block_col", 0)]) == (row, col)
        assert stats[("blocks_activation_worst_block_flushed%", 0)] == 100 * 31 / 32
        assert stats[("blocks_activation_worst_flushed_row", 0)] == 5
        assert stats[("blocks_activation_worst_flushed_col", 0)] == 2
