"""The GEMM entry point: emulated FP8 equals the matmul of dequantized operands; mixed operands run in
high precision; torch._scaled_mm stays within the stated accumulation bound of the emulation on a GPU."""

from __future__ import annotations

import pytest
import torch

import lowprec
from lowprec.formats.elements import E4M3, E5M2
from lowprec.gemm import ACCUMULATION_BOUND, emulated_fp8_gemm, gemm, gemm_and_probe, scaled_mm_unsupported
from lowprec.quant.per_tensor import CurrentScalingQuantizer
from lowprec.quant.protocol import Float8Tensor

HAS_FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def operands(m=32, k=64, n=48, device="cpu"):
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(m, k, generator=g) * 3).to(device)
    b = (torch.randn(k, n, generator=g) * 0.1).to(device)
    return CurrentScalingQuantizer(E4M3).quantize(a), CurrentScalingQuantizer(E4M3).quantize(b)


def test_emulated_fp8_gemm_equals_matmul_of_dequantized_operands():
    qa, qb = operands()
    expected = qa.dequantize(torch.float64) @ qb.dequantize(torch.float64)
    got = gemm(qa, qb, torch.float32)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(got, emulated_fp8_gemm(qa, qb, torch.float32))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_c_epilogue_equals_torchs_and_checks_the_result(out_dtype, with_bias):
    """On a CPU the emulated FP8 GEMM scales its product (and adds an fp32 bias) in the C kernel: bit for bit torch's
    multiply and add, with the result's non-finite probe from the same pass; in kernel mode "emulated" torch's ops,
    and no probe. A bias of another dtype than the output's is added by torch (no probe)."""
    qa, qb = operands()
    bias = torch.randn(48) if with_bias else None
    previous = lowprec.kernels.set_kernel_mode("emulated")
    try:
        expected, none = gemm_and_probe(qa, qb, out_dtype, bias)
    finally:
        lowprec.kernels.set_kernel_mode(previous)
    got, probe = gemm_and_probe(qa, qb, out_dtype, bias)
    assert none is None and torch.equal(got, expected) and got.dtype == out_dtype
    fused = bias is None or out_dtype == torch.float32
    assert (probe is not None) == fused
    if fused:
        assert probe.shape == () and probe.item() == 0
        if bias is not None:
            bias[7] = float("inf")
            result, probe = gemm_and_probe(qa, qb, out_dtype, bias)
            assert torch.isinf(result[:, 7]).all() and probe.isnan()


@pytest.mark.parametrize(
    ("out_dtype", "finite", "overflowing"),
    [
        (torch.float16, (65504.0, 65519.0), (65520.0,)),  # 65519 rounds down to the largest value; 65520 is a tie: inf
        (torch.bfloat16, (float.fromhex("0x1.fep127"), float.fromhex("0x1.fefffep127")), (float.fromhex("0x1.ffp127"),)),
        (torch.float32, (float.fromhex("0x1.fffffep127"),), (2.0**129,)),
    ],
)
def test_the_probe_is_nan_exactly_when_the_result_overflows_its_dtype(out_dtype, finite, overflowing):
    """Each output is 16 products of ones times the scale: the value asked for. The probe is NaN exactly when that value
    is no longer finite in the output dtype (rounded to it as torch converts), however finite in the fp32 product."""
    ones = Float8Tensor(torch.ones(16, 16).to(torch.float8_e4m3fn), torch.tensor(1.0), E4M3, torch.float32)
    for value in (*finite, *overflowing):
        a = Float8Tensor(ones.data, torch.tensor(value / 16, dtype=torch.float32), E4M3, torch.float32)
        result, probe = gemm_and_probe(a, ones, out_dtype)
        assert bool(probe.isnan()) == (value in overflowing) == (not torch.isfinite(result).all()), (out_dtype, value)


def test_transposed_operands():
    qa, qb = operands(m=16, k=16, n=16)
    assert torch.allclose(gemm(qa.t(), qb.t(), torch.float32), qa.dequantize().t() @ qb.dequantize().t(), rtol=1e-5, atol=1e-6)


def test_output_dtype():
    qa, qb = operands()
    assert gemm(qa, qb, torch.bfloat16).dtype == torch.bfloat16


def test_one_fp8_operand_runs_in_high_precision():
    qa, _ = operands()
    b = torch.randn(64, 8)
    assert torch.allclose(gemm(qa, b, torch.float32), qa.dequantize() @ b)
    assert torch.allclose(gemm(b.t(), qa.t(), torch.float32), b.t() @ qa.dequantize().t())


def test_high_precision_operands():
    a, b = torch.randn(4, 5, dtype=torch.bfloat16), torch.randn(5, 3, dtype=torch.bfloat16)
    assert torch.equal(gemm(a, b, torch.bfloat16), a @ b)


def test_scaled_mm_reasons():
    qa, qb = operands()
    assert scaled_mm_unsupported(qa, qb) == "not a CUDA device"


def test_accumulation_bound_is_tight_enough_to_catch_a_wrong_scale():
    """The bound the GPU test checks: an error of one scale's rounding already breaks it."""
    qa, qb = operands(m=64, k=128, n=96)
    emulated = emulated_fp8_gemm(qa, qb, torch.float32)
    wrong = Float8Tensor(qb.data, qb.scale_inv * (1 + 2**-9), E4M3, torch.float32)
    assert within_accumulation_bound(emulated, qa, qb, emulated)
    assert not within_accumulation_bound(emulated_fp8_gemm(qa, wrong, torch.float32), qa, qb, emulated)


def within_accumulation_bound(result: torch.Tensor, qa: Float8Tensor, qb: Float8Tensor, emulated: torch.Tensor) -> bool:
    """|result - emulated| <= ACCUMULATION_BOUND * (|qa| @ |qb|) * scale_inv_a * scale_inv_b, elementwise
    (the README's statement of what torch._scaled_mm computes on Hopper)."""
    magnitude = (qa.data.float().abs().cpu() @ qb.data.float().abs().cpu()) * (qa.scale_inv * qb.scale_inv).cpu()
    return bool(((result.cpu() - emulated.cpu()).abs() <= ACCUMULATION_BOUND * magnitude).all())


@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs a CUDA GPU with FP8 tensor cores (compute capability 8.9+)")
@pytest.mark.parametrize("k", [128, 4096])
def test_scaled_mm_is_within_the_accumulation_bound_of_the_emulation_on_gpu(k):
    qa, qb = operands(m=64, k=k, n=96, device="cuda")
    assert scaled_mm_unsupported(qa, qb) is None
    hardware = gemm(qa, qb, torch.float32)
    emulated = emulated_fp8_gemm(qa, qb, torch.float32)
    assert within_accumulation_bound(hardware, qa, qb, emulated)
    # odd shapes fall back to the emulation
    qc, qd = operands(m=5, k=24, n=7, device="cuda")
    assert "multiples of 16" in scaled_mm_unsupported(qc, qd)
    e5 = Float8Tensor(qa.data.to(torch.float8_e5m2), qa.scale_inv, E5M2, torch.float32)
    f5 = Float8Tensor(qb.data.to(torch.float8_e5m2), qb.scale_inv, E5M2, torch.float32)
    assert "E5M2 x E5M2" in scaled_mm_unsupported(e5, f5)
