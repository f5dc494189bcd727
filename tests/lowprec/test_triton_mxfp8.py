"""The fused MXFP8 quantize kernel: bit for bit against the torch emulation in Triton's interpreter,
compiled for Hopper without a GPU, and for real on a CUDA GPU with FP8 support when there is one."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowprec.block_quantization import MX_BLOCK, BlockQuantizer
from lowprec.block_scales import MXScaleRule
from lowprec.formats import E4M3, E5M2
from lowprec.quantization import uses_fused_kernels

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
CHECKS = Path(__file__).with_name("triton_mxfp8_checks.py")
needs_fp8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 tensor cores"
)
SIGNATURE = {
    "x_ptr": "*bf16",
    **dict.fromkeys(["out_ptr", "scales_ptr", "out_t_ptr", "scales_t_ptr"], "*u8"),
    **dict.fromkeys(["rows", "cols", "stride_row", "stride_col"], "i32"),
    **dict.fromkeys(["INV_FP8_MAX", "FP8_MAX", "MIN_NORMAL_EXP", "MANTISSA_BITS", "IS_E4M3", "COLUMNWISE", "BLOCK"], "constexpr"),
}


def test_kernel_in_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, str(CHECKS)], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok: ")


@pytest.mark.parametrize(("fmt", "dtype", "columnwise"), [(E4M3, "*bf16", True), (E5M2, "*fp32", False)])
def test_kernel_compiles_for_hopper_with_exact_conversions(fmt, dtype, columnwise):
    from triton_aot import hopper_ptx

    from lowprec import triton_mxfp8

    constexprs = {"INV_FP8_MAX": 1.0 / fmt.max, "FP8_MAX": fmt.max, "MIN_NORMAL_EXP": fmt.min_normal_exp}
    constexprs |= {"MANTISSA_BITS": fmt.mantissa_bits, "IS_E4M3": fmt is E4M3, "COLUMNWISE": columnwise, "BLOCK": MX_BLOCK}
    ptx = hopper_ptx(triton_mxfp8._mxfp8_tile, SIGNATURE | {"x_ptr": dtype}, constexprs, triton_mxfp8.OPTIONS)
    name = "e4m3x2" if fmt is E4M3 else "e5m2x2"
    assert f"cvt.rn.satfinite.{name}.f32" in ptx  # round to nearest even, as the emulation
    assert ".ftz" not in ptx and "fma" not in ptx  # subnormals kept, each rounding as written


def test_cpu_tensors_keep_the_torch_path():
    assert not uses_fused_kernels(torch.randn(4, 40))
    cast = BlockQuantizer(MXScaleRule(E4M3), E4M3, (1, MX_BLOCK), E4M3).quantize(torch.randn(4, 40), transpose=True)
    assert cast.rowwise.data.shape == (4, 64) and cast.columnwise.data.shape == (40, 32)


@needs_fp8_gpu
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_casts_equal_the_cpu_emulation_bit_for_bit(fmt, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1000, 777, generator=g) * torch.logspace(-30, 30, 777)).to(dtype)
    x[0, :5] = torch.tensor([float("nan"), -float("nan"), float("inf"), -0.0, 1e-40]).to(dtype)
    x[40:72, 64:96] = 0.0
    quantizer = BlockQuantizer(MXScaleRule(fmt), fmt, (1, MX_BLOCK), fmt)
    assert uses_fused_kernels(x.cuda())
    cuda, cpu = quantizer.quantize(x.cuda(), transpose=True), quantizer.quantize(x, transpose=True)
    for got, want in zip(cuda.tensors(), cpu.tensors(), strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
