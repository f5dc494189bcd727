"""Checks of the fused FP8 block kernel (MXFP8 and FP8 block scaling), run by test_block_fp8.py in a
process where ``TRITON_INTERPRET=1`` (set before Triton loads) makes it run on CPU tensors.

1. Rowwise and columnwise bytes and scales equal ``BlockQuantizer``'s torch emulation exactly, for MXFP8
   (E8M0 scales, 1 x 32 and 32 x 32 blocks) and FP8 block scaling (fp32 scales, power of two or not,
   1 x 128 and 128 x 128 blocks): random data over fp32's range, every FP8 value and every tie between
   two of them (and their neighbours) at several block scales, an amax sweep over every fp32 binade and
   the boundaries of the scale rules, zero blocks, NaN of any sign and payload (alone in a block too),
   infinities, fp32 subnormals, amaxes so small that ``fp8_max / amax`` overflows (bf16 and fp32 input: the
   input dtype's largest value stands in, as in TE), shapes not divisible by the block, strided views,
   fp32/bf16/fp16 inputs, E4M3 and E5M2; and that overflow by hand (bf16: scale 0x7f7f0000).
2. The non-finite flags equal, tile by tile, torch's ``~isfinite`` of the same elements (NaN where a tile held
   one, else 0) for every case above (empty tensors: a single 0), and for a NaN, a +inf and a -inf each alone
   in a tile, at the last row or column of ragged tiles and inside whole ones, beside finite ragged tiles
   (the padding never flags): fp32 and bf16, rowwise only and with columnwise.
3. ``BlockQuantizer`` uses the kernel where ``kernels.runs_on`` holds (and only there, never for
   NVFP4), and a Linear trained under MXFP8 and under FP8 block scaling gives bit-identical results with it.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))  # for triton_strict (this runs as a script)
from fp8_cast_checks import bits, train  # noqa: E402  (this file's folder is on the path too)
from triton_strict import index_as_triton_36  # noqa: E402

import lowprec  # noqa: E402
from lowprec import kernels  # noqa: E402
from lowprec.formats.elements import E4M3, E5M2, FP8Format  # noqa: E402
from lowprec.formats.scales import Float8BlockScaleRule, MXScaleRule, ScaleRule  # noqa: E402
from lowprec.kernels import block_fp8  # noqa: E402
from lowprec.quant.block import BlockQuantizer  # noqa: E402

NAN_BITS = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345, 0x7FFFFFFF, 0xFFFFFFFF]
RULES = {  # name: (rule, block width)
    "MXFP8 E4M3": (MXScaleRule(E4M3), 32),
    "MXFP8 E5M2": (MXScaleRule(E5M2), 32),
    "block E4M3": (Float8BlockScaleRule(E4M3), 128),
    "block E5M2": (Float8BlockScaleRule(E5M2), 128),
    "block E4M3 fp32 scales": (Float8BlockScaleRule(E4M3, power_2=False), 128),
}


def grid_and_ties(fmt: FP8Format) -> torch.Tensor:
    """Every finite FP8 value, the midpoints between neighbours and the fp32 values either side of them."""
    every = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    grid = every[torch.isfinite(every)].unique()
    ties = (grid[1:] + grid[:-1]) / 2
    return torch.cat([grid, ties, torch.nextafter(ties, grid[1:]), torch.nextafter(ties, grid[:-1])])


def tie_case(fmt: FP8Format, width: int, exponent: int) -> torch.Tensor:
    """``grid_and_ties`` in ``width + 1`` columns, with ``fmt.max`` leading every block of both orientations
    (so each block's scale is exactly 2**-exponent), all times 2**exponent."""
    values = grid_and_ties(fmt)
    cols = width + 1
    rows = -(-values.numel() // cols)
    x = torch.cat([values, torch.zeros(rows * cols - values.numel())]).reshape(rows, cols)
    x[:, ::width] = fmt.max
    x[::width, :] = fmt.max
    return x * 2.0**exponent


def amax_sweep(fmt: FP8Format, width: int, g: torch.Generator) -> torch.Tensor:
    """One block (a row of ``width``) per amax: every power of two of fp32, ``fp8_max`` times them and the
    fp32 values either side, the smallest subnormals, fp32 max and inf; the rest of each block below."""
    powers = 2.0 ** torch.arange(-149, 128, dtype=torch.float64)
    at_max = (powers * fmt.max).float()
    at_max = at_max[torch.isfinite(at_max)]
    inf = torch.full_like(at_max, math.inf)
    extremes = torch.tensor([1e-45, 3e-45, 1e-40, torch.finfo(torch.float32).max, math.inf, 0.0])
    amaxes = torch.cat([powers.float(), at_max, torch.nextafter(at_max, inf), torch.nextafter(at_max, -inf), extremes])
    rest = torch.rand(amaxes.numel(), width - 1, generator=g) * 2 - 1
    return torch.cat([amaxes[:, None], torch.nan_to_num(amaxes[:, None] * rest, posinf=1.0)], dim=1)


def special_case(g: torch.Generator, width: int) -> torch.Tensor:
    """NaNs of every kind (and a block of nothing but NaN), infinities, signed zeros, subnormals, zero blocks."""
    x = torch.randn(2 * width + 6, 3 * width - 6, generator=g)
    x[:, width : 2 * width] = 0.0
    x[5, width : 2 * width] = -0.0
    nans = torch.tensor(NAN_BITS, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x[0, : len(NAN_BITS)] = nans
    x[40:46, 2 * width + 6] = nans
    x[2 * width, :width] = math.nan
    x[2, 3], x[3, 2 * width + 6], x[width + 1, 2 * width + 16] = math.inf, -math.inf, math.inf
    x[10, :32] = torch.tensor([1e-45, -1e-45, 1e-40, 1e-38] * 8)
    return x


def cases():
    g = torch.Generator().manual_seed(0)
    for name, (rule, width) in RULES.items():
        fmt = rule.element
        for square in (False, True):
            block = (width, width) if square else (1, width)
            label = f"{name} {block}"
            exponents = (-130, -20, 0, 17, 100) if not square else (-20, 100)
            for exponent in exponents:
                yield f"{label} ties at 2**{exponent}", rule, block, tie_case(fmt, width, exponent)
            if not square:
                yield f"{label} amax sweep", rule, block, amax_sweep(fmt, width, g)
            cols = 75 if width == 32 else 200
            random = torch.randn(100, cols, generator=g) * torch.logspace(-30, 30, cols)
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                yield f"{label} random {dtype}", rule, block, random.to(dtype)
                yield f"{label} special {dtype}", rule, block, special_case(g, width).to(dtype)
            tiny = torch.tensor([1e-37, 3e-38, 1e-39, 2e-41, 1e-36])[:, None] * torch.rand(5, width, generator=g)
            for dtype in (torch.float32, torch.bfloat16):
                yield f"{label} overflowing scales {dtype}", rule, block, tiny.to(dtype)
            yield f"{label} transposed view", rule, block, random.t()
            yield f"{label} strided view", rule, block, random[::3, 1::2]
            for shape in ((1, 1), (1, width + 1), (width + 1, 1), (width - 1, width - 1), (width, width), (0, 5)):
                yield f"{label} {shape}", rule, block, torch.randn(*shape, generator=g) * 1000


def emulation(rule: ScaleRule, block: tuple[int, int]) -> BlockQuantizer:
    return BlockQuantizer(rule, rule.element, block, rule.element)


def check_cases(failures: list[str]) -> int:
    count = 0
    for name, rule, block, x in cases():
        count += 1
        want = emulation(rule, block).quantize(x, transpose=True)
        data, scales, data_t, scales_t, flags = block_fp8.quantize_block_fp8(x, rule, block, columnwise=True)
        if wrong := flag_failure(flags, x, (block[1], block[1])):
            failures.append(f"{name}: {wrong}")
        pairs = {
            "rowwise bytes": (data, want.rowwise.data),
            "rowwise scales": (scales, want.rowwise.scales),
            "columnwise bytes": (data_t, want.columnwise.data),
            "columnwise scales": (scales_t, want.columnwise.scales),
        }
        for part, (got, expected) in pairs.items():
            if got.dtype != expected.dtype or got.shape != expected.shape or not torch.equal(bits(got), bits(expected)):
                where = (bits(got) != bits(expected)).nonzero()[:3].tolist() if got.shape == expected.shape else got.shape
                failures.append(f"{name}: {part} differ at {where}")
    return count


def flag_failure(flags: torch.Tensor, x: torch.Tensor, tile: tuple[int, int]) -> str | None:
    """What is wrong with ``flags``, a kernel's fp32 non-finite flags of ``x`` in ``tile``s (row-major, one per
    program): each NaN where its tile of ``x`` (as fp32) holds a NaN or an infinity, else 0; a single 0 for an
    empty ``x``. None if nothing."""
    if x.numel() == 0:
        expected = torch.zeros(1, dtype=torch.bool)
    else:
        rows, cols = x.shape
        padded = torch.zeros(-(-rows // tile[0]) * tile[0], -(-cols // tile[1]) * tile[1])
        padded[:rows, :cols] = x.float()
        tiles = padded.reshape(padded.shape[0] // tile[0], tile[0], padded.shape[1] // tile[1], tile[1])
        expected = (~tiles.isfinite()).any(dim=3).any(dim=1).reshape(-1)
    if flags.dtype != torch.float32 or flags.shape != expected.shape or flags.device != x.device:
        return f"flags {flags.dtype} {tuple(flags.shape)} on {flags.device}, expected fp32 {tuple(expected.shape)}"
    if not (torch.equal(flags.isnan(), expected) and torch.all(flags[~expected] == 0)):
        return f"flags {flags.tolist()} where tiles {expected.int().tolist()} held NaN or inf"
    if flags.amax().isnan() != (not x.isfinite().all()):
        return f"flags.amax() is {flags.amax()}"
    return None


def planted(shape: tuple[int, int], dtype: torch.dtype, spots: dict[tuple[int, int], float], g: torch.Generator):
    """Random finite values of ``shape``, the last column near fp32's and bf16's largest, with ``spots`` set."""
    x = torch.randn(*shape, generator=g) * torch.logspace(-20, 20, shape[1])
    x[:, -1] = 3.0e38
    for (row, col), value in spots.items():
        x[row, col] = value
    return x.to(dtype)


def check_nonfinite_flags(failures: list[str]) -> int:
    """A NaN, a +inf and a -inf each alone in its tile: at the last row and the last column of ragged tiles and
    inside whole ones, beside finite tiles (ragged ones too); and a finite ragged tensor."""
    g = torch.Generator().manual_seed(6)
    count = 0
    inf = math.inf
    for rule, block, dtype, columnwise in (
        (MXScaleRule(E4M3), (1, 32), torch.float32, False),
        (MXScaleRule(E5M2), (32, 32), torch.bfloat16, True),
        (Float8BlockScaleRule(E4M3), (1, 128), torch.bfloat16, False),
    ):
        width = block[1]
        rows, cols = 2 * width + 5, 2 * width + 3  # 3 x 3 tiles, the last row and column of them ragged
        last_row, last_col = rows - 1, cols - 1
        spots = {  # tile (row, col): what it holds
            (last_row, last_col): math.nan,  # (2, 2): the ragged corner's last element
            (last_row, 3): -inf,  # (2, 0): the ragged tile row's last row
            (7, last_col): inf,  # (0, 2): the ragged tile column's last column
            (width + 4, width + 9): -inf,  # (1, 1): inside a whole tile
            (width - 1, 2 * width - 1): math.nan,  # (0, 1): a whole tile's last element
        }
        for name, x in (
            ("planted", planted((rows, cols), dtype, spots, g)),
            ("finite ragged", planted((rows - 2, cols - 1), dtype, {}, g)),
        ):
            count += 1
            got = block_fp8.quantize_block_fp8(x, rule, block, columnwise)
            if wrong := flag_failure(got[4], x, (width, width)):
                label = f"{type(rule).__name__} {rule.element.name} {block} {dtype} columnwise={columnwise}"
                failures.append(f"{label} {name}: {wrong}")
    return count


def check_te_overflow(failures: list[str]) -> None:
    """bf16 input, block amax bf16(1e-37) = 9.9917e-38: 448 / amax overflows fp32, so the scale is bf16's max,
    0x7f7f0000 (TE's ``compute_scale_from_types<bf16>``), stored as its reciprocal 0x00202020; a power of two:
    2**127, stored 2**-127 (0x00400000). fp32 input: fp32's max, stored 0x00200000 (its reciprocal rounds to 2**-128)."""
    x = torch.zeros(1, 128)
    x[0, 0] = torch.tensor(1e-37).to(torch.bfloat16).float()
    for dtype, power_2, want in (
        (torch.bfloat16, False, 0x00202020),
        (torch.bfloat16, True, 0x00400000),
        (torch.float32, False, 0x00200000),
    ):
        rule = Float8BlockScaleRule(E4M3, power_2=power_2)
        scales = block_fp8.quantize_block_fp8(x.to(dtype), rule, (1, 128), columnwise=False)[1]
        if scales.view(torch.int32).item() != want:
            failures.append(
                f"overflowing scale, {dtype} power_2={power_2}: {hex(scales.view(torch.int32).item())} != {hex(want)}"
            )


def check_rowwise_only(failures: list[str]) -> None:
    g = torch.Generator().manual_seed(4)
    for rule, block in ((MXScaleRule(E4M3), (1, 32)), (Float8BlockScaleRule(E5M2), (128, 128))):
        x = special_case(g, block[1]).to(torch.bfloat16).t()
        both = block_fp8.quantize_block_fp8(x, rule, block, columnwise=True)
        alone = block_fp8.quantize_block_fp8(x, rule, block, columnwise=False)
        if not (
            torch.equal(bits(alone[0]), bits(both[0]))
            and torch.equal(bits(alone[1]), bits(both[1]))
            and alone[2:4] == (None, None)
        ):
            failures.append(f"{rule} {block}: the rowwise-only cast differs")
        if wrong := flag_failure(alone[4], x, (block[1], block[1])):
            failures.append(f"{type(rule).__name__} {block} rowwise only: {wrong}")


def check_wiring(failures: list[str]) -> None:
    original_uses, original_kernel = kernels.runs_on, block_fp8.quantize_block_fp8
    calls: list[tuple[tuple[int, ...], tuple[int, int]]] = []

    def spy(x, rule, block, columnwise):
        calls.append((tuple(x.shape), block))
        return original_kernel(x, rule, block, columnwise)

    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 20, 40, generator=g).to(torch.bfloat16)
    quantizers = {
        "MXFP8": lowprec.MXFP8BlockScaling(enable_2d_quantization=True).quantizers("fc")["weight"],
        "block": lowprec.Float8BlockScaling().quantizers("fc")["weight"],
        "NVFP4": lowprec.NVFP4BlockScaling().quantizers("fc")["weight"],
    }
    results = {}
    try:
        block_fp8.quantize_block_fp8 = spy
        for name, quantizer in quantizers.items():
            kernels.runs_on = lambda t: t.dim() == 2
            fused = quantizer.quantize(x, transpose=True)
            kernels.runs_on = lambda t: False
            results[name] = fused, quantizer.quantize(x, transpose=True)
    finally:
        block_fp8.quantize_block_fp8, kernels.runs_on = original_kernel, original_uses
    if calls != [((60, 40), (32, 32)), ((60, 40), (128, 128))]:
        failures.append(f"the kernel ran for {calls}, not once for each FP8 block cast (and never for NVFP4)")
    for name, (fused, plain) in results.items():
        if fused.dtype != plain.dtype or fused.shape != plain.shape:
            failures.append(f"{name} fused cast: dtype or shape differ")
        for got, want in zip(fused.inner_tensors().values(), plain.inner_tensors().values(), strict=True):
            same = got is not None and torch.equal(bits(got.reshape(-1)), bits(want.reshape(-1)))
            if (got is None) != (want is None) or (got is not None and not same):
                failures.append(f"{name}: fused BlockQuantizer cast differs from the torch path")
        if fused.metadata() != plain.metadata():
            failures.append(f"{name}: fused metadata {fused.metadata()} != {plain.metadata()}")


def check_training(failures: list[str]) -> None:
    original = kernels.runs_on
    try:
        for recipe in (lowprec.MXFP8BlockScaling(), lowprec.Float8BlockScaling(use_f32_scales=True)):
            fused, plain = train(True, recipe), train(False, recipe)
            for key in plain:
                if not torch.equal(fused[key], plain[key]):
                    failures.append(f"{type(recipe).__name__} training: {key} differs")
    finally:
        kernels.runs_on = original


def main() -> None:
    index_as_triton_36()
    failures: list[str] = []
    count = check_cases(failures)
    flag_count = check_nonfinite_flags(failures)
    check_te_overflow(failures)
    check_rowwise_only(failures)
    check_wiring(failures)
    check_training(failures)
    print(
        "\n".join(failures[:40])
        or f"ok: {count} FP8 block cases, {flag_count} non-finite flag cases (Triton {triton.__version__})"
    )
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
