"""Hand-computed vectors where lowprec once differed from Transformer Engine's kernels (issue 25, part A).

Each expected number is derived by TE's rule in float64 (then rounded once, as TE's correctly rounded
fp32 operations round) and written out, so each test states its input and its bits:
1. FP8 per-tensor scale: ``fp8_max / amax`` correctly rounded (``__fdiv_rn``), not ``reciprocal(amax) * fp8_max``.
2. NaN: amaxes ignore it (``fmaxf``), per tensor and per NVFP4 block.
3. NVFP4 global decode scale: ``amax / (448 * 6)``, not ``1 / (448 * 6 / amax)``.
4. NVFP4 random Hadamard transform: TE's fixed signs, and the transformed bf16 tensor rounded to bf16.
5. FP8 block scaling: an overflowing ``448 / amax`` becomes the input dtype's largest value (bf16's for bf16).
"""

from __future__ import annotations

import torch

import lowprec
from lowprec.formats import hadamard
from lowprec.formats.elements import E4M3, E5M2
from lowprec.formats.scales import Float8BlockScaleRule, scale_from_amax
from lowprec.quant.per_tensor import CurrentScalingQuantizer, DelayedScalingQuantizer

NAN = float("nan")


def f32(bits: int) -> float:
    """The fp32 value of ``bits``."""
    return torch.tensor(bits, dtype=torch.int32).view(torch.float32).item()


def bits_of(x: torch.Tensor) -> int:
    return x.float().reshape(()).view(torch.int32).item() & 0xFFFFFFFF


def test_per_tensor_scale_is_the_correctly_rounded_quotient():
    # 448 / 903.6708984375 = 0.4957557013... -> fp32 0x3efdd3b1; reciprocal-then-multiply gave 0x3efdd3b2
    assert bits_of(scale_from_amax(torch.tensor(903.6708984375), E4M3)) == 0x3EFDD3B1
    # E5M2: 57344 / 7729.1494140625 = 7.41916... -> 0x40ed69fa (not 0x40ed69f9)
    assert bits_of(scale_from_amax(torch.tensor(7729.1494140625), E5M2)) == 0x40ED69FA
    # delayed scaling divides fp8_max * 2**-margin: 224 / 903.6708984375 -> 0x3e7dd3b1
    assert bits_of(scale_from_amax(torch.tensor(903.6708984375), E4M3, margin=1)) == 0x3E7DD3B1


def test_current_scaling_bytes_follow_the_correctly_rounded_scale():
    # 0.005909538... * 0.49575570 = 0.0029296873 lies just below the tie 1.5 * 2**-9 between the subnormals
    # 2**-9 (byte 0x01) and 2**-8 (0x02): byte 0x01; with the scale one ulp larger it reached the tie -> 0x02
    x = torch.tensor([[903.6708984375, f32(0x3BC1A4CD)]])
    q = CurrentScalingQuantizer(E4M3).quantize(x)
    assert bits_of(q.scale) == 0x3EFDD3B1
    assert q.data.view(torch.uint8).tolist() == [[0x7E, 0x01]]  # 903.67 * scale = 448.0: 0x7E


def test_a_nan_leaves_the_per_tensor_scale_of_the_other_values():
    x = torch.tensor([[NAN, 2.0, -1.0, 0.5]])  # amax 2 (NaN ignored): scale 448 / 2 = 224
    q = CurrentScalingQuantizer(E4M3).quantize(x)
    assert q.scale.item() == 224.0
    # NaN -> 0x7F; 448 -> 0x7E; -224 = -1.75 * 2**7 -> 0xF6; 112 = 1.75 * 2**6 -> 0x6E
    assert q.data.view(torch.uint8).tolist() == [[0x7F, 0x7E, 0xF6, 0x6E]]
    delayed = DelayedScalingQuantizer(E4M3, lowprec.DelayedScaling(amax_history_len=2))
    delayed.quantize(x)  # the first cast uses scale 1 and records the amax 2
    assert delayed.amax_history.tolist() == [2.0, 0.0] and delayed.scale.item() == 224.0
    delayed.record_amax(torch.tensor(NAN))  # a NaN in the history is skipped by the max, as TE's fmaxf
    assert delayed.scale.item() == 224.0


def test_a_nan_leaves_the_nvfp4_block_scale_of_the_other_values():
    x = torch.zeros(1, 16)
    x[0, :3] = torch.tensor([NAN, 6.0, 3.0])  # tensor and block amax 6: S_enc = 2688 / 6 = 448
    q = lowprec.NVFP4BlockScaling(disable_2d_quantization=True).quantizers("fc")["weight"].quantize(x).rowwise
    # 6 * (448 * fp32(1/6)) = 448.00003 -> E4M3 448 (0x7E); multiplier 1 / (448 * fp32(1/448)), about 1
    assert q.scales.view(torch.uint8).tolist() == [[0x7E]]
    assert q.data[0, :3].tolist() == [0, 7, 5]  # NaN has no E2M1 code: +0; 6 -> code 7; 3 -> code 5


