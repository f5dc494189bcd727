"""``lowprec.quantize``: codes and scales decode, by the formats' definitions, to what ``dequantize`` returns."""

import pytest
import torch

import lowprec

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def sample(rows: int = 48, cols: int = 96, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.logspace(-4, 4, cols)


def expand(scales: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """One scale per block -> one per element of ``shape``."""
    height, width = block
    return scales.repeat_interleave(height, 0).repeat_interleave(width, 1)[: shape[0], : shape[1]]


def test_mxfp8_codes_are_e4m3_bytes_and_scales_e8m0_bytes():
    x = sample()
    q = lowprec.quantize(x, lowprec.MXFP8BlockScaling(), tensor_name="activation")
    for part, values in ((q.rowwise, q.dequantize()), (q.columnwise, q.dequantize().t())):
        assert part.codes.dtype == torch.uint8 and part.scale_inv.dtype == torch.uint8 and part.block == (1, 32)
        elements = part.codes.view(torch.float8_e4m3fn).float()
        scale = torch.exp2(part.scale_inv.double() - 127).float()  # E8M0: 2**(byte - 127)
        assert torch.equal(elements * expand(scale, part.block, tuple(part.codes.shape)), values) is (part is q.rowwise)
    # the columnwise orientation is the rowwise cast of the transpose (one rule, blocks along its rows)
    of_transpose = lowprec.quantize(x.t().contiguous(), lowprec.MXFP8BlockScaling())
    assert torch.equal(q.columnwise.codes, of_transpose.rowwise.codes)
    assert torch.equal(q.columnwise.scale_inv, of_transpose.rowwise.scale_inv)
    assert q.rowwise.global_scale_inv is None


def test_nvfp4_codes_scales_and_global_scale_give_the_values():
    x = sample(seed=1)
    q = lowprec.quantize(x, lowprec.NVFP4BlockScaling(), tensor_name="weight")
    part = q.rowwise
    assert part.block == (16, 16) and tuple(part.codes.shape) == (48, 96) and tuple(part.scale_inv.shape) == (3, 6)
    assert int(part.codes.max()) <= 15 and part.scale_inv.dtype == torch.uint8
    block_scale = expand(part.scale_inv.view(torch.float8_e4m3fn).float(), part.block, (48, 96))
    decoded = E2M1_VALUES[part.codes.long()] * block_scale * part.global_scale_inv  # e2m1 * scale * S_dec, in that order
    assert torch.equal(decoded, q.dequantize())
    # the global decode scale is amax / (448 * 6), as NVFP4 defines it (fp32)
    assert torch.equal(part.global_scale_inv, torch.div(x.abs().amax(), torch.tensor(448.0 * 6.0)))
    assert (q.dequantize() - x).abs().max() > 0  # 4 bits lose something


@pytest.mark.parametrize("recipe", [lowprec.Float8CurrentScaling(), lowprec.DelayedScaling()], ids=["current", "delayed"])
def test_per_tensor_casts_use_the_tensors_amax(recipe):
    x = sample(seed=2).to(torch.bfloat16)
    q = lowprec.quantize(x, recipe, tensor_name="gradient")  # HYBRID: gradients in E5M2
    scale = torch.tensor(57344.0) / x.float().abs().amax()
    assert torch.equal(q.rowwise.scale_inv, scale.reciprocal()) and q.rowwise.block is None
    assert torch.equal(q.rowwise.codes.view(torch.float8_e5m2).float() * q.rowwise.scale_inv, q.dequantize())
    assert torch.equal(q.columnwise.codes, q.rowwise.codes.t()) and q.dequantize(torch.bfloat16).dtype == torch.bfloat16


def test_more_dimensions_are_read_as_a_gemm_reads_them():
    x = sample(seed=3).reshape(4, 12, 96)
    q = lowprec.quantize(x, lowprec.Float8BlockScaling())
    assert tuple(q.rowwise.codes.shape) == (48, 96) and q.dequantize().shape == x.shape
    assert q.rowwise.scale_inv.dtype == torch.float32 and q.rowwise.block == (1, 128)


def test_bad_arguments_name_what_is_allowed():
    with pytest.raises(ValueError, match="tensor_name must be one of 'activation', 'weight', 'gradient'; got 'output'"):
        lowprec.quantize(sample(), lowprec.MXFP8BlockScaling(), tensor_name="output")
    with pytest.raises(TypeError, match="recipe must be one of lowprec.DelayedScaling, .*; got str"):
        lowprec.quantize(sample(), "mxfp8")
    with pytest.raises(TypeError, match="tensor must be a floating-point torch.Tensor"):
        lowprec.quantize(torch.arange(4), lowprec.MXFP8BlockScaling())
