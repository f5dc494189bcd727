"""Block quantizers, by hand: element bytes and codes, per-block scales, ties, saturation, zeros, NaN and
inf, subnormals, padding to whole blocks, rowwise and columnwise copies, 2-D blocks, the Hadamard
transform, stochastic-rounding replay, and rebuilding a tensor from its saved tensors."""

from __future__ import annotations

import math

import pytest
import torch

import lowprec
from lowprec.errors import LowprecValueError
from lowprec.formats import hadamard
from lowprec.formats.elements import E2M1, E4M3, E5M2
from lowprec.formats.noise import RoundingStream
from lowprec.formats.scales import Float8BlockScaleRule, MXScaleRule, NVFP4ScaleRule
from lowprec.quant.block import BlockQuantizer, block_scaling_quantize, mxfp8_quantize
from lowprec.quant.protocol import BlockScaledTensor
from lowprec.recipe import Float8BlockScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling

NAN, INF = float("nan"), float("inf")


def mxfp8(fmt=E4M3, block=(1, 32)) -> BlockQuantizer:
    return BlockQuantizer(MXScaleRule(fmt), fmt, block, fmt)


def nvfp4(block=(1, 16), **kwargs) -> BlockQuantizer:
    return BlockQuantizer(NVFP4ScaleRule(), E2M1, block, E4M3, **kwargs)


def test_mxfp8_by_hand():
    x = torch.zeros(3, 40)  # 40 columns: the second block of each row is padded with 24 zeros
    x[0, :4] = torch.tensor([3.0, 1.0, -0.01, 1.0625 / 128])  # amax 3: scale 2**-7, values times 128
    x[0, 32:34] = torch.tensor([NAN, 2.0])  # NaN is left out of the amax (2: scale 2**-7) and stays NaN
    x[1, :4] = torch.tensor([448.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10])  # scale 1: E4M3 subnormals, step 2**-9
    x[2, :2] = torch.tensor([INF, 1.0])  # inf: the largest scale, 2**127; inf saturates, 1.0 underflows
    q = mxfp8().quantize(x).rowwise
    assert q.data.shape == (3, 64) and q.scales.dtype == torch.float8_e8m0fnu
    assert q.scales.view(torch.uint8).tolist() == [[120, 120], [127, 0], [254, 0]]  # row 1, block 2: all zero -> 2**-127
    # 384, 128; -1.28 -> -1.25; the tie 1.0625 -> 1 (even); 2**-10 ties 0 and 2**-9 -> 0; 3 * 2**-10 -> 2**-8 (even)
    assert q.data[0, :4].float().tolist() == [384.0, 128.0, -1.25, 1.0]
    assert q.data[1, :4].float().tolist() == [448.0, 2.0**-9, 0.0, 2.0**-8]
    assert q.data[0, 32].view(torch.uint8).item() == 0x7F and q.data[0, 33].item() == 256.0
    assert q.data[2, :2].float().tolist() == [448.0, 0.0]
    assert (q.data[:, 40:].float() == 0).all()  # padding stays zero
    out = q.dequantize()
    assert out.shape == (3, 40)
    assert out[0, :4].tolist() == [3.0, 1.0, -1.25 / 128, 1 / 128] and out[0, 33].item() == 2.0
    assert math.isnan(out[0, 32].item()) and out[2, 0].item() == INF  # 448 * 2**127 overflows fp32
    assert out[1, :4].tolist() == [448.0, 2.0**-9, 0.0, 2.0**-8]


def test_mxfp8_gradients_in_e5m2_and_the_recipes_quantizers():
    q = mxfp8(E5M2).quantize(torch.tensor([[57344.0, 1.125, 1.375]])).rowwise
    assert q.scales.view(torch.uint8).tolist() == [[127]]
    assert q.data.float()[0, :3].tolist() == [57344.0, 1.0, 1.5]  # 2 mantissa bits: ties to even
    hybrid = MXFP8BlockScaling(fp8_format=Format.HYBRID).quantizers("fc1")
    assert [hybrid[t].element for t in ("activation", "weight", "gradient")] == [E4M3, E4M3, E5M2]
    default = MXFP8BlockScaling().quantizers("fc1")
    assert default["gradient"].element is E4M3 and default["weight"].block == (1, 32)
    assert MXFP8BlockScaling(enable_2d_quantization=True).quantizers("fc1")["weight"].block == (32, 32)


