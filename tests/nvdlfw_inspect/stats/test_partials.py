"""Partial statistics: every field against float64 references, merging equals concatenation."""

from __future__ import annotations

import math

import pytest
import torch
from statref import reference_stats

from nvdlfw_inspect.stats import compute_partials, derive_stats, merge_partials, supported_stats
from nvdlfw_inspect.stats.partials import FIELDS, INDEX, empty_partials

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def stats_of(x: torch.Tensor) -> dict[str, float]:
    return derive_stats(compute_partials(x, {"abs_min_nonzero"}), supported_stats())


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_stat_matches_float64_reference(dtype):
    x = (torch.randn(37, 29, generator=torch.Generator().manual_seed(0)) * 3 + 0.5).to(dtype)
    x[0, 0] = 0.0
    expected = reference_stats(x)
    got = stats_of(x)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-12, abs=1e-12), name


def test_fields_layout_and_count():
    x = torch.arange(10, dtype=torch.float32)
    p = compute_partials(x)
    assert p.dtype == torch.float64 and p.shape == (len(FIELDS),)
    assert p[INDEX["count"]].item() == 10
    assert p[INDEX["mean"]].item() == 4.5
    assert p[INDEX["m2"]].item() == pytest.approx(82.5)
    assert p[INDEX["abs_min_nonzero"]].item() == math.inf  # not requested, left at the identity
    assert compute_partials(x, {"abs_min_nonzero"})[INDEX["abs_min_nonzero"]].item() == 1.0


@pytest.mark.parametrize("sizes", [(5, 5), (1, 1000), (0, 7, 0, 3), (1, 1, 1)])
def test_merge_equals_concatenation(sizes):
    g = torch.Generator().manual_seed(1)
    chunks = [torch.randn(n, generator=g) * (i + 1) + 3 * i for i, n in enumerate(sizes)]
    merged = merge_partials(torch.stack([compute_partials(c, {"abs_min_nonzero"}) for c in chunks]))
    expected = reference_stats(torch.cat(chunks))
    got = derive_stats(merged, supported_stats())
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-10), name


def test_std_survives_large_mean():
    """mean = 1000 x std: sum-of-squares formulas lose every digit in float32; M2 merging does not."""
    g = torch.Generator().manual_seed(2)
    x = (1000.0 + torch.randn(100_000, generator=g)).float()
    chunks = torch.split(x, [1, 30_000, 69_999])
    merged = merge_partials(torch.stack([compute_partials(c) for c in chunks]))
    expected = x.to(torch.float64).std().item()
    assert derive_stats(merged, ["std"])["std"] == pytest.approx(expected, rel=1e-5)
    assert derive_stats(merged, ["mean"])["mean"] == pytest.approx(x.to(torch.float64).mean().item(), rel=1e-12)


def test_empty_tensor():
    got = stats_of(torch.empty(0))
    assert all(math.isnan(got[s]) for s in ("min", "max", "mean", "std", "cur_amax", "dynamic_range"))
    assert got["l1_norm"] == 0.0 and got["l2_norm"] == 0.0
    assert torch.equal(merge_partials(torch.stack([empty_partials(), empty_partials()])), empty_partials())


def test_single_element_std_is_nan():
    assert math.isnan(stats_of(torch.tensor([3.0]))["std"])


def test_all_zeros_dynamic_range_is_zero():
    got = stats_of(torch.zeros(8))
    assert got["dynamic_range"] == 0.0 and got["cur_amax"] == 0.0 and got["std"] == 0.0


def test_nan_and_inf_are_reported_not_raised():
    got = stats_of(torch.tensor([1.0, float("nan"), 2.0]))
    assert math.isnan(got["mean"]) and math.isnan(got["std"])
    got = stats_of(torch.tensor([1.0, float("inf"), -2.0]))
    assert got["max"] == math.inf and got["min"] == -2.0 and got["cur_amax"] == math.inf
    assert got["l1_norm"] == math.inf
    got = stats_of(torch.tensor([float("-inf"), 0.5]))
    assert got["min"] == -math.inf and got["cur_amax"] == math.inf


@pytest.mark.parametrize("dtype", DTYPES)
def test_low_precision_input_is_not_accumulated_in_low_precision(dtype):
    """4096 ones summed in bf16 would stop at 256; the partials accumulate in float64."""
    x = torch.ones(4096, dtype=dtype)
    got = stats_of(x)
    assert got["l1_norm"] == 4096.0 and got["l2_norm"] == 64.0 and got["mean"] == 1.0
