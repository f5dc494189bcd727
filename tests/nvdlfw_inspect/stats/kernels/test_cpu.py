"""Building and loading the C statistics kernel: compiled once into the cache, reused, and replaced by
the torch reductions (with the reason in the debug log) where it cannot be built or is switched off."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from nvdlfw_inspect.stats.fields import INDEX, empty_partials
from nvdlfw_inspect.stats.kernels import compute_partials, cpu
from nvdlfw_inspect.stats.kernels.fallback import torch_tensor_stats

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    """An empty kernel cache and no kernel loaded yet in this process."""
    monkeypatch.setenv("NVDLFW_INSPECT_CACHE", str(tmp_path / "cache"))
    cpu.forget_library()
    yield tmp_path / "cache"
    cpu.forget_library()


@needs_compiler
def test_compiled_once_into_the_cache_then_reused(fresh_build):
    kernel = cpu.native_kernel()
    assert kernel is not None
    (library,) = fresh_build.glob("cpu_partials-*.so")
    built = library.stat().st_mtime_ns
    cpu.forget_library()
    assert cpu.native_kernel() is not None and library.stat().st_mtime_ns == built
    x = torch.tensor([[-3.0, 0.0, 2.0], [0.5, 4.0, -1.0]], dtype=torch.bfloat16)
    out = empty_partials()
    kernel(x, out.view(1, -1), [0], [-1], [], [], [], [], True)
    expected = [6.0, 2.5 / 6, 30.25 - 2.5**2 / 6, -3.0, 4.0, 10.5, 0.5]  # mean in float32 within a chunk
    assert out[:7].tolist() == pytest.approx(expected, rel=1e-7)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_many_chunks_merge_like_one_float64_pass(dtype):
    x = (torch.randn(300_001) * 5 + 2000).to(dtype)  # a mean 400 times the spread, 147 chunks
    x[12345] = 0.0
    out = empty_partials()
    cpu.native_kernel()(x, out.view(1, -1), [0], [-1], [], [], [], [], True)
    reference = x.double()
    assert out[INDEX["mean"]].item() == pytest.approx(reference.mean().item(), rel=1e-7)
    assert out[INDEX["m2"]].item() == pytest.approx(((reference - reference.mean()) ** 2).sum().item(), rel=1e-6)
    assert out[INDEX["abs_sum"]].item() == pytest.approx(reference.abs().sum().item(), rel=1e-7)
    assert out[INDEX["abs_min_nonzero"]].item() == reference.abs()[reference != 0].min().item()


def test_without_a_compiler_the_torch_reductions_take_over(fresh_build, monkeypatch, caplog):
    monkeypatch.setenv("CC", "no-such-compiler")
    with caplog.at_level(logging.INFO, logger="nvdlfw_inspect"):
        assert cpu.native_kernel() is None
    assert "statistics of CPU tensors use torch reductions" in caplog.text and "no-such-compiler" in caplog.text
    assert compute_partials(torch.tensor([1.0, 3.0]))[INDEX["mean"]].item() == 2.0


def test_a_compiler_error_is_reported(fresh_build, monkeypatch, caplog):
    monkeypatch.setenv("CC", "false")  # runs, fails
    with caplog.at_level(logging.INFO, logger="nvdlfw_inspect"):
        assert cpu.native_kernel() is None
    assert "false -O3" in caplog.text and not list(fresh_build.glob("*.so"))


def test_switched_off_by_the_environment(fresh_build, monkeypatch):
    monkeypatch.setenv("NVDLFW_INSPECT_NATIVE", "0")
    assert cpu.native_kernel() is None and not fresh_build.exists()


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_compiler), False], ids=["C", "torch"])
def test_amax_out_ignores_nan_as_an_fp8_recipes_amax(native):
    """What-if delayed scaling records ``amax_out``: NaN is left out, as Transformer Engine's ``fmaxf`` leaves it."""
    kernel = cpu.native_kernel() if native else torch_tensor_stats
    nan = float("nan")
    for x, want in (
        (torch.tensor([1.0, nan, -3.0, 2.0]), 3.0),
        (torch.tensor([nan, nan], dtype=torch.bfloat16), 0.0),
        (torch.tensor([-float("inf"), nan]), float("inf")),
        (torch.zeros(0), 0.0),
    ):
        amax_out = torch.full((), -1.0)
        kernel(x, empty_partials().view(1, -1), [0], [-1], [], [], [], [], False, None, amax_out)
        assert amax_out.item() == want, (x, amax_out)
