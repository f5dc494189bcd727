"""Partial statistics: every field and statistic against independent float64 references, merging equals
concatenation (chunks of any size, empty ones included), std survives a mean far above the spread.
Every test runs twice on the CPU: with the compiled one-read kernel and with the torch reductions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from statref import reference_stats

from nvdlfw_inspect.stats import compute_partials, derive_stats, kernels, merge_partials, supported_stats
from nvdlfw_inspect.stats.fields import FIELDS, INDEX, OPTIONAL_FIELDS, empty_partials

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ALL_FIELDS = {"abs_min_nonzero"}
REL = 2e-6  # sums accumulate in float32 (no float64 copy of the tensor); extremes and counts are exact
EXACT_FIELDS = ("count", "min", "max", "abs_min_nonzero")


@pytest.fixture(autouse=True, params=["C kernel", "torch reductions"])
def cpu_implementation(request, monkeypatch):
    if request.param == "torch reductions":
        monkeypatch.setattr(kernels, "native_kernel", lambda: None)
    elif kernels.native_kernel() is None:
        pytest.skip("no C compiler: the kernel cannot be built")
    return request.param


def f64(x: torch.Tensor) -> np.ndarray:
    """A float64 numpy copy of ``x`` (through torch: numpy has no bfloat16); every input value is exact in float64."""
    return x.detach().to(torch.float64).reshape(-1).numpy().copy()


def np_fields(x: torch.Tensor) -> dict[str, float]:
    """The partial fields computed with numpy and ``math.fsum`` on a float64 copy."""
    v = f64(x)
    n = v.size
    if n == 0:
        return dict(zip(FIELDS, empty_partials().tolist(), strict=True))
    mean = math.fsum(v) / n
    nonzero = np.abs(v)[v != 0]
    fields = dict(zip(FIELDS, empty_partials().tolist(), strict=True))  # FP8 and blockwise fields: identity
    return fields | {
        "count": float(n),
        "mean": mean,
        "m2": math.fsum((v - mean) ** 2),
        "min": float(v.min()),
        "max": float(v.max()),
        "abs_sum": math.fsum(np.abs(v)),
        "abs_min_nonzero": float(nonzero.min()) if nonzero.size else math.inf,
    }


def np_stats(x: torch.Tensor) -> dict[str, float]:
    """Every statistic computed with numpy on a float64 copy, independent of the partials."""
    v = f64(x)
    if v.size == 0:
        nan = math.nan
        return dict(min=nan, max=nan, mean=nan, std=nan, l1_norm=0.0, l2_norm=0.0, cur_amax=nan, dynamic_range=nan)
    with np.errstate(all="ignore"):
        amax = float(np.abs(v).max())
        nonzero = np.abs(v)[v != 0]
        return {
            "min": float(v.min()),
            "max": float(v.max()),
            "mean": float(v.mean()),
            "std": float(v.std(ddof=1)) if v.size > 1 else math.nan,
            "l1_norm": float(np.abs(v).sum()),
            "l2_norm": float(np.sqrt((v * v).sum())),
            "cur_amax": amax,
            "dynamic_range": math.log2(amax) - math.log2(float(nonzero.min())) if nonzero.size else 0.0,
        }


def stats_of(x: torch.Tensor) -> dict[str, float]:
    return derive_stats(compute_partials(x, ALL_FIELDS), supported_stats())


def merged_stats(chunks: list[torch.Tensor]) -> dict[str, float]:
    rows = torch.stack([compute_partials(c, ALL_FIELDS) for c in chunks])
    return derive_stats(merge_partials(rows), supported_stats())


def same(a: float, b: float, rel: float = REL) -> bool:
    """Equal within ``rel``, with nan equal to nan and infinities compared exactly."""
    if math.isnan(b):
        return math.isnan(a)
    if math.isinf(b):
        return a == b
    return a == pytest.approx(b, rel=rel, abs=1e-300)


def assert_stats(got: dict[str, float], expected: dict[str, float], rel: float = REL) -> None:
    assert got.keys() == expected.keys()
    bad = {k: (got[k], expected[k]) for k in expected if not same(got[k], expected[k], rel)}
    assert not bad, bad


def sample(dtype: torch.dtype, shape=(37, 29), seed: int = 0, scale: float = 3.0, shift: float = 0.5) -> torch.Tensor:
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale + shift).to(dtype)
    x.view(-1)[0] = 0.0  # a zero, so the smallest non-zero magnitude is not simply the smallest magnitude
    return x


# --- one tensor ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_field_matches_numpy_reference(dtype):
    x = sample(dtype)
    p = compute_partials(x, ALL_FIELDS)
    assert p.dtype == torch.float64 and p.shape == (len(FIELDS),)
    expected = np_fields(x)
    got = dict(zip(FIELDS, p.tolist(), strict=True))
    for name in FIELDS:
        assert got[name] == pytest.approx(expected[name], rel=0 if name in EXACT_FIELDS else REL), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("scale", "shift"), [(3.0, 0.5), (1e-3, 0.0), (0.1, -40.0)])
def test_every_stat_matches_numpy_and_torch_references(dtype, scale, shift):
    x = sample(dtype, scale=scale, shift=shift)
    got = stats_of(x)
    assert list(got) == supported_stats()
    assert_stats(got, np_stats(x))
    assert_stats(got, reference_stats(x))


def test_hand_computed_values():
    x = torch.tensor([[1.0, -2.0], [3.0, 4.0]])
    got = stats_of(x)
    assert got["min"] == -2.0 and got["max"] == 4.0 and got["mean"] == 1.5
    # unbiased: sum of squared deviations 0.25 + 12.25 + 2.25 + 6.25 = 21, divided by n - 1 = 3
    assert got["std"] == pytest.approx(math.sqrt(7.0), rel=1e-15)
    assert got["l1_norm"] == 10.0
    assert got["l2_norm"] == pytest.approx(math.sqrt(30.0), rel=1e-15)
    assert got["cur_amax"] == 4.0
    assert got["dynamic_range"] == pytest.approx(2.0)  # log2(4) - log2(1)


def test_cur_amax_comes_from_the_most_negative_value():
    got = stats_of(torch.tensor([-7.0, 3.0, 0.5]))
    assert got["cur_amax"] == 7.0
    assert got["dynamic_range"] == pytest.approx(math.log2(7.0) + 1.0)


def test_float16_subnormals_and_extremes_are_exact():
    x = torch.tensor([2.0**-24, -65504.0, 0.0, 1.0], dtype=torch.float16)
    got = stats_of(x)
    assert got["min"] == -65504.0 and got["cur_amax"] == 65504.0
    assert got["dynamic_range"] == pytest.approx(math.log2(65504.0) + 24, rel=1e-15)
    assert_stats(got, np_stats(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_low_precision_input_is_not_accumulated_in_low_precision(dtype):
    """4096 ones summed in bf16 would stop at 256; the partials accumulate in float64."""
    x = torch.ones(4096, dtype=dtype)
    got = stats_of(x)
    assert got["l1_norm"] == 4096.0 and got["l2_norm"] == 64.0 and got["mean"] == 1.0 and got["std"] == 0.0


@pytest.mark.parametrize(
    "x",
    [
        torch.tensor(2.5),  # 0-d
        torch.arange(24.0).reshape(2, 3, 4).transpose(0, 2),  # non-contiguous
        torch.arange(-5, 7, dtype=torch.int32),
        torch.tensor([True, False, True]),
        torch.randn(8, 3, requires_grad=True),
    ],
    ids=["scalar", "non-contiguous", "int32", "bool", "requires-grad"],
)
def test_any_shape_and_dtype(x):
    assert_stats(stats_of(x), np_stats(x))


def test_input_is_left_alone():
    x = sample(torch.float16)
    before = x.clone()
    compute_partials(x, ALL_FIELDS)
    assert torch.equal(x, before) and x.dtype == torch.float16


def test_count_field():
    for n in (1, 2, 10, 12345):
        assert compute_partials(torch.zeros(n))[INDEX["count"]].item() == n
    assert compute_partials(torch.zeros(3, 0, 4))[INDEX["count"]].item() == 0
    x = torch.arange(10, dtype=torch.float32)
    p = compute_partials(x)
    assert p[INDEX["count"]].item() == 10 and p[INDEX["mean"]].item() == 4.5
    assert p[INDEX["m2"]].item() == pytest.approx(82.5)


def test_optional_field_only_when_named():
    assert OPTIONAL_FIELDS == {"abs_min_nonzero"}
    x = torch.tensor([0.0, -0.5, 2.0])
    assert compute_partials(x)[INDEX["abs_min_nonzero"]].item() == math.inf  # left at the identity
    for fields in ({"abs_min_nonzero"}, ["abs_min_nonzero"], ("abs_min_nonzero",)):
        assert compute_partials(x, fields)[INDEX["abs_min_nonzero"]].item() == 0.5
    # the other fields do not depend on it
    without, with_ = compute_partials(x), compute_partials(x, ALL_FIELDS)
    others = [i for name, i in INDEX.items() if name != "abs_min_nonzero"]
    assert torch.equal(without[others], with_[others])


# --- empty, all-zero, NaN and inf ---------------------------------------------------------


@pytest.mark.parametrize("x", [torch.empty(0), torch.empty(0, 5, dtype=torch.bfloat16), torch.empty(0, dtype=torch.float16)])
def test_empty_tensor(x):
    p = compute_partials(x, ALL_FIELDS)
    assert torch.equal(p, empty_partials())
    got = stats_of(x)
    for stat in ("min", "max", "mean", "std", "cur_amax", "dynamic_range"):
        assert math.isnan(got[stat]), stat
    assert got["l1_norm"] == 0.0 and got["l2_norm"] == 0.0
    assert_stats(got, np_stats(x))


def test_empty_partials_is_the_merge_identity():
    e = empty_partials("cpu")
    identity = [0.0, 0.0, 0.0, math.inf, -math.inf, 0.0, math.inf, 0.0, 0.0, 0.0, math.inf, -math.inf, -math.inf, 0.0]
    identity += [0.0, 0.0, -math.inf]  # m3, m4, channels
    assert e.dtype == torch.float64 and e.tolist() == identity
    assert torch.equal(merge_partials(torch.stack([e, e, e])), e)
    p = compute_partials(sample(torch.float32), ALL_FIELDS)
    for rows in ([e, p], [p, e], [e, p, e]):
        assert torch.allclose(merge_partials(torch.stack(rows)), p, rtol=1e-15, atol=0)


def test_single_element_std_is_nan_and_two_elements_is_unbiased():
    got = stats_of(torch.tensor([3.0]))
    assert math.isnan(got["std"]) and got["mean"] == 3.0 and got["l2_norm"] == 3.0
    assert stats_of(torch.tensor([1.0, 3.0]))["std"] == pytest.approx(math.sqrt(2.0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_zeros(dtype):
    got = stats_of(torch.zeros(8, dtype=dtype))
    assert got == {
        "min": 0.0,
        "max": 0.0,
        "mean": 0.0,
        "std": 0.0,
        "l1_norm": 0.0,
        "l2_norm": 0.0,
        "cur_amax": 0.0,
        "dynamic_range": 0.0,
    }


NAN, INF = math.nan, math.inf


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([1.0, NAN, 2.0], dict(min=NAN, max=NAN, mean=NAN, std=NAN, l1_norm=NAN, l2_norm=NAN, cur_amax=NAN)),
        ([NAN, NAN], dict(min=NAN, max=NAN, mean=NAN, std=NAN, l1_norm=NAN, l2_norm=NAN, dynamic_range=NAN)),
        ([1.0, INF, -2.0], dict(min=-2.0, max=INF, mean=INF, std=NAN, l1_norm=INF, l2_norm=INF, cur_amax=INF)),
        ([-INF, 0.5], dict(min=-INF, max=0.5, mean=-INF, l1_norm=INF, l2_norm=INF, cur_amax=INF, dynamic_range=INF)),
        ([INF, -INF], dict(min=-INF, max=INF, mean=NAN, std=NAN, l2_norm=INF, cur_amax=INF, dynamic_range=NAN)),
        ([INF, 0.0], dict(min=0.0, max=INF, l2_norm=INF, dynamic_range=NAN)),
        ([INF, NAN], dict(mean=NAN, l1_norm=NAN, l2_norm=NAN, cur_amax=NAN)),
    ],
)
def test_nan_and_inf_give_nan_or_inf_statistics(dtype, values, expected):
    x = torch.tensor(values, dtype=dtype)
    got = stats_of(x)
    for stat, value in expected.items():
        assert same(got[stat], value), (stat, got[stat], value)
    assert_stats(got, np_stats(x))  # every other statistic too, against numpy


def test_nan_or_inf_in_one_chunk_poisons_the_merge_like_the_concatenation():
    clean = torch.randn(50, generator=torch.Generator().manual_seed(3))
    for bad in (torch.tensor([1.0, NAN]), torch.tensor([INF, 2.0]), torch.tensor([-INF])):
        chunks = [clean, torch.empty(0), bad, clean[:3]]
        assert_stats(merged_stats(chunks), np_stats(torch.cat(chunks)))


# --- merging ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sizes",
    [(5, 5), (1, 1000), (1, 50_000, 2), (0, 7, 0, 3), (3, 0, 0, 2000, 1), (1, 1, 1), (0, 0, 4), (2000, 0)],
)
def test_merge_equals_concatenation(sizes):
    g = torch.Generator().manual_seed(1)
    chunks = [torch.randn(n, generator=g) * (i + 1) + 3 * i for i, n in enumerate(sizes)]
    assert_stats(merged_stats(chunks), np_stats(torch.cat(chunks)), rel=REL)


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_of_low_precision_chunks(dtype):
    x = sample(dtype, shape=(3001,), seed=4, scale=2.0, shift=-1.0)
    chunks = list(torch.split(x, [1, 1000, 0, 2000]))
    assert_stats(merged_stats(chunks), np_stats(x), rel=REL)


def test_merge_counts_add_up():
    chunks = [torch.ones(n) for n in (0, 1, 17, 400)]
    merged = merge_partials(torch.stack([compute_partials(c) for c in chunks]))
    assert merged[INDEX["count"]].item() == 418


def test_merge_of_a_single_partial():
    p = compute_partials(sample(torch.float32), ALL_FIELDS)
    assert merge_partials(p) is p  # a 1-D partial is already merged
    assert torch.equal(merge_partials(p.unsqueeze(0)), p)


def test_merge_is_order_independent_and_associative():
    g = torch.Generator().manual_seed(5)
    chunks = [torch.randn(n, generator=g) + 10 * i for i, n in enumerate((3, 300, 1, 0, 70))]
    rows = [compute_partials(c, ALL_FIELDS) for c in chunks]
    flat = merge_partials(torch.stack(rows))
    reversed_ = merge_partials(torch.stack(rows[::-1]))
    nested = merge_partials(torch.stack([merge_partials(torch.stack(rows[:2])), merge_partials(torch.stack(rows[2:]))]))
    for other in (reversed_, nested):
        assert torch.allclose(other, flat, rtol=1e-12, atol=0)


def test_merge_of_many_single_elements():
    x = torch.randn(500, generator=torch.Generator().manual_seed(6)) * 2 + 1
    assert_stats(merged_stats(list(x.split(1))), np_stats(x), rel=REL)


@pytest.mark.parametrize("splits", [[1, 30_000, 69_999], [12_500] * 8, [1] * 10 + [99_990], [99_999, 1]])
def test_std_survives_large_mean(splits):
    """mean = 1000 x std: sum-of-squares formulas lose every digit in float32; M2 merging does not."""
    x = (1000.0 + torch.randn(100_000, generator=torch.Generator().manual_seed(2))).float()
    merged = merge_partials(torch.stack([compute_partials(c) for c in torch.split(x, splits)]))
    got = derive_stats(merged, ["mean", "std", "l2_norm"])
    v = f64(x)
    assert got["std"] == pytest.approx(float(v.std(ddof=1)), rel=1e-5)
    assert got["mean"] == pytest.approx(math.fsum(v) / v.size, rel=1e-7)  # float32 rounding of ~1000
    assert got["l2_norm"] == pytest.approx(math.sqrt(math.fsum(v * v)), rel=1e-7)


def test_std_survives_large_mean_across_chunks_with_different_means():
    g = torch.Generator().manual_seed(7)
    chunks = [(1e4 + 0.01 * i + torch.randn(n, generator=g) * 10).float() for i, n in enumerate((10, 5000, 3, 20_000))]
    got = merged_stats(chunks)
    v = f64(torch.cat(chunks))
    assert got["std"] == pytest.approx(float(v.std(ddof=1)), rel=1e-6)


def test_the_operator_is_dispatched_when_watched_and_called_directly_otherwise():
    """Dispatch modes, the profiler and ``torch.compile`` see ``nvdlfw_inspect::tensor_stats`` as one op; a plain
    eager call skips the dispatcher's round trip (host time). Both write the same table."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.name())
            return func(*args, **(kwargs or {}))

    x = torch.randn(1000) * 3
    scale, grid = torch.tensor(40.0), (448.0, -6, 3)
    direct, watched = torch.stack([empty_partials()] * 2), torch.stack([empty_partials()] * 2)
    calls = []
    original = kernels._IMPLEMENTATIONS["cpu"]
    kernels._IMPLEMENTATIONS["cpu"] = lambda *args: calls.append(1) or original(*args)
    try:
        kernels.tensor_stats(x, direct, [0, 1], [-1, 0], [scale], [grid], True)
        with Seen() as seen:
            kernels.tensor_stats(x, watched, [0, 1], [-1, 0], [scale], [grid], True)
    finally:
        kernels._IMPLEMENTATIONS["cpu"] = original
    assert calls == [1]  # the direct call only: the watched one went through the registered operator
    assert seen.ops == ["nvdlfw_inspect::tensor_stats"]
    assert torch.equal(direct, watched) and direct[1, INDEX["sq_err"]] > 0
