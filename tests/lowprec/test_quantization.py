"""Scales, quantized tensors, current and delayed scaling."""

from __future__ import annotations

import math

import pytest
import torch

from lowprec.formats import E4M3, E5M2
from lowprec.quantization import (
    FP32_MAX,
    CurrentScalingQuantizer,
    DelayedScalingQuantizer,
    amax_of,
    quantize_with_scale,
    scale_from_amax,
)
from lowprec.recipe import DelayedScaling


def test_scale_from_amax():
    assert scale_from_amax(torch.tensor(2.0), E4M3).item() == 224.0
    assert scale_from_amax(torch.tensor(2.0), E4M3, margin=2).item() == 56.0
    for bad in (0.0, float("inf"), float("nan")):
        assert scale_from_amax(torch.tensor(bad), E4M3).item() == 1.0
        assert scale_from_amax(torch.tensor(bad), E4M3, fallback=torch.tensor(7.0)).item() == 7.0
    assert scale_from_amax(torch.tensor(1e-45), E5M2).item() == FP32_MAX  # 57344 / 1e-45 overflows


def test_quantize_and_dequantize_by_hand():
    x = torch.tensor([[0.5, -3.0], [100.0, 1e-3]])
    q = quantize_with_scale(x, torch.tensor(2.0), E4M3)
    assert q.data.dtype == torch.float8_e4m3fn and q.scale_inv.item() == 0.5
    assert q.data.float().tolist() == [[1.0, -6.0], [200.0 - 8.0, 0.001953125]]  # 200 rounds to 192; 2e-3 to 2^-9
    assert torch.equal(q.dequantize(), q.data.float() * 0.5)
    assert q.t().shape == (2, 2) and torch.equal(q.t().data.float(), q.data.float().t())
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16


def test_current_scaling_uses_the_tensors_amax():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 5
    quantizer = CurrentScalingQuantizer(E4M3)
    q = quantizer.quantize(x)
    amax = x.abs().max()
    assert q.scale_inv.item() == pytest.approx((amax / 448.0).item(), rel=1e-6)
    assert q.data.float().abs().max().item() == 448.0
    subnormal_step = (amax / 448.0).item() * 2**-9  # below 2**-6 E4M3 has fixed steps of 2**-9
    assert torch.allclose(q.dequantize(), x, rtol=2**-4, atol=subnormal_step / 2)  # 3 mantissa bits: half a step
    assert CurrentScalingQuantizer(E4M3, margin=1).quantize(x).data.float().abs().max().item() == 224.0


def test_amax_of_empty_and_nan():
    assert amax_of(torch.empty(0)).item() == 0.0
    assert math.isnan(amax_of(torch.tensor([1.0, float("nan")])).item())


def test_delayed_scaling_first_cast_uses_scale_one_then_history():
    quantizer = DelayedScalingQuantizer(E4M3, DelayedScaling(amax_history_len=3))
    casts = [torch.full((4,), v) for v in (2.0, 8.0, 1.0, 0.5, 0.25)]
    scales = []
    for x in casts:
        q = quantizer.quantize(x)
        scales.append(1.0 / q.scale_inv.item())
    # scale of cast i comes from the max amax of the (up to 3) casts before it
    assert scales == pytest.approx([1.0, 448.0 / 2.0, 448.0 / 8.0, 448.0 / 8.0, 448.0 / 8.0], rel=1e-6)
    assert quantizer.amax_history.tolist() == [0.25, 0.5, 1.0]
    assert quantizer.scale.item() == 448.0 / 1.0


def test_delayed_scaling_most_recent_and_margin():
    quantizer = DelayedScalingQuantizer(E5M2, DelayedScaling(margin=1, amax_compute_algo="most_recent"))
    for v in (4.0, 1.0):
        quantizer.quantize(torch.full((2,), v))
    assert quantizer.scale.item() == 57344.0 / 1.0 / 2


def test_delayed_scaling_keeps_the_scale_for_zero_or_nan_amax():
    quantizer = DelayedScalingQuantizer(E4M3, DelayedScaling(amax_history_len=1))
    quantizer.quantize(torch.full((2,), 4.0))
    quantizer.quantize(torch.zeros(2))
    assert quantizer.scale.item() == 112.0
    quantizer.quantize(torch.tensor([float("nan")]))
    assert quantizer.scale.item() == 112.0


def test_delayed_scaling_overflow_saturates():
    quantizer = DelayedScalingQuantizer(E4M3, DelayedScaling())
    quantizer.quantize(torch.full((2,), 1.0))  # next scale 448
    q = quantizer.quantize(torch.tensor([3.0, 0.5]))  # 3 * 448 is beyond E4M3
    assert q.dequantize().tolist() == [1.0, 0.5]