def test_columnwise_is_the_rowwise_quantization_of_the_transpose():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 70, generator=g) * torch.exp2(torch.randint(-8, 8, (40, 70), generator=g))  # blocks of many ranges
    q = mxfp8().quantize(x, transpose=True)
    direct = mxfp8().quantize(x.t()).rowwise
    assert torch.equal(q.columnwise.data.view(torch.uint8), direct.data.view(torch.uint8))
    assert torch.equal(q.columnwise.scales.view(torch.uint8), direct.scales.view(torch.uint8))
    assert q.shape == (40, 70) and q.t().shape == (70, 40) and q.t().rowwise is q.columnwise
    assert not torch.equal(q.dequantize(), q.t().dequantize().t())  # blocks along rows or columns: other values
    assert mxfp8().quantize(x).columnwise is None


@pytest.mark.parametrize(
    "quantizer",
    [mxfp8(block=(32, 32)), BlockQuantizer(Float8BlockScaleRule(E4M3), E4M3, (128, 128), E4M3), nvfp4(block=(16, 16))],
    ids=["mxfp8-32x32", "float8-128x128", "nvfp4-16x16"],
)
def test_2d_blocks_give_both_orientations_the_same_values(quantizer):
    w = torch.randn(150, 40, generator=torch.Generator().manual_seed(1))
    q = quantizer.quantize(w, transpose=True)
    assert torch.equal(q.rowwise.data.view(torch.uint8).t(), q.columnwise.data.view(torch.uint8))
    assert torch.equal(q.dequantize(), q.t().dequantize().t())


