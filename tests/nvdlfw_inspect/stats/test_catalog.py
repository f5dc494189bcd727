"""The catalog: deriving statistics from merged partials, the fields each statistic reads, its group and
its torch reduction."""

from __future__ import annotations

import math

import pytest
import torch

from nvdlfw_inspect.stats import STAT_PARTIALS, catalog, compute_partials, derive_stats, merge_partials, supported_stats
from nvdlfw_inspect.stats.catalog import CATALOG, GROUPS, TORCH_REDUCTIONS, derive_floats, derive_tensors, fields_for, stats_of
from nvdlfw_inspect.stats.fields import FIELDS, INDEX, empty_partials

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EVERY = ["min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range"]
FP8 = [
    "underflows%",
    "overflows%",
    "mse",
    "scale_inv_min",
    "scale_inv_max",
    "underflow_blocks%",
    "saturated_blocks%",
    "worst_block_rel_err",
    "worst_block_row",
    "worst_block_col",
    "worst_block_flushed%",
    "worst_flushed_row",
    "worst_flushed_col",
    "max_blockwise_dynamic_range",
    "count",
    "num_zeros",
    "num_zeros%",
]
REL = 2e-6  # sums accumulate in float32


def partial(**fields: float) -> torch.Tensor:
    """A partial written field by field (starting from the empty one), independent of compute_partials."""
    values = dict(zip(FIELDS, empty_partials().tolist(), strict=True))
    values.update(fields)
    return torch.tensor([values[name] for name in FIELDS], dtype=torch.float64)


def math_reference(x: torch.Tensor) -> dict[str, float]:
    """Every statistic with plain Python on float64 copies of the values (two-pass, exact sums)."""
    v = x.detach().to(torch.float64).reshape(-1).tolist()
    n = len(v)
    mean = math.fsum(v) / n
    amax = max(abs(a) for a in v)
    nonzero = [abs(a) for a in v if a != 0]
    return {
        "min": min(v),
        "max": max(v),
        "mean": mean,
        "std": math.sqrt(math.fsum((a - mean) ** 2 for a in v) / (n - 1)),
        "l1_norm": math.fsum(abs(a) for a in v),
        "l2_norm": math.sqrt(math.fsum(a * a for a in v)),
        "cur_amax": amax,
        "dynamic_range": math.log2(amax) - math.log2(min(nonzero)) if nonzero else 0.0,
    }


