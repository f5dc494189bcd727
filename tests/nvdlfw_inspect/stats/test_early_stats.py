"""kurtosis, rms, outlier_channel_ratio and max_channel: each against float64 torch written here, exact over
micro-batches of different sizes and over ranks (the packed all-reduces, simulated, and two gloo processes), and
accepted by both namespaces' LogTensorStats."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import spawning
import torch
from collecting import Collect
from torch.utils._python_dispatch import TorchDispatchMode

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.errors import ConfigError
from nvdlfw_inspect.stats import kernels
from nvdlfw_inspect.stats.catalog import EARLY_STATS, column_amax, derive_floats, derive_tensors
from nvdlfw_inspect.stats.fields import INDEX, empty_partials, merge_partials
from nvdlfw_inspect.stats.kernels import cpu, tensor_stats
from nvdlfw_inspect.stats.kernels.fallback import tensor_partials
from nvdlfw_inspect.stats.reduce import combine, pack_min, pack_sum, unpack_min

HERE = Path(__file__).parent
EARLY = ["kurtosis", "rms", "outlier_channel_ratio", "max_channel"]


def reference(t: torch.Tensor) -> dict[str, float]:
    """The four statistics in float64 torch, from their definitions."""
    v = t.double()
    d = v - v.mean()
    amax = v.reshape(-1, v.shape[-1]).abs().amax(0)
    ordered = amax.sort().values
    k = ordered.numel()
    median = (ordered[(k - 1) // 2] + ordered[k // 2]) / 2
    return {
        "kurtosis": ((d**4).mean() / (d**2).mean() ** 2).item(),
        "rms": (v**2).mean().sqrt().item(),
        "outlier_channel_ratio": (amax.max() / median).item(),
        "max_channel": float(amax.argmax()),
    }


def derived(partials: torch.Tensor, amax: torch.Tensor) -> dict[str, float]:
    return derive_floats(partials.tolist(), EARLY, amax.tolist())


def assert_matches(got: dict[str, float], want: dict[str, float], rel: float = 1e-10) -> None:
    for stat in ("kurtosis", "rms", "outlier_channel_ratio"):
        assert got[stat] == pytest.approx(want[stat], rel=rel, nan_ok=True), stat
    assert got["max_channel"] == want["max_channel"]


def gaussian(rows: int = 512, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, 64, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def heavy_tailed(rows: int = 512, seed: int = 1) -> torch.Tensor:
    """A Gaussian over a uniform: tails like a Cauchy's, kurtosis in the hundreds."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 64, generator=g, dtype=torch.float64) / torch.rand(rows, 64, generator=g, dtype=torch.float64)


def planted(rows: int = 256) -> torch.Tensor:
    """Channel 37 of 48 is ten times the others."""
    x = torch.randn(rows, 48, generator=torch.Generator().manual_seed(2), dtype=torch.float64) + 0.5
    x[:, 37] *= 10.0
    return x


def far_from_zero(seed: int = 3) -> torch.Tensor:
    """A mean 10^4 times the spread: the central moments must not come from raw power sums."""
    return gaussian(seed=seed) + 1e4


TENSORS = {"gaussian": gaussian, "heavy-tailed": heavy_tailed, "planted outlier channel": planted, "far from zero": far_from_zero}


