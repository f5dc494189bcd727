"""``lowprec.quantize``: codes and scales decode, by the formats' definitions, to what ``dequantize`` returns."""

import pytest
import torch

import lowprec
from lowprec.study import QuantizedView

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
    with pytest.raises(TypeError, match="layer_name must be a str; got 3"):
        lowprec.quantize(sample(), lowprec.NVFP4BlockScaling(), "gradient", layer_name=3)


# --- scales as numbers, both orientations, the Hadamard domain, reproducible noise, scale bytes, NaN blocks ---


def test_per_tensor_casts_give_the_scale_itself():
    x = sample(seed=4)
    for recipe, fmt in ((lowprec.Float8CurrentScaling(), torch.float8_e4m3fn), (lowprec.DelayedScaling(), torch.float8_e4m3fn)):
        q = lowprec.quantize(x, recipe, tensor_name="weight")
        expected = torch.tensor(448.0 / x.double().abs().max().item()).float()  # fp64 then fp32: correctly rounded
        for part in (q.rowwise, q.columnwise):
            assert torch.equal(part.scale, expected) and torch.equal(part.scale_inv, expected.reciprocal())
            assert part.global_amax is None and part.global_scale is None and part.hadamard_signs is None
        assert torch.equal(q.rowwise.codes, (x * expected).to(fmt).view(torch.uint8))  # torch's own FP8 cast
    block = lowprec.quantize(x, lowprec.MXFP8BlockScaling())
    assert block.rowwise.scale is None and block.columnwise.scale is None


def test_nvfp4_gives_the_global_amax_and_encode_scale():
    x = sample(seed=5)
    q = lowprec.quantize(x, lowprec.NVFP4BlockScaling(), tensor_name="weight")  # 16 x 16 blocks, no transform
    amax = x.double().abs().max().item()
    for part in (q.rowwise, q.columnwise):
        assert part.global_amax.item() == amax
        assert part.global_scale.item() == torch.tensor(448.0 * 6.0 / amax).float().item()  # S_enc
        assert part.global_scale_inv.item() == torch.tensor(amax / (448.0 * 6.0)).float().item()  # S_dec
    # the block scales are e4m3(block_amax * S_enc / 6), in fp32 as the kernels compute them
    block_amax = x.abs().reshape(3, 16, 6, 16).amax(dim=(1, 3))
    expected = (block_amax * (q.rowwise.global_scale * (1.0 / 6.0))).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(q.rowwise.scale_inv, expected)


def test_columnwise_dequantize_is_the_columnwise_cast_in_the_inputs_shape():
    x = sample(seed=6).reshape(2, 24, 96)
    for recipe in (lowprec.MXFP8BlockScaling(), lowprec.Float8BlockScaling(), lowprec.NVFP4BlockScaling(disable_rht=True)):
        q = lowprec.quantize(x, recipe)
        columnwise = q.dequantize(orientation="columnwise")
        assert columnwise.shape == x.shape and torch.equal(columnwise.reshape(48, 96).t(), q.columnwise.values())
        assert torch.equal(q.dequantize(orientation="rowwise"), q.dequantize()) and not torch.equal(columnwise, q.dequantize())
        # the columnwise cast is the rowwise cast of the transpose, transposed back
        of_transpose = lowprec.quantize(x.reshape(48, 96).t(), recipe)
        assert torch.equal(columnwise.reshape(48, 96), of_transpose.dequantize().t())
    per_tensor = lowprec.quantize(x, lowprec.Float8CurrentScaling())  # one scale: both orientations hold the same values
    assert torch.equal(per_tensor.dequantize(torch.bfloat16, "columnwise"), per_tensor.dequantize(torch.bfloat16))
    with pytest.raises(ValueError, match="orientation must be one of 'rowwise', 'columnwise' or None; got 'cols'"):
        q.dequantize(orientation="cols")


def close(got: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float = 1e-6) -> bool:
    """Within fp32 rounding (``torch.testing.assert_close`` costs 2 s of imports at its first call)."""
    return bool(((got - expected).abs() <= atol + rtol * expected.abs()).all())


