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


@pytest.mark.parametrize("dtype", ["*bf16", "*fp16", "*fp32"])
def test_kernel_compiles_for_hopper(dtype):
    from triton_aot import hopper_ptx

    from nvdlfw_inspect.stats.triton_partials import BLOCK, OPTIONS, _block_partials

    signature = {"x_ptr": dtype, "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    ptx = hopper_ptx(_block_partials, signature, {"BLOCK": BLOCK}, OPTIONS)
    assert ".ftz" not in ptx and "ld.global" in ptx


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_take_the_kernel_and_match_the_eager_path():
    from nvdlfw_inspect.stats.derive import derive_stats, supported_stats
    from nvdlfw_inspect.stats.partials import compute_partials

    x = (torch.randn(3, 5000, device="cuda") * 2 + 7).to(torch.bfloat16)
    fused = derive_stats(compute_partials(x), supported_stats())
    eager = derive_stats(compute_partials(x.cpu(), {"abs_min_nonzero"}), supported_stats())
    for stat in supported_stats():
        assert fused[stat] == pytest.approx(eager[stat], rel=1e-5), stat
