"""Every statistic once: its name, the partial fields it reads, how it is derived from them, and which
statistics features offer it. Adding a statistic is one entry in ``CATALOG`` (plus a field in ``fields``
if it needs a partial no field holds yet).

Each derivation is written once against a small set of operations (``ops``) and evaluated two ways:
on tensors (``derive_tensors``: a 0-dim tensor on the device, returned to callers without a host
sync, or a column for many partials at once) and on Python floats (``derive_floats``: what
``debug_api.step()`` logs, after its one copy to the host; a handful of float operations per
statistic cost far less host time than a torch operator each). Both compute in float64 and give NaN
and infinities alike; they may differ in the last bit where torch's vectorised sqrt or log2 is not
correctly rounded (``math``'s are).
"""

from __future__ import annotations

import math
import statistics
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nvdlfw_inspect.stats import kernels
from nvdlfw_inspect.stats.fields import FIELDS, OPTIONAL_FIELDS

_LOW_WORD = (1 << 32) - 1
_TINY = math.ulp(0.0)
LOCATION_BIAS = 1 << 20
"""Added to a location key's high word (``lowprec.debug.per_block_stats``), so that every key is a normal float64."""


class _TensorOps:
    """The operations on float64 tensors."""

    where = staticmethod(torch.where)
    sqrt = staticmethod(torch.sqrt)
    log2 = staticmethod(torch.log2)
    maximum = staticmethod(torch.maximum)
    abs = staticmethod(torch.abs)
    isinf = staticmethod(torch.isinf)
    isnan = staticmethod(torch.isnan)

    @staticmethod
    def clamp_min(x: torch.Tensor, low: float) -> torch.Tensor:
        return x.clamp(min=low)

    @staticmethod
    def location(key: torch.Tensor) -> torch.Tensor:
        index = (key.double().contiguous().view(torch.int64) & _LOW_WORD).double()
        return torch.where(key.isfinite(), index, math.nan)

    @staticmethod
    def outlier_channel(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = amax.numel()
        if k == 0:
            nan = torch.full((), math.nan, dtype=torch.float64, device=amax.device)
            return nan, nan
        ordered = amax.double().sort().values
        median = (ordered[(k - 1) // 2] + ordered[k // 2]) / 2
        top = ordered[-1]
        return top / median, amax.argmax().double()


class _FloatOps:
    """The same operations on Python floats, with the tensors' results where ``math`` would raise."""

    @staticmethod
    def where(condition: bool, if_true: float, if_false: float) -> float:
        return if_true if condition else if_false

    @staticmethod
    def sqrt(x: float) -> float:
        return math.sqrt(x) if x >= 0 else math.nan

    @staticmethod
    def log2(x: float) -> float:
        if x > 0:
            return math.log2(x)
        return -math.inf if x == 0 else math.nan

    @staticmethod
    def maximum(a: float, b: float) -> float:
        return a if a != a or a >= b else b  # NaN wins, as in torch.maximum

    abs = staticmethod(abs)
    isinf = staticmethod(math.isinf)
    isnan = staticmethod(math.isnan)

    @staticmethod
    def clamp_min(x: float, low: float) -> float:
        return low if x < low else x  # NaN stays NaN

    @staticmethod
    def location(key: float) -> float:
        if not math.isfinite(key):
            return math.nan
        return float(struct.unpack("<q", struct.pack("<d", key))[0] & _LOW_WORD)

    @staticmethod
    def outlier_channel(amax: Sequence[float]) -> tuple[float, float]:
        if not amax:
            return math.nan, math.nan
        top, median = max(amax), statistics.median(amax)
        ratio = top / median if median else (math.inf if top > 0 else math.nan)
        return ratio, float(amax.index(top))


Fields = Mapping[str, Any]  # field name -> a tensor (or column) or a float; "channel_amax" -> a vector
Derivation = Callable[[Fields, Any], Any]


def _nan_if_empty(value: Derivation) -> Derivation:
    return lambda p, ops: ops.where(p["count"] > 0, value(p, ops), math.nan)


def _std(p: Fields, ops: Any) -> Any:
    n = p["count"]
    return ops.where(n > 1, ops.sqrt(ops.clamp_min(p["m2"], 0.0) / ops.clamp_min(n - 1, 1.0)), math.nan)


def _amax(p: Fields, ops: Any) -> Any:
    return ops.maximum(ops.abs(p["min"]), ops.abs(p["max"]))


def _dynamic_range(p: Fields, ops: Any) -> Any:
    """``log2(amax) - log2(smallest non-zero |x|)``; 0 for a tensor of zeros, NaN if undefined."""
    amin, amax = p["abs_min_nonzero"], _amax(p, ops)
    ratio = ops.log2(amax) - ops.log2(amin)
    ratio = ops.where(ops.isinf(amin), ops.where(ops.isinf(amax), math.nan, 0.0), ratio)
    ratio = ops.where(amax == 0, 0.0, ratio)
    return ops.where(ops.isnan(amax) | ops.isnan(amin), math.nan, ratio)


def _l2_norm(p: Fields, ops: Any) -> Any:
    """``sqrt(sum x^2)`` rebuilt from M2 and the mean; inf (not NaN) when the tensor holds +/-inf but no NaN."""
    norm = ops.sqrt(ops.clamp_min(p["m2"] + p["count"] * (p["mean"] * p["mean"]), 0.0))
    return ops.where(ops.isinf(p["abs_sum"]), math.inf, norm)


def _rms(p: Fields, ops: Any) -> Any:
    """``sqrt(mean x^2)``: the L2 norm over ``sqrt(n)``."""
    return _l2_norm(p, ops) / ops.sqrt(ops.clamp_min(p["count"], 1.0))


def _kurtosis(p: Fields, ops: Any) -> Any:
    """Pearson's ``m4 / m2^2`` with population moments, ``n M4 / M2^2`` (3 for a Gaussian); NaN for a constant
    tensor. Divided by M2 twice, so that M2^2 cannot overflow or underflow."""
    m2 = ops.clamp_min(p["m2"], _TINY)  # no division by zero where the result is NaN anyway
    return ops.where(p["m2"] > 0, (p["m4"] / m2) * (p["count"] / m2), math.nan)


def _outlier_ratio(p: Fields, ops: Any) -> Any:
    """The largest column amax over the median one (the mean of the two middle ones for an even count)."""
    return ops.outlier_channel(p["channel_amax"])[0]


def _max_channel(p: Fields, ops: Any) -> Any:
    """The column of the largest amax (the first such)."""
    return ops.outlier_channel(p["channel_amax"])[1]


def _percent(field: str) -> Derivation:
    return _nan_if_empty(lambda p, ops: 100.0 * p[field] / ops.clamp_min(p["count"], 1.0))


def _field(name: str) -> Derivation:
    return lambda p, ops: p[name]


def _location(p: Fields, ops: Any) -> Any:
    """The index a location key carries in its low 32 bits (``max``: the largest key, the largest value's)."""
    return ops.where(p["count"] > 0, ops.location(p["max"]), math.nan)


GROUPS = ("tensor", "early", "quantization", "block", "feature")


@dataclass(frozen=True)
class Statistic:
    """``fields``: every partial field ``derive`` reads (and ``"channel_amax"``, the merged ``column_amax`` vector kept
    beside the row). ``group``: ``"tensor"``, a statistic of any tensor's values (``supported_stats``); ``"early"``,
    one that warns early of trouble (both namespaces' ``LogTensorStats``), derived from what ``STATS_BUFFERS.feed``
    adds for it: M3 and M4 from torch reductions, the per-column amax vector; ``"quantization"``, of a cast of it (the
    fields of a quantization grid); ``"block"``, of each block of a block-scaled cast
    (``lowprec.debug.per_block_stats``: ``count`` holds the blocks); ``"feature"``, a value a feature logs under a
    name of its own. ``torch``: torch's own reduction of the tensor, which the base namespace's ``LogTensorStats``
    returns (the statistics of the reference framework)."""

    name: str
    fields: tuple[str, ...]
    derive: Derivation
    group: str
    torch: Callable[[torch.Tensor], torch.Tensor] | None = None


CATALOG: dict[str, Statistic] = {
    stat.name: stat
    for stat in (
        Statistic("min", ("count", "min"), _nan_if_empty(_field("min")), "tensor", torch.min),
        Statistic("max", ("count", "max"), _nan_if_empty(_field("max")), "tensor", torch.max),
        Statistic("mean", ("count", "mean"), _nan_if_empty(_field("mean")), "tensor", torch.mean),
        Statistic("std", ("count", "m2"), _std, "tensor", torch.std),
        Statistic("l1_norm", ("abs_sum",), _field("abs_sum"), "tensor", lambda t: torch.norm(t, p=1)),
        Statistic("l2_norm", ("count", "mean", "m2", "abs_sum"), _l2_norm, "tensor", lambda t: torch.norm(t, p=2)),
        Statistic("cur_amax", ("count", "min", "max"), _nan_if_empty(_amax), "tensor"),
        Statistic("dynamic_range", ("count", "min", "max", "abs_min_nonzero"), _nan_if_empty(_dynamic_range), "tensor"),
        # statistics that warn early: heavy tails, and one channel far above the others
        Statistic("kurtosis", ("count", "m2", "m4"), _nan_if_empty(_kurtosis), "early"),
        Statistic("rms", ("count", "mean", "m2", "abs_sum"), _nan_if_empty(_rms), "early"),
        Statistic("outlier_channel_ratio", ("channel_amax",), _outlier_ratio, "early"),
        Statistic("max_channel", ("channel_amax",), _max_channel, "early"),
        Statistic("underflows%", ("count", "underflows"), _percent("underflows"), "quantization"),
        Statistic("overflows%", ("count", "overflows"), _percent("overflows"), "quantization"),
        Statistic("scale_inv_min", ("count", "scale_inv_min"), _nan_if_empty(_field("scale_inv_min")), "quantization"),
        Statistic("scale_inv_max", ("count", "scale_inv_max"), _nan_if_empty(_field("scale_inv_max")), "quantization"),
        Statistic(
            "mse", ("count", "sq_err"), _nan_if_empty(lambda p, ops: p["sq_err"] / ops.clamp_min(p["count"], 1.0)), "quantization"
        ),
        # per block of a block-scaled cast (lowprec.debug.per_block_stats): count = blocks, underflows and overflows
        # = blocks that flush or saturate, max = the worst block's relative error, the largest flushed share, or a
        # location key (max with argmax)
        Statistic("underflow_blocks%", ("count", "underflows"), _percent("underflows"), "block"),
        Statistic("saturated_blocks%", ("count", "overflows"), _percent("overflows"), "block"),
        Statistic("worst_block_rel_err", ("count", "max"), _nan_if_empty(_field("max")), "block"),
        Statistic("worst_block_row", ("count", "max"), _location, "block"),
        Statistic("worst_block_col", ("count", "max"), _location, "block"),
        Statistic("worst_block_flushed%", ("count", "max"), _nan_if_empty(_field("max")), "block"),
        Statistic("worst_flushed_row", ("count", "max"), _location, "block"),
        Statistic("worst_flushed_col", ("count", "max"), _location, "block"),
        Statistic("max_blockwise_dynamic_range", ("count", "blockwise_dr"), _nan_if_empty(_field("blockwise_dr")), "feature"),
        # values of magnitude at most a threshold (``stats.zeros``: the family's names carry the threshold)
        Statistic("num_zeros", ("zeros",), _field("zeros"), "feature"),
        Statistic("num_zeros%", ("count", "zeros"), _percent("zeros"), "feature"),
        # how many values were fed, summed over micro-batches and ranks (block_scale_stats' histogram bins)
        Statistic("count", ("count",), _field("count"), "feature"),
    )
}


def stats_of(group: str) -> tuple[str, ...]:
    """The statistics of ``group`` (one of ``GROUPS``), in catalog order."""
    return tuple(name for name, stat in CATALOG.items() if stat.group == group)


BASE_STATS = stats_of("tensor")
EARLY_STATS = stats_of("early")
TORCH_REDUCTIONS = {name: stat.torch for name, stat in CATALOG.items() if stat.torch is not None}
STAT_PARTIALS = {name: tuple(f for f in stat.fields if f in OPTIONAL_FIELDS) for name, stat in CATALOG.items()}


def reads(stats: Iterable[str], field: str) -> bool:
    """Whether deriving any of ``stats`` reads ``field``: "m4" (M3 and M4, which torch computes, not the operator)
    or "channel_amax" (the per-column amax vector, kept beside the row)."""
    return any(field in CATALOG[stat].fields for stat in stats)


def reducible(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as torch's reductions and comparisons take it: a float of two bytes or more as it is; 8-bit floats,
    integers and bool, which torch cannot reduce (``"min_all" not implemented for 'Float8_e4m3fn'``) or compare as
    they are, as float32 (exact for all of them but integers beyond 2^24)."""
    return tensor if tensor.is_floating_point() and tensor.element_size() > 1 else tensor.float()


def column_amax(tensor: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of each column of ``tensor`` viewed as ``[-1, last_dim]`` (a 1-D tensor as one row), as
    float64 on its device (no host sync); empty for an empty tensor. NaN is ignored, as in a recipe's amax: one NaN
    must not hide an outlier channel. It merges exactly by an element-wise max over micro-batches and ranks."""
    x = tensor.detach()
    x = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
    if x.numel() == 0:
        return torch.empty(0, dtype=torch.float64, device=x.device)
    read_once = kernels.kernel_column_amax(x)  # one read in C or Triton
    if read_once is not None:
        return read_once
    magnitude = reducible(x).abs()
    return torch.where(magnitude.isnan(), 0.0, magnitude).amax(0).double()


def supported_stats() -> list[str]:
    """The statistics computed from the tensor alone (FP8 and blockwise ones need their feature)."""
    return list(BASE_STATS)


def fields_for(stats: Iterable[str]) -> set[str]:
    """Optional partial fields that computing ``stats`` requires."""
    return {field for stat in stats for field in STAT_PARTIALS[stat]}


def derive_tensors(
    partials: torch.Tensor, stats: Iterable[str], channel_amax: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The named statistics of merged partials ``[..., FIELDS]``, as float64 tensors on their device;
    ``channel_amax``: the merged ``column_amax`` vector of one partial, which the channel statistics read."""
    columns: dict[str, Any] = {name: partials[..., i] for i, name in enumerate(FIELDS)}
    columns["channel_amax"] = channel_amax if channel_amax is not None else partials.new_empty(0)
    return {stat: CATALOG[stat].derive(columns, _TensorOps) for stat in stats}


def derive_floats(partial: Sequence[float], stats: Iterable[str], channel_amax: Sequence[float] = ()) -> dict[str, float]:
    """The named statistics of one merged partial given as Python floats in ``FIELDS`` order (and its merged
    ``column_amax`` vector as a list)."""
    fields: dict[str, Any] = dict(zip(FIELDS, partial, strict=True))
    fields["channel_amax"] = list(channel_amax)
    return {stat: float(CATALOG[stat].derive(fields, _FloatOps)) for stat in stats}


def derive_stats(partials: torch.Tensor, stats: Iterable[str]) -> dict[str, float]:
    """The named statistics of one merged partial as Python floats (one copy to the host)."""
    return derive_floats(partials.detach().cpu().tolist(), stats)
