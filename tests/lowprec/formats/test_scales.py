"""Scale rules, by hand: the per-tensor scale from an amax; of the block formats MXFP8's E8M0 exponents,
FP8 block scaling's fp32 scales, NVFP4's two levels; zeros, infinities, tiny amaxes and NaN blocks."""

from __future__ import annotations

import pytest
import torch

from lowprec.formats.elements import E4M3, E5M2
from lowprec.formats.scales import FP32_MAX, Float8BlockScaleRule, MXScaleRule, NVFP4ScaleRule, scale_from_amax

INF = float("inf")


def mx(amax: list[float], fmt=E4M3):
    scales = MXScaleRule(fmt).scales(torch.tensor(amax))
    return scales.stored.view(torch.uint8).tolist(), scales.multiplier.tolist()


def test_mxfp8_rounds_the_exponent_up_so_no_value_saturates():
    # 448 -> 2**0; just above 448 -> 2**1; 3 -> 3/448 = 2**-7.2 -> 2**-7; 1 -> 2**-8.8 -> 2**-8
    stored, multiplier = mx([448.0, 449.0, 3.0, 1.0])
    assert stored == [127, 128, 120, 119]
    assert multiplier == [1.0, 0.5, 128.0, 256.0]
    assert mx([57344.0, 1.0], E5M2)[0] == [127, 112]  # E5M2: 1 / 57344 = 2**-15.8 -> 2**-15


def test_mxfp8_zero_infinite_and_tiny_blocks():
    stored, multiplier = mx([0.0, INF, 1e-40])
    assert stored == [0, 254, 0]  # zero: the smallest scale 2**-127; inf: the largest finite, 2**127; tiny: clamped
    assert multiplier == [2.0**127, 2.0**-127, 2.0**127]
    assert torch.tensor([0, 254], dtype=torch.uint8).view(torch.float8_e8m0fnu).float().tolist() == [2.0**-127, 2.0**127]


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(x))`` exactly, for positive finite x, by ``frexp`` (x = m * 2**e with m in [0.5, 1)): a reference
    independent of the rule's bit arithmetic."""
    mantissa, exponent = torch.frexp(x)
    return torch.where(mantissa == 0.5, exponent - 1, exponent)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("binade", [0, -20, -126])
def test_mxfp8_rule_equals_ceil_log2_of_amax_over_fp8_max(fmt, binade):
    """Transformer Engine multiplies by fp32(1 / fp8_max) where the what-if statistics used to divide. The
    two quotients differ by an ulp or two at most, which can change the exponent only next to a power of
    two, where amax is next to fp8_max * 2**k: there all 2**17 neighbouring amaxes agree."""
    boundary = torch.tensor(fmt.max * 2.0**binade).view(torch.int32)
    amax = (boundary + torch.arange(-(2**16), 2**16, dtype=torch.int32)).view(torch.float32)
    stored = MXScaleRule(fmt).scales(amax).stored.view(torch.uint8).long()
    assert torch.equal(stored, ceil_log2(amax / fmt.max) + 127)


def test_float8_block_scales_power_of_two_and_fp32():
    amax = torch.tensor([3.0, 0.5, 0.0, INF, 1e-40])
    pow2 = Float8BlockScaleRule(E4M3).scales(amax)
    # 448/3 = 149.3 -> 128; 448/0.5 = 896 -> 512; zero and inf -> 1; 448/1e-40 overflows -> fp32 max -> 2**127
    assert pow2.multiplier.tolist() == [128.0, 512.0, 1.0, 1.0, 2.0**127]
    assert pow2.stored.tolist() == [1 / 128, 1 / 512, 1.0, 1.0, 2.0**-127]
    fp32 = Float8BlockScaleRule(E4M3, power_2=False).scales(amax)
    expected = torch.tensor([448.0]) / torch.tensor([3.0])
    assert fp32.multiplier[0] == expected[0] and fp32.multiplier[1] == 896.0
    assert fp32.multiplier[4].item() == FP32_MAX and fp32.stored[0] == expected.reciprocal()[0]


def test_nvfp4_two_level_scales():
    # tensor amax 5.25: S_enc = 448 * 6 / 5.25 = 512, S_dec = 1/512
    # block amax 5.25: 5.25 * 512 / 6 = 448 -> E4M3 448 (0x7E); 3.0 -> 256 (0x78); 0 -> 0
    scales = NVFP4ScaleRule().scales(torch.tensor([5.25, 3.0, 0.0]))
    assert scales.tensor_scale_inv.item() == 1 / 512
    assert scales.stored.view(torch.uint8).tolist() == [0x7E, 0x78, 0x00]
    # each block is multiplied by 1 / (scale * S_dec): 512/448, 2, and fp32 max for the zero block
    assert scales.multiplier.tolist() == [torch.tensor(512 / 448).item(), 2.0, FP32_MAX]


def test_nvfp4_degenerate_tensors_follow_transformer_engines_kernels():
    """All zero: S_enc = 1 (the kernels' rule; TE's Python reference gives fp32 max) and S_dec = 0 / 2688 = 0.
    An infinite amax: 2688 / inf = 0, so S_enc = 1, S_dec = inf / 2688 = inf; the block's scale saturates at 448."""
    zero = NVFP4ScaleRule().scales(torch.tensor([0.0, 0.0]))
    assert zero.tensor_scale_inv.item() == 0.0 and zero.stored.float().tolist() == [0.0, 0.0]
    assert zero.multiplier.tolist() == [FP32_MAX, FP32_MAX]
    infinite = NVFP4ScaleRule().scales(torch.tensor([INF, 1.0]))
    assert infinite.tensor_scale_inv.item() == INF and infinite.stored.float().tolist()[0] == 448.0
    assert infinite.multiplier[0].item() == torch.tensor(1 / 448).item()  # 1 / (448 * (1 / S_enc)) in fp32


def test_scale_from_amax():
    assert scale_from_amax(torch.tensor(2.0), E4M3).item() == 224.0
    assert scale_from_amax(torch.tensor(2.0), E4M3, margin=2).item() == 56.0
    for bad in (0.0, float("inf"), float("nan")):
        assert scale_from_amax(torch.tensor(bad), E4M3).item() == 1.0
        assert scale_from_amax(torch.tensor(bad), E4M3, fallback=torch.tensor(7.0)).item() == 7.0
    assert scale_from_amax(torch.tensor(1e-45), E5M2).item() == FP32_MAX  # 57344 / 1e-45 overflows
