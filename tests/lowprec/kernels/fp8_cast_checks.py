"""Checks of the fused FP8 cast kernels, run by test_fp8_cast.py in a process where
``TRITON_INTERPRET=1`` (set before Triton loads) makes the kernels run on CPU tensors.

1. The bytes equal ``FP8Format.cast(x * scale)`` exactly: every FP8 value, every tie between two of
   them and its neighbours, NaN of both signs, infinities, zeros of both signs, fp32 subnormals,
   saturation, several scales, input dtypes and strides; the transposed bytes are the transpose.
   Every NaN (either sign, any payload, fp32, bf16 and fp16) is the byte 0x7F in both layouts.
2. The amaxes equal ``x.abs().amax()`` with NaN ignored (as TE's ``fmaxf``), over several loop rounds.
3. The scales of current scaling and the history and scales of delayed scaling, each from one tiny
   kernel, equal ``scale_from_amax`` and ``DelayedScalingQuantizer.record_amax`` exactly: zero, NaN,
   infinite and tiny amaxes (scale overflow), margins, both amax algorithms, several history lengths,
   partials of shape (2, P) and 1-D ones alike; and TE's correctly rounded quotient by hand
   (448 / 903.6708984375 -> 0x3efdd3b1).
3b. The non-finite flags (row 1 of the partials) of the amax pass and of the cast equal, program by program
   and tile by tile, torch's ``~isfinite`` of the same elements, and the probes of both scalings are NaN
   exactly when the tensor holds a NaN or +-inf, 0 otherwise: one NaN, +inf or -inf anywhere, at the last
   row and column of ragged tiles (65 x 257, 3 x 200), none (ragged shapes' padding never flags), the
   largest finite values, bf16, fp16 and fp32, E4M3 and E5M2; 1-D partials give no probe and the same
   history and scales.
4. A ``lowprec.Linear`` trained with the kernels standing in for CUDA's gives bit-identical outputs,
   gradients and amax histories to the torch path, and its operands carry the transposed layout.
5. With ``torch._scaled_mm`` (it runs on the CPU too) standing in for the GPU's, all three GEMMs of a
   layer get their operands in the layouts it wants straight from the fused casts, with no copy.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))  # for triton_strict (this runs as a script)
from triton_strict import index_as_triton_36  # noqa: E402

import lowprec  # noqa: E402
from lowprec import kernels  # noqa: E402
from lowprec.formats.elements import E4M3, E5M2  # noqa: E402
from lowprec.formats.scales import scale_from_amax  # noqa: E402
from lowprec.kernels import (
    fp8_cast,  # noqa: E402
    fp8_scales,  # noqa: E402
)
from lowprec.quant import per_tensor  # noqa: E402


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def same_amax(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (math.isnan(a.item()) and math.isnan(b.item())) or a.item() == b.item()


def reference_amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` with NaN ignored, in plain torch."""
    return per_tensor.nan_ignoring_amax(x.float().abs())


