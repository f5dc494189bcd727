"""The C cast and decode of CPU tensors (``kernels/cpu_cast.c``) equal the torch emulation bit for bit, and a
missing compiler falls back to the emulation."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowprec import kernels
from lowprec.formats import hadamard
from lowprec.formats.elements import E2M1, E2M3, E3M2, E4M3, E5M2, decode_table
from lowprec.formats.noise import RoundingStream
from lowprec.formats.scales import Float8BlockScaleRule, MXScaleRule, NVFP4ScaleRule
from lowprec.kernels import cpu_cast
from lowprec.quant.block import BlockQuantizer

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")


def quantizers() -> dict[str, BlockQuantizer]:
    """Every rule and element the kernel takes, in the blocks the recipes use."""
    out = {}
    for element in (E4M3, E5M2, E3M2, E2M3, E2M1):
        for convention in ("nvidia", "ocp"):
            fmt = element if element in (E4M3, E5M2) else E4M3
            out[f"mx-{element.name}-{convention}"] = BlockQuantizer(MXScaleRule(element, convention), element, (1, 32), fmt)
    for fmt in (E4M3, E5M2):
        for block in ((1, 128), (128, 128)):
            for power_2 in (True, False):
                out[f"block-{fmt.name}-{block[0]}-{power_2}"] = BlockQuantizer(
                    Float8BlockScaleRule(fmt, power_2), fmt, block, fmt
                )
    rule = NVFP4ScaleRule()
    out["nvfp4"] = BlockQuantizer(rule, E2M1, (1, 16), E4M3)
    out["nvfp4-16x16"] = BlockQuantizer(rule, E2M1, (16, 16), E4M3)
    out["nvfp4-sr"] = BlockQuantizer(rule, E2M1, (1, 16), E4M3, rounding=RoundingStream(7, "layer.gradient"))
    out["nvfp4-rht-sr"] = BlockQuantizer(
        rule, E2M1, (1, 16), E4M3, hadamard_seed=hadamard.TE_SIGNS, rounding=RoundingStream(7, "layer.gradient")
    )
    out["nvfp4-rht-seeded"] = BlockQuantizer(rule, E2M1, (1, 16), E4M3, hadamard_seed=3)
    return out


QUANTIZERS = quantizers()


def awkward(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values over many binades with zeros, NaN, infinities, values near every format's max and subnormals."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator) * torch.exp2(
        torch.randint(-30, 30, (rows, cols), generator=generator).float()
    )
    flat = x.view(-1)
    specials = torch.tensor(
        [0.0, -0.0, float("nan"), float("inf"), -float("inf"), 448.0, -448.0, 464.0, 57344.0, 6.0, 5.0, 0.25, 0.75,
         1e-40, -3e-39, 2.0**-126, 2.0**-133, 3.4e38, -1e-45]
    )  # fmt: skip
    where = torch.randperm(flat.numel(), generator=generator)[: 3 * specials.numel()]
    flat[where] = specials.repeat(3)[: where.numel()]
    x[: min(rows, 3)] = 0.0  # whole zero blocks
    if rows > 5:
        x[5, : cols // 2] = float("nan")  # blocks of NaN only
    return x.to(dtype)


def quantized(quantizer: BlockQuantizer, x: torch.Tensor, mode: str, offset: int):
    saved = kernels.set_kernel_mode(mode)
    try:
        replay = quantizer.replaying(offset)
        return replay.quantize(x, transpose=True)
    finally:
        kernels.set_kernel_mode(saved)


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    bytes_a, bytes_b = (t.reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8) for t in (a, b))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bytes_a, bytes_b)


@pytest.mark.parametrize("name", list(QUANTIZERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(64, 128), (37, 70), (1, 200), (130, 19), (40, 531), (0, 32), (16, 0)])
@pytest.mark.parametrize("finite", [False, True], ids=["specials", "finite"])
def test_casts_and_decodes_equal_the_emulation(name, dtype, shape, finite):
    """``finite``: without NaN and infinities, which decide NVFP4's per-tensor scale."""
    assert cpu_cast._library() is not None
    x = awkward(*shape, torch.float32, seed=sum(shape))
    if finite:
        x = x.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    if dtype == torch.float16:
        x = x.clamp(-60000, 60000)
    x = x.to(dtype)
    native, emulated = (quantized(QUANTIZERS[name], x, mode, offset=3) for mode in ("auto", "emulated"))
    for part in ("rowwise", "columnwise"):
        ours, theirs = getattr(native, part), getattr(emulated, part)
        assert same(ours.data, theirs.data), f"{part} data"
        assert same(ours.scales, theirs.scales), f"{part} scales"
        assert same(ours.tensor_scale_inv, theirs.tensor_scale_inv), f"{part} tensor scale"
        assert ours.layout == theirs.layout
        saved = kernels.set_kernel_mode("emulated")
        try:
            values, dequantized = theirs.values(), theirs.dequantize()
        finally:
            kernels.set_kernel_mode(saved)
        assert same(ours.values(), values), f"{part} decode"
        assert same(ours.dequantize(), dequantized), f"{part} dequantize"


