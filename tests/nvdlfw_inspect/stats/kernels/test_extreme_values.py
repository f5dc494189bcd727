"""Extreme values give finite statistics within 1e-6 of the exact value rounded to float64, on every path
of the statistics operator: the C kernel, the torch reductions, and the Triton kernel in its interpreter
on the CPU (and on a GPU when there is one). Cases: values near 3e38, subnormals, a mean a million
times the spread, huge and tiny values mixed, bfloat16 and float16 extremes, float64, and FP8 cast
errors whose squares overflow float32. With inf or NaN present, every path gives what torch gives in
float64.

Run as a script, this file prints the statistics the operator's CUDA implementation gives for every
case, as JSON: the tests run it with ``TRITON_INTERPRET=1`` (set before Triton loads) on CPU tensors,
or with ``--device cuda``."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from lowprec.formats.elements import E4M3
from lowprec.quant.per_tensor import quantize_with_scale
from nvdlfw_inspect.stats import kernels
from nvdlfw_inspect.stats.catalog import derive_stats, supported_stats
from nvdlfw_inspect.stats.fields import empty_partials

N = 3 * 2048 + 123  # several chunks of the C kernel and blocks of the Triton kernel, the last one partial
FP8_STATS = ["underflows%", "overflows%", "mse", "scale_inv_min", "scale_inv_max"]
REL = 1e-6
# Triton 3.9's interpreter converts bfloat16 subnormals to float32 wrongly (interpreter._convert_float
# renormalises them into float32's subnormal range); a GPU's conversion is an exact shift
NOT_IN_THE_INTERPRETER = {"bfloat16 subnormal"}
Case = tuple[torch.Tensor, float | None]  # a tensor, and the scale of an E4M3 cast whose statistics count too
Run = Callable[[torch.Tensor, torch.Tensor, list[int], list[int], list[torch.Tensor], list[tuple]], None]


def cases() -> dict[str, Case]:
    g = torch.Generator().manual_seed(0)

    def normal() -> torch.Tensor:
        return torch.randn(N, generator=g, dtype=torch.float64)

    def uniform(low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(N, generator=g, dtype=torch.float64)

    half, quarter = N // 2, N // 4
    mixed = torch.cat([uniform(1e38, 3.4e38)[:half], normal()[:quarter] * 1e-40, normal()[: N - half - quarter]])
    float16 = torch.cat([uniform(3e4, 65504.0)[:half], normal()[: N - half].abs() * 1e-6])  # the small ones subnormal
    with_inf, both_inf, with_nan = normal(), normal(), normal()
    with_inf[3] = math.inf  # in the first chunk: later chunks merge into an infinite mean
    both_inf[3], both_inf[N - 5] = math.inf, -math.inf
    with_nan[N - 5] = math.nan
    return {
        "3e38": (torch.full((4096,), 3e38), 448.0 / 3e38),
        "near the float32 max": (uniform(1e38, 3.4e38).float(), 2e-36),  # a cast that saturates above 2.24e38
        "subnormal": (((normal() + 3) * 1e-39).float(), 2.0**126),
        "mean = 1e6 x std": ((1e6 + normal()).float(), None),
        "mean = 1e6 x std near 1e36": ((1e36 + 1e30 * normal()).float(), None),
        "huge and tiny mixed": (mixed[torch.randperm(N, generator=g)].float(), 2e-36),
        "bfloat16 near its max": (uniform(1e38, 3.38e38).bfloat16(), None),
        "bfloat16 subnormal": (((normal() + 3) * 1e-39).bfloat16(), None),
        "float16 extremes": (float16[torch.randperm(N, generator=g)].half(), None),
        "float64 1e150": (1e150 * (1 + 1e-3 * normal()), None),
        "+inf": (with_inf.float(), None),
        "+inf and -inf": (both_inf.float(), None),
        "NaN": (with_nan.float(), None),
    }


def kernel_stats(x: torch.Tensor, scale: float | None, run: Run) -> dict[str, float]:
    """Every statistic of ``x``, and of its E4M3 cast with ``scale``, from one call of ``run`` (the
    operator's arguments: tensor, table, rows, row variants, scales, grids)."""
    table = torch.stack([empty_partials()] * 2).to(x.device)
    scales = [] if scale is None else [torch.tensor(scale, dtype=torch.float32, device=x.device)]
    run(x, table, [0, 1], [-1, 0] if scales else [-1, -1], scales, [E4M3.grid] * len(scales))
    stats = derive_stats(table[0], supported_stats())
    return stats | (derive_stats(table[1], FP8_STATS) if scales else {})


def run_operator(x, table, rows, row_variants, scales, grids) -> None:
    kernels.tensor_stats(x, table, rows, row_variants, scales, grids, want_abs_min=True)


def run_cuda_implementation(x, table, rows, row_variants, scales, grids) -> None:
    """The operator's CUDA implementation called directly, so that the interpreter runs it on CPU tensors."""
    grid_args = [list(column) for column in zip(*grids, strict=True)] if grids else [[], [], []]
    kernels._cuda(x, table, rows, row_variants, scales, *grid_args, True)


def fp8_reference(x: torch.Tensor, scale: float) -> dict[str, float]:
    """The E4M3 cast's statistics from lowprec's cast, the squared error summed exactly."""
    s = torch.tensor(scale, dtype=torch.float32)
    cast = quantize_with_scale(x, s, E4M3)
    errors = (x.double() - cast.dequantize(torch.float32).double()).reshape(-1).tolist()
    n = x.numel()
    return {
        "underflows%": 100 * ((x != 0) & (cast.data.float() == 0)).sum().item() / n,
        "overflows%": 100 * ((x.float() * s).abs() > E4M3.max).sum().item() / n,
        "mse": float(sum((Fraction(e) ** 2 for e in errors), Fraction(0)) / n),
        "scale_inv_min": (1 / s).item(),
        "scale_inv_max": (1 / s).item(),
    }


def torch_float64_stats(v: torch.Tensor) -> dict[str, float]:
    """What torch gives in float64: the reference where inf or NaN make the exact values undefined."""
    magnitude = v.abs()
    amax = magnitude.max().item()
    return {
        "min": v.min().item(),
        "max": v.max().item(),
        "mean": v.mean().item(),
        "std": v.std().item(),
        "l1_norm": magnitude.sum().item(),
        "l2_norm": v.square().sum().sqrt().item(),
        "cur_amax": amax,
        "dynamic_range": math.log2(amax) - math.log2(magnitude[v != 0].min().item()),
    }


def reference(x: torch.Tensor, scale: float | None) -> dict[str, float]:
    """Every statistic computed exactly with rationals and rounded to float64 (torch's float64 ones with
    inf or NaN present)."""
    v = x.double().reshape(-1)
    if not v.isfinite().all():
        return torch_float64_stats(v)
    q = [Fraction(value) for value in v.tolist()]
    mean = sum(q, Fraction(0)) / len(q)
    m2 = sum(((value - mean) ** 2 for value in q), Fraction(0))
    amax = v.abs().max().item()
    stats = {
        "min": v.min().item(),
        "max": v.max().item(),
        "mean": float(mean),
        "std": math.sqrt(m2 / (len(q) - 1)),
        "l1_norm": float(sum(abs(value) for value in q)),
        "l2_norm": math.sqrt(sum(value * value for value in q)),
        "cur_amax": amax,
        "dynamic_range": math.log2(amax) - math.log2(v.abs()[v != 0].min().item()),
    }
    return stats | (fp8_reference(x, scale) if scale is not None else {})


def close(got: float, want: float) -> bool:
    if math.isnan(want):
        return math.isnan(got)
    if math.isinf(want) or want == 0:
        return got == want
    return abs(got - want) <= REL * abs(want)


def from_script(*args: str, env: dict[str, str] | None = None) -> dict[str, dict[str, float]]:
    """The statistics this file prints when run as a script."""
    support = str(Path(__file__).resolve().parents[3] / "support")  # for triton_strict
    env = dict(env or os.environ, PYTHONPATH=os.pathsep.join(filter(None, [support, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def computed(path: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, float]]:
    """Every case's statistics as ``path`` computes them (skips a path this machine does not have)."""
    if path == "Triton interpreter":
        if importlib.util.find_spec("triton") is None:
            pytest.skip("Triton is not installed")
        return from_script(env=dict(os.environ, TRITON_INTERPRET="1"))
    if path == "Triton on the GPU":
        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
        return from_script("--device", "cuda")
    if path == "torch reductions":
        monkeypatch.setattr(kernels, "native_kernel", lambda: None)
    elif kernels.native_kernel() is None:
        pytest.skip("no C compiler: the kernel cannot be built")
    return {name: kernel_stats(x, scale, run_operator) for name, (x, scale) in cases().items()}


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, float]]:
    return {name: reference(x, scale) for name, (x, scale) in cases().items()}


@pytest.mark.parametrize(
    "path", ["C kernel", "torch reductions", "Triton interpreter", pytest.param("Triton on the GPU", marks=pytest.mark.cuda)]
)
def test_extreme_values_give_the_float64_statistics(path, references, monkeypatch):
    got = computed(path, monkeypatch)
    assert set(got) == set(references) - (NOT_IN_THE_INTERPRETER if path == "Triton interpreter" else set())
    wrong = {
        (name, stat): (got[name][stat], value)
        for name in got
        for stat, value in references[name].items()
        if not close(got[name][stat], value)
    }
    assert not wrong, wrong


def main() -> None:
    from triton_strict import index_as_triton_36

    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu"
    index_as_triton_36()
    wanted = {name: case for name, case in cases().items() if device != "cpu" or name not in NOT_IN_THE_INTERPRETER}
    stats = {name: kernel_stats(x.to(device), scale, run_cuda_implementation) for name, (x, scale) in wanted.items()}
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
