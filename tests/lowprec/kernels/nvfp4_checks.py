"""Checks of the fused NVFP4 kernel, run by test_nvfp4.py in a process where ``TRITON_INTERPRET=1``
(set before Triton loads) makes it run on CPU tensors.

1. Rowwise and columnwise E2M1 codes, E4M3 scales and per-tensor decode scales equal ``BlockQuantizer``'s
   torch emulation exactly, in 1 x 16 and 16 x 16 blocks: random data over a wide range, every E2M1 value
   and every tie between neighbours (and the fp32 values either side) at several block and tensor scales,
   block amaxes sweeping the E4M3 scale range (saturation at 448, subnormal scales, scales that round to
   0), tensor amaxes of 0, inf, fp32 max and subnormals, NaN of any sign and payload (alone in a block
   and mixed), infinities, signed zeros, fp32 subnormals, shapes not divisible by 16 (and crossing
   tiles), empty tensors, strided and transposed views, fp32/bf16/fp16/fp64 inputs.
2. Stochastic rounding with ``keys`` equals the emulation with the matching ``RoundingStream`` and offset
   (keys whose low half is below and above 2**31; values whose ``units + noise`` is exactly an integer);
   the emulation's 4-D noise is ``uniform`` over the padded 2-D shape in row-major order; the kernel's
   noise equals ``uniform``'s formula at element indices beyond 2**32 too.
3. The rowwise-only cast equals the rowwise part of the rowwise + columnwise one; the amax pass ignores NaN.
   Its non-finite flags equal, tile by tile, torch's ``~isfinite`` of the same elements for every case above,
   stochastic ones included (empty tensors: a single 0), and for a NaN, a +inf and a -inf each alone in a
   tile, at the last row or column of ragged tiles and inside whole ones, beside finite ragged tiles: fp32
   and bf16, rowwise only and with columnwise, with and without keys.
   Transformer Engine's rules by hand: a NaN leaves its block's scale to the other elements (scale 0x7E,
   not NaN), and the decode scale is amax / 2688 correctly rounded (amax 5: 0x3af3cf3d).
4. ``BlockQuantizer`` casts every NVFP4 tensor with the kernel where ``kernels.runs_on`` holds (the
   Hadamard-transformed columnwise copy from a second launch), bit-identical to the torch path, and a
   Linear trained under NVFP4BlockScaling gives bit-identical results with it.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))  # for triton_strict (this runs as a script)
from block_fp8_checks import flag_failure, planted  # noqa: E402  (this file's folder is on the path too)
from fp8_cast_checks import train  # noqa: E402
from triton_strict import index_as_triton_36  # noqa: E402

import lowprec  # noqa: E402
from lowprec import kernels  # noqa: E402
from lowprec.formats.elements import (  # noqa: E402
    E2M1,
    E4M3,  # noqa: E402
    MAGNITUDES,
)
from lowprec.formats.noise import MASK32, NOISE_BITS, RoundingStream, hash32, uniform  # noqa: E402
from lowprec.formats.scales import NVFP4ScaleRule  # noqa: E402
from lowprec.kernels import nvfp4  # noqa: E402
from lowprec.quant.block import BlockQuantizer  # noqa: E402

NAN_BITS = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345, 0x7FFFFFFF, 0xFFFFFFFF]
FP32_MAX = torch.finfo(torch.float32).max
TENSOR_MAX = E4M3.max * E2M1.max  # a tensor amax of 2688 * 2**k makes the encode scale 2**-k
PARTS = ("data", "scales", "tensor_scale_inv", "data_t", "scales_t", "tensor_scale_inv_t")
AMAX_TILE = (nvfp4.AMAX_TILE_ROWS, nvfp4.AMAX_TILE_COLS)  # the tiles of the flags


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def emulation(block_height: int, rounding: RoundingStream | None = None, offset: int | None = None) -> BlockQuantizer:
    return BlockQuantizer(NVFP4ScaleRule(), E2M1, (block_height, 16), E4M3, rounding=rounding, fixed_offset=offset)


def reference(x: torch.Tensor, block_height: int) -> tuple:
    """The emulation's six tensors; ``quantize`` cannot reshape a tensor with no columns, so those go
    straight to the orientations it would cast."""
    quantizer = emulation(block_height)
    if x.shape[1]:
        return quantizer.quantize(x, transpose=True).inner_tensors().values()
    rowwise, columnwise = (
        quantizer._orientation(x.float(), False, None, None, x.dtype),
        quantizer._orientation(x.float(), True, None, None, x.dtype),
    )
    return (
        rowwise.data,
        rowwise.scales,
        rowwise.tensor_scale_inv,
        columnwise.data,
        columnwise.scales,
        columnwise.tensor_scale_inv,
    )


def grid_and_ties() -> torch.Tensor:
    """Every E2M1 magnitude, the midpoints between neighbours and the fp32 values either side of both (just
    above 6 saturates), with both signs."""
    grid = torch.tensor(MAGNITUDES)
    ties = (grid[1:] + grid[:-1]) / 2
    points = torch.cat([grid, ties])
    up, down = torch.nextafter(points, torch.tensor(math.inf)), torch.nextafter(points, torch.tensor(0.0))
    values = torch.cat([points, up, down[1:]])
    return torch.cat([values, -values])


def tie_case(block_exponent: float, scale: float) -> torch.Tensor:
    """``grid_and_ties`` in 33 columns, times ``scale * 2**k`` (``scale`` an E4M3 value), each block of both
    orientations led by ``6 * scale * 2**k`` (so its E4M3 scale is ``scale``) and the tensor amax
    ``2688 * 2**k`` (so the decode scale is ``2**k``): the scaled values are exactly the E2M1 grid and ties."""
    values = grid_and_ties()
    cols = 33
    rows = -(-values.numel() // cols)
    x = torch.cat([values, torch.zeros(rows * cols - values.numel())]).reshape(rows, cols) * scale
    x[:, ::16] = 6 * scale
    x[::16, :] = 6 * scale
    x[-1, -1] = TENSOR_MAX
    return x * 2.0**block_exponent


def amax_sweep(tensor_amax: float, g: torch.Generator) -> torch.Tensor:
    """One block (a row of 16) per amax, under a tensor amax of ``tensor_amax``: 6 * 2**k / 2688 times the
    tensor amax for every E4M3 value, the midpoints between neighbours, the fp32 values either side of
    both, and the amaxes near and below where the scale rounds to 0; the rest of each block below it."""
    e4m3 = torch.arange(256, dtype=torch.uint8).view(E4M3.dtype).float()
    grid = e4m3[torch.isfinite(e4m3) & (e4m3 >= 0)].unique()
    ties = (grid[1:] + grid[:-1]) / 2
    tiny = torch.tensor([2.0**-10, 2.0**-11, 2.0**-20, 2.0**-10 * 1.0000001, 2.0**-10 * 0.9999999])
    targets = torch.cat([grid, ties, torch.nextafter(ties, grid[1:]), torch.nextafter(ties, grid[:-1]), tiny, grid[-1:]])
    amaxes = (targets.double() * (tensor_amax / E4M3.max)).float()
    rest = torch.rand(amaxes.numel(), 15, generator=g) * 2 - 1
    x = torch.cat([amaxes[:, None], amaxes[:, None] * rest], dim=1)
    x[-1, 0] = tensor_amax
    return x


def special_case(g: torch.Generator) -> torch.Tensor:
    """NaNs of every kind (alone in a block, mixed, a block of nothing but NaN), infinities, signed zeros,
    fp32 subnormals, zero blocks."""
    x = torch.randn(40, 50, generator=g)
    x[:, 16:32] = 0.0
    x[5, 16:32] = -0.0
    x[6, 16:20] = torch.tensor([-0.0, 0.0, -0.0, 1e-3])
    nans = torch.tensor(NAN_BITS, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x[0, : len(NAN_BITS)] = nans
    x[20:26, 40] = nans
    x[33, :16] = math.nan
    x[17, 20] = math.nan  # alone in a zero block
    x[2, 3], x[3, 45], x[35, 2] = math.inf, -math.inf, math.inf
    x[10, :16] = torch.tensor([1e-45, -1e-45, 1e-40, 1e-38] * 4)
    return x


def tensor_amax_cases(g: torch.Generator) -> Iterator[tuple[str, torch.Tensor]]:
    base = torch.randn(20, 40, generator=g)
    yield "tensor amax 0", torch.zeros(20, 40)
    yield "tensor amax -0", torch.full((3, 5), -0.0)
    yield "tensor amax inf", torch.cat([base[:10], torch.full((1, 40), -math.inf), base[10:] * 1e30])
    yield "tensor amax fp32 max", torch.cat([base * 1e-5, torch.full((1, 40), FP32_MAX)])
    yield "tensor amax huge", base * 1e37
    yield "tensor amax tiny", base * 1e-40
    yield "tensor amax smallest subnormal", torch.tensor([[1e-45, 0.0, -1e-45] * 6])
    yield "tensor amax only NaN", torch.full((17, 18), math.nan)
    yield "NaN and a tiny amax", torch.tensor([[math.nan] + [1e-38] * 20])


def cases() -> Iterator[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    for exponent in (-120, -20, 0, 9, 100):
        for scale in (1.0, 2.0**-9, 0.75, 3.5, 256.0):
            yield f"ties at scale {scale} * 2**{exponent}", tie_case(exponent, scale)
    # 13 and 0.3: the tensor amax's own block scale rounds to just above 448 and saturates; 1e-30 just below
    for tensor_amax in (TENSOR_MAX, 13.0, 0.3, 3.0e-5, 1.7e38, 1e-30, 6.1e-39):
        yield f"amax sweep under {tensor_amax}", amax_sweep(tensor_amax, g)
    yield "amax sweep under inf", torch.cat([amax_sweep(TENSOR_MAX, g), torch.full((1, 16), math.inf)])
    yield from tensor_amax_cases(g)
    wide = torch.randn(70, 45, generator=g) * torch.logspace(-6, 6, 45)
    wider = torch.randn(40, 35, generator=g) * torch.logspace(-35, 35, 35)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        yield f"random {dtype}", wide.to(dtype)
        yield f"special {dtype}", special_case(g).to(dtype)
    yield "random over fp32's range", wider
    yield "random bf16 over fp32's range", wider.to(torch.bfloat16)
    yield "random float64", wide.double() * (1 + 1e-12)
    yield "transposed view", wide.t()
    yield "strided view", wide[::3, 1::2]
    yield "transposed strided view", wide.t()[1::2, 3:]
    yield "broadcast view (row stride 0)", wide[5:6].expand(33, 45)
    for shape in ((1, 1), (1, 17), (17, 1), (15, 33), (16, 16), (65, 66), (0, 5), (5, 0), (0, 0)):
        yield f"shape {shape}", torch.randn(*shape, generator=g) * 100


def compare(name: str, got: tuple, want: tuple, failures: list[str]) -> None:
    for part, a, b in zip(PARTS, got, want, strict=True):
        if (a is None) != (b is None):
            failures.append(f"{name}: {part} is {a is None and 'None' or 'set'}, expected {b is None and 'None' or 'set'}")
        elif a is not None and (
            a.dtype != b.dtype or a.shape != b.shape or a.device != b.device or not torch.equal(bits(a), bits(b))
        ):
            where = (
                (bits(a) != bits(b)).nonzero()[:3].tolist() if a.shape == b.shape and a.dtype == b.dtype else (a.shape, a.dtype)
            )
            failures.append(f"{name}: {part} differ at {where} (expected {b.shape}, {b.dtype})")


def check_cases(failures: list[str]) -> int:
    count = 0
    for name, x in cases():
        for height in (1, 16):
            count += 1
            want = reference(x, height)
            got = nvfp4.quantize_nvfp4(x, height, columnwise=True)
            compare(f"{name}, {height} x 16", got[:6], want, failures)
            if wrong := flag_failure(got[6], x, AMAX_TILE):
                failures.append(f"{name}, {height} x 16: {wrong}")
    return count


def stochastic_cases() -> Iterator[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    yield "random", torch.randn(70, 45, generator=g) * torch.logspace(-3, 3, 45)
    yield "random bf16 transposed", (torch.randn(33, 80, generator=g) * 10).to(torch.bfloat16).t()
    yield "special", special_case(g)
    yield "ties", tie_case(0, 1.0)
    yield "shape (1, 5)", torch.randn(1, 5, generator=g)


def check_stochastic(failures: list[str]) -> int:
    stream, count = RoundingStream(1234, "layer.3.gradient"), 0
    key_halves = set()
    offsets_and_cases = list(enumerate(stochastic_cases()))
    offsets_and_cases.append((9, ("units + noise exactly 1", exact_sum_case(stream.key(9, "rowwise")))))
    for offset, (name, x) in offsets_and_cases:
        keys = (stream.key(offset, "rowwise"), stream.key(offset, "columnwise"))
        key_halves.update((key & 0xFFFFFFFF) >= 2**31 for key in keys)
        for height in (1, 16):
            count += 1
            want = emulation(height, stream, offset).quantize(x, transpose=True).inner_tensors().values()
            got = nvfp4.quantize_nvfp4(x, height, columnwise=True, keys=keys)
            compare(f"stochastic {name}, {height} x 16, offset {offset}", got[:6], want, failures)
            if wrong := flag_failure(got[6], x, AMAX_TILE):
                failures.append(f"stochastic {name}, {height} x 16: {wrong}")
            nearest = nvfp4.quantize_nvfp4(x, height, columnwise=True)
            if x.numel() > 100 and torch.equal(nearest[0], got[0]):
                failures.append(f"stochastic {name}: rounds as round to nearest does")
    if key_halves != {False, True}:
        failures.append("the stochastic checks do not cover key low halves both below and above 2**31")
    for shape, height in (((37, 70), 1), ((37, 70), 16)):
        padded = (-(-shape[0] // height) * height, -(-shape[1] // 16) * 16)
        four_d = (padded[0] // height, height, padded[1] // 16, 16)
        if not torch.equal(uniform(99, four_d, "cpu").reshape(padded), uniform(99, padded, "cpu")):
            failures.append(f"the emulation's 4-D noise is not the padded 2-D noise for {shape}, {height} x 16")
    return count


def exact_sum_case(key: int) -> torch.Tensor:
    """A rowwise cast whose scaled values are ``0.5 * (1 - noise)`` (one E2M1 step short of 0.5 by exactly
    the noise: ``units + noise`` is exactly 1 and rounds up), each block led by 6 (scale 1) under the
    tensor amax 2688 (decode scale 1)."""
    rows, cols = 20, 48
    x = 0.5 * (1 - uniform(key, (rows, cols), "cpu"))
    x[:, ::16] = 6.0
    x[0, 0] = TENSOR_MAX
    return x


@triton.jit
def _noise_kernel(index_ptr, out_ptr, key_lo, key_hi, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    index = tl.load(index_ptr + offsets, mask=offsets < n, other=0)
    tl.store(out_ptr + offsets, nvfp4._uniform(index, key_lo.to(tl.uint32), key_hi.to(tl.uint32)), mask=offsets < n)


def check_nonfinite_flags(failures: list[str]) -> int:
    """A NaN, a +inf and a -inf each alone in its amax tile: at the last row and the last column of ragged tiles
    and inside whole ones, beside finite tiles (ragged ones too); and a finite ragged tensor."""
    g = torch.Generator().manual_seed(6)
    stream, count = RoundingStream(8, "flags"), 0
    tile_rows, tile_cols = AMAX_TILE
    rows, cols = tile_rows + 5, 2 * tile_cols + 3  # 2 x 3 tiles, the last row and column of them ragged
    spots = {  # tile (row, col): what it holds
        (rows - 1, cols - 1): math.nan,  # (1, 2): the ragged corner's last element
        (rows - 1, 3): -math.inf,  # (1, 0): the ragged tile row's last row
        (7, cols - 1): math.inf,  # (0, 2): the ragged tile column's last column
        (9, tile_cols + 9): -math.inf,  # (0, 1): inside a whole tile
    }
    for height, dtype, columnwise, offset in ((1, torch.float32, False, None), (16, torch.bfloat16, True, 0)):
        keys = None if offset is None else (stream.key(offset, "rowwise"), stream.key(offset, "columnwise"))
        for name, x in (
            ("planted", planted((rows, cols), dtype, spots, g)),
            ("finite ragged", planted((rows - 2, cols - 1), dtype, {}, g)),
        ):
            count += 1
            got = nvfp4.quantize_nvfp4(x, height, columnwise, keys)
            if wrong := flag_failure(got[6], x, AMAX_TILE):
                failures.append(f"{height} x 16 {dtype} columnwise={columnwise} keys={keys is not None} {name}: {wrong}")
    return count


def check_noise(failures: list[str]) -> None:
    """The kernel's noise at element indices beyond 2**32 (whose high half enters the hash) equals
    ``uniform``'s formula, which is checked against ``uniform`` itself for the first indices."""
    key = RoundingStream(3, "x").key(0, "rowwise")
    index = torch.cat([torch.arange(20), torch.tensor([2**32 - 1, 2**32, 2**32 + 5, 3 * 2**32 + 7, 2**40 + 123])])

    def formula(index: torch.Tensor) -> torch.Tensor:
        mixed = hash32(hash32((index & MASK32) ^ (key & MASK32)) ^ (index >> 32) ^ (key >> 32))
        return (mixed >> (32 - NOISE_BITS)).float() * 2.0**-NOISE_BITS

    got = torch.empty(index.numel(), dtype=torch.float32)
    _noise_kernel[(1,)](index, got, key & MASK32, key >> 32, index.numel(), BLOCK=32)
    if not torch.equal(formula(torch.arange(20)), uniform(key, (20,), "cpu")):
        failures.append("the noise formula of this check is not uniform's")
    if not torch.equal(bits(got), bits(formula(index))):
        failures.append(f"kernel noise differs at indices {index[got != formula(index)].tolist()}")