@pytest.mark.parametrize("name", ["mx-FP8E4M3-nvidia", "nvfp4-rht-sr"])
def test_a_transposed_view_casts_as_its_copy(name):
    """A non-contiguous input (a weight's ``.t()``, a 3-D activation's view) is copied to rows first, as in the emulation."""
    x = awkward(70, 48, torch.bfloat16, seed=1).t()
    native, emulated = (quantized(QUANTIZERS[name], x, mode, offset=0) for mode in ("auto", "emulated"))
    for part in ("rowwise", "columnwise"):
        assert same(getattr(native, part).data, getattr(emulated, part).data)
        assert same(getattr(native, part).scales, getattr(emulated, part).scales)


def test_the_kernel_transforms_columnwise_casts_only():
    """The recipe transforms the columnwise (wgrad) operands only, and the kernel's transform is written for them."""
    quantizer = QUANTIZERS["nvfp4-rht-seeded"]
    x = torch.randn(32, 32)
    signs = hadamard.random_signs(3, x.device)
    with pytest.raises(ValueError, match="columnwise casts only"):
        cpu_cast.quantize(x, quantizer.rule, quantizer.element, quantizer.block, x.dtype, False, None, signs)


def test_fp32_bit_patterns_and_ties_cast_as_torch_does():
    """The element cast alone, over a sweep of fp32 bit patterns (every binade) and every tie between neighbouring
    codes with its two neighbouring floats: each 1 x 32 block ends with the element's max, so under the OCP rule
    its scale is 1 and the codes are those of the values themselves."""
    sweep = torch.arange(0, 2**32, 4099, dtype=torch.int64).to(torch.int32).view(torch.float32)
    for element in (E4M3, E5M2, E3M2, E2M3, E2M1):
        grid = decode_table(element, torch.device("cpu")).nan_to_num(0.0).unique()
        ties = (grid[1:] + grid[:-1]) / 2
        ties = torch.cat([ties, ties.nextafter(torch.tensor(math.inf)), ties.nextafter(torch.tensor(-math.inf))])
        values = torch.cat([sweep, ties]).clamp(-element.max, element.max).nan_to_num(0.0)
        values = torch.cat([values, values.new_zeros(-values.numel() % 31)]).reshape(-1, 31)
        x = torch.cat([values, torch.full((values.shape[0], 1), element.max)], 1)
        quantizer = BlockQuantizer(MXScaleRule(element, "ocp"), element, (1, 32), E4M3)
        native, emulated = (quantized(quantizer, x, mode, 0) for mode in ("auto", "emulated"))
        assert same(native.rowwise.data, emulated.rowwise.data), element.name
        assert same(native.rowwise.scales, emulated.rowwise.scales), element.name