@pytest.mark.parametrize("rows", [48, 40])  # 40: the transform's last chunk of each columnwise row spreads over padding
def test_nvfp4_wgrad_operands_expose_their_hadamard_domain(rows):
    from hadamardref import sylvester_hadamard

    from lowprec.formats.hadamard import TE_SIGN_VECTOR
    from lowprec.study import decode_e2m1, decode_e4m3

    x = sample(rows=rows, seed=7)
    q = lowprec.quantize(x, lowprec.NVFP4BlockScaling(), tensor_name="activation")
    assert q.rowwise.hadamard_signs is None and q.rowwise.transformed_input is None
    part = q.columnwise
    assert part.hadamard_signs == "transformer_engine"
    # the cast read x^T with every 16-element chunk of a row times diag(signs) H16 / 4 (float64, by matrix product)
    t = torch.diag(torch.tensor(TE_SIGN_VECTOR, dtype=torch.float64)) @ sylvester_hadamard().double() / 4
    padded = torch.nn.functional.pad(x.double().t(), (0, -rows % 16))
    reference = (padded.reshape(96, -1, 16) @ t).reshape(96, -1)
    assert close(part.transformed_input.double(), reference[:, :rows], atol=1e-6 * x.abs().max().item())
    assert part.global_amax.item() == pytest.approx(reference.abs().max().item(), rel=1e-6)  # padding included
    # values(): codes x block scales x S_dec, in the transformed domain
    scales = expand(decode_e4m3(part.scale_inv), part.block, tuple(part.codes.shape))
    assert torch.equal(decode_e2m1(part.codes) * scales * part.global_scale_inv, part.values())
    error = (part.values() - part.transformed_input).norm() / part.transformed_input.norm()
    assert 0.05 < error < 0.2  # 4 bits
    if rows % 16 == 0:  # then the inverse transform (T is orthogonal) of values() is what dequantize gives
        back = (part.values().double().reshape(96, -1, 16) @ t.t()).reshape(96, rows)
        atol = 1e-6 * back.abs().max().item()  # fp32 butterflies against a float64 product, on values spanning 8 decades
        assert close(q.dequantize(orientation="columnwise").t().double(), back, atol=atol)
    seeded = lowprec.quantize(x, lowprec.NVFP4BlockScaling(rht_signs="seeded", seed=5), tensor_name="gradient")
    assert seeded.columnwise.hadamard_signs == 5 and seeded.rowwise.hadamard_signs is None
    assert lowprec.quantize(x, lowprec.NVFP4BlockScaling(), tensor_name="weight").columnwise.hadamard_signs is None


def test_quantize_reproduces_a_layers_stochastically_rounded_gradient(monkeypatch):
    """A Linear named "model.proj" trains 2 steps under NVFP4 (stochastic rounding on); the gradient it cast in
    step 2's backward is ``quantize(dy, recipe, "gradient", layer_name="model.proj", cast_index=1)``, bit for bit."""
    from lowprec.quant.block import BlockQuantizer

    casts = []
    original = BlockQuantizer.quantize

    def recording(self, tensor, transpose=False):
        out = original(self, tensor, transpose)
        if self.rounding is not None:  # the gradient quantizer
            casts.append((self.rounding.name, tensor.detach().clone(), out))
        return out

    monkeypatch.setattr(BlockQuantizer, "quantize", recording)
    torch.manual_seed(0)
    recipe = lowprec.NVFP4BlockScaling()
    layer = lowprec.Linear(64, 32, name="model.proj")
    for _ in range(2):
        with lowprec.autocast(recipe=recipe):
            loss = layer(torch.randn(48, 64)).square().mean()
        loss.backward()
        with torch.no_grad():  # an SGD step by hand (torch.optim's first optimizer costs seconds of imports)
            for parameter in layer.parameters():
                parameter -= 0.1 * parameter.grad
                parameter.grad = None
    assert [name for name, _, _ in casts] == ["model.proj.gradient"] * 2
    _, dy, made = casts[1]
    trained = QuantizedView(made, dy.shape)
    q = lowprec.quantize(dy, recipe, "gradient", layer_name="model.proj", cast_index=1)
    for orientation in ("rowwise", "columnwise"):
        assert torch.equal(getattr(q, orientation).codes, getattr(trained, orientation).codes)
        assert torch.equal(getattr(q, orientation).scale_inv, getattr(trained, orientation).scale_inv)
    # the noise is the layer's cast 1: another cast number or layer name rounds otherwise
    for other in ({"layer_name": "model.proj", "cast_index": 0}, {"cast_index": 1}):
        assert not torch.equal(lowprec.quantize(dy, recipe, "gradient", **other).rowwise.codes, trained.rowwise.codes)
    # deterministic casts ignore the noise arguments
    plain = lowprec.quantize(dy, recipe, "activation", layer_name="model.proj", cast_index=7)
    assert torch.equal(plain.rowwise.codes, lowprec.quantize(dy, recipe, "activation").rowwise.codes)
    with pytest.raises(ValueError, match="cast_index must be a non-negative integer; got -1"):
        lowprec.quantize(dy, recipe, "gradient", cast_index=-1)