def check_amax(failures: list[str]) -> None:
    g = torch.Generator().manual_seed(5)
    for x in (
        special_case(g),
        special_case(g).to(torch.float16).t(),
        torch.full((70, 130), math.nan),
        torch.randn(130, 3, generator=g),
    ):
        want = torch.where(x.isnan(), 0.0, x.float().abs()).amax()
        got = nvfp4.tensor_amax(x)
        if got.shape != () or got.dtype != torch.float32 or not torch.equal(bits(got), bits(want)):
            failures.append(f"tensor_amax {got} != {want} for shape {tuple(x.shape)}")


def check_te_rules(failures: list[str]) -> None:
    """Block [NaN, 6, 3, 0...]: amax 6 (NaN ignored), S_enc = 448, scale e4m3(448.00003) = 0x7E, codes 0 (NaN),
    7 (6) and 5 (3). A tensor of amax 5: S_dec = 5 / 2688 = 0.00186011904 -> 0x3af3cf3d (1 / fp32(2688 / 5)
    would be 0x3af3cf3e), in both orientations."""
    x = torch.zeros(2, 32)
    x[0, :3] = torch.tensor([math.nan, 6.0, 3.0])
    data, scales, *_ = nvfp4.quantize_nvfp4(x, 1, False)
    if scales.view(torch.uint8)[0].tolist() != [0x7E, 0] or data[0, :3].tolist() != [0, 7, 5]:
        failures.append(f"NaN block: scales {scales.view(torch.uint8).tolist()}, codes {data[0, :3].tolist()}")
    x = torch.zeros(16, 16)
    x[3, 5] = -5.0
    _, _, decode, _, _, decode_t, _ = nvfp4.quantize_nvfp4(x, 1, True)
    for name, got in (("rowwise", decode), ("columnwise", decode_t)):
        if got.view(torch.int32).item() != 0x3AF3CF3D:
            failures.append(f"{name} decode scale of amax 5: {hex(got.view(torch.int32).item())}, not 0x3af3cf3d")


