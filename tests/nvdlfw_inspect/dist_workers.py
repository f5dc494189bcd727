"""Worker processes for the distributed tests (importable by spawned children)."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

SIZES = (100, 37, 58)


def rank_tensor(rank: int) -> torch.Tensor:
    """A different, deterministic tensor per rank: different sizes, means and spreads."""
    g = torch.Generator().manual_seed(1234 + rank)
    return torch.randn(SIZES[rank], generator=g) * (rank + 1) + 50.0 * rank


def run(rank: int, world: int, init_file: str, log_dir: str, errors: str, body: str) -> None:
    """Set up a gloo group, run ``body`` (a function name of this module), tear down; record failures."""
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        globals()[body](rank, world, Path(log_dir))
    except BaseException:
        Path(errors, f"rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        import nvdlfw_inspect.api as debug_api

        debug_api.end_debug()
        if dist.is_initialized():
            dist.destroy_process_group()


SIX = ["min", "max", "mean", "std", "l1_norm", "l2_norm"]


def base_log_tensor_stats(rank: int, world: int, log_dir: Path) -> None:
    """Base LogTensorStats: default group, explicit global group, reduction_group kwarg, skip_reduction."""
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
    group = dist.new_group(list(range(world)))
    debug_api.log_tensor_stats(layer_name="kwarg", tensor=t, tensor_name="activation", reduction_group=group)
    debug_api.set_tensor_reduction_group(group)
    debug_api.log_tensor_stats(layer_name="global", tensor=t, tensor_name="activation")
    debug_api.step()


if __name__ == "__main__":  # pragma: no cover - manual runs
    sys.exit("run through tests/nvdlfw_inspect/test_distributed.py")