@pytest.mark.parametrize(
    "quantizer",
    [mxfp8(block=(32, 32)), BlockQuantizer(Float8BlockScaleRule(E4M3), E4M3, (128, 128), E4M3), nvfp4(block=(16, 16))],
    ids=["mxfp8-32x32", "float8-128x128", "nvfp4-16x16"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_square_blocks_columnwise_copy_is_the_cast_of_the_transpose(quantizer, dtype):
    """Square blocks take their columnwise copy from the rowwise one: bit for bit a cast of the transpose, padding,
    NaN and infinities included."""
    w = torch.randn(150, 40, generator=torch.Generator().manual_seed(2)) * 100
    w[3, 5], w[7, 0], w[100, 39] = math.nan, math.inf, -math.inf
    w = w.to(dtype)
    columnwise, cast = quantizer.quantize(w, transpose=True).columnwise, quantizer.quantize(w.t()).rowwise
    assert torch.equal(columnwise.data.view(torch.uint8), cast.data.view(torch.uint8))
    assert torch.equal(columnwise.scales.view(torch.uint8), cast.scales.view(torch.uint8))
    assert columnwise.layout == cast.layout and columnwise.data.stride() == cast.data.stride()
    assert (columnwise.tensor_scale_inv is None) == (cast.tensor_scale_inv is None)
    if cast.tensor_scale_inv is not None:
        assert torch.equal(columnwise.tensor_scale_inv, cast.tensor_scale_inv)


def test_float8_block_scaling_by_hand():
    x = torch.zeros(2, 130)  # 1 x 128 tiles: the second tile of a row holds 2 values and 126 zeros of padding
    x[0, 0], x[1, 129] = 3.0, 1e-40
    q = BlockQuantizer(Float8BlockScaleRule(E4M3), E4M3, (1, 128), E4M3).quantize(x).rowwise
    # 448/3 -> 128; the all-zero tile scale 1; 448 / 1e-40 overflows fp32 -> fp32 max -> 2**127
    assert q.scales.tolist() == [[1 / 128, 1.0], [1.0, 2.0**-127]]
    assert q.data[0, 0].item() == 384.0 and q.data[1, 129].item() == E4M3.cast(torch.tensor(1e-40) * 2.0**127).float().item()
    fp32 = BlockQuantizer(Float8BlockScaleRule(E4M3, power_2=False), E4M3, (1, 128), E4M3).quantize(x).rowwise
    assert fp32.data[0, 0].item() == 448.0  # 3 * fp32(448 / 3) rounds to 448
    assert fp32.dequantize()[0, 0].item() == pytest.approx(3.0, rel=2**-20)
    w = torch.zeros(130, 130)
    w[0, 0], w[129, 129] = 3.0, 0.5
    tiles = BlockQuantizer(Float8BlockScaleRule(E4M3), E4M3, (128, 128), E4M3).quantize(w).rowwise
    assert tiles.data.shape == (256, 256) and tiles.scales.tolist() == [[1 / 128, 1.0], [1.0, 1 / 512]]


def test_float8_block_scaling_recipe_tiles():
    quantizers = Float8BlockScaling().quantizers("fc1")
    assert [quantizers[t].block for t in ("activation", "weight", "gradient")] == [(1, 128), (128, 128), (1, 128)]
    assert quantizers["weight"].rule.power_2
    assert not Float8BlockScaling(use_f32_scales=True).quantizers("fc1")["weight"].rule.power_2
    both_1d = Float8BlockScaling(w_block_scaling_dim=1, x_block_scaling_dim=2).quantizers("fc1")
    assert both_1d["weight"].block == (1, 128) and both_1d["activation"].block == (128, 128)


def test_nvfp4_by_hand():
    x = torch.zeros(3, 20)  # blocks of 16: the second block of each row holds 4 values and 12 zeros of padding
    x[0, 0] = 5.25  # the tensor amax: S_enc = 448 * 6 / 5.25 = 512; this block's E4M3 scale 448
    x[1, :6] = torch.tensor([3.0, 1.25, -0.375, 0.1, 2.9, 2.5])  # block amax 3: scale 256, values times 2
    x[1, 16:18] = torch.tensor([NAN, 1.0])  # a NaN: left out of the amax (1: scale e4m3(85.3) = 88); E2M1 has none: +0
    q = nvfp4().quantize(x).rowwise
    assert q.tensor_scale_inv.item() == 1 / 512 and q.data.dtype == torch.uint8 and q.data.shape == (3, 32)
    assert q.scales.view(torch.uint8).tolist() == [[0x7E, 0x00], [0x78, 0x6B], [0x00, 0x00]]
    assert q.data[1, 16:18].tolist() == [0, 7]  # 1.0 * 512 / 88 = 5.8 -> 6
    # 6; 2.5 -> 2 and 5 -> 4 (ties to even); -0.75 -> -1 (tie, even); 0.2 -> 0; 5.8 -> 6
    assert E2M1.decode(q.data[1, :6]).tolist() == [6.0, 2.0, -1.0, 0.0, 6.0, 4.0]
    assert q.data[1, :6].tolist() == [7, 4, 10, 0, 7, 6] and q.data[0, 0].item() == 7
    out = q.dequantize()
    assert out.shape == (3, 20) and out[0, 0].item() == 5.25
    assert out[1, :6].tolist() == [3.0, 1.0, -0.5, 0.0, 3.0, 2.0]
    assert out[1, 16:18].tolist() == [0.0, 6 * 88 / 512] and (out[2] == 0).all() and (out[0, 1:] == 0).all()


def test_nvfp4_recipe_quantizers_follow_transformer_engine():
    q = NVFP4BlockScaling(seed=3).quantizers("fc1")
    signs = hadamard.TE_SIGNS  # TE's fixed Hadamard signs by default
    assert q["activation"].hadamard_seed == signs and q["activation"].rounding is None and q["activation"].block == (1, 16)
    assert q["weight"].hadamard_seed is None and q["weight"].rounding is None and q["weight"].block == (16, 16)
    assert q["gradient"].hadamard_seed == signs and q["gradient"].rounding.name == "fc1.gradient"
    seeded = NVFP4BlockScaling(seed=3, rht_signs="seeded").quantizers("fc1")
    assert seeded["activation"].hadamard_seed == 3 and seeded["gradient"].hadamard_seed == 3
    with pytest.raises(LowprecValueError, match=r"rht_signs must be one of \['transformer_engine', 'seeded'\], got 'random'"):
        NVFP4BlockScaling(rht_signs="random")
    assert all(quantizer.format is E4M3 for quantizer in q.values())
    plain = NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True).quantizers("x")
    assert all(p.hadamard_seed is None and p.rounding is None and p.block == (1, 16) for p in plain.values())


def test_nvfp4_columnwise_with_hadamard_dequantizes_to_the_tensor():
    x = torch.randn(40, 24, generator=torch.Generator().manual_seed(3))  # 40 tokens: padded to 48 before the transform
    q = nvfp4(hadamard_seed=0).quantize(x, transpose=True)
    assert q.columnwise.layout.hadamard_seed == 0 and q.columnwise.data.shape == (24, 48)
    plain = nvfp4().quantize(x, transpose=True)
    for quantized in (q, plain):
        error = (quantized.t().dequantize().t() - x).norm() / x.norm()
        assert error < 0.15  # 4-bit values: a few percent


def test_stochastic_rounding_replays_a_cast_without_advancing_the_stream():
    stream = RoundingStream(seed=1, name="fc1.gradient")
    quantizer = nvfp4(rounding=stream)
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(4))
    first, second = quantizer.quantize(x, transpose=True), quantizer.quantize(x, transpose=True)
    assert (first.rounding_offset, second.rounding_offset, stream.next_offset) == (0, 1, 2)
    assert not torch.equal(first.rowwise.data, second.rowwise.data)  # fresh noise for every cast
    replay = quantizer.replaying(0).quantize(x, transpose=True)
    assert torch.equal(replay.rowwise.data, first.rowwise.data) and torch.equal(replay.columnwise.data, first.columnwise.data)
    assert stream.next_offset == 2
    deterministic = nvfp4()
    assert deterministic.replaying(None) is deterministic  # without noise a cast repeats itself
    with pytest.raises(ValueError, match="stochastic rounding is implemented for E2M1 elements only, got element format FP8E4M3"):
        BlockQuantizer(MXScaleRule(E4M3), E4M3, (1, 32), E4M3, rounding=stream)


