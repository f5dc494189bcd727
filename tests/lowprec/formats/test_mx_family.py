"""The OCP MX family's numbers: the FP6 grids (E3M2, E2M3), both E8M0 scale rules by hand, and every element under
both rules bit for bit against torchao's ``to_mx`` (NVIDIA's rule is its RCEIL, the specification's its FLOOR).

Where torchao's eager code departs from its own rule, the rule is followed and the case has a test of its own:
fp32 ``log2`` just above a power of two (RCEIL), blocks whose scale is byte 0 (E8M0 2**-127), infinite blocks
(FLOOR) and NaN blocks.
"""

from __future__ import annotations

import pytest
import torch
from mxref import ELEMENTS, MODE, ScaleCalculationMode, torchao_cast

from lowprec.errors import LowprecValueError
from lowprec.formats.elements import E2M1, E2M3, E3M2, E4M3, E5M2, ElementFormat, FP8Format
from lowprec.formats.scales import MX_BLOCK, MXScaleRule
from lowprec.quant.block import BlockQuantizer

EMAX = {E4M3: 8, E5M2: 15, E3M2: 4, E2M3: 2, E2M1: 2}  # floor(log2(max)) of each element: the OCP rule's emax_elem


def values(element: ElementFormat, x: list[float]) -> list[float]:
    return element.decode(element.cast(torch.tensor(x))).tolist()


def test_fp6_grids_by_their_definition():
    # E3M2: bias 3, subnormals 0.0625 * m; E2M3: bias 1, subnormals 0.125 * m; no inf or NaN, so the top binade is normal
    e3m2 = E3M2.decode(torch.arange(32, dtype=torch.uint8))
    assert e3m2[:8].tolist() == [0, 0.0625, 0.125, 0.1875, 0.25, 0.3125, 0.375, 0.4375]
    assert e3m2[-4:].tolist() == [16, 20, 24, 28] and E3M2.max == 28
    e2m3 = E2M3.decode(torch.arange(32, dtype=torch.uint8))
    assert e2m3[:9].tolist() == [0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0]
    assert e2m3[-4:].tolist() == [6, 6.5, 7, 7.5] and E2M3.max == 7.5
    for element in (E3M2, E2M3):
        codes = torch.arange(64, dtype=torch.uint8)
        grid = element.decode(codes)
        assert torch.equal(grid[32:], -grid[:32]) and grid.signbit().tolist() == [False] * 32 + [True] * 32  # bit 5: sign
        assert torch.equal(element.cast(grid), codes)  # every code decodes and casts back, -0.0 included


def test_fp6_ties_round_to_even_and_saturate():
    assert values(E3M2, [0.03125, 0.09375, 18.0, 22.0, 26.0, 27.9, 30.0, 1e9, float("inf")]) == [
        0,
        0.125,
        16,
        24,
        24,
        28,
        28,
        28,
        28,
    ]
    assert values(E2M3, [0.0625, 0.1875, 1.0625, 1.1875, 7.25, 7.75, 100.0]) == [0, 0.25, 1.0, 1.25, 7.0, 7.5, 7.5]
    assert values(E3M2, [-26.0, -0.0, -0.01]) == [-24.0, -0.0, -0.0]
    assert E2M3.cast(torch.tensor([float("nan"), -float("nan")])).tolist() == [0, 0]  # no NaN code: the block's scale says it
    assert E3M2.count_nonzero(E3M2.cast(torch.tensor([0.0, -0.0, 0.02, 0.05]))).item() == 1


def rule_bytes(element: ElementFormat, rule: str, amaxes: list[float], nan: list[bool] | None = None) -> list[int]:
    amax = torch.tensor(amaxes)
    has_nan = torch.tensor(nan if nan is not None else [False] * len(amaxes))
    return MXScaleRule(element, rule).scales(amax, has_nan=has_nan).stored.view(torch.uint8).tolist()


