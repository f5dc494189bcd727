"""Per-tensor partial statistics in float64 that merge exactly across ranks.

A partial is a 1-D float64 tensor laid out as ``FIELDS``. Mean and M2 (sum of squared deviations)
merge with Chan's formula, so std stays accurate even when the mean dwarfs the spread.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

FIELDS = ("count", "mean", "m2", "min", "max", "abs_sum", "abs_min_nonzero")
INDEX = {name: i for i, name in enumerate(FIELDS)}
OPTIONAL_FIELDS = frozenset({"abs_min_nonzero"})


def empty_partials(device: torch.device | str = "cpu") -> torch.Tensor:
    """The partial of an empty tensor: the identity of ``merge_partials``."""
    return torch.tensor([0.0, 0.0, 0.0, math.inf, -math.inf, 0.0, math.inf], dtype=torch.float64, device=device)


def compute_partials(tensor: torch.Tensor, fields: Iterable[str] = ()) -> torch.Tensor:
    """Partials of ``tensor`` (any dtype, any shape). Optional fields are computed only when named."""
    x = tensor.detach().reshape(-1)
    out = empty_partials(x.device)
    n = x.numel()
    if n == 0:
        return out
    x64 = x.to(torch.float64)
    mean = x64.mean()
    low, high = torch.aminmax(x64)
    values = [
        torch.tensor(float(n), dtype=torch.float64, device=x.device),
        mean,
        (x64 - mean).square().sum(),
        low,
        high,
        x64.abs().sum(),
    ]
    if "abs_min_nonzero" in set(fields):
        magnitude = x64.abs()
        values.append(torch.where(magnitude > 0, magnitude, math.inf).min())
    else:
        values.append(out[INDEX["abs_min_nonzero"]])
    return torch.stack(values)


def merge_partials(rows: torch.Tensor) -> torch.Tensor:
    """Merge partials stacked as rows of a 2-D tensor into one partial of their concatenation."""
    if rows.dim() == 1:
        return rows
    count = rows[:, INDEX["count"]]
    total = count.sum()
    out = empty_partials(rows.device)
    if total == 0:
        return out
    means = rows[:, INDEX["mean"]]
    mean = (count * means).sum() / total
    m2 = rows[:, INDEX["m2"]].sum() + (count * (means - mean).square()).sum()
    filled = count > 0
    out[INDEX["count"]] = total
    out[INDEX["mean"]] = mean
    out[INDEX["m2"]] = m2
    out[INDEX["min"]] = rows[filled, INDEX["min"]].min()
    out[INDEX["max"]] = rows[filled, INDEX["max"]].max()
    out[INDEX["abs_sum"]] = rows[:, INDEX["abs_sum"]].sum()
    out[INDEX["abs_min_nonzero"]] = rows[:, INDEX["abs_min_nonzero"]].min()
    return out
