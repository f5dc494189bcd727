"""Worker processes for the distributed tests (importable by spawned children)."""

from __future__ import annotations

import datetime
import os
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

SIZES = (100, 37, 58)


def rank_tensor(rank: int) -> torch.Tensor:
    """A different, deterministic tensor per rank: different sizes, means and spreads."""
    g = torch.Generator().manual_seed(1234 + rank)
    return torch.randn(SIZES[rank], generator=g) * (rank + 1) + 50.0 * rank


SIX = ["min", "max", "mean", "std", "l1_norm", "l2_norm"]


def base_log_tensor_stats(rank: int, world: int, log_dir: Path) -> None:
    """Base LogTensorStats: default group, explicit global group, reduction_group kwarg, skip_reduction. The last
    two are different groups over every rank, fed in a different order on odd ranks."""
    import nvdlfw_inspect.api as debug_api

    config = {
        "all": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": ".*"},
            "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": SIX},
        }
    }
    debug_api.initialize(config_file=config, log_dir=str(log_dir))
    t = rank_tensor(rank)
    debug_api.log_tensor_stats(layer_name="default", tensor=t, tensor_name="activation")
    debug_api.log_tensor_stats(layer_name="skipped", tensor=t, tensor_name="activation", skip_reduction=True)
    groups = [dist.new_group(list(range(world))) for _ in range(2)]
    debug_api.set_tensor_reduction_group(groups[1])
    feeds = [("kwarg", {"reduction_group": groups[0]}), ("global", {})]
    for layer, kwargs in feeds if rank % 2 == 0 else feeds[::-1]:
        debug_api.log_tensor_stats(layer_name=layer, tensor=t, tensor_name="activation", **kwargs)
    debug_api.step()


def te_stats(rank: int, world: int, log_dir: Path) -> None:
    """lowprec layers under FP8: activations over the world (two micro-batches), weights over the
    tensor-parallel group (layer "tp") or per rank (layer "local"); saves what it fed for the test."""
    import lowprec
    import nvdlfw_inspect.api as debug_api

    features = {
        "LogTensorStats": {"enabled": True, "tensors": ["activation", "weight"], "stats": SIX},
        "LogFp8TensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["underflows%", "mse"]},
    }
    config = {"all": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "transformer_engine": features}}
    debug_api.initialize(config_file=config, feature_dirs=[lowprec.FEATURE_DIR], log_dir=str(log_dir))
    torch.manual_seed(100 + rank)
    layers = {"tp": lowprec.Linear(16, 8, name="tp"), "local": lowprec.Linear(16, 8, name="local")}
    layers["tp"].set_tensor_parallel_group(dist.new_group(list(range(world))))
    g = torch.Generator().manual_seed(rank)
    fed = {"x": [], "weights": {name: layer.weight.detach().clone() for name, layer in layers.items()}}
    for _ in range(2):  # micro-batches
        x = torch.randn(4 + rank, 16, generator=g) * (rank + 1) + rank
        fed["x"].append(x)
        with lowprec.fp8_autocast(fp8_recipe=lowprec.Float8CurrentScaling()):
            for layer in layers.values():
                layer(x).sum().backward()
    debug_api.step()
    torch.save(fed, log_dir / f"fed{rank}.pt")


BLOCK_WORLD_STATS = ["worst_block_rel_err", "worst_block_row", "worst_block_col", "worst_block_flushed%"]
BLOCK_WORLD_STATS += ["worst_flushed_row", "worst_flushed_col"]


def outlier_tensor(rank: int, micro_batch: int) -> torch.Tensor:
    """N(0, 1) values with channel 70 at 1e6: MXFP8 flushes the rest of its blocks (column block 2, clipped to 1.5)
    but a value of 100 in each, except in row 5 of rank 1's first micro-batch, whose block alone flushes 31 of 32."""
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(10 * rank + micro_batch))
    x[:, 64:96].clamp_(-1.5, 1.5)
    x[:, 70], x[:, 64] = 1e6, 100.0
    if (rank, micro_batch) == (1, 0):
        x[5, 64] = 0.5
    return x


def block_stats(rank: int, world: int, log_dir: Path) -> None:
    """Per-block statistics of a layer's own MXFP8 activation: two micro-batches per rank, reduced over the world."""
    import lowprec
    import nvdlfw_inspect.api as debug_api

    features = {"LogFp8TensorStats": {"enabled": True, "tensors": ["activation"], "stats": BLOCK_WORLD_STATS}}
    config = {"all": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "transformer_engine": features}}
    debug_api.initialize(config_file=config, feature_dirs=[lowprec.FEATURE_DIR], log_dir=str(log_dir))
    torch.manual_seed(0)
    layer = lowprec.Linear(256, 32, name="blocks")
    for micro_batch in range(2):
        with lowprec.fp8_autocast(fp8_recipe=lowprec.MXFP8BlockScaling()):
            layer(outlier_tensor(rank, micro_batch)).sum().backward()
    debug_api.step()
    debug_api.end_debug()