def test_the_nvidia_rule_rounds_amax_over_the_element_max_up():
    # e = ceil(log2(amax * fp32(1 / max))): an amax at the element's max is scale 1 (byte 127), a hair above it scale 2
    assert rule_bytes(E4M3, "nvidia", [448.0, 449.0, 1.0, 0.0, float("inf")]) == [127, 128, 119, 0, 254]
    assert rule_bytes(E2M1, "nvidia", [6.0, 7.0, 3.0, 3.0001]) == [127, 128, 126, 127]
    assert rule_bytes(E2M3, "nvidia", [7.5, 7.6]) == [127, 128] and rule_bytes(E3M2, "nvidia", [28.0, 29.0]) == [127, 128]
    assert rule_bytes(E2M1, "nvidia", [3.4e38, 1e-40]) == [253, 0]  # clamped to the E8M0 range


def test_the_ocp_rule_floors_log2_amax_minus_emax():
    # e = floor(log2(amax)) - emax_elem: everything below the next power of two keeps scale 1 and may saturate
    assert rule_bytes(E4M3, "ocp", [448.0, 511.0, 512.0, 1.0, 0.0, float("inf")]) == [127, 127, 128, 119, 0, 254]
    assert rule_bytes(E2M1, "ocp", [6.0, 7.9, 8.0, 0.75]) == [127, 127, 128, 124]
    assert rule_bytes(E3M2, "ocp", [28.0, 31.0, 32.0]) == [127, 127, 128]
    assert rule_bytes(E2M3, "ocp", [7.5, 4.0, 3.99]) == [127, 127, 126]
    assert rule_bytes(E5M2, "ocp", [57344.0, 65536.0]) == [127, 128]
    assert rule_bytes(E2M1, "ocp", [3.4e38, 2.0**-130]) == [252, 0]  # 127 - 2; clamped at -127


def test_nan_blocks_get_the_nan_scale_where_the_elements_cannot_hold_it():
    nan = [True, False]
    for element in (E3M2, E2M3, E2M1):
        for rule in ("nvidia", "ocp"):
            assert rule_bytes(element, rule, [1.0, 1.0], nan)[0] == 0xFF
    assert rule_bytes(E4M3, "ocp", [1.0], [True]) == [0xFF]
    assert rule_bytes(E4M3, "nvidia", [1.0], [True]) == [119]  # Transformer Engine: the other values' scale, a NaN element


def test_a_saturating_block_under_the_ocp_rule():
    x = torch.zeros(1, 32)
    x[0, :3] = torch.tensor([7.9, 1.0, -0.26])
    ocp = BlockQuantizer(MXScaleRule(E2M1, "ocp"), E2M1, (1, MX_BLOCK), E4M3).quantize(x).dequantize()
    nvidia = BlockQuantizer(MXScaleRule(E2M1, "nvidia"), E2M1, (1, MX_BLOCK), E4M3).quantize(x).dequantize()
    assert ocp[0, :3].tolist() == [6.0, 1.0, -0.5]  # scale 1: 7.9 saturates, -0.26 rounds to -0.5
    assert nvidia[0, :3].tolist() == [8.0, 1.0, -0.0]  # scale 2: 7.9 -> 8, -0.26 / 2 flushes to zero


def test_bad_rule_names_are_refused():
    with pytest.raises(LowprecValueError, match=r"MX scale rule must be one of \['nvidia', 'ocp'\], got 'floor'"):
        MXScaleRule(E4M3, "floor")


# --- torchao ---------------------------------------------------------------------------------------------------