def test_nvfp4_global_decode_scale_is_amax_over_2688():
    x = torch.zeros(1, 16)
    x[0, 0] = 5.0  # 5 / 2688 = 0.00186011904... -> 0x3af3cf3d; 1 / fp32(2688 / 5) gave 0x3af3cf3e
    q = lowprec.NVFP4BlockScaling(disable_2d_quantization=True).quantizers("fc")["weight"].quantize(x).rowwise
    assert bits_of(q.tensor_scale_inv) == 0x3AF3CF3D
    assert q.scales.view(torch.uint8).tolist() == [[0x7E]] and q.data[0, 0].item() == 7  # scale 448, code 6
    # the value: 6 * 448 * S_dec = 2688 * 0.0018601190531626344 = 5.0000000149 -> fp32 5.0 (old: 5.0000005)
    assert q.dequantize()[0, 0].item() == 5.0


def test_nvfp4_hadamard_uses_te_signs_and_rounds_bf16_input_to_bf16():
    identity = hadamard.transform(torch.eye(16), hadamard.TE_SIGNS)  # row i: signs[i] * H16[i] / 4
    assert (identity[:, 0] * 4).tolist() == [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]
    # one 16-token column: the wgrad (columnwise) copy goes through the transform
    tokens = torch.tensor([40, 40, -18, 20, -15, 38, -23, -6, 14, -3, -15, 15, 35, 17, 28, 40]) / 8
    quantizer = lowprec.NVFP4BlockScaling(disable_stochastic_rounding=True).quantizers("fc")["activation"]
    q = quantizer.quantize(tokens.to(torch.bfloat16).reshape(16, 1), transpose=True).columnwise
    # in float64: (tokens * signs) @ H16 / 4 = [-1.53125, -0.46875, 1.40625, -2.40625, 5.34375, -0.46875, 3.40625,
    # 1.21875, 2.65625, 3.09375, 0.84375, 2.65625, -1.21875, -1.90625, 9.09375, -1.71875]; to bf16: 9.09375 -> 9.125,
    # the amax. S_enc = 2688 / 9.125, the block scale 448, the multiplier 6 / 9.125: E2M1 values -1, -0.5, 1,
    # -1.5, 4, -0.5, 2, 1, 1.5, 2, 0.5, 1.5, -1, -1.5, 6, -1
    assert q.scales.view(torch.uint8).tolist() == [[0x7E]]
    assert q.data.tolist() == [[10, 9, 2, 11, 6, 9, 4, 2, 3, 4, 1, 3, 10, 11, 7, 10]]
    assert q.tensor_scale_inv.item() == torch.tensor(9.125 / 2688).item()
    # fp32 input is transformed in fp32: amax 9.09375, and 2.65625 * 6 / 9.09375 = 1.7526 rounds to 2 (code 4)
    fp32 = quantizer.quantize(tokens.reshape(16, 1), transpose=True).columnwise
    assert fp32.data[0, 8].item() == 4 and fp32.data[0, 11].item() == 4
    seeded = lowprec.NVFP4BlockScaling(rht_signs="seeded", seed=0).quantizers("fc")["activation"]
    assert seeded.hadamard_seed == 0 and not torch.equal(hadamard.random_signs(0, torch.device("cpu")), identity[:, 0] * 4)


def test_fp8_block_scale_overflow_takes_the_input_dtypes_max():
    amax = torch.tensor([1e-37]).to(torch.bfloat16)  # 9.9917e-38: 448 / amax overflows fp32
    scales = Float8BlockScaleRule(E4M3, power_2=False).scales(amax.float(), torch.bfloat16)
    assert bits_of(scales.multiplier) == 0x7F7F0000  # bf16's max, 3.3895e38 (fp32 input: fp32's, 0x7f7fffff)
    assert bits_of(scales.stored) == 0x00202020  # its fp32 reciprocal, 2.9503e-39
    assert bits_of(Float8BlockScaleRule(E4M3, power_2=False).scales(amax.float()).multiplier) == 0x7F7FFFFF
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    x[0, 0] = amax[0]
    q = lowprec.Float8BlockScaling(use_f32_scales=True).quantizers("fc")["activation"].quantize(x).rowwise
    assert bits_of(q.scales) == 0x00202020
    assert q.data.view(torch.uint8)[0, 0].item() == 0x60  # 9.9917e-38 * 3.3895e38 = 33.87 -> E4M3 32
    assert q.dequantize()[0, 0].item() == 32 * f32(0x00202020)