def packed_gather(rank: int, world: int, log_dir: Path) -> None:
    """Five steps of base statistics; at step 3 rank 0 adds a layer of its own. Saves, per step, the
    collectives the statistics ran on the tool's own group and what was logged."""
    import nvdlfw_inspect.api as debug_api
    from nvdlfw_inspect.logging import BaseLogger
    from nvdlfw_inspect.stats.desync import OwnGroup

    calls: list[str] = []
    for name in ("all_gather", "gather_objects", "all_reduce"):
        original = getattr(OwnGroup, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        setattr(OwnGroup, name, counted)

    logged: dict = {}

    class Keep(BaseLogger):
        def log_scalar(self, name, value, iteration):
            logged[(name, iteration)] = value

    config = {
        "all": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": ".*"},
            "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["mean", "std"]},
        }
    }
    debug_api.initialize(config_file=config, log_dir=str(log_dir), statistics_logger=Keep())
    debug_api.set_tensor_reduction_group(dist.group.WORLD)
    per_step = []
    for step in range(5):
        for layer in ("a", "b"):
            debug_api.log_tensor_stats(layer_name=layer, tensor=rank_tensor(rank) + step, tensor_name="activation")
        if rank == 0 and step >= 3:
            debug_api.log_tensor_stats(layer_name="only0", tensor=rank_tensor(rank), tensor_name="activation")
        del calls[:]
        debug_api.step()
        per_step.append(list(calls))
    torch.save({"calls": per_step, "logged": logged}, log_dir / f"packed{rank}.pt")


MEAN_CONFIG = {
    "all": {
        "enabled": True,
        "layers": {"layer_name_regex_pattern": ".*"},
        "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["mean"]},
    }
}


def _step_outcome(step: int) -> tuple[int, str | None]:
    """``debug_api.step()``: (``step``, None), or (``step``, the message of the DistributedDesyncError it raised)."""
    import nvdlfw_inspect.api as debug_api
    from nvdlfw_inspect.errors import DistributedDesyncError

    try:
        debug_api.step()
    except DistributedDesyncError as error:
        return step, str(error)
    return step, None


def out_of_step(rank: int, world: int, log_dir: Path) -> None:
    """Both ranks log their loop's iteration (layer "local" per rank); rank 1 skips ``step()`` at iteration 1,
    and after the error rank 1 sets another iteration counter. Saves every step's outcome."""
    import nvdlfw_inspect.api as debug_api

    debug_api.initialize(config_file=MEAN_CONFIG, log_dir=str(log_dir), collective_timeout=60)
    debug_api.set_tensor_reduction_group(dist.group.WORLD)
    outcomes = []
    for iteration in range(3):
        debug_api.log_tensor_stats(layer_name="a", tensor=rank_tensor(rank), tensor_name="activation", iteration=iteration)
        debug_api.log_tensor_stats(
            layer_name="local", tensor=rank_tensor(rank), tensor_name="activation", iteration=iteration, skip_reduction=True
        )
        if rank == 1 and iteration == 1:
            continue  # the skipped step()
        outcomes.append(_step_outcome(iteration))
        if outcomes[-1][1] is not None:
            break
    if rank == 1:
        debug_api.initialize_training_step(7)
    debug_api.log_tensor_stats(layer_name="a", tensor=rank_tensor(rank), tensor_name="activation")
    outcomes.append(_step_outcome(-1))
    torch.save(outcomes, log_dir / f"outcomes{rank}.pt")


def silent_rank(rank: int, world: int, log_dir: Path) -> None:
    """Rank 0 logs and steps with a 3 s collective timeout; rank 1 stays alive and never steps (it waits
    for rank 0's result, at most a minute). Rank 0 saves the error and how long step() took."""
    import nvdlfw_inspect.api as debug_api

    debug_api.initialize(config_file=MEAN_CONFIG, log_dir=str(log_dir), collective_timeout=3)
    done = log_dir / "silent0.pt"
    if rank == 1:
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        return
    debug_api.log_tensor_stats(layer_name="a", tensor=rank_tensor(rank), tensor_name="activation")
    start = time.monotonic()
    outcome = _step_outcome(0)
    torch.save({"error": outcome[1], "seconds": time.monotonic() - start}, log_dir / "silent0.tmp")
    (log_dir / "silent0.tmp").rename(done)