def test_supported_stats_and_their_fields():
    assert supported_stats() == EVERY
    assert supported_stats() is not supported_stats()  # a fresh list each time: callers may mutate it
    assert set(STAT_PARTIALS) == set(EVERY) | set(FP8) | set(stats_of("early"))
    assert STAT_PARTIALS["dynamic_range"] == ("abs_min_nonzero",)
    assert all(STAT_PARTIALS[s] == () for s in EVERY + FP8 if s != "dynamic_range")
    assert fields_for([]) == set()
    assert fields_for(["min", "std"]) == set()
    assert fields_for(["dynamic_range", "mean"]) == {"abs_min_nonzero"}
    assert fields_for(iter(EVERY)) == {"abs_min_nonzero"}
    with pytest.raises(KeyError):
        fields_for(["median"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_every_stat_matches_python_math_reference(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(503, generator=g) * 4 - 1).to(dtype)
    x[7] = 0.0
    got = derive_stats(compute_partials(x, fields_for(EVERY)), EVERY)
    expected = math_reference(x)
    assert list(got) == EVERY
    for stat in EVERY:
        assert isinstance(got[stat], float)
        assert got[stat] == pytest.approx(expected[stat], rel=REL), stat


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_stat_of_merged_chunks_matches_the_concatenation(dtype):
    g = torch.Generator().manual_seed(9)
    chunks = [(torch.randn(n, generator=g) * (i + 1) + i).to(dtype) for i, n in enumerate((1, 0, 999, 4, 0, 250))]
    merged = merge_partials(torch.stack([compute_partials(c, fields_for(EVERY)) for c in chunks]))
    got = derive_stats(merged, EVERY)
    expected = math_reference(torch.cat(chunks))
    for stat in EVERY:
        assert got[stat] == pytest.approx(expected[stat], rel=REL), stat


def test_formulas_on_a_hand_written_partial():
    p = partial(count=4, mean=1.5, m2=21.0, min=-2.0, max=4.0, abs_sum=10.0, abs_min_nonzero=0.25)
    got = derive_stats(p, EVERY)
    assert got == {
        "min": -2.0,
        "max": 4.0,
        "mean": 1.5,
        "std": math.sqrt(21.0 / 3),  # unbiased: n - 1
        "l1_norm": 10.0,
        "l2_norm": math.sqrt(21.0 + 4 * 1.5**2),  # sum x^2 = M2 + n mean^2
        "cur_amax": 4.0,
        "dynamic_range": 4.0,  # log2(4) - log2(0.25)
    }


def test_derive_only_what_is_asked_in_that_order():
    p = compute_partials(torch.tensor([-4.0, 1.0, 2.0]))
    assert derive_stats(p, ["max", "cur_amax"]) == {"max": 2.0, "cur_amax": 4.0}
    assert list(derive_stats(p, ["std", "min", "mean"])) == ["std", "min", "mean"]
    assert derive_stats(p, []) == {}
    with pytest.raises(KeyError):
        derive_stats(p, ["median"])


def test_derive_leaves_the_partial_alone():
    p = compute_partials(torch.tensor([1.0, -3.0]), {"abs_min_nonzero"})
    before = p.clone()
    derive_stats(p, EVERY)
    assert torch.equal(p, before)


def test_cur_amax_is_the_larger_magnitude_of_min_and_max():
    assert derive_stats(partial(count=2, min=-9.0, max=3.0), ["cur_amax"]) == {"cur_amax": 9.0}
    assert derive_stats(partial(count=2, min=-1.0, max=3.0), ["cur_amax"]) == {"cur_amax": 3.0}
    assert derive_stats(partial(count=2, min=2.0, max=3.0), ["cur_amax"]) == {"cur_amax": 3.0}


def test_dynamic_range_is_log2_ratio():
    p = compute_partials(torch.tensor([0.0, -0.25, 8.0]), {"abs_min_nonzero"})
    assert derive_stats(p, ["dynamic_range"])["dynamic_range"] == pytest.approx(5.0)
    p = compute_partials(torch.tensor([-3.0, 0.0, 3.0]), {"abs_min_nonzero"})
    assert derive_stats(p, ["dynamic_range"])["dynamic_range"] == 0.0  # one magnitude only
    p = compute_partials(torch.tensor([0.1, 1000.0]), {"abs_min_nonzero"})
    assert derive_stats(p, ["dynamic_range"])["dynamic_range"] == pytest.approx(math.log2(1000 / 0.1))


def test_dynamic_range_edge_cases():
    assert derive_stats(partial(count=3, min=0.0, max=0.0, abs_min_nonzero=math.inf), ["dynamic_range"]) == {
        "dynamic_range": 0.0
    }  # all zeros
    only_inf = derive_stats(partial(count=2, min=-math.inf, max=math.inf, abs_min_nonzero=math.inf), ["dynamic_range"])
    assert math.isnan(only_inf["dynamic_range"])  # log2(inf) - log2(inf)
    with_inf = derive_stats(partial(count=2, min=1.0, max=math.inf, abs_min_nonzero=1.0), ["dynamic_range"])
    assert with_inf["dynamic_range"] == math.inf
    with_nan = derive_stats(partial(count=2, min=math.nan, max=math.nan, abs_min_nonzero=1.0), ["dynamic_range"])
    assert math.isnan(with_nan["dynamic_range"])


def test_std_needs_two_values():
    assert math.isnan(derive_stats(partial(count=1, mean=5.0, m2=0.0, min=5.0, max=5.0), ["std"])["std"])
    assert derive_stats(partial(count=2, mean=2.0, m2=2.0, min=1.0, max=3.0), ["std"])["std"] == pytest.approx(math.sqrt(2))


def test_empty_partial():
    got = derive_stats(empty_partials(), EVERY)
    for stat in ("min", "max", "mean", "std", "cur_amax", "dynamic_range"):
        assert math.isnan(got[stat]), stat
    assert got["l1_norm"] == 0.0 and got["l2_norm"] == 0.0


def test_l2_norm_from_mean_and_m2():
    x = torch.tensor([3.0, 4.0])
    assert derive_stats(compute_partials(x), ["l2_norm"])["l2_norm"] == pytest.approx(5.0)
    x = (1000.0 + torch.randn(10_000, generator=torch.Generator().manual_seed(3))).float()
    expected = math.sqrt(math.fsum(a * a for a in x.double().tolist()))
    assert derive_stats(compute_partials(x), ["l2_norm"])["l2_norm"] == pytest.approx(expected, rel=REL)


def test_l2_norm_of_infinite_values_is_inf_and_of_nan_is_nan():
    assert derive_stats(compute_partials(torch.tensor([1.0, -math.inf])), ["l2_norm"]) == {"l2_norm": math.inf}
    assert derive_stats(compute_partials(torch.tensor([math.inf, -math.inf])), ["l2_norm"]) == {"l2_norm": math.inf}
    assert math.isnan(derive_stats(compute_partials(torch.tensor([math.inf, math.nan])), ["l2_norm"])["l2_norm"])


def test_negative_rounding_in_m2_does_not_give_nan():
    p = compute_partials(torch.tensor([1.0, 1.0]))
    p[2] = -1e-30  # m2 a hair below zero after merging
    assert derive_stats(p, ["std"])["std"] == 0.0
    assert derive_stats(p, ["l2_norm"])["l2_norm"] == pytest.approx(math.sqrt(2.0))


def special_partials() -> torch.Tensor:
    """Partials of ordinary, empty, one-value, all-zero, infinite, NaN and huge tensors, and random fields."""
    tensors = [
        torch.randn(100) * 3 + 1,
        torch.tensor([]),
        torch.tensor([5.0]),
        torch.zeros(7),
        torch.tensor([1.0, -math.inf, 2.0]),
        torch.tensor([math.inf, -math.inf]),
        torch.tensor([1.0, math.nan]),
        torch.tensor([3e38, -3e38, 1e-45]),
        torch.tensor([0.0, 1e-30, -7.0]),
    ]
    rows = [compute_partials(t, fields_for(EVERY)) for t in tensors]
    g = torch.Generator().manual_seed(0)
    for _ in range(20):  # every field at once, including underflows, overflows and scales, some of them zero or negative
        row = (torch.randn(len(FIELDS), generator=g, dtype=torch.float64) * 10).round()
        row[INDEX["count"]] = abs(row[INDEX["count"]])
        rows.append(row)
    return torch.stack(rows)


def test_host_floats_give_the_same_statistics_as_the_tensor_expressions():
    """``step()`` logs ``derive_floats`` of each row; callers get ``derive_tensors``: one definition, equal results up
    to the last bit (torch's vectorised sqrt and log2 are not always correctly rounded; ``math``'s are)."""
    rows = special_partials()
    stats = EVERY + FP8
    columns = {stat: column.tolist() for stat, column in derive_tensors(rows, stats).items()}
    for i, row in enumerate(rows.tolist()):
        floats = derive_floats(row, stats)
        for stat in stats:
            want, got = columns[stat][i], floats[stat]
            assert (math.isnan(want) and math.isnan(got)) or math.isclose(got, want, rel_tol=4e-16), (i, stat, got, want)


class Reads(dict):
    """A partial as a mapping that records which fields are read."""

    def __init__(self, values: dict[str, float]):
        super().__init__(values)
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> float:
        self.read.add(name)
        return super().__getitem__(name)


def test_each_statistic_reads_the_fields_it_declares_and_no_other():
    for row in special_partials().tolist():
        for stat in CATALOG.values():
            fields = Reads({**dict(zip(FIELDS, row, strict=True)), "channel_amax": [1.0, 4.0]})
            stat.derive(fields, catalog._FloatOps)
            assert fields.read == set(stat.fields), stat.name


def test_groups_and_torch_reductions():
    assert all(stat.group in GROUPS and stat.name == name for name, stat in CATALOG.items())
    assert list(stats_of("tensor")) == EVERY == supported_stats()
    assert set(stats_of("quantization")) == {"underflows%", "overflows%", "mse", "scale_inv_min", "scale_inv_max"}
    assert set(stats_of("feature")) == {"max_blockwise_dynamic_range", "count", "num_zeros", "num_zeros%"}
    # the base namespace's LogTensorStats returns torch's own reductions: the six of the reference framework
    assert list(TORCH_REDUCTIONS) == ["min", "max", "mean", "std", "l1_norm", "l2_norm"]
    x = torch.randn(1000, generator=torch.Generator().manual_seed(4)) * 3 + 1
    derived = derive_stats(compute_partials(x), list(TORCH_REDUCTIONS))
    for name, reduction in TORCH_REDUCTIONS.items():
        assert reduction(x).item() == pytest.approx(derived[name], rel=1e-5), name
    assert TORCH_REDUCTIONS["l1_norm"](x).item() == torch.norm(x, p=1).item()