def ours(x: torch.Tensor, element: ElementFormat, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale bytes, codes)`` of ``x`` (2-D) rowwise, cropped to the unpadded shape."""
    part = BlockQuantizer(MXScaleRule(element, rule), element, (1, MX_BLOCK), E4M3).quantize(x).rowwise
    codes = part.data if part.data.dtype == torch.uint8 else part.data.view(torch.uint8)
    return part.scales.view(torch.uint8), codes[:, : x.shape[1]]


def torchao(x: torch.Tensor, element: ElementFormat, mode: ScaleCalculationMode) -> tuple[torch.Tensor, torch.Tensor]:
    return torchao_cast(x, element, mode)


def spread(rows: int, cols: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values over 60 binades, rows of very different magnitudes: every scale byte from ~30 to ~230."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, cols, generator=g) * 2)
    return (x * torch.logspace(-30, 30, rows)[:, None]).to(dtype)


@pytest.mark.parametrize("rule", ["nvidia", "ocp"])
@pytest.mark.parametrize("name", ELEMENTS)
@pytest.mark.parametrize(
    ("rows", "cols", "dtype"),
    [(64, 256, torch.float32), (7, 45, torch.float32), (33, 96, torch.bfloat16)],
    ids=["random", "odd-shape", "bf16"],
)
def test_bit_exact_with_torchao(name, rule, rows, cols, dtype):
    element = ELEMENTS[name]
    x = spread(rows, cols, seed=rows + cols, dtype=dtype)
    x[0, :MX_BLOCK] = 0.0  # a zero block: byte 0, zero codes
    x[1, :5] = torch.tensor([3.0, -1e-3, 0.5, 1e-30, -0.0], dtype=dtype)  # values that flush to (signed) zero
    scales, codes = ours(x, element, rule)
    their_scales, their_codes = torchao(x, element, MODE[rule])
    assert torch.equal(scales, their_scales) and torch.equal(codes, their_codes)
    assert scales.min() == 0 and scales.max() > 180  # the data reached both ends of the E8M0 range
    # the columnwise copy is the rowwise cast of the transpose, so it matches to_mx on the transpose
    part = BlockQuantizer(MXScaleRule(element, rule), element, (1, MX_BLOCK), E4M3).quantize(x, transpose=True).columnwise
    assert torch.equal(part.scales.view(torch.uint8), torchao(x.t().contiguous(), element, MODE[rule])[0])


@pytest.mark.parametrize("name", ELEMENTS)
def test_torchao_modes_ceil_and_even_are_neither_rule(name):
    """The mapping: RCEIL is NVIDIA's rule and FLOOR the specification's; CEIL (``ceil(log2 amax) - emax``) and
    EVEN (the amax rounded to the element's mantissa first) match neither."""
    element = ELEMENTS[name]
    x = spread(64, 256, seed=5)
    for mode in (ScaleCalculationMode.CEIL, ScaleCalculationMode.EVEN):
        their_scales = torchao(x, element, mode)[0]
        for rule in ("nvidia", "ocp"):
            assert not torch.equal(ours(x, element, rule)[0], their_scales), (mode, rule)


def decode(element: ElementFormat, codes: torch.Tensor) -> float:
    return (codes.view(element.dtype).float() if isinstance(element, FP8Format) else element.decode(codes)).item()


def one_block(*head: float) -> torch.Tensor:
    x = torch.zeros(1, MX_BLOCK)
    x[0, : len(head)] = torch.tensor(head)
    return x


@pytest.mark.parametrize("name", ELEMENTS)
def test_departure_rceil_log2_just_above_a_power_of_two(name):
    """torchao's eager RCEIL takes ``ceil(torch.log2(amax / max))`` in fp32: one ulp above ``max * 2**k`` the log2
    rounds down to exactly k, so its scale is 2**k and the block's largest value saturates. The rule's ``ceil`` is
    exact (``frexp``): 2**(k+1), nothing saturates."""
    element = ELEMENTS[name]
    top = torch.nextafter(torch.tensor(element.max * 2.0**5), torch.tensor(float("inf"))).item()
    x = one_block(top, 1.0)
    scales, codes = ours(x, element, "nvidia")
    their_scales, their_codes = torchao(x, element, ScaleCalculationMode.RCEIL)
    assert scales.item() == 127 + 6 and their_scales.item() == 127 + 5
    assert decode(element, codes[0, :1]) == element.max / 2  # top / 2**6 rounds to max / 2: nothing saturates
    assert decode(element, their_codes[0, :1]) == element.max  # top / 2**5 saturated at max


@pytest.mark.parametrize("rule", ["nvidia", "ocp"])
@pytest.mark.parametrize("name", ELEMENTS)
def test_departure_byte_zero_blocks(name, rule):
    """A block whose scale is byte 0 (2**-127: the clamp at the bottom of E8M0) but whose values are not zero is
    multiplied by 2**127 here, the rule's ``2**-e``. torchao's RCEIL multiplies it by 1 (Transformer Engine's
    ``exp2f_rcp`` special case) and its FLOOR divides by 2**-126 (the scale clamped to fp32's smallest normal)."""
    element = ELEMENTS[name]
    tiny = {"nvidia": element.max * 2.0**-128, "ocp": 2.0 ** (EMAX[element] - 128)}[rule]  # below byte 1's range
    x = one_block(tiny, -tiny / 2)
    scales, codes = ours(x, element, rule)
    their_scales, their_codes = torchao(x, element, MODE[rule])
    assert scales.item() == their_scales.item() == 0
    expected = element.cast(x * 2.0**127)  # the rule: scaled by 2**127, every value representable
    expected = expected if expected.dtype == torch.uint8 else expected.view(torch.uint8)
    assert torch.equal(codes, expected) and not torch.equal(codes, their_codes)
    assert element.count_nonzero(codes).item() == 2  # torchao flushes (RCEIL) or halves (FLOOR) them


@pytest.mark.parametrize("name", ELEMENTS)
def test_departure_floor_inf_blocks(name):
    """An infinite amax: floor(log2(inf)) - emax clamps to 127 (byte 254, as NVIDIA's rule gives). torchao's FLOOR
    reads the exponent bits of inf (128) and stores byte ``255 - emax``."""
    element = ELEMENTS[name]
    x = one_block(float("inf"), 1.0)
    assert ours(x, element, "ocp")[0].item() == 254
    assert torchao(x, element, ScaleCalculationMode.FLOOR)[0].item() == 255 - EMAX[element]
    assert ours(x, element, "nvidia")[0].item() == torchao(x, element, ScaleCalculationMode.RCEIL)[0].item() == 254


@pytest.mark.parametrize("rule", ["nvidia", "ocp"])
@pytest.mark.parametrize("name", ELEMENTS)
def test_departure_nan_blocks(name, rule):
    """A block holding a NaN: torchao's amax is NaN, so its scale is 0xFF and every code is what NaN casts to. Here
    the amax ignores NaN (as Transformer Engine's ``fmaxf``): the other values keep their codes, and the scale is
    0xFF wherever the rule marks NaN blocks there (both rules with FP6 and FP4 elements, the OCP rule with FP8); the
    NVIDIA rule with FP8 elements keeps the other values' scale and stores the NaN element (0x7F). Either way the
    NaN decodes to NaN; codes of NaN blocks are not compared."""
    element = ELEMENTS[name]
    x = torch.cat([one_block(float("nan"), 3.0, -0.5), spread(1, MX_BLOCK, seed=9)], dim=1)
    scales, codes = ours(x, element, rule)
    their_scales, their_codes = torchao(x, element, MODE[rule])
    assert torch.equal(scales[:, 1:], their_scales[:, 1:]) and torch.equal(codes[:, MX_BLOCK:], their_codes[:, MX_BLOCK:])
    marks_nan = rule == "ocp" or not isinstance(element, FP8Format)
    assert their_scales[0, 0].item() == 0xFF and (scales[0, 0].item() == 0xFF) is marks_nan
    dequantized = BlockQuantizer(MXScaleRule(element, rule), element, (1, MX_BLOCK), E4M3).quantize(x).dequantize()
    assert dequantized[0, 0].isnan() and (dequantized[0, 1:MX_BLOCK].isnan().all().item() is marks_nan)
    if not marks_nan:
        assert dequantized[0, 1:3].tolist() == [3.0, -0.5]


def test_mini_float_formats_must_fit_a_uint8_code():
    from lowprec.formats.elements import MiniFloatFormat

    assert MiniFloatFormat("FP6E3M2", 3, 2) == E3M2
    assert MiniFloatFormat("E4M3-like", 4, 3).max == 480.0  # no NaN: the top binade is normal
    with pytest.raises(LowprecValueError, match=r"E5M3: a sign, 5 exponent and 3 mantissa bits exceed a uint8 code"):
        MiniFloatFormat("E5M3", 5, 3)
    with pytest.raises(LowprecValueError, match=r"E0M3: exponent_bits >= 1 and mantissa_bits >= 0 .*, got \(0, 3\)"):
        MiniFloatFormat("E0M3", 0, 3)