@pytest.mark.parametrize("name", list(TENSORS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_each_statistic_is_the_float64_one(name, dtype):
    x = TENSORS[name]().to(dtype)
    assert_matches(derived(tensor_partials(x, False, want_moments=True), column_amax(x)), reference(x))


def test_the_planted_outlier_channel_is_found_exactly():
    x = planted()
    got = derived(tensor_partials(x, False, want_moments=True), column_amax(x))
    ordered = x.abs().amax(0).sort().values
    assert got["max_channel"] == 37.0
    assert got["outlier_channel_ratio"] == (ordered[47] / ((ordered[23] + ordered[24]) / 2)).item()  # 48: two middle ones
    assert got["outlier_channel_ratio"] > 5.0


def test_a_gaussians_kurtosis_is_three_and_the_tensor_ops_agree_with_the_float_ones():
    x = gaussian(rows=4096)
    partials, amax = tensor_partials(x, False, want_moments=True), column_amax(x)
    floats = derived(partials, amax)
    assert floats["kurtosis"] == pytest.approx(3.0, abs=0.05)
    tensors = derive_tensors(partials, EARLY, amax)
    assert {stat: value.item() for stat, value in tensors.items()} == pytest.approx(floats, rel=1e-15)


def test_edge_cases():
    constant = derived(tensor_partials(torch.full((4, 3), 2.0), False, want_moments=True), column_amax(torch.full((4, 3), 2.0)))
    assert math.isnan(constant["kurtosis"]) and constant["rms"] == 2.0 and constant["outlier_channel_ratio"] == 1.0
    empty = derived(tensor_partials(torch.empty(0, 5), False, want_moments=True), column_amax(torch.empty(0, 5)))
    assert all(math.isnan(value) for value in empty.values())
    zeros = torch.zeros(3, 4)
    zeros[1, 2] = -5.0  # the median channel's amax is 0: the ratio is infinite
    assert derived(tensor_partials(zeros, False, want_moments=True), column_amax(zeros))["outlier_channel_ratio"] == math.inf
    with_nan = torch.tensor([[1.0, math.nan], [-3.0, 2.0]])  # NaN is ignored by the channel statistics
    assert column_amax(with_nan).tolist() == [3.0, 2.0]
    assert column_amax(torch.tensor([1.0, -4.0, 2.0])).tolist() == [1.0, 4.0, 2.0]  # a 1-D tensor is one row


def operator_partials(*pieces: torch.Tensor) -> torch.Tensor:
    """One row fed ``pieces`` in turn by the statistics operator with M3 and M4 (the C kernel for a CPU tensor)."""
    row = empty_partials().view(1, -1)
    for piece in pieces:
        tensor_stats(piece, row, [0], want_abs_min=False, want_moments=True)
    return row[0]


@pytest.mark.parametrize("name", list(TENSORS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_kernel_computes_the_moments_in_its_one_pass(name, dtype, monkeypatch):
    """M3 and M4 beside the other fields, over many of the kernel's chunks (2,048 values) and over calls merged into
    one row (Pebay's formulas in C): float64 torch's statistics, and no torch reduction runs."""
    if cpu.native_kernel() is None:
        pytest.skip("no C compiler: the kernel cannot be built")
    monkeypatch.setattr(kernels, "torch_tensor_stats", None)  # a call of the torch reductions would fail
    x = torch.cat([TENSORS[name](seed=seed) if name != "planted outlier channel" else planted() for seed in range(3)])
    x = x.to(dtype)
    whole, merged = operator_partials(x), operator_partials(*split(x, [1, 700, 37, x.shape[0] - 738]))
    assert_matches(derived(whole, column_amax(x)), reference(x), rel=1e-9)
    assert_matches(derived(merged, column_amax(x)), reference(x), rel=1e-9)
    torch_row = tensor_partials(x, False, want_moments=True)
    for field in ("count", "mean", "m2", "m3", "m4"):
        for got in (whole, merged):
            assert got[INDEX[field]].item() == pytest.approx(torch_row[INDEX[field]].item(), rel=1e-9, abs=1e-9), field


def test_a_kurtosis_request_on_a_cpu_tensor_is_one_operator_call(log_dir, base_config, monkeypatch):
    if cpu.native_kernel() is None:
        pytest.skip("no C compiler: the kernel cannot be built")
    monkeypatch.setattr(kernels, "torch_tensor_stats", None)  # a call of the torch reductions would fail
    calls = []
    real = kernels._IMPLEMENTATIONS["cpu"]
    monkeypatch.setitem(kernels._IMPLEMENTATIONS, "cpu", lambda *args: calls.append(args[-1]) or real(*args))
    collect = Collect()
    debug_api.initialize(config_file=base_config(["kurtosis", "mean", "std"]), log_dir=str(log_dir), statistics_logger=collect)
    try:
        x = heavy_tailed().float()
        for piece in split(x, [100, 412]):
            debug_api.log_tensor_stats("layer", tensor=piece, tensor_name="activation")
        debug_api.step()
    finally:
        debug_api.end_debug()
    assert calls == [True, True]  # one call per tensor, M3 and M4 asked of it
    assert collect.values[("layer_activation_kurtosis", 0)] == pytest.approx(reference(x)["kurtosis"], rel=1e-9)
    assert collect.values[("layer_activation_std", 0)] == pytest.approx(x.double().std().item(), rel=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_c_column_amax_is_torchs(dtype, monkeypatch):
    """One read in C: NaN left out, infinities, negative zeros and subnormals as torch takes them, a column without
    a number at 0; the same under a dispatch mode (which runs the torch ops instead) and without the kernel."""
    if cpu.column_amax_kernel() is None:
        pytest.skip("no C compiler: the kernel cannot be built")
    x = torch.randn(300, 70, generator=torch.Generator().manual_seed(9)) * torch.logspace(-8, 4, 70)
    x[:, 3], x[5, 6], x[7, 8], x[:, 9] = math.nan, math.inf, -math.inf, -0.0
    x[11, 12] = torch.finfo(torch.float32).tiny / 8  # a subnormal float32
    x = x.to(dtype)
    magnitude = x.double().abs()
    want = torch.where(magnitude.isnan(), 0.0, magnitude).amax(0)
    assert torch.equal(column_amax(x), want)
    assert torch.equal(column_amax(x[0]), magnitude[0].nan_to_num(0.0))  # a 1-D tensor: one row
    with SeenOps() as seen:  # watched: the torch ops run, which the mode sees
        assert torch.equal(column_amax(x), want)
    assert "aten.amax" in seen.names
    monkeypatch.setattr(kernels, "column_amax_kernel", lambda: None)
    assert torch.equal(column_amax(x), want)


class SeenOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def split(x: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
    assert sum(rows) == x.shape[0]
    return list(x.split(rows))


@pytest.mark.parametrize("name", list(TENSORS))
def test_micro_batches_of_different_sizes_merge_exactly(name):
    x = TENSORS[name]()
    pieces = split(x, [1, 2, 37, 100, x.shape[0] - 140])
    merged = merge_partials(torch.stack([tensor_partials(p, False, want_moments=True) for p in pieces]))
    amax = torch.stack([column_amax(p) for p in pieces]).amax(0)
    assert torch.equal(amax, column_amax(x))
    assert_matches(derived(merged, amax), reference(x))
    whole = tensor_partials(x, False, want_moments=True)
    for field in ("m2", "m3", "m4"):
        assert merged[INDEX[field]].item() == pytest.approx(whole[INDEX[field]].item(), rel=1e-9, abs=1e-9), field


def test_pairwise_merging_in_any_order_is_the_same():
    pieces = split(heavy_tailed(), [5, 300, 7, 200])
    rows = [tensor_partials(p, False, want_moments=True) for p in pieces]
    left = rows[0]
    for row in rows[1:]:
        left = merge_partials(torch.stack([left, row]))
    right = merge_partials(torch.stack([rows[3], merge_partials(torch.stack([rows[1], merge_partials(torch.stack(rows[::2]))]))]))
    torch.testing.assert_close(left, right, rtol=1e-12, atol=0)


def test_the_packed_all_reduces_merge_the_moments_exactly():
    """Three ranks, stacked on a dimension: MIN and SUM element by element, as gloo and NCCL apply them."""
    x = planted()
    per_rank = [tensor_partials(p, False, want_moments=True).unsqueeze(0) for p in split(x, [10, 200, 46])]
    first = torch.stack([pack_min(rows, 7.0, 3.0, 3.0) for rows in per_rank]).amin(0)
    _, extremes, shift = unpack_min(first, 1)
    second = torch.stack([pack_sum(rows, shift) for rows in per_rank]).sum(0)
    merged = combine(extremes, shift, second, 1)[0]
    assert_matches(derived(merged, column_amax(x)), reference(x))
    torch.testing.assert_close(merged, merge_partials(torch.cat(per_rank)), rtol=1e-10, atol=0, equal_nan=True)


@spawning.needs_gloo
def test_two_gloo_ranks_log_the_statistics_of_every_micro_batch_of_both(tmp_path):
    import early_workers

    log_dir = spawning.spawn(HERE / "early_workers.py", "early_stats", 2, tmp_path)
    every = torch.cat([early_workers.early_tensor(rank, mb) for rank in range(2) for mb in range(2)])
    want = reference(every)
    assert want["max_channel"] == 5.0
    for rank in range(2):
        stats = json.loads((log_dir / f"values-{rank}.json").read_text())
        assert_matches({stat: stats[f"early_activation_{stat}"] for stat in EARLY}, want)
        assert stats["early_activation_std"] == pytest.approx(every.std().item(), rel=1e-12)


@pytest.fixture
def base_config():
    def make(stats: list) -> dict:
        feature = {"enabled": True, "tensors": ["activation"], "stats": stats}
        return {"all": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "LogTensorStats": feature}}

    return make


def test_the_base_namespace_returns_the_calls_values_and_logs_the_merged_ones(log_dir, base_config):
    collect = Collect()
    debug_api.initialize(config_file=base_config([*EARLY, "mean"]), log_dir=str(log_dir), statistics_logger=collect)
    try:
        x = heavy_tailed()
        first, second = x[:100], x[100:]
        returned = debug_api.log_tensor_stats("layer", tensor=first, tensor_name="activation")
        assert {stat: returned[stat].item() for stat in EARLY} == pytest.approx(reference(first), rel=1e-6)
        second = second.clone()
        returned = debug_api.log_tensor_stats("layer", tensor=second, tensor_name="activation")
        want = reference(second)
        second.zero_()  # changed in place: the returned values still describe it as passed
        assert {stat: returned[stat].item() for stat in EARLY} == pytest.approx(want, rel=1e-6)
        debug_api.step()
    finally:
        debug_api.end_debug()
    assert_matches({stat: collect.values[(f"layer_activation_{stat}", 0)] for stat in EARLY}, reference(x))


def test_an_unknown_statistic_is_still_a_clear_error_naming_the_new_ones(log_dir, base_config):
    with pytest.raises(ConfigError) as error:
        debug_api.initialize(config_file=base_config(["kurtosis", "kurtosys"]), log_dir=str(log_dir))
    debug_api.end_debug()
    message = str(error.value)
    assert "kurtosys" in message and all(stat in message for stat in EARLY_STATS)


def test_a_tensor_of_other_channels_is_left_out_of_the_channel_statistics_with_a_warning(log_dir, base_config):
    collect = Collect()
    debug_api.initialize(config_file=base_config(["max_channel", "rms"]), log_dir=str(log_dir), statistics_logger=collect)
    try:
        x, other = planted(), torch.ones(3, 5)
        debug_api.log_tensor_stats("layer", tensor=x, tensor_name="activation")
        with pytest.warns(RuntimeWarning, match="5 channels, 48 earlier"):
            debug_api.log_tensor_stats("layer", tensor=other, tensor_name="activation")
        debug_api.step()
    finally:
        debug_api.end_debug()
    assert collect.values[("layer_activation_max_channel", 0)] == 37.0
    assert collect.values[("layer_activation_rms", 0)] == pytest.approx(
        reference(torch.cat([x.flatten(), other.flatten()]).unsqueeze(0))["rms"]
    )
