"""The fused FP8 block quantize kernel (MXFP8, FP8 block scaling): bit for bit against the torch emulation
in Triton's interpreter, compiled for Hopper without a GPU, and for real on a CUDA GPU with FP8 support
when there is one."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowprec.formats.elements import E2M1, E4M3, E5M2
from lowprec.formats.scales import MX_BLOCK, Float8BlockScaleRule, MXScaleRule, NVFP4ScaleRule
from lowprec.kernels import runs_on
from lowprec.quant.block import BlockQuantizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
CHECKS = Path(__file__).with_name("block_fp8_checks.py")
needs_fp8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 tensor cores"
)
SIGNATURE = {
    "x_ptr": "*bf16",
    **dict.fromkeys(["out_ptr", "scales_ptr", "out_t_ptr", "scales_t_ptr"], "*u8"),
    "flags_ptr": "*fp32",
    **dict.fromkeys(["rows", "cols", "stride_row", "stride_col"], "i32"),
    **dict.fromkeys(["INV_FP8_MAX", "FP8_MAX", "MIN_NORMAL_EXP", "MANTISSA_BITS", "IS_E4M3"], "constexpr"),
    **dict.fromkeys(["SCALE_KIND", "OVERFLOW_SCALE", "SQUARE", "COLUMNWISE", "BLOCK"], "constexpr"),
}


def stores_nonfinite_flag(ptx: str) -> bool:
    """Whether ``ptx`` stores a 32-bit register selected between NaN (0x7FC00000) and 0: a tile's flag."""
    return any(
        re.search(rf"st\.global\.b32 \[ %rd\d+ \+ 0 \], {{ {register} }};", ptx)
        for register in re.findall(r"selp\.b32\s+(%r\d+), 2143289344, 0, %p\d+;", ptx)
    )


def test_kernel_in_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, str(CHECKS)], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok: ")


@pytest.mark.parametrize(
    ("fmt", "dtype", "kind", "square", "block"),
    [(E4M3, "*bf16", 0, False, 32), (E5M2, "*fp32", 0, True, 32), (E4M3, "*bf16", 1, False, 128), (E4M3, "*fp16", 2, True, 128)],
)
def test_kernel_compiles_for_hopper_with_exact_conversions(fmt, dtype, kind, square, block):
    from triton_aot import hopper_ptx

    from lowprec.kernels import block_fp8

    constexprs = {"INV_FP8_MAX": 1.0 / fmt.max, "FP8_MAX": fmt.max, "MIN_NORMAL_EXP": fmt.min_normal_exp}
    constexprs |= {"MANTISSA_BITS": fmt.mantissa_bits, "IS_E4M3": fmt is E4M3}
    constexprs |= {"SCALE_KIND": kind, "OVERFLOW_SCALE": torch.finfo(torch.bfloat16).max, "SQUARE": square}
    constexprs |= {"COLUMNWISE": True, "BLOCK": block}
    signature = SIGNATURE | {"x_ptr": dtype} | ({} if kind == 0 else dict.fromkeys(["scales_ptr", "scales_t_ptr"], "*fp32"))
    ptx = hopper_ptx(block_fp8._block_fp8_tile, signature, constexprs, block_fp8.OPTIONS)
    name = "e4m3x2" if fmt is E4M3 else "e5m2x2"
    assert f"cvt.rn.satfinite.{name}.f32" in ptx  # round to nearest even, as the emulation
    assert ".ftz" not in ptx and "fma" not in ptx  # subnormals kept, each rounding as written
    assert ("div.rn.f32" in ptx) == (kind != 0)  # fp32 scales: IEEE division, as torch divides
    assert "div.full" not in ptx and "div.approx" not in ptx and "rcp.approx" not in ptx
    assert stores_nonfinite_flag(ptx)  # each tile's NaN/inf flag, from the same read


def test_unsupported_blocks_are_refused_with_what_is_allowed():
    from lowprec.kernels import block_fp8

    assert block_fp8.supports(MXScaleRule(E4M3), E4M3, (32, 32)) and not block_fp8.supports(MXScaleRule(E4M3), E4M3, (16, 32))
    with pytest.raises(ValueError, match=r"casts 1 x B or B x B blocks, B in \(32, 64, 128\), got \(1, 16\)"):
        block_fp8.quantize_block_fp8(torch.zeros(2, 2), Float8BlockScaleRule(E4M3), (1, 16), columnwise=False)


def test_only_the_rules_own_fp8_element_format_takes_the_kernel(monkeypatch):
    """The kernel writes the rule's FP8 bytes: another element format under an MX or block rule (E5M2 values
    under an E4M3 rule, E2M1, any future format) must take the torch path, never be encoded as E4M3/E5M2."""
    from lowprec import kernels

    monkeypatch.setattr(kernels, "runs_on", lambda t: True)
    x = torch.randn(4, 64)
    assert BlockQuantizer(MXScaleRule(E4M3), E4M3, (1, MX_BLOCK), E4M3)._uses_kernel(x)
    assert BlockQuantizer(Float8BlockScaleRule(E5M2), E5M2, (1, 128), E5M2)._uses_kernel(x)
    assert not BlockQuantizer(MXScaleRule(E4M3), E5M2, (1, MX_BLOCK), E4M3)._uses_kernel(x)
    assert not BlockQuantizer(MXScaleRule(E4M3), E2M1, (1, MX_BLOCK), E4M3)._uses_kernel(x)
    assert not BlockQuantizer(NVFP4ScaleRule(), E4M3, (1, 16), E4M3)._uses_kernel(x)
    assert BlockQuantizer(NVFP4ScaleRule(), E2M1, (1, 16), E4M3)._uses_kernel(x)


def test_cpu_tensors_keep_the_torch_path():
    assert not runs_on(torch.randn(4, 40))
    cast = BlockQuantizer(MXScaleRule(E4M3), E4M3, (1, MX_BLOCK), E4M3).quantize(torch.randn(4, 40), transpose=True)
    assert cast.rowwise.data.shape == (4, 64) and cast.columnwise.data.shape == (40, 32)


@needs_fp8_gpu
@pytest.mark.parametrize(
    ("rule", "block"),
    [
        (MXScaleRule(E4M3), (1, MX_BLOCK)),
        (MXScaleRule(E5M2), (MX_BLOCK, MX_BLOCK)),
        (Float8BlockScaleRule(E4M3), (1, 128)),
        (Float8BlockScaleRule(E5M2, power_2=False), (128, 128)),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_casts_equal_the_cpu_emulation_bit_for_bit(rule, block, dtype):
    from lowprec.kernels import block_fp8

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1000, 777, generator=g) * torch.logspace(-30, 30, 777)).to(dtype)
    x[0, :5] = torch.tensor([float("nan"), -float("nan"), float("inf"), -0.0, 1e-40]).to(dtype)
    x[40:72, 64:96] = 0.0
    quantizer = BlockQuantizer(rule, rule.element, block, rule.element)
    assert runs_on(x.cuda())
    cuda, cpu = quantizer.quantize(x.cuda(), transpose=True), quantizer.quantize(x, transpose=True)
    flags = block_fp8.quantize_block_fp8(x.cuda(), rule, block, columnwise=False)[4]
    assert flags.is_cuda and flags.dtype == torch.float32 and flags.amax().isnan()  # the NaN and inf in row 0
    assert block_fp8.quantize_block_fp8(x.nan_to_num().cuda(), rule, block, columnwise=True)[4].amax().item() == 0
    for got, want in zip(cuda.inner_tensors().values(), cpu.inner_tensors().values(), strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
