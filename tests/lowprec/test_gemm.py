"""The GEMM entry point: emulated FP8 equals the matmul of dequantized operands; mixed operands run in
high precision; torch._scaled_mm stays within the stated accumulation bound of the emulation on a GPU."""

from __future__ import annotations

import pytest
import torch

from lowprec.formats.elements import E4M3, E5M2
from lowprec.gemm import ACCUMULATION_BOUND, emulated_fp8_gemm, gemm, scaled_mm_unsupported
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
