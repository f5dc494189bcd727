"""The fused FP8 cast kernels: bit for bit against the CPU emulation in Triton's interpreter, and for
real on a CUDA GPU with FP8 tensor cores when there is one."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lowprec
from lowprec import kernels
from lowprec.formats.elements import E4M3, E5M2
from lowprec.kernels import runs_on
from lowprec.quant.per_tensor import CurrentScalingQuantizer, DelayedScalingQuantizer
from lowprec.recipe import DelayedScaling

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
CHECKS = Path(__file__).with_name("fp8_cast_checks.py")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_fp8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 tensor cores"
)


def test_kernels_in_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, str(CHECKS)], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok: ")


CAST_SIGNATURE = {
    "x_ptr": "*bf16",
    "scale_ptr": "*fp32",
    "out_ptr": "*u8",
    "out_t_ptr": "*u8",
    "amax_ptr": "*fp32",
    **dict.fromkeys(["rows", "cols", "stride_row", "stride_col"], "i32"),
    **dict.fromkeys(["FP8_MAX", "MIN_NORMAL_EXP", "MANTISSA_BITS", "IS_E4M3", "TRANSPOSE", "RECORD_AMAX", "TILE"], "constexpr"),
}


@pytest.mark.parametrize(
    ("fmt", "dtype", "transpose", "record_amax"), [(E4M3, "*bf16", True, True), (E5M2, "*fp32", False, False)]
)
def test_cast_kernel_compiles_for_hopper_with_exact_hardware_conversions(fmt, dtype, transpose, record_amax):
    from triton_aot import hopper_ptx

    from lowprec.kernels import fp8_cast

    exponent, mantissa = fmt.min_normal_exp, fmt.mantissa_bits
    constexprs = {"FP8_MAX": fmt.max, "MIN_NORMAL_EXP": exponent, "MANTISSA_BITS": mantissa, "IS_E4M3": fmt is E4M3}
    constexprs |= {"TRANSPOSE": transpose, "RECORD_AMAX": record_amax, "TILE": fp8_cast.TILE}
    ptx = hopper_ptx(fp8_cast._cast_tile, CAST_SIGNATURE | {"x_ptr": dtype}, constexprs, fp8_cast.OPTIONS)
    name = "e4m3x2" if fmt is E4M3 else "e5m2x2"
    assert f"cvt.rn.satfinite.{name}.f32" in ptx  # round to nearest even, as the emulation
    assert ".ftz" not in ptx  # subnormals are not flushed
    assert "0f4B400000" in ptx and "fma" not in ptx  # the grid rounding, each step rounded as written


@pytest.mark.parametrize(("rows", "cols"), [(256, 384), (1000, 777)])
def test_cast_kernel_reads_element_wise_whatever_the_sizes(rows, cols):
    """On an H200 (Triton 3.6) the transposing, amax-recording cast specialized for 256 x 384 made misaligned
    16-byte reads; for 1000 x 777 (no size a multiple of 16) it ran correctly. Every size now gets that code."""
    from triton_aot import hopper_ptx

    from lowprec.kernels import fp8_cast

    constexprs = {"FP8_MAX": E4M3.max, "MIN_NORMAL_EXP": E4M3.min_normal_exp, "MANTISSA_BITS": E4M3.mantissa_bits}
    constexprs |= {"IS_E4M3": True, "TRANSPOSE": True, "RECORD_AMAX": True, "TILE": fp8_cast.TILE}
    launch = {"rows": rows, "cols": cols, "stride_row": cols, "stride_col": 1}
    ptx = hopper_ptx(fp8_cast._cast_tile, CAST_SIGNATURE, constexprs, fp8_cast.OPTIONS, launch)
    assert "ld.global.b16" in ptx and "ld.global.v" not in ptx


def test_amax_kernel_compiles_for_hopper():
    from triton_aot import hopper_ptx

    from lowprec.kernels import fp8_cast

    signature = {"x_ptr": "*bf16", "amax_ptr": "*fp32", "n": "i64", "BLOCK": "constexpr"}
    ptx = hopper_ptx(fp8_cast._amax_blocks, signature, {"BLOCK": fp8_cast.AMAX_BLOCK}, fp8_cast.OPTIONS)
    assert "max" in ptx and "atom" not in ptx  # partials, no contended atomics
    assert ptx.count("st.global") == 2  # row 0 (the partial amax) and row 1 (the non-finite flag) of the partials


def test_scale_kernels_compile_for_hopper_with_exact_division():
    from triton_aot import hopper_ptx

    from lowprec.kernels import fp8_scales

    common = {"SCALED_MAX": 224.0, "BLOCK": fp8_scales.PARTIALS_BLOCK}
    current = {"partials_ptr": "*fp32", "n": "i32", "scale_ptr": "*fp32", "scale_inv_ptr": "*fp32", "probe_ptr": "*fp32"}
    current |= dict.fromkeys(common, "constexpr")
    delayed = {"partials_ptr": "*fp32", "n": "i32", "history_ptr": "*fp32", "new_history_ptr": "*fp32"}
    delayed |= {"scale_ptr": "*fp32", "new_scale_ptr": "*fp32", "new_scale_inv_ptr": "*fp32", "probe_ptr": "*fp32"}
    delayed |= dict.fromkeys(["HISTORY", "HISTORY_BLOCK", "USE_MAX", "PROBE", *common], "constexpr")
    delayed_constexprs = common | {"HISTORY": 1000, "HISTORY_BLOCK": 1024, "USE_MAX": True}
    stores = []
    for kernel, signature, constexprs in (
        (fp8_scales._current_scale, current, common),
        (fp8_scales._delayed_update, delayed, delayed_constexprs | {"PROBE": True}),
        (fp8_scales._delayed_update, delayed, delayed_constexprs | {"PROBE": False}),  # 1-D partials
    ):
        ptx = hopper_ptx(kernel, signature, constexprs, fp8_scales.OPTIONS)
        assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
        stores.append(ptx.count("st.global"))
    assert stores[0] == 3 and stores[1] == stores[2] + 1  # the probe is written only from (2, P) partials


def test_cpu_tensors_keep_the_torch_path():
    assert not runs_on(torch.randn(4, 4))
    cast = CurrentScalingQuantizer(E4M3).quantize(torch.randn(4, 4), transpose=True)
    assert cast.other_layout is None


@needs_fp8_gpu
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("make", [CurrentScalingQuantizer, lambda fmt: DelayedScalingQuantizer(fmt, DelayedScaling())])
def test_cuda_casts_equal_the_cpu_emulation_bit_for_bit(fmt, dtype, make):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1000, 777, generator=g) * torch.logspace(-8, 8, 777)).to(dtype)
    x[0, :4] = torch.tensor([float("nan"), -float("nan"), float("inf"), -0.0]).to(dtype)
    cuda_quantizer, cpu_quantizer = make(fmt), make(fmt)
    for _ in range(2):  # delayed scaling: scale 1, then the scale from the recorded amax
        cuda, cpu = cuda_quantizer.quantize(x.cuda(), transpose=True), cpu_quantizer.quantize(x)
        assert torch.equal(cuda.data.cpu().view(torch.uint8), cpu.data.view(torch.uint8))
        assert torch.equal(cuda.other_layout.cpu().view(torch.uint8), cpu.data.view(torch.uint8))
        assert cuda.other_layout.t().is_contiguous()
        assert torch.equal(cuda.scale_inv.cpu(), cpu.scale_inv)
        assert cuda.nonfinite_probe.isnan() and cpu.nonfinite_probe.isnan()  # the cast's read saw the NaN and inf
    finite = x.nan_to_num(nan=0.0, posinf=0.0)
    assert cuda_quantizer.quantize(finite.cuda()).nonfinite_probe.item() == 0 == cpu_quantizer.quantize(finite).nonfinite_probe


@needs_cuda
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("make", [CurrentScalingQuantizer, lambda fmt: DelayedScalingQuantizer(fmt, DelayedScaling())])
def test_unfused_cuda_casts_equal_the_cpu_emulation_bit_for_bit(fmt, dtype, make, monkeypatch):
    """torch's own CUDA path (NaN loses its sign in the GPU's multiply) writes the same bytes too."""
    monkeypatch.setattr(kernels, "_mode", "emulated")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1000, 777, generator=g) * torch.logspace(-8, 8, 777)).to(dtype)
    x[0, :4] = torch.tensor([float("nan"), -float("nan"), float("inf"), -0.0]).to(dtype)
    cuda_quantizer, cpu_quantizer = make(fmt), make(fmt)
    for _ in range(2):  # delayed scaling: scale 1, then the scale from the recorded amax
        cuda, cpu = cuda_quantizer.quantize(x.cuda()), cpu_quantizer.quantize(x)
        assert cuda.other_layout is None  # the torch path, not the fused kernel
        assert torch.equal(cuda.data.cpu().view(torch.uint8), cpu.data.view(torch.uint8))
        assert torch.equal(cuda.scale_inv.cpu(), cpu.scale_inv)


@needs_cuda
def test_cuda_delayed_scaling_follows_the_cpu_history():
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(256, 384, generator=g).to(torch.bfloat16) * (i + 1) for i in range(4)]
    cuda_q, cpu_q = (DelayedScalingQuantizer(E4M3, DelayedScaling(amax_history_len=3)) for _ in range(2))
    for x in batches:
        cuda, cpu = cuda_q.quantize(x.cuda(), transpose=True), cpu_q.quantize(x)
        assert torch.equal(cuda.data.cpu().view(torch.uint8), cpu.data.view(torch.uint8))
        assert torch.equal(cuda_q.amax_history.cpu(), cpu_q.amax_history)
        assert torch.equal(cuda_q.scale.cpu(), cpu_q.scale)


@needs_fp8_gpu
@pytest.mark.parametrize("recipe", [DelayedScaling(), lowprec.Float8CurrentScaling()], ids=["delayed", "current"])
def test_fp8_linear_on_the_gpu_matches_the_emulation(recipe):
    torch.manual_seed(0)
    layer = lowprec.Linear(256, 128, name="fc", device="cuda", params_dtype=torch.bfloat16)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with lowprec.fp8_autocast(fp8_recipe=recipe):
        y = layer(x)
    y.float().square().mean().backward()
    cpu_layer = lowprec.Linear(256, 128, name="fc", params_dtype=torch.bfloat16)
    cpu_layer.load_state_dict({k: v.cpu() for k, v in layer.state_dict().items()})
    x_cpu = x.detach().cpu().requires_grad_()
    with lowprec.fp8_autocast(fp8_recipe=recipe):
        y_cpu = cpu_layer(x_cpu)
    y_cpu.float().square().mean().backward()
    # same FP8 operands; the GEMMs themselves may sum in a different order
    torch.testing.assert_close(y.cpu(), y_cpu, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x.grad.cpu(), x_cpu.grad, rtol=5e-2, atol=1e-3)
    torch.testing.assert_close(layer.weight.grad.cpu(), cpu_layer.weight.grad, rtol=5e-2, atol=1e-3)