def test_inner_tensors_rebuild_the_quantized_tensor():
    x = torch.randn(20, 36, generator=torch.Generator().manual_seed(5), dtype=torch.bfloat16)
    for q in (nvfp4(hadamard_seed=0).quantize(x, transpose=True), mxfp8().quantize(x)):
        inner = q.inner_tensors()
        assert list(inner) == [
            f"{part}_{field}" for part in ("rowwise", "columnwise") for field in ("data", "scales", "tensor_scale_inv")
        ]
        rebuilt = BlockScaledTensor.from_inner(inner, q.metadata())
        assert torch.equal(rebuilt.dequantize(), q.dequantize()) and rebuilt.dtype == torch.bfloat16
        assert rebuilt.dequantize().dtype == torch.bfloat16 and rebuilt.shape == (20, 36)
    assert repr(q) == "BlockScaledTensor(FP8E4M3, block=(1, 32), shape=(20, 36), dtype=torch.bfloat16, columnwise=False)"
    with pytest.raises(ValueError, match="needs its rowwise or its columnwise quantization; got neither"):
        BlockScaledTensor(None, None, E4M3, torch.float32)


def test_what_if_statistics_quantize_exactly_as_the_training_recipes():
    """``quant/block.py`` (LogFp8TensorStats' ``mxfp8_`` and ``fp8_block_scaling_`` statistics) casts with the
    recipes' own rules: the same bytes and scales. A NaN leaves its block's scale alone (it used to make it 2**127)."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(70, 150, generator=g) * torch.exp2(torch.randint(-10, 10, (70, 1), generator=g))
    x[3, 5] = NAN
    trained = MXFP8BlockScaling().quantizers("fc1")["activation"].quantize(x, transpose=True)
    for columnwise, part in ((False, trained.rowwise), (True, trained.columnwise)):
        what_if = mxfp8_quantize(x, E4M3, columnwise)
        assert torch.equal(what_if.data.view(torch.uint8), part.data.view(torch.uint8))
        assert torch.equal(what_if.scale_inv, part.scales.view(torch.uint8).reshape(-1).float())
    assert mxfp8_quantize(x, E4M3).scale_inv[3 * 5].item() < 254  # row 3, first block: scaled by its other values
    weight = Float8BlockScaling().quantizers("fc1")["weight"].quantize(x).rowwise
    assert torch.equal(block_scaling_quantize(x, E4M3).data.view(torch.uint8), weight.data.view(torch.uint8))
    torch.testing.assert_close(block_scaling_quantize(x, E4M3).dequantized, weight.dequantize(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("recipe", [MXFP8BlockScaling(), Float8BlockScaling(), NVFP4BlockScaling()], ids=repr)
def test_empty_tensors_quantize_to_empty_blocks(recipe):
    for quantizer in recipe.quantizers("fc1").values():
        for shape in ((5, 0), (0, 0), (0, 7)):
            q = quantizer.quantize(torch.zeros(shape), transpose=True)
            assert q.shape == shape and q.dequantize().shape == shape and q.t().dequantize().shape == shape[::-1]
            assert q.rowwise.data.numel() == q.columnwise.data.numel() == 0


def test_a_block_of_zeros_of_either_sign_gets_the_positive_zero_scale():
    """``amax`` of a block of -0.0 and +0.0 may come out as -0.0; its scale must be +0 all the same (a -0 NVFP4
    scale made every value of the block NaN)."""
    x = torch.zeros(2, 32)
    x[0, ::2] = -0.0
    x[1] = torch.linspace(-1, 1, 32)
    for recipe in (lowprec.NVFP4BlockScaling(), lowprec.MXFP8BlockScaling()):
        quantized = recipe.quantizers("fc")["activation"].quantize(x)
        assert torch.equal(quantized.dequantize()[0], torch.zeros(32)), recipe
        assert not quantized.dequantize().isnan().any(), recipe