def check_rowwise_only(failures: list[str]) -> None:
    g = torch.Generator().manual_seed(4)
    stream = RoundingStream(5, "w")
    for height, x, keys in (
        (1, special_case(g), None),
        (16, special_case(g).to(torch.bfloat16).t(), None),
        (1, special_case(g), (stream.key(0, "rowwise"), stream.key(0, "columnwise"))),
        (16, special_case(g)[3:], (stream.key(1, "rowwise"), stream.key(1, "columnwise"))),
    ):
        both = nvfp4.quantize_nvfp4(x, height, columnwise=True, keys=keys)
        alone = nvfp4.quantize_nvfp4(x, height, columnwise=False, keys=keys)
        if not (
            all(torch.equal(bits(a), bits(b)) for a, b in zip(alone[:3], both[:3], strict=True)) and alone[3:6] == (None,) * 3
        ):
            failures.append(f"{height} x 16, keys {keys is not None}: the rowwise-only cast differs")
        if wrong := flag_failure(alone[6], x, AMAX_TILE):
            failures.append(f"{height} x 16, keys {keys is not None}, rowwise only: {wrong}")


def check_wiring(failures: list[str]) -> None:
    """``BlockQuantizer`` of each NVFP4 tensor (Hadamard transform, 16 x 16 blocks, stochastic rounding) casts
    with the kernel where ``kernels.runs_on`` holds, the same bits and offsets as the torch path."""
    original_uses, original_kernel = kernels.runs_on, nvfp4.quantize_nvfp4
    calls: list[tuple[tuple[int, ...], int, bool, bool]] = []

    def spy(x, block_height, columnwise, keys=None):
        calls.append((tuple(x.shape), block_height, columnwise, keys is not None))
        return original_kernel(x, block_height, columnwise, keys)

    x = torch.randn(3, 20, 40, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    results = {}
    try:
        nvfp4.quantize_nvfp4 = spy
        for fused in (True, False):
            kernels.runs_on = (lambda t: t.dim() == 2) if fused else (lambda t: False)
            quantizers = lowprec.NVFP4BlockScaling(seed=7).quantizers("fc")
            results[fused] = {name: [q.quantize(x, transpose=True), q.quantize(x)] for name, q in quantizers.items()}
    finally:
        nvfp4.quantize_nvfp4, kernels.runs_on = original_kernel, original_uses
    want_calls = [  # activation: rowwise, then its transformed transpose; weight: 16 x 16, both at once; gradient: noise
        ((60, 40), 1, False, False), ((40, 64), 1, False, False), ((60, 40), 1, False, False),
        ((60, 40), 16, True, False), ((60, 40), 16, False, False),
        ((60, 40), 1, False, True), ((40, 64), 1, False, True), ((60, 40), 1, False, True),
    ]  # fmt: skip
    if calls != want_calls:
        failures.append(f"the kernel ran for {calls}, expected {want_calls}")
    for name, casts in results[True].items():
        for fused, plain in zip(casts, results[False][name], strict=True):
            if fused.metadata() != plain.metadata() or fused.rounding_offset != plain.rounding_offset:
                failures.append(f"{name}: fused metadata {fused.metadata()} != {plain.metadata()}")
            for got, want in zip(fused.inner_tensors().values(), plain.inner_tensors().values(), strict=True):
                same = got is not None and want is not None and torch.equal(bits(got.reshape(-1)), bits(want.reshape(-1)))
                if (got is None) != (want is None) or (got is not None and not same):
                    failures.append(f"{name}: the fused BlockQuantizer cast differs from the torch path")


def check_training(failures: list[str]) -> None:
    original = kernels.runs_on
    try:
        recipe = lowprec.NVFP4BlockScaling(seed=2)
        fused, plain = train(True, recipe), train(False, recipe)
    finally:
        kernels.runs_on = original
    for key in plain:
        if not torch.equal(fused[key], plain[key]):
            failures.append(f"NVFP4 training: {key} differs")


def main() -> None:
    index_as_triton_36()
    np.seterr(all="ignore")  # the interpreter's numpy divides 1 by a zero scale, as the GPU does
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    failures: list[str] = []
    count = check_cases(failures)
    count += check_stochastic(failures)
    flag_count = check_nonfinite_flags(failures)
    check_te_rules(failures)
    check_rowwise_only(failures)
    check_noise(failures)
    check_amax(failures)
    check_wiring(failures)
    check_training(failures)
    print("\n".join(failures) or f"ok: {count} NVFP4 cases, {flag_count} non-finite flag cases (Triton {triton.__version__})")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
