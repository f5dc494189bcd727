"""The two packed all-reduces give what merging every rank's partials gives (``merge_partials``), simulated
here over ranks stacked on a dimension: MIN and SUM are what gloo and NCCL apply element by element."""

from __future__ import annotations

import math

import pytest
import torch

from nvdlfw_inspect.stats.fields import FIELDS, INDEX, identity_partials, merge_partials
from nvdlfw_inspect.stats.kernels import tensor_stats
from nvdlfw_inspect.stats.kernels.fallback import tensor_partials
from nvdlfw_inspect.stats.reduce import MIN_WIDTH, SUM_WIDTH, combine, pack_min, pack_sum, unpack_min


def partials(tensor: torch.Tensor) -> torch.Tensor:
    """One row of every field the statistics operator fills (abs_min_nonzero included), and M3 and M4."""
    table = identity_partials("cpu").expand(2, -1).clone()
    tensor_stats(tensor, table, [1], [-1], [], [], True, None, None)
    table[1, INDEX["m3"] : INDEX["m4"] + 1] = tensor_partials(tensor, False, want_moments=True)[INDEX["m3"] : INDEX["m4"] + 1]
    return table[1]


def all_reduced(per_rank: list[torch.Tensor], stamps: list[tuple[float, float, float]] | None = None):
    """Each rank's ``[n, FIELDS]`` rows through pack, an element-wise MIN / SUM over the ranks, and unpack."""
    n = per_rank[0].shape[0]
    stamps = stamps or [(7.0, 3.0, 3.0)] * len(per_rank)
    first = torch.stack([pack_min(rows, *stamp) for rows, stamp in zip(per_rank, stamps, strict=True)]).amin(0)
    stamp, extremes, shift = unpack_min(first, n)
    second = torch.stack([pack_sum(rows, shift) for rows in per_rank]).sum(0)
    return stamp, combine(extremes, shift, second, n)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Every field to 1e-12 relative; M3 and M4 also within their conditioning: moving the k-th moment to another
    centre adds k x M_{k-1} x the centre's shift, whose rounding is |mean| x eps, whichever way it is merged (with a
    mean a million times the spread, that is 1e-8 of M3), allowed at 30 eps."""
    for field, i in INDEX.items():
        g, w = got[..., i], want[..., i]
        assert torch.equal(g.isnan(), w.isnan()), field
        ok = ~w.isnan()
        allowed = 1e-12 * w[ok].abs() + 1e-300
        if field in ("m3", "m4"):
            lower = want[..., INDEX["m2" if field == "m3" else "m3"]][ok].abs()
            allowed = allowed + 1e-14 * lower * want[..., INDEX["mean"]][ok].abs()
        assert ((g[ok] == w[ok]) | ((g[ok] - w[ok]).abs() <= allowed)).all(), (field, g[ok], w[ok])


_G = torch.Generator().manual_seed(0)  # the cases' values, the same whatever ran before


def _randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=_G, dtype=dtype)


CASES = {
    "plain": [_randn(100) * 3 + 1, _randn(37) - 2, _randn(5) * 0.1],
    "mean a million times the spread": [_randn(4096, dtype=torch.float64) + 1e6 for _ in range(3)],
    "an empty rank": [_randn(50), torch.empty(0), _randn(20)],
    "NaN on one rank": [torch.tensor([1.0, math.nan, 2.0]), _randn(10), _randn(10)],
    "inf on one rank": [torch.tensor([1.0, math.inf, -2.0]), _randn(10), _randn(10)],
    "all zero": [torch.zeros(8), torch.zeros(3), torch.zeros(1)],
    "one value": [torch.tensor([3.5]), torch.empty(0), torch.empty(0)],
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_all_reduces_merge_as_merge_partials(case):
    tensors = CASES[case]
    per_rank = [torch.stack([partials(t), partials(t * -2 + 1)]) for t in tensors]  # two rows per rank
    stamp, got = all_reduced(per_rank)
    assert stamp.agreed and stamp.in_step and stamp.step == (3.0, 3.0)
    assert_same(got, merge_partials(torch.stack(per_rank, dim=1)))


def test_the_variance_of_a_mean_a_million_times_the_spread_is_the_float64_one():
    torch.manual_seed(1)
    tensors = [torch.randn(10_000, dtype=torch.float64) * (r + 1) + 1e6 for r in range(4)]
    _, got = all_reduced([partials(t).unsqueeze(0) for t in tensors])
    every = torch.cat(tensors)
    assert got[0, INDEX["mean"]].item() == pytest.approx(every.mean().item(), rel=1e-15)
    assert got[0, INDEX["m2"]].item() == pytest.approx(((every - every.mean()) ** 2).sum().item(), rel=1e-9)


def test_the_stamp_tells_the_order_the_step_and_the_newest_iteration_apart():
    rows = [partials(torch.randn(4)).unsqueeze(0)] * 3
    stamp, _ = all_reduced(rows, [(7.0, 3.0, 3.0), (7.0, 3.0, -math.inf), (7.0, 3.0, 3.0)])
    assert stamp.agreed and stamp.in_step  # a rank that fed nothing is not out of step
    assert not all_reduced(rows, [(7.0, 3.0, 3.0), (7.0, 4.0, 4.0), (7.0, 3.0, 3.0)])[0].in_step
    assert not all_reduced(rows, [(7.0, 3.0, 2.0), (7.0, 3.0, 3.0), (7.0, 3.0, 3.0)])[0].in_step
    assert not all_reduced(rows, [(7.0, 3.0, 3.0), (8.0, 3.0, 3.0), (7.0, 3.0, 3.0)])[0].agreed
    assert not all_reduced(rows, [(7.0, 3.0, 3.0), (-1.0, 3.0, 3.0), (7.0, 3.0, 3.0)])[0].agreed


def test_the_payloads_grow_with_the_rows_only():
    rows = identity_partials("cpu").expand(5, -1)
    assert pack_min(rows, 1.0, 0.0, 0.0).numel() == 6 + 5 * MIN_WIDTH
    assert pack_sum(rows, torch.zeros(5)).numel() == 5 * SUM_WIDTH
    assert MIN_WIDTH + SUM_WIDTH < 2 * len(FIELDS)  # both together: under two rows of partials per row
