"""THE layout of a partial: each field's name, merge rule and identity, in the order of its float64 vector.

A partial holds a tensor's statistics in a form that merges exactly across micro-batches and ranks:
counts and sums add, extremes take the min or max, and mean/M2 (sum of squared deviations) merge with
Chan's formula, so std stays accurate even when the mean dwarfs the spread; M3 and M4 (sums of cubed and
fourth-power deviations) merge with Pébay's formulas (Sandia report SAND2008-6212), written for many
partials at once. A field nobody fills keeps its identity, so one layout serves every statistic.

Every implementation takes the layout from here: ``merge_partials`` below, the torch reductions and the
Triton kernel (offsets as constexprs), and the C kernel (an enum, the rules and the identities generated
into its source by ``kernels.cpu``); ``tests/nvdlfw_inspect/stats/test_fields.py`` checks that they agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MERGE_RULES = ("sum", "chan", "min", "max")
FILLERS = ("tensor", "grid", "scale", "moments", "feature")


@dataclass(frozen=True)
class Field:
    """``merge``: one of ``MERGE_RULES`` ("chan": the central moments mean, M2, M3 and M4, merged with the count by
    Chan's and Pébay's formulas).
    ``filled_by``: what the statistics operator fills it from: ``"tensor"`` (the values), ``"grid"``
    (counted per quantization grid), ``"scale"`` (a grid's scale_inv), ``"moments"`` (the values' higher central
    moments, when asked: ``want_moments``), or ``"feature"`` (features only, with
    ``set_fields``; the operator leaves it at its identity). ``optional``: computed only when asked."""

    name: str
    merge: str
    identity: float
    filled_by: str
    optional: bool = False


LAYOUT: tuple[Field, ...] = (
    Field("count", "sum", 0.0, "tensor"),
    Field("mean", "chan", 0.0, "tensor"),
    Field("m2", "chan", 0.0, "tensor"),
    Field("min", "min", math.inf, "tensor"),
    Field("max", "max", -math.inf, "tensor"),
    Field("abs_sum", "sum", 0.0, "tensor"),
    Field("abs_min_nonzero", "min", math.inf, "tensor", optional=True),
    Field("underflows", "sum", 0.0, "grid"),
    Field("overflows", "sum", 0.0, "grid"),
    Field("sq_err", "sum", 0.0, "grid"),
    Field("scale_inv_min", "min", math.inf, "scale"),
    Field("scale_inv_max", "max", -math.inf, "scale"),
    Field("blockwise_dr", "max", -math.inf, "feature"),
    Field("zeros", "sum", 0.0, "feature"),  # values of magnitude at most a request's threshold (``stats.zeros``)
    # sums of the cubed and fourth-power deviations from the mean (kurtosis), when a request wants them
    Field("m3", "chan", 0.0, "moments"),
    Field("m4", "chan", 0.0, "moments"),
    # the length of a request's per-column amax vector, which ``buffers`` keeps beside the row (channel statistics)
    Field("channels", "max", -math.inf, "feature"),
)
FIELDS = tuple(field.name for field in LAYOUT)
INDEX = {name: i for i, name in enumerate(FIELDS)}
BY_NAME = {field.name: field for field in LAYOUT}
OPTIONAL_FIELDS = frozenset(field.name for field in LAYOUT if field.optional)


def filled_by(filler: str) -> tuple[str, ...]:
    """The fields the statistics operator fills from ``filler`` (one of ``FILLERS``), in layout order."""
    return tuple(field.name for field in LAYOUT if field.filled_by == filler)


_IDENTITY = [field.identity for field in LAYOUT]
_RULE_CODE = {"sum": 0, "chan": 0, "min": 1, "max": 2}  # the central moments are overwritten by merge_partials
_identity_cache: dict[torch.device, torch.Tensor] = {}
_rule_cache: dict[torch.device, torch.Tensor] = {}


def _on_device(values: list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor built on ``device`` by scalar fills: no copy from host memory, which on
    CUDA would wait for the device."""
    out = torch.zeros(len(values), dtype=dtype, device=device)
    for i, value in enumerate(values):
        if value:
            out[i : i + 1].fill_(value)
    return out


def identity_partials(device: torch.device | str) -> torch.Tensor:
    """The cached empty partial of ``device`` (do not modify it; ``empty_partials`` gives a copy)."""
    device = torch.device(device)
    if device not in _identity_cache:
        _identity_cache[device] = _on_device(_IDENTITY, torch.float64, device)
    return _identity_cache[device]


def _rule_codes(device: torch.device) -> torch.Tensor:
    """Per field: 0 merges by sum, 1 by min, 2 by max."""
    if device not in _rule_cache:
        _rule_cache[device] = _on_device([_RULE_CODE[field.merge] for field in LAYOUT], torch.int8, device)
    return _rule_cache[device]


def empty_partials(device: torch.device | str = "cpu") -> torch.Tensor:
    """The partial of an empty tensor: the identity of ``merge_partials``."""
    return identity_partials(device).clone()


def merge_partials(rows: torch.Tensor) -> torch.Tensor:
    """Merge partials along dim -2: ``[..., rows, FIELDS] -> [..., FIELDS]`` (a 1-D input is returned).

    With ``d_i`` each row's mean minus the merged one, the central moments add up as (Chan, Pébay):
    ``M2 = sum M2_i + n_i d_i^2``, ``M3 = sum M3_i + 3 d_i M2_i + n_i d_i^3`` and
    ``M4 = sum M4_i + 4 d_i M3_i + 6 d_i^2 M2_i + n_i d_i^4``: the pairwise formulas, for any number of rows."""
    if rows.dim() == 1:
        return rows
    count = rows[..., INDEX["count"]]
    filled = count > 0
    total = count.sum(-1)
    means = rows[..., INDEX["mean"]]
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    weighted = torch.where(filled, count * means, torch.zeros_like(means))
    mean = weighted.sum(-1) / safe_total
    d = torch.where(filled, means - mean.unsqueeze(-1), torch.zeros_like(means))
    m2, m3, m4 = (torch.where(filled, rows[..., INDEX[name]], torch.zeros_like(means)) for name in ("m2", "m3", "m4"))
    merged = {
        "mean": mean,
        "m2": (m2 + count * d.square()).sum(-1),
        "m3": (m3 + 3 * d * m2 + count * d**3).sum(-1),
        "m4": (m4 + 4 * d * m3 + 6 * d.square() * m2 + count * d**4).sum(-1),
    }
    rule = _rule_codes(rows.device)
    out = torch.where(rule == 0, rows.sum(-2), torch.where(rule == 1, rows.amin(-2), rows.amax(-2)))
    for name, value in merged.items():
        out[..., INDEX[name]] = torch.where(total > 0, value, torch.zeros_like(value))
    return out


def set_fields(partials: torch.Tensor, values: dict[str, torch.Tensor | float]) -> torch.Tensor:
    """Write fields (underflows, blockwise_dr, ...) into a partial in place, on its device: tensors
    are copied device to device, Python numbers filled in (no copy from host memory)."""
    for name, value in values.items():
        target = partials[INDEX[name] : INDEX[name] + 1]
        if isinstance(value, torch.Tensor):
            target.copy_(value.reshape(1))
        else:
            target.fill_(value)
    return partials