def value_cases():
    g = torch.Generator().manual_seed(0)
    for fmt in (E4M3, E5M2):
        every = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
        grid = every[torch.isfinite(every)].unique()
        ties = (grid[1:] + grid[:-1]) / 2
        up, down = torch.full_like(ties, math.inf), torch.full_like(ties, -math.inf)
        special = [math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, -1e-45, 1e-38, 3e38, -3e38]
        special += [fmt.max, fmt.max * 1.01, -fmt.max * 1.2]
        random = torch.randn(3000, generator=g) * torch.logspace(-20, 20, 3000)
        values = torch.cat([grid, ties, torch.nextafter(ties, up), torch.nextafter(ties, down), torch.tensor(special), random])
        cols = 37
        rows = -(-values.numel() // cols)
        x = torch.cat([values, torch.zeros(rows * cols - values.numel())]).reshape(rows, cols)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for scale in (1.0, 3.7, 2.0**-20, 2.0**30):
                yield f"{fmt.name} {dtype} scale {scale}", fmt, x.to(dtype), torch.tensor(scale)
        yield f"{fmt.name} transposed view", fmt, x.t(), torch.tensor(1.5)
        yield f"{fmt.name} 1x1", fmt, torch.tensor([[0.3]]), torch.tensor(2.0)
        yield f"{fmt.name} 130x70", fmt, torch.randn(130, 70, generator=g), torch.tensor(100.0)


def check_casts(failures: list[str]) -> int:
    count = 0
    for name, fmt, x, scale in value_cases():
        count += 1
        want = bits(fmt.cast(x.float() * scale))
        data, data_t, partials = fp8_cast.cast_fp8(x, scale, fmt, transpose=True, record_amax=True)
        amax = partials[0].amax()
        if not torch.equal(bits(data), want):
            wrong = (bits(data) != want).nonzero()[:3].tolist()
            failures.append(f"{name}: bytes differ at {wrong}")
        if not torch.equal(bits(data_t), want.t().contiguous()):
            failures.append(f"{name}: transposed bytes differ")
        if not same_amax(amax, reference_amax(x)):
            failures.append(f"{name}: amax {amax.item()} != {reference_amax(x).item()}")
        alone, none_t, no_partials = fp8_cast.cast_fp8(x, scale, fmt, transpose=False)
        if not torch.equal(bits(alone), want) or none_t is not None or no_partials is not None:
            failures.append(f"{name}: cast without transpose and amax differs")
    data, data_t, partials = fp8_cast.cast_fp8(torch.zeros(0, 5), torch.tensor(1.0), E4M3, True, True)
    if data.shape != (0, 5) or data_t.shape != (5, 0) or not torch.equal(partials, torch.zeros(2, 1)):
        failures.append("empty tensor")
    if not torch.equal(fp8_cast.amax_partials(torch.zeros(0, 5)), torch.zeros(2, 1)):
        failures.append("empty tensor's amax partials")
    return count


NAN_BITS = {  # +NaN, -NaN, NaNs with payloads (signalling ones too), all-ones of both signs
    torch.float32: (torch.int32, [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345, 0x7FFFFFFF, 0xFFFFFFFF]),
    torch.bfloat16: (torch.int16, [0x7FC0, 0xFFC0, 0x7F81, 0xFF85, 0x7FFF, 0xFFFF]),
    torch.float16: (torch.int16, [0x7E00, 0xFE00, 0x7C01, 0xFC2A, 0x7FFF, 0xFFFF]),
}


def check_nan_bytes(failures: list[str]) -> None:
    """The kernel writes the canonical NaN byte 0x7F for every NaN, as ``FP8Format.cast`` does."""
    for dtype, (int_dtype, nan_bits) in NAN_BITS.items():
        nans = torch.tensor(nan_bits, dtype=torch.int64).to(int_dtype).view(dtype)
        x = torch.cat([nans, torch.tensor([1.0, -2.0], dtype=dtype)]).reshape(2, 4)
        for fmt in (E4M3, E5M2):
            data, data_t, _ = fp8_cast.cast_fp8(x, torch.tensor(3.0), fmt, transpose=True)
            for name, got, nan_at in (("bytes", data, x.isnan()), ("transposed bytes", data_t, x.isnan().t())):
                if bits(got)[nan_at].unique().tolist() != [0x7F] or bits(got)[~nan_at].eq(0x7F).any():
                    failures.append(f"NaN {dtype} {fmt.name}: {name} {bits(got).tolist()}")


def check_amax(failures: list[str]) -> None:
    fp8_cast.AMAX_PROGRAMS = 3  # several rounds of the loop with small tensors
    g = torch.Generator().manual_seed(1)
    n = fp8_cast.AMAX_BLOCK * 7 + 5
    for name, x in [
        ("random", torch.randn(n, generator=g)),
        ("bf16 2-D", torch.randn(n // 3, 3, generator=g).to(torch.bfloat16)),
        ("inf", torch.cat([torch.randn(n, generator=g), torch.tensor([-math.inf])])),
        ("zeros", torch.zeros(n)),
        ("non-contiguous", torch.randn(300, 200, generator=g).t()),
        ("one element", torch.tensor([-3.5])),
    ] + [(f"NaN at {i}", torch.randn(n, generator=g).index_fill_(0, torch.tensor([i]), math.nan)) for i in (0, 4096, n - 1)]:
        got, want = fp8_cast.amax_of(x), reference_amax(x)
        if not same_amax(got, want):
            failures.append(f"amax {name}: {got.item()} != {want.item()}")


def check_scales(failures: list[str]) -> None:
    g = torch.Generator().manual_seed(2)
    tensors = {
        "random": torch.randn(70, 50, generator=g),
        "zeros": torch.zeros(8, 8),
        "tiny": torch.full((4, 4), 1e-44),
        "huge": torch.full((3, 3), 3e38),
        "NaN": torch.tensor([[1.0, math.nan]]),
        "all NaN": torch.full((2, 3), math.nan),
        "TE quotient": torch.tensor([[903.6708984375, -1.0]]),
        "inf": torch.tensor([[1.0, -math.inf]]),
    }
    for name, x in tensors.items():
        for fmt, margin in ((E4M3, 0), (E5M2, 3)):
            scale, scale_inv, probe = fp8_scales.current_scaling(x, fmt, margin)
            want = scale_from_amax(reference_amax(x), fmt, margin)
            if not (torch.equal(scale, want) and torch.equal(scale_inv, want.reciprocal())):
                failures.append(f"current scale {name} {fmt.name}: {scale.item()}, {scale_inv.item()} != {want.item()}")
            if not right_probe(probe, x):
                failures.append(f"current scale {name} {fmt.name}: probe {probe}")
    amaxes = [3.0, 0.0, 250.0, math.nan, 1e-3, math.inf, 7.5, 1e-44, 2.0]
    for length, algo, margin in ((1, "max", 0), (5, "max", 1), (4, "most_recent", 0), (1024, "max", 2)):
        recipe = lowprec.DelayedScaling(amax_history_len=length, amax_compute_algo=algo, margin=margin)
        reference = per_tensor.DelayedScalingQuantizer(E4M3, recipe)
        history, scale = reference.amax_history.clone(), reference.scale.clone()
        for amax in amaxes:
            partials = torch.tensor([amax / 2, amax, 0.0])
            flags = (~partials.isfinite()).float()  # what a cast of such values flags
            update = fp8_scales.delayed_scaling_update(partials, history, scale, E4M3, margin, algo == "max")
            with_flags = fp8_scales.delayed_scaling_update(
                torch.stack([partials, flags]), history, scale, E4M3, margin, algo == "max"
            )
            history, scale, scale_inv, probe = update
            reference.record_amax(reference_amax(partials))  # the partials' max, NaN ignored
            same = torch.equal(history.nan_to_num(-1), reference.amax_history.nan_to_num(-1))
            if not (same and torch.equal(scale, reference.scale) and torch.equal(scale_inv, reference.scale_inv)):
                failures.append(
                    f"delayed {length} {algo} margin {margin}, amax {amax}: {scale.item()} != {reference.scale.item()}"
                )
                break
            if probe is not None or not same_update(with_flags[:3], update[:3]) or not right_probe(with_flags[3], partials):
                failures.append(f"delayed {length} {algo} margin {margin}, amax {amax}: (2, P) partials {with_flags}")
                break


def check_te_quotient(failures: list[str]) -> None:
    """Transformer Engine's ``__fdiv_rn(448, amax)``: 448 / 903.6708984375 = 0.49575570130 -> fp32 0x3efdd3b1
    (reciprocal-then-multiply gives 0x3efdd3b2); with margin 1, 224 / amax -> 0x3e7dd3b1. A NaN is ignored."""
    x = torch.tensor([[903.6708984375, math.nan, -2.0]])
    scale, _, _ = fp8_scales.current_scaling(x, E4M3, 0)
    if scale.view(torch.int32).item() != 0x3EFDD3B1:
        failures.append(f"current scale of amax 903.6708984375: {hex(scale.view(torch.int32).item())}, not 0x3efdd3b1")
    history, scale = torch.zeros(2), torch.ones(())
    partials = fp8_cast.cast_fp8(x, scale, E4M3, transpose=False, record_amax=True)[2]
    history, scale, _, _ = fp8_scales.delayed_scaling_update(partials, history, scale, E4M3, 1, True)
    if history.tolist() != [903.6708984375, 0.0] or scale.view(torch.int32).item() != 0x3E7DD3B1:
        failures.append(f"delayed update: history {history.tolist()}, scale {hex(scale.view(torch.int32).item())}")


def right_probe(probe: torch.Tensor | None, x: torch.Tensor) -> bool:
    """A 0-dim fp32 probe on ``x``'s device: NaN if ``x`` holds a NaN or an infinity, else 0."""
    if probe is None or probe.shape != () or probe.dtype != torch.float32 or probe.device != x.device:
        return False
    return math.isnan(probe.item()) if not x.isfinite().all() else probe.item() == 0.0


def same_update(a, b) -> bool:
    """The same ``(history, scale, scale_inv)``, bit for bit."""
    return all(torch.equal(bits(s.reshape(-1)), bits(t.reshape(-1))) for s, t in zip(a, b, strict=True))


def program_references(x: torch.Tensor, programs: int) -> torch.Tensor:
    """What ``amax_partials(x)`` should hold, in torch: program ``p`` reads blocks ``p, p + programs, ...`` of
    ``AMAX_BLOCK`` elements of the flattened tensor, zeros beyond its end."""
    flat = x.reshape(-1).float()
    blocks = -(-flat.numel() // fp8_cast.AMAX_BLOCK)
    flat = torch.cat([flat, flat.new_zeros(blocks * fp8_cast.AMAX_BLOCK - flat.numel())])
    rounds = -(-blocks // programs)
    flat = torch.cat([flat, flat.new_zeros((rounds * programs - blocks) * fp8_cast.AMAX_BLOCK)])
    per_program = flat.reshape(rounds, programs, fp8_cast.AMAX_BLOCK).transpose(0, 1).reshape(programs, -1)
    return torch.stack([per_program.abs().nan_to_num(nan=0.0, posinf=math.inf).amax(1), (~per_program.isfinite()).any(1).float()])


def tile_references(x: torch.Tensor) -> torch.Tensor:
    """What ``cast_fp8(x, ..., record_amax=True)`` should return as partials, in torch: column ``r * tile_cols
    + c`` from the tile of rows ``r * TILE ...`` and columns ``c * TILE ...`` (of the real elements only)."""
    tile = fp8_cast.TILE
    columns = [x[r : r + tile, c : c + tile].float() for r in range(0, x.shape[0], tile) for c in range(0, x.shape[1], tile)]
    amaxes = [reference_amax(t) for t in columns]
    flags = [(~t.isfinite()).any().float() for t in columns]
    return torch.stack([torch.stack(amaxes), torch.stack(flags)])


def nonfinite_cases():
    """``(name, x)``: tensors without and with one NaN, +inf or -inf, in ragged tiles too."""
    g = torch.Generator().manual_seed(3)
    for rows, cols in ((65, 257), (3, 200), (64, 128), (130, 70)):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            base = torch.randn(rows, cols, generator=g).to(dtype)
            yield f"{rows}x{cols} {dtype} finite", base
            largest = base.clone()
            largest[0, 0], largest[-1, -1] = torch.finfo(dtype).max, -torch.finfo(dtype).max
            yield f"{rows}x{cols} {dtype} largest finite", largest
            at = [(rows - 1, cols - 1)]  # the last row and column of a ragged tile
            at += [(rows // 2, cols // 3), (0, 0), (rows - 1, 0)] if dtype == torch.float32 else []
            for value in (math.nan, math.inf, -math.inf):
                for i, j in at:
                    x = base.clone()
                    x[i, j] = value
                    yield f"{rows}x{cols} {dtype} {value} at ({i}, {j})", x
    x = torch.randn(257, 65, generator=g)
    x[256, 3] = math.inf
    yield "transposed view 65x257 inf", x.t()
    x = torch.randn(65, 257, generator=g)
    x[64, 200], x[1, 256] = -math.inf, math.nan
    yield "65x257 NaN and -inf", x


def check_nonfinite_flags(failures: list[str]) -> int:
    """Row 1 of the partials and the probes, against torch on the same tensors."""
    saved = fp8_cast.AMAX_PROGRAMS
    count = 0
    try:
        for name, x in nonfinite_cases():
            for programs in (1024, 2):  # one block per program, and several rounds of the loop
                fp8_cast.AMAX_PROGRAMS = programs
                partials = fp8_cast.amax_partials(x)
                want = program_references(x, partials.shape[1])
                if partials.shape != (2, min(-(-x.numel() // fp8_cast.AMAX_BLOCK), programs)):
                    failures.append(f"{name}: amax partials of shape {tuple(partials.shape)}")
                elif not torch.equal(partials, want):
                    failures.append(f"{name}, {programs} programs: amax partials {partials.tolist()} != {want.tolist()}")
                if not same_amax(fp8_cast.amax_of(x), reference_amax(x)):
                    failures.append(f"{name}: amax_of {fp8_cast.amax_of(x).item()}")
            fmt, margin = ((E4M3, 0), (E5M2, 1))[count % 2]  # the formats in turn, case by case
            count += 1
            scale = torch.tensor(0.75)
            data, data_t, partials = fp8_cast.cast_fp8(x, scale, fmt, transpose=True, record_amax=True)
            want_bytes = bits(fmt.cast(x.float() * scale))
            if not (torch.equal(bits(data), want_bytes) and torch.equal(bits(data_t), want_bytes.t().contiguous())):
                failures.append(f"{name} {fmt.name}: bytes differ")
            if not torch.equal(partials, tile_references(x)):
                failures.append(f"{name} {fmt.name}: cast partials {partials.tolist()} != {tile_references(x).tolist()}")
            current = fp8_scales.current_scaling(x, fmt, margin)
            if not right_probe(current[2], x):
                failures.append(f"{name} {fmt.name}: current scaling probe {current[2]}")
            want = scale_from_amax(reference_amax(x), fmt, margin)
            if not same_update(current[:2], (want, want.reciprocal())):
                failures.append(f"{name} {fmt.name}: current scale {current[0].item()} != {want.item()}")
            history, old_scale = torch.tensor([5.0, 0.0, 7.0]), torch.tensor(2.0)
            with_probe = fp8_scales.delayed_scaling_update(partials, history, old_scale, fmt, margin, True)
            if not right_probe(with_probe[3], x):
                failures.append(f"{name} {fmt.name}: delayed scaling probe {with_probe[3]}")
            from_amax_pass = fp8_scales.delayed_scaling_update(fp8_cast.amax_partials(x), history, old_scale, fmt, margin, True)
            if not right_probe(from_amax_pass[3], x) or not same_update(from_amax_pass[:3], with_probe[:3]):
                failures.append(f"{name} {fmt.name}: delayed update from amax_partials {from_amax_pass}")
            for amaxes in (partials[0], partials[0].amax().reshape(1)):  # 1-D: the amaxes alone
                alone = fp8_scales.delayed_scaling_update(amaxes, history, old_scale, fmt, margin, True)
                if alone[3] is not None or not same_update(alone[:3], with_probe[:3]):
                    failures.append(f"{name} {fmt.name}: 1-D partials {alone} != {with_probe}")
            reference = per_tensor.DelayedScalingQuantizer(
                fmt, lowprec.DelayedScaling(amax_history_len=3, amax_compute_algo="max", margin=margin)
            )
            reference.amax_history, reference.scale = history, old_scale
            reference.record_amax(reference_amax(x))
            if not same_update(with_probe[:3], (reference.amax_history, reference.scale, reference.scale_inv)):
                failures.append(f"{name} {fmt.name}: delayed update {with_probe[:3]} != the quantizer's")
    finally:
        fp8_cast.AMAX_PROGRAMS = saved
    return count


def train(fused: bool, recipe) -> dict[str, torch.Tensor]:
    """Three steps of a Linear (two micro-batches each) on the CPU, the kernels standing in for CUDA's."""
    kernels.runs_on = (lambda t: t.dim() == 2) if fused else (lambda t: False)
    torch.manual_seed(0)
    layer = lowprec.Linear(48, 40, name="fc")
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    out: dict[str, torch.Tensor] = {}
    for step in range(3):
        for micro in range(2):
            x = torch.randn(24, 48, requires_grad=True)
            with lowprec.fp8_autocast(fp8_recipe=recipe):
                y = layer(x)
            y.square().mean().backward()
            out[f"y{step}{micro}"], out[f"dx{step}{micro}"] = y.detach(), x.grad
        out[f"dw{step}"] = layer.weight.grad.clone()
        optimizer.step()
        optimizer.zero_grad()
    for name, quantizer in layer.gemm_unit.quantizers(recipe, layer.name).items():
        if hasattr(quantizer, "amax_history"):
            out[f"history {name}"] = quantizer.amax_history
    return out


def check_training(failures: list[str]) -> None:
    original = kernels.runs_on
    try:
        for recipe in (lowprec.DelayedScaling(amax_history_len=4), lowprec.Float8CurrentScaling()):
            fused, plain = train(True, recipe), train(False, recipe)
            for key in plain:
                if not torch.equal(fused[key], plain[key]):
                    failures.append(f"training {type(recipe).__name__}: {key} differs")
        kernels.runs_on = lambda t: t.dim() == 2
        cast = per_tensor.CurrentScalingQuantizer(E5M2).quantize(torch.randn(20, 36), transpose=True)
        if (
            cast.other_layout is None
            or not torch.equal(bits(cast.column_major()), bits(cast.data))
            or cast.column_major().data_ptr() != cast.other_layout.data_ptr()
        ):
            failures.append("the fused cast's other layout is not used as the column-major operand")
        poisoned = torch.randn(20, 36)
        poisoned[19, 35] = math.inf
        delayed = per_tensor.DelayedScalingQuantizer(E4M3, lowprec.DelayedScaling())
        for quantizer in (per_tensor.CurrentScalingQuantizer(E4M3), delayed):  # the probe the guard takes
            for x in (poisoned, poisoned.nan_to_num(posinf=1.0)):
                if not right_probe(quantizer.quantize(x, transpose=True).nonfinite_probe, x):
                    failures.append(f"{type(quantizer).__name__}: the cast's probe misses what the tensor holds")
    finally:
        kernels.runs_on = original


def check_scaled_mm_layouts(failures: list[str]) -> None:
    from lowprec import gemm
    from lowprec.quant.protocol import Float8Tensor

    copies: list[str] = []
    original = {name: getattr(Float8Tensor, name) for name in ("row_major", "column_major")}

    def watching(name):
        def layout(self):
            result = original[name](self)
            stored = {self.data.data_ptr()} | ({self.other_layout.data_ptr()} if self.other_layout is not None else set())
            if result.data_ptr() not in stored:
                copies.append(name)
            return result

        return layout

    patches = [(kernels, "runs_on", lambda t: t.dim() == 2), (gemm, "scaled_mm_unsupported", lambda a, b: None)]
    patches += [(Float8Tensor, name, watching(name)) for name in original]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    calls = []
    scaled_mm = torch._scaled_mm

    def spy(a, b, **kwargs):
        calls.append((a.is_contiguous(), b.t().is_contiguous()))
        return scaled_mm(a, b, **kwargs)

    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        torch._scaled_mm = spy
        torch.manual_seed(0)
        layer = lowprec.Linear(32, 48, name="fc")
        x = torch.randn(16, 32, requires_grad=True)
        with lowprec.fp8_autocast(fp8_recipe=lowprec.Float8CurrentScaling()):
            y = layer(x)
        y.sum().backward()
    finally:
        torch._scaled_mm = scaled_mm
        for owner, name, value in saved:
            setattr(owner, name, value)
    if calls != [(True, True)] * 3 or copies:
        failures.append(f"_scaled_mm operands: layouts {calls}, copies made by {copies}")


def main() -> None:
    index_as_triton_36()
    failures: list[str] = []
    count = check_casts(failures)
    check_nan_bytes(failures)
    check_amax(failures)
    check_scales(failures)
    flag_count = check_nonfinite_flags(failures)
    check_te_quotient(failures)
    check_training(failures)
    check_scaled_mm_layouts(failures)
    print("\n".join(failures) or f"ok: {count} cast cases, {flag_count} non-finite flag cases (Triton {triton.__version__})")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