def lost_rank(rank: int, world: int, log_dir: Path) -> None:
    """Rank 1 goes away before the step of iteration 2 (its process ends, as a crash ends it); rank 0 steps on
    through iteration 5 with a 2 s collective timeout. Rank 0 saves each step's outcome and time, and its warnings."""
    import nvdlfw_inspect.api as debug_api

    debug_api.initialize(config_file=MEAN_CONFIG, log_dir=str(log_dir), collective_timeout=2)
    debug_api.set_tensor_reduction_group(dist.group.WORLD)
    dist.barrier()  # the ranks start the steps together: the first step's wait measures no start-up skew
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outcomes = []
        for iteration in range(6):
            if rank == 1 and iteration == 2:
                os._exit(0)
            debug_api.log_tensor_stats(layer_name="a", tensor=rank_tensor(rank) + iteration, tensor_name="activation")
            start = time.monotonic()
            outcomes.append((*_step_outcome(iteration), time.monotonic() - start))
    said = [str(warning.message) for warning in caught]
    torch.save({"outcomes": outcomes, "warnings": said}, log_dir / f"lost{rank}.pt")


def late_rank(rank: int, world: int, log_dir: Path) -> None:
    """Rank 1 comes to the step of iteration 1 once rank 0 gave up waiting for it (collective timeout 1.5 s); after
    each step both ranks run the training's own collectives on the default group (a barrier and a sum), each bounded
    by 10 s. Saves every step's outcome and sum."""
    import nvdlfw_inspect.api as debug_api

    debug_api.initialize(config_file=MEAN_CONFIG, log_dir=str(log_dir), collective_timeout=1.5)
    debug_api.set_tensor_reduction_group(dist.group.WORLD)
    dist.barrier()
    gave_up = log_dir / "rank0_gave_up"
    outcomes, sums = [], []
    for iteration in range(4):
        debug_api.log_tensor_stats(layer_name="a", tensor=rank_tensor(rank) + iteration, tensor_name="activation")
        if rank == 1 and iteration == 1:
            deadline = time.monotonic() + 30
            while not gave_up.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        outcomes.append(_step_outcome(iteration))
        if rank == 0 and iteration == 1:
            gave_up.touch()
        dist.barrier(async_op=True).wait(datetime.timedelta(seconds=10))
        value = torch.tensor([rank + 1.0])
        dist.all_reduce(value, async_op=True).wait(datetime.timedelta(seconds=10))
        sums.append(value.item())
    torch.save({"outcomes": outcomes, "sums": sums}, log_dir / f"late{rank}.pt")


def pipeline_stages(rank: int, world: int, log_dir: Path) -> None:
    """Two pipeline stages and no reduction group: the last rank holds layer "stage1", the others (data parallel)
    layer "stage0"."""
    import nvdlfw_inspect.api as debug_api

    debug_api.initialize(config_file=MEAN_CONFIG, log_dir=str(log_dir))
    layer = "stage1" if rank == world - 1 else "stage0"
    debug_api.log_tensor_stats(layer_name=layer, tensor=rank_tensor(rank), tensor_name="activation")
    debug_api.step()


ZEROS = ["num_zeros", "num_zeros%", "num_zeros[1e-10]", "num_zeros[1e-10]%", "max"]


def zeros_tensor(rank: int, micro_batch: int) -> torch.Tensor:
    """Exact zeros (signed too), values at, under and over 1e-10, and a NaN: a different mix per rank and micro-batch."""
    base = torch.tensor([0.0, -0.0, 1e-10, -5e-11, 2e-10, 3.0, float("nan")], dtype=torch.float64)
    return base[: 4 + rank + micro_batch].float()


def zeros_stats(rank: int, world: int, log_dir: Path) -> None:
    """The num_zeros family of the base LogTensorStats: two micro-batches per rank, reduced over the world."""
    import nvdlfw_inspect.api as debug_api

    config = {
        "all": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": ".*"},
            "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ZEROS},
        }
    }
    debug_api.initialize(config_file=config, log_dir=str(log_dir))
    debug_api.set_tensor_reduction_group(dist.new_group(list(range(world))))
    for micro_batch in range(2):
        debug_api.log_tensor_stats(layer_name="zeros", tensor=zeros_tensor(rank, micro_batch), tensor_name="activation")
    debug_api.step()
    debug_api.end_debug()
