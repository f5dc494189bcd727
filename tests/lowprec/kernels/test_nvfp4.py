"""The fused NVFP4 quantize kernel: bit for bit against the torch emulation in Triton's interpreter,
compiled for Hopper without a GPU, and for real on a CUDA GPU with FP8 support when there is one."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowprec.formats.elements import E2M1, E4M3
from lowprec.formats.noise import RoundingStream
from lowprec.formats.scales import NVFP4ScaleRule
from lowprec.quant.block import BlockQuantizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
CHECKS = Path(__file__).with_name("nvfp4_checks.py")
needs_fp8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs a CUDA GPU with FP8 conversions"
)
SIGNATURE = {
    "x_ptr": "*bf16",
    "factors_ptr": "*fp32",
    **dict.fromkeys(["out_ptr", "scales_ptr", "out_t_ptr", "scales_t_ptr"], "*u8"),
    **dict.fromkeys(["rows", "cols", "stride_row", "stride_col"], "i32"),
    **{"key_lo": "u32", "key_hi": "i32", "key_t_lo": "i32", "key_t_hi": "i32"},
    **dict.fromkeys(["BLOCK_HEIGHT", "COLUMNWISE", "STOCHASTIC", "TILE"], "constexpr"),
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
    ("dtype", "block_height", "stochastic", "columnwise"),
    [("*bf16", 1, True, True), ("*fp32", 16, False, True), ("*fp16", 16, True, True), ("*bf16", 1, False, False)],
)
def test_kernel_compiles_for_hopper_with_exact_arithmetic(dtype, block_height, stochastic, columnwise):
    from triton_aot import hopper_ptx

    from lowprec.kernels import nvfp4

    constexprs = {"BLOCK_HEIGHT": block_height, "COLUMNWISE": columnwise, "STOCHASTIC": stochastic, "TILE": nvfp4.TILE}
    ptx = hopper_ptx(nvfp4._nvfp4_tile, SIGNATURE | {"x_ptr": dtype}, constexprs, nvfp4.OPTIONS)
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx  # the block scales round to nearest even, as the emulation's
    assert "div.rn.f32" in ptx  # the multipliers are IEEE reciprocals
    assert ".ftz" not in ptx and "fma" not in ptx  # subnormals kept, each rounding as written
    amax_signature = {
        "x_ptr": dtype,
        "partials_ptr": "*fp32",
        "flags_ptr": "*fp32",
        **dict.fromkeys(["rows", "cols", "stride_row", "stride_col"], "i32"),
    }
    amax_ptx = hopper_ptx(
        nvfp4._amax_tile,
        amax_signature | dict.fromkeys(["TILE_ROWS", "TILE_COLS"], "constexpr"),
        {"TILE_ROWS": nvfp4.AMAX_TILE_ROWS, "TILE_COLS": nvfp4.AMAX_TILE_COLS},
        nvfp4.OPTIONS,
    )
    assert ".ftz" not in amax_ptx
    assert amax_ptx.count("st.global") == 2 and stores_nonfinite_flag(amax_ptx)  # the partial amax and the tile's flag


def test_arguments_are_checked():
    from lowprec.kernels import nvfp4

    with pytest.raises(ValueError, match="2-D"):
        nvfp4.quantize_nvfp4(torch.zeros(2, 3, 16), 1, False)
    with pytest.raises(ValueError, match="block height"):
        nvfp4.quantize_nvfp4(torch.zeros(32, 32), 32, False)


@needs_fp8_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_height", [1, 16])
@pytest.mark.parametrize("stochastic", [False, True])
def test_cuda_casts_equal_the_cpu_emulation_bit_for_bit(dtype, block_height, stochastic):
    from lowprec.kernels import nvfp4

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1000, 777, generator=g) * torch.logspace(-6, 6, 777)).to(dtype)
    x[0, :5] = torch.tensor([float("nan"), -float("nan"), float("inf"), -0.0, 1e-40]).to(dtype)
    x[40:72, 64:96] = 0.0
    x[100, 16:32] = float("nan")
    stream = RoundingStream(7, "layer.gradient") if stochastic else None
    quantizer = BlockQuantizer(
        NVFP4ScaleRule(), E2M1, (block_height, 16), E4M3, rounding=stream, fixed_offset=2 if stochastic else None
    )
    keys = (stream.key(2, "rowwise"), stream.key(2, "columnwise")) if stochastic else None
    want = quantizer.quantize(x, transpose=True).inner_tensors().values()
    got = nvfp4.quantize_nvfp4(x.cuda(), block_height, columnwise=True, keys=keys)
    flags = got[6]
    assert flags.is_cuda and flags.dtype == torch.float32 and flags.amax().isnan()  # the NaNs and the inf
    assert nvfp4.quantize_nvfp4(x.nan_to_num().cuda(), block_height, columnwise=True, keys=keys)[6].amax().item() == 0
    for part, expected in zip(got[:6], want, strict=True):
        assert part.is_cuda and part.dtype == expected.dtype and part.shape == expected.shape
        assert torch.equal(part.cpu().reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8))
