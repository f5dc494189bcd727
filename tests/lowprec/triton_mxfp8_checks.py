"""Checks of the fused MXFP8 kernel, run by test_triton_mxfp8.py in a process where
``TRITON_INTERPRET=1`` (set before Triton loads) makes it run on CPU tensors.

1. Rowwise and columnwise bytes and E8M0 scales equal ``BlockQuantizer``'s torch emulation exactly:
   random data over fp32's range, every FP8 value and every tie between two of them (and their
   neighbours) at several block scales, an amax sweep over every fp32 binade and the boundaries of
   the scale rule, zero blocks, NaN of any sign and payload (alone in a block too), infinities, fp32
   subnormals, shapes not divisible by 32, strided views, fp32/bf16/fp16 inputs, E4M3 and E5M2.
2. ``BlockQuantizer`` uses the kernel for MXFP8 with 1 x 32 blocks where ``uses_fused_kernels`` holds
   (and only there), and a Linear trained under MXFP8 gives bit-identical results with it.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for triton_strict (this runs as a script)
from triton_cast_checks import bits, train  # noqa: E402  (this file's folder is on the path too)
from triton_strict import index_as_triton_36  # noqa: E402

import lowprec  # noqa: E402
from lowprec import quantization, triton_mxfp8  # noqa: E402
from lowprec.block_quantization import BlockQuantizer  # noqa: E402
from lowprec.block_scales import MXScaleRule  # noqa: E402
from lowprec.formats import E4M3, E5M2, FP8Format  # noqa: E402

NAN_BITS = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345, 0x7FFFFFFF, 0xFFFFFFFF]


def emulation(fmt: FP8Format) -> BlockQuantizer:
    return BlockQuantizer(MXScaleRule(fmt), fmt, (1, 32), fmt)


def grid_and_ties(fmt: FP8Format) -> torch.Tensor:
    """Every finite FP8 value, the midpoints between neighbours and the fp32 values either side of them."""
    every = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    grid = every[torch.isfinite(every)].unique()
    ties = (grid[1:] + grid[:-1]) / 2
    return torch.cat([grid, ties, torch.nextafter(ties, grid[1:]), torch.nextafter(ties, grid[:-1])])


def tie_case(fmt: FP8Format, exponent: int) -> torch.Tensor:
    """``grid_and_ties`` in 33 columns, with ``fmt.max`` leading every block of both orientations (so each
    block's scale is exactly 2**-exponent), all times 2**exponent."""
    values = grid_and_ties(fmt)
    cols = 33
    rows = -(-values.numel() // cols)
    x = torch.cat([values, torch.zeros(rows * cols - values.numel())]).reshape(rows, cols)
    x[:, ::32] = fmt.max
    x[::32, :] = fmt.max
    return x * 2.0**exponent


def amax_sweep(fmt: FP8Format, g: torch.Generator) -> torch.Tensor:
    """One block (a row of 32) per amax: every power of two of fp32, ``fp8_max`` times them and the
    fp32 values either side, the smallest subnormals, fp32 max and inf; the rest of each block below."""
    powers = 2.0 ** torch.arange(-149, 128, dtype=torch.float64)
    at_max = (powers * fmt.max).float()
    at_max = at_max[torch.isfinite(at_max)]
    inf = torch.full_like(at_max, math.inf)
    extremes = torch.tensor([1e-45, 3e-45, 1e-40, torch.finfo(torch.float32).max, math.inf, 0.0])
    amaxes = torch.cat([powers.float(), at_max, torch.nextafter(at_max, inf), torch.nextafter(at_max, -inf), extremes])
    rest = torch.rand(amaxes.numel(), 31, generator=g) * 2 - 1
    return torch.cat([amaxes[:, None], torch.nan_to_num(amaxes[:, None] * rest, posinf=1.0)], dim=1)


def special_case(g: torch.Generator) -> torch.Tensor:
    """NaNs of every kind (and a block of nothing but NaN), infinities, signed zeros, subnormals, zero blocks."""
    x = torch.randn(70, 90, generator=g)
    x[:, 32:64] = 0.0
    x[5, 32:64] = -0.0
    nans = torch.tensor(NAN_BITS, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x[0, : len(NAN_BITS)] = nans
    x[40:46, 70] = nans
    x[64, :32] = math.nan
    x[2, 3], x[3, 70], x[33, 80] = math.inf, -math.inf, math.inf
    x[10, :32] = torch.tensor([1e-45, -1e-45, 1e-40, 1e-38] * 8)
    return x


def cases():
    g = torch.Generator().manual_seed(0)
    for fmt in (E4M3, E5M2):
        for exponent in (-130, -20, 0, 17, 100):
            yield f"{fmt.name} ties at 2**{exponent}", fmt, tie_case(fmt, exponent)
        yield f"{fmt.name} amax sweep", fmt, amax_sweep(fmt, g)
        random = torch.randn(100, 75, generator=g) * torch.logspace(-30, 30, 75)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            yield f"{fmt.name} random {dtype}", fmt, random.to(dtype)
            yield f"{fmt.name} special {dtype}", fmt, special_case(g).to(dtype)
        yield f"{fmt.name} transposed view", fmt, random.t()
        yield f"{fmt.name} strided view", fmt, random[::3, 1::2]
        for shape in ((1, 1), (1, 33), (33, 1), (31, 31), (64, 64), (0, 5)):
            yield f"{fmt.name} {shape}", fmt, torch.randn(*shape, generator=g) * 1000


def check_cases(failures: list[str]) -> int:
    count = 0
    for name, fmt, x in cases():
        count += 1
        want = emulation(fmt).quantize(x, transpose=True)
        data, scales, data_t, scales_t = triton_mxfp8.quantize_mxfp8(x, fmt, columnwise=True)
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


def check_rowwise_only(failures: list[str]) -> None:
    g = torch.Generator().manual_seed(4)
    for fmt, x in ((E4M3, special_case(g)), (E5M2, special_case(g).to(torch.bfloat16).t())):
        both = triton_mxfp8.quantize_mxfp8(x, fmt, columnwise=True)
        alone = triton_mxfp8.quantize_mxfp8(x, fmt, columnwise=False)
        if not (
            torch.equal(bits(alone[0]), bits(both[0]))
            and torch.equal(bits(alone[1]), bits(both[1]))
            and alone[2:] == (None, None)
        ):
            failures.append(f"{fmt.name}: the rowwise-only cast differs")


def check_wiring(failures: list[str]) -> None:
    original_uses, original_kernel = quantization.uses_fused_kernels, triton_mxfp8.quantize_mxfp8
    calls: list[tuple[int, ...]] = []

    def spy(x, fmt, columnwise):
        calls.append(tuple(x.shape))
        return original_kernel(x, fmt, columnwise)

    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 20, 40, generator=g).to(torch.bfloat16)
    try:
        triton_mxfp8.quantize_mxfp8 = spy
        quantization.uses_fused_kernels = lambda t: t.dim() == 2
        fused = emulation(E4M3).quantize(x, transpose=True)
        two_d = BlockQuantizer(MXScaleRule(E4M3), E4M3, (32, 32), E4M3).quantize(x, transpose=True)
        quantization.uses_fused_kernels = lambda t: False
        plain = emulation(E4M3).quantize(x, transpose=True)
    finally:
        triton_mxfp8.quantize_mxfp8, quantization.uses_fused_kernels = original_kernel, original_uses
    if calls != [(60, 40)]:
        failures.append(f"the kernel ran for {calls}, not once for the 1 x 32 MXFP8 cast")
    if fused.dtype != plain.dtype or fused.shape != plain.shape or two_d.rowwise.layout.block != (32, 32):
        failures.append("fused cast: dtype, shape or 2-D blocks differ")
    for got, want in zip(fused.tensors(), plain.tensors(), strict=True):
        if (got is None) != (want is None) or (got is not None and not torch.equal(bits(got), bits(want))):
            failures.append("fused BlockQuantizer cast differs from the torch path")
    if fused.metadata() != plain.metadata():
        failures.append(f"fused metadata {fused.metadata()} != {plain.metadata()}")


def check_training(failures: list[str]) -> None:
    original = quantization.uses_fused_kernels
    try:
        recipe = lowprec.MXFP8BlockScaling()
        fused, plain = train(True, recipe), train(False, recipe)
    finally:
        quantization.uses_fused_kernels = original
    for key in plain:
        if not torch.equal(fused[key], plain[key]):
            failures.append(f"MXFP8 training: {key} differs")


def main() -> None:
    index_as_triton_36()
    failures: list[str] = []
    count = check_cases(failures)
    check_rowwise_only(failures)
    check_wiring(failures)
    check_training(failures)
    print("\n".join(failures) or f"ok: {count} MXFP8 cases (Triton {triton.__version__})")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
