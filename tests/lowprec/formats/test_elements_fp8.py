"""FP8 formats: limits, saturating round-to-nearest-even casts, overflow counts."""

from __future__ import annotations

import math

import pytest
import torch

from lowprec.formats.elements import E2M1, E3M2, E4M3, E5M2, fp8_format


def test_limits_and_lookup():
    assert (E4M3.max, E4M3.dtype) == (448.0, torch.float8_e4m3fn)
    assert (E5M2.max, E5M2.dtype) == (57344.0, torch.float8_e5m2)
    assert fp8_format("FP8E5M2") is E5M2
    with pytest.raises(ValueError, match=r"unknown FP8 format 'FP8E3M4'.*'FP8E4M3', 'FP8E5M2'"):
        fp8_format("FP8E3M4")


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_cast_saturates_and_keeps_nan(fmt):
    x = torch.tensor([1e9, -1e9, float("inf"), float("-inf"), float("nan"), 1.0])
    out = fmt.cast(x).float()
    assert out[:4].tolist() == [fmt.max, -fmt.max, fmt.max, -fmt.max]
    assert math.isnan(out[4].item()) and out[5].item() == 1.0
    assert fmt.count_overflows(x).item() == 4


def test_round_to_nearest_even():
    # E4M3 has 3 mantissa bits: between 1 and 2 the step is 1/8
    x = torch.tensor([1.0625, 1.1875, 1.0624, 17.0, 19.0])  # 1 + 1/16 is a tie -> 1; 1 + 3/16 -> 1.25; 17 -> 16; 19 -> 20
    assert E4M3.cast(x).float().tolist() == [1.0, 1.25, 1.0, 16.0, 20.0]
    # E5M2 has 2 mantissa bits: between 1 and 2 the step is 1/4
    assert E5M2.cast(torch.tensor([1.125, 1.375])).float().tolist() == [1.0, 1.5]


def test_cast_accepts_low_precision_inputs():
    x = torch.tensor([500.0, 2.0], dtype=torch.bfloat16)
    assert E4M3.cast(x).float().tolist() == [448.0, 2.0]


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1, E3M2], ids=lambda fmt: fmt.name)
def test_a_cast_leaves_its_input_alone_unless_told_it_may_overwrite_it(fmt):
    x = torch.tensor([1e9, -1e9, float("nan"), 0.3])
    kept = x.clone()
    codes = fmt.cast(x)
    assert torch.equal(x.isnan(), kept.isnan()) and torch.equal(x.nan_to_num(), kept.nan_to_num())
    assert torch.equal(fmt.cast(x.clone(), overwrite=True).view(torch.uint8), codes.view(torch.uint8))
