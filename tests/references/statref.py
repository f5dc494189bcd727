"""Float64 reference statistics, computed directly (not through partials) for checking logged values."""

from __future__ import annotations

import math

import torch

SIX = ("min", "max", "mean", "std", "l1_norm", "l2_norm")


def reference_stats(x: torch.Tensor, names: tuple[str, ...] | None = None) -> dict[str, float]:
    """Every statistic of ``x`` in float64, or only those in ``names``."""
    v = x.detach().to(torch.float64).reshape(-1)
    nonzero = v.abs()[v != 0]
    amax = v.abs().max().item()
    values = {
        "min": v.min().item(),
        "max": v.max().item(),
        "mean": v.mean().item(),
        "std": v.std().item(),
        "l1_norm": v.abs().sum().item(),
        "l2_norm": math.sqrt((v * v).sum().item()),
        "cur_amax": amax,
        "dynamic_range": math.log2(amax) - math.log2(nonzero.min().item()) if nonzero.numel() else 0.0,
    }
    return values if names is None else {name: values[name] for name in names}
