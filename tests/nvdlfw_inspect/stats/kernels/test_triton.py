"""The Triton statistics kernel against float64 statistics: in Triton's interpreter on the CPU, and for
real on a CUDA GPU when there is one."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
CHECKS = Path(__file__).with_name("triton_checks.py")


def test_kernel_in_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, str(CHECKS)], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok: ")


def kernel_signature(dtype: str) -> tuple[dict[str, str], dict]:
    from nvdlfw_inspect.stats.kernels.triton import BLOCK, MAX_PROGRAMS

    pointers = ["table_ptr", "scratch_ptr", "call_out_ptr"]
    signature = {"x_ptr": dtype, **dict.fromkeys(pointers, "*fp64"), "counter_ptr": "*i32", "amax_out_ptr": "*fp32"}
    signature |= {"n": "i64", **{f"row{i}": "i32" for i in range(4)}}
    signature |= {f"scale{i}_ptr": "*fp32" for i in range(4)}
    grids = [(448.0, -6, 3), (57344.0, -14, 2), (448.0, -6, 3), (0.0, 0, 0)]
    constexprs = {"ROWS": 4, "VARIANTS": 3, "CALL_OUT": True, "AMAX_OUT": True, "WANT_MOMENTS": True}
    constexprs |= {"BLOCK": BLOCK, "PROGRAMS_BLOCK": MAX_PROGRAMS}
    constexprs |= {f"ROW_VARIANT{i}": v for i, v in enumerate([-1, 0, 1, 2])}
    for i, (grid_max, exponent, mantissa) in enumerate(grids):
        constexprs |= {f"GRID_MAX{i}": grid_max, f"MIN_EXP{i}": exponent, f"MANTISSA{i}": mantissa}
    return signature | dict.fromkeys(constexprs, "constexpr"), constexprs


@pytest.mark.parametrize("dtype", ["*bf16", "*fp16", "*fp32"])
def test_kernel_compiles_for_hopper(dtype):
    """The real compiler accepts the kernel; the grid rounds exactly (no flushed subnormals, no
    contracted multiply-add) and the last program's merge is ordered after every program's row."""
    from triton_aot import hopper_ptx

    from nvdlfw_inspect.stats.kernels.triton import OPTIONS, _tensor_stats

    signature, constexprs = kernel_signature(dtype)
    ptx = hopper_ptx(_tensor_stats, signature, constexprs, OPTIONS)
    assert ".ftz" not in ptx and "fma.rn.f32" not in ptx and "ld.global" in ptx
    assert "atom.global.gpu.acq_rel.add" in ptx  # the counter releases each row and acquires all of them
    assert "ld.global.cg" in ptx  # the scratch rows bypass the L1 cache, which other programs' writes do not update


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1], [16, 32]])
def test_kernel_compiles_for_the_rows_a_launch_specializes(rows):
    """A launch turns an int argument equal to 1 into a constant and marks multiples of 16; rows 0 and 1 are every
    first two rows of a table (an H200 refused the kernel for row 1 before the rows were exempted)."""
    from triton_aot import hopper_ptx

    from nvdlfw_inspect.stats.kernels.triton import OPTIONS, _tensor_stats

    signature, constexprs = kernel_signature("*bf16")
    launch_ints = {"n": 4096, **{f"row{i}": row for i, row in enumerate(rows + [0] * (4 - len(rows)))}}
    assert "ld.global" in hopper_ptx(_tensor_stats, signature, constexprs, OPTIONS, launch_ints)


@pytest.mark.parametrize("dtype", ["*bf16", "*fp16", "*fp32"])
def test_column_amax_compiles_for_hopper(dtype):
    """The channel statistics' kernel: the sizes are not specialized (1 would be a constant), the maximum is atomic."""
    from triton_aot import hopper_ptx

    from nvdlfw_inspect.stats.kernels.triton import COLUMN_BLOCK, ROW_BLOCK, _column_amax

    signature = {"x_ptr": dtype, "top_ptr": "*i32", "rows": "i64", "cols": "i64", "row_programs": "i32"}
    constexprs = {"ROWS": ROW_BLOCK, "COLUMNS": COLUMN_BLOCK}
    signature |= dict.fromkeys(constexprs, "constexpr")
    ptx = hopper_ptx(_column_amax, signature, constexprs, {}, {"rows": 1, "cols": 4096, "row_programs": 1})
    assert "atom.global" in ptx and ".max" in ptx and "ld.global" in ptx


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_on_the_gpu():
    result = subprocess.run([sys.executable, str(CHECKS), "--device", "cuda"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok: ")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_take_the_kernel_and_match_the_cpu_kernel():
    from nvdlfw_inspect.stats.catalog import derive_stats, supported_stats
    from nvdlfw_inspect.stats.kernels import compute_partials

    x = (torch.randn(3, 5000, device="cuda") * 2 + 7).to(torch.bfloat16)
    fused = derive_stats(compute_partials(x, {"abs_min_nonzero"}), supported_stats())
    eager = derive_stats(compute_partials(x.cpu(), {"abs_min_nonzero"}), supported_stats())
    for stat in supported_stats():
        assert fused[stat] == pytest.approx(eager[stat], rel=1e-5), stat
