"""Gloo worker for the statistics that warn early (importable by spawned children)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

EARLY = ["kurtosis", "rms", "outlier_channel_ratio", "max_channel"]
ROWS = {(0, 0): 3, (0, 1): 40, (1, 0): 17, (1, 1): 1}  # micro-batches of different sizes on each rank


def early_tensor(rank: int, micro_batch: int) -> torch.Tensor:
    """Heavy-tailed rows of 24 channels, a different mean per rank; channel 5 is the outlier, at its largest on rank 1."""
    g = torch.Generator().manual_seed(100 * rank + micro_batch)
    x = torch.randn(ROWS[(rank, micro_batch)], 24, generator=g, dtype=torch.float64)
    x = x / torch.rand(x.shape, generator=g, dtype=torch.float64).add(0.05) + 3.0 * rank
    x[:, 5] *= 40.0 + rank
    return x


def early_stats(rank: int, world: int, log_dir: Path) -> None:
    """Base LogTensorStats with the early statistics: two micro-batches per rank, reduced over the world; the
    logged values, in full precision, go to ``values-{rank}.json``."""
    import nvdlfw_inspect.api as debug_api
    from nvdlfw_inspect.logging import BaseLogger

    class Collect(BaseLogger):
        values: dict[str, float] = {}

        def log_scalar(self, name: str, value: float, iteration: int) -> None:
            self.values[name] = value

    config = {
        "all": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": ".*"},
            "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": [*EARLY, "std"]},
        }
    }
    collect = Collect()
    debug_api.initialize(config_file=config, log_dir=str(log_dir), statistics_logger=collect)
    debug_api.set_tensor_reduction_group(dist.new_group(list(range(world))))
    for micro_batch in range(2):
        debug_api.log_tensor_stats(layer_name="early", tensor=early_tensor(rank, micro_batch), tensor_name="activation")
    debug_api.step()
    debug_api.end_debug()
    (log_dir / f"values-{rank}.json").write_text(json.dumps(collect.values))