def test_without_a_compiler_the_emulation_casts(tmp_path: Path):
    """A compiler that does not exist: the cast still works, through torch, with one log line naming the cause."""
    script = (
        "import logging, torch\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from lowprec.formats.elements import E4M3\n"
        "from lowprec.quant.block import mxfp8_quantizer\n"
        "from lowprec.kernels import cpu_cast\n"
        "q = mxfp8_quantizer(E4M3).quantize(torch.randn(64, 64), transpose=True)\n"
        "q = mxfp8_quantizer(E4M3).quantize(torch.randn(64, 64), transpose=True)\n"
        "assert cpu_cast._library() is None\n"
        "print(q.rowwise.data.dtype)\n"
    )
    env = {**os.environ, "CC": str(tmp_path / "no-such-compiler"), "NVDLFW_INSPECT_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "float8_e4m3fn" in result.stdout
    messages = [line for line in result.stderr.splitlines() if "C kernel is unavailable" in line]
    assert len(messages) == 1 and "no-such-compiler" in messages[0] and "C compiler" in messages[0]
    assert not list((tmp_path / "cache").glob("cpu_cast-*.so"))


def test_the_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv("LOWPREC_NATIVE", "0")
    cpu_cast._library.cache_clear()
    try:
        assert not cpu_cast.runs_on(torch.zeros(2, 2))
    finally:
        monkeypatch.delenv("LOWPREC_NATIVE")
        cpu_cast._library.cache_clear()
    assert cpu_cast.runs_on(torch.zeros(2, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_per_tensor_amax_and_its_nonfinite_probe_come_from_one_read(dtype):
    """``per_tensor.amax_and_probe`` on a CPU: the C kernel's amax equals the torch emulation's (NaN ignored, infinity
    kept, subnormals, the format's largest value) and its probe is NaN exactly when the tensor holds NaN or inf."""
    from lowprec.quant.per_tensor import amax_and_probe, nan_ignoring_amax

    g = torch.Generator().manual_seed(0)
    tiny, largest = torch.finfo(dtype).smallest_normal / 4, torch.finfo(dtype).max
    for shape in ((1,), (3, 5), (65, 257)):
        base = (torch.randn(shape, generator=g) * 100).to(dtype)
        for planted in (None, math.nan, math.inf, -math.inf, -largest):
            x = base.clone()
            if planted is not None:
                x.view(-1)[x.numel() // 2] = planted
            for tensor in (x, torch.full(shape, tiny, dtype=dtype), torch.full(shape, math.nan, dtype=dtype)):
                amax, probe = amax_and_probe(tensor)
                assert torch.equal(amax, nan_ignoring_amax(tensor.abs())), (shape, planted)
                assert probe.shape == () and probe.dtype == torch.float32
                assert math.isnan(probe) == (not tensor.isfinite().all()) and (math.isnan(probe) or probe == 0)
                alone = cpu_cast.nonfinite_probe(tensor)  # the guard's own read, without the amax
                assert alone.shape == () and math.isnan(alone) == math.isnan(probe) and (math.isnan(alone) or alone == 0)
    previous = kernels.set_kernel_mode("emulated")  # torch's path: the same amax, no probe (it would take a read)
    try:
        amax, probe = amax_and_probe(base)
        assert torch.equal(amax, nan_ignoring_amax(base.abs())) and probe is None
    finally:
        kernels.set_kernel_mode(previous)
    assert amax_and_probe(base.t())[1] is None and cpu_cast.nonfinite_probe(base.t()) is None  # not contiguous: torch's


@pytest.mark.parametrize("name", ["mx-FP8E4M3-nvidia", "block-FP8E4M3-128-True", "nvfp4-sr", "nvfp4-rht-seeded"])
def test_a_block_cast_tells_whether_its_source_held_nan_or_inf(name):
    """The C block cast's own read says whether ``x`` held NaN or inf (``BlockScaledTensor.nonfinite_probe``), for
    ragged shapes, both orientations and a Hadamard-transformed columnwise one (whose rowwise read answers)."""
    quantizer = QUANTIZERS[name]
    g = torch.Generator().manual_seed(1)
    for shape, dtype in (((33, 70), torch.float32), ((129, 160), torch.bfloat16)):
        base = torch.randn(shape, generator=g).to(dtype)
        for planted in (None, math.nan, math.inf, -math.inf):
            x = base.clone()
            if planted is not None:
                x[-1, -1] = planted  # the last row and column: a ragged block's
            for transpose in (False, True):
                probe = quantizer.quantize(x, transpose).nonfinite_probe
                assert probe.shape == () and math.isnan(probe) == (planted is not None) and (math.isnan(probe) or probe == 0)
    previous = kernels.set_kernel_mode("emulated")  # torch's cast keeps no probe: the guard reads the tensor itself
    try:
        assert quantizer.quantize(base, True).nonfinite_probe is None
    finally:
        kernels.set_kernel_mode(previous)


@pytest.mark.parametrize("element", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_a_per_tensor_fp8_operand_decodes_as_torch_does_every_byte(element):
    """``Float8Tensor.values`` on a CPU (the C table lookup) equals ``FP8Format.decode`` (torch) bit for bit: all 256
    bytes (NaN bytes, -0, subnormals, the largest), row-major, transposed (its stored other layout read as it is) and
    transposed without one (copied first)."""
    from lowprec.quant.protocol import Float8Tensor

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(3).reshape(16, 48).view(element.dtype)
    other = codes.t().contiguous().t()  # the same values column-major, as the fused cast stores them
    one = torch.ones((), dtype=torch.float32)
    for tensor in (
        Float8Tensor(codes, one, element, torch.float32, other),
        Float8Tensor(codes, one, element, torch.float32, other).t(),
        Float8Tensor(codes, one, element, torch.float32).t(),
    ):
        values = tensor.values()
        reference = element.decode(tensor.data)
        assert values.shape == reference.shape and values.is_contiguous()
        assert torch.equal(values.view(torch.int32), reference.view(torch.int32))  # NaN payloads and -0 included
    previous = kernels.set_kernel_mode("emulated")  # the torch path: the kernel is not called
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(cpu_cast, "decode_fp8", lambda *args: pytest.fail("the C decode ran in the emulated mode"))
            values = Float8Tensor(codes, one, element, torch.float32).values()
        assert torch.equal(values.view(torch.int32), element.decode(codes).view(torch.int32))
    finally:
        kernels.set_kernel_mode(previous)