def test_scale_byte_decoders_match_torchs_float8_dtypes():
    from lowprec.study import decode_e2m1, decode_e4m3, decode_e8m0

    every = torch.arange(256, dtype=torch.uint8)
    e8m0 = decode_e8m0(every)
    assert torch.equal(e8m0[:255], every[:255].view(torch.float8_e8m0fnu).float()) and e8m0[255].isnan()
    assert e8m0[127] == 1.0 and e8m0[0] == 2.0**-127 and e8m0[254] == 2.0**127
    e4m3 = decode_e4m3(every)
    reference = every.view(torch.float8_e4m3fn).float()
    assert torch.equal(e4m3.isnan(), reference.isnan()) and e4m3.isnan().sum() == 2  # 0x7F, 0xFF
    finite = ~reference.isnan()
    assert torch.equal(e4m3[finite], reference[finite]) and torch.equal(e4m3.signbit()[finite], reference.signbit()[finite])
    assert e4m3[0x7E] == 448.0 and e4m3[1] == 2.0**-9 and e4m3[0x38] == 1.0
    # the float8 dtypes themselves are accepted too
    assert torch.equal(decode_e4m3(every.view(torch.float8_e4m3fn))[finite], e4m3[finite])
    assert torch.equal(decode_e2m1(torch.arange(16, dtype=torch.uint8)), E2M1_VALUES)
    with pytest.raises(TypeError, match="expected a uint8"):
        decode_e8m0(torch.ones(3))


def nan_and_inf_blocks() -> torch.Tensor:
    """Two rows of two MX blocks: a NaN in row 0's first block, an infinity in row 1's second."""
    x = torch.linspace(-3, 3, 64).repeat(2, 1)
    x[0, 5], x[1, 40] = float("nan"), float("inf")
    return x


def test_a_nan_in_an_mx_block_under_the_ocp_rule_gives_the_nan_scale_byte():
    from lowprec.study import decode_e8m0

    x = nan_and_inf_blocks()
    q = lowprec.quantize(x, lowprec.MXBlockScaling(element="e4m3", scale_rule="ocp"))
    clean = lowprec.quantize(torch.where(x.isnan(), 0.0, x), lowprec.MXBlockScaling(element="e4m3", scale_rule="ocp"))
    part = q.rowwise
    assert part.scale_inv[0, 0] == 255 and decode_e8m0(part.scale_inv)[0, 0].isnan()
    # inside it: the NaN element is E4M3's NaN (0x7F), the others keep the codes the block's other values give
    assert part.codes[0, 5] == 0x7F
    others = torch.arange(32) != 5
    assert torch.equal(part.codes[0, :32][others], clean.rowwise.codes[0, :32][others])
    dequantized = q.dequantize()
    assert dequantized[0, :32].isnan().all() and not dequantized[0, 32:].isnan().any()  # the whole block is NaN
    # an infinity gives no NaN byte: the amax is infinite, the exponent clamps to 127 (byte 254); the infinity
    # saturates to 448 (448 * 2**127 overflows fp32: inf) and the block's finite values underflow to 0
    assert part.scale_inv[1, 1] == 254 and part.codes[1, 40] == 0x7E
    assert dequantized[1, 40] == float("inf") and (dequantized[1, 32:][torch.arange(32) != 8] == 0).all()


@pytest.mark.parametrize(
    "recipe, nan_scale, nan_code",
    [
        (lowprec.MXFP8BlockScaling(), False, 0x7F),  # FP8 elements, NVIDIA's rule: the element is NaN, its scale is not
        (lowprec.MXBlockScaling(element="e2m1"), True, 0),  # FP4 has no NaN: the scale is, the element codes 0
        (lowprec.MXBlockScaling(element="e3m2", scale_rule="nvidia"), True, 0),
    ],
    ids=["mxfp8", "mxfp4", "mxfp6-nvidia"],
)
def test_where_an_mx_blocks_nan_goes(recipe, nan_scale, nan_code):
    x = nan_and_inf_blocks()
    q = lowprec.quantize(x, recipe)
    assert bool(q.rowwise.scale_inv[0, 0] == 255) is nan_scale and q.rowwise.codes[0, 5] == nan_code
    nans = q.dequantize()[0, :32].isnan()
    assert nans.all() if nan_scale else (nans.sum() == 1 and nans[5])
