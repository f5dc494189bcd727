"""Checks of the Triton statistics kernel, run by test_triton.py in a process where
``TRITON_INTERPRET=1`` (set before Triton loads) makes the kernel run on CPU tensors, or with
``--device cuda`` on a GPU: tensor statistics against float64 ones, quantization counts against
lowprec's casts, merging into table rows against the whole tensor, every field merged into a row by its
rule in ``stats.fields``, and the table rows against the C kernel's (or the torch reductions') for the
same feeds."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[3]  # for statref and triton_strict (this runs as a script)
sys.path[:0] = [str(TESTS / "support"), str(TESTS / "references")]
from statref import reference_stats  # noqa: E402
from triton_strict import index_as_triton_36  # noqa: E402

from lowprec.formats.elements import E4M3, E5M2  # noqa: E402
from lowprec.quant.per_tensor import quantize_with_scale  # noqa: E402
from nvdlfw_inspect.stats.catalog import derive_stats, supported_stats  # noqa: E402
from nvdlfw_inspect.stats.fields import FIELDS, INDEX, empty_partials, filled_by, merge_partials  # noqa: E402
from nvdlfw_inspect.stats.kernels.fallback import tensor_partials, torch_tensor_stats  # noqa: E402
from nvdlfw_inspect.stats.kernels.triton import BLOCK, triton_column_amax, triton_tensor_stats  # noqa: E402

GRIDS = {E4M3: (448.0, -6, 3), E5M2: (57344.0, -14, 2)}
CHAN = {name for name in FIELDS if name in ("mean", "m2", "m3", "m4")}


def same(a: float, b: float, rel: float) -> bool:
    if math.isnan(b):
        return math.isnan(a)
    if math.isinf(b):
        return a == b
    return abs(a - b) <= rel * abs(b) + 1e-12


def cases(device: str) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in (1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 123, 20 * BLOCK + 5):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = (torch.randn(n, generator=g) * 3 - 1).to(dtype)
            x[: max(1, n // 10)] = 0.0
            out.append((f"n={n} {dtype}", x))
    out.append(("large mean", 1000.0 + torch.randn(5 * BLOCK, generator=g)))
    out.append(("2-D non-contiguous", torch.randn(96, 80, generator=g).t()))
    out.append(("all zeros", torch.zeros(BLOCK + 5)))
    return [(name, x.to(device)) for name, x in out]


def one_row(x: torch.Tensor, **kwargs) -> torch.Tensor:
    table = empty_partials(x.device).view(1, -1)
    triton_tensor_stats(x.reshape(-1).contiguous(), table, [0], [-1], [], [], **kwargs)
    return table[0].cpu()


def check_tensor_fields(device: str, failures: list[str]) -> None:
    for name, x in cases(device):
        got = derive_stats(one_row(x), supported_stats())
        want = reference_stats(x.cpu())
        for stat in supported_stats():
            if not same(got[stat], want[stat], 1e-5):
                failures.append(f"{name}: {stat} {got[stat]} != {want[stat]}")
    special = torch.tensor([1.0, math.inf, -2.0] + [0.5] * BLOCK, device=device)
    got = derive_stats(one_row(special), ["max", "min", "l1_norm", "std"])
    if not (got["max"] == math.inf and got["min"] == -2.0 and got["l1_norm"] == math.inf and math.isnan(got["std"])):
        failures.append(f"inf: {got}")
    with_nan = torch.tensor([1.0] * 3 * BLOCK + [math.nan, 2.0], device=device)
    got = derive_stats(one_row(with_nan), supported_stats())
    if not all(math.isnan(got[s]) for s in ("min", "max", "mean", "std", "l1_norm", "dynamic_range")):
        failures.append(f"nan: {got}")


def check_merging_into_rows(device: str, failures: list[str]) -> None:
    """Micro-batches fed into one row equal the whole tensor; launches reuse the scratch rows."""
    g = torch.Generator().manual_seed(1)  # fixed data: an unseeded mean can land near zero, where rel 1e-6 is below fp32
    parts = [torch.randn(3 * BLOCK + 3, generator=g), torch.randn(17, generator=g) + 5, torch.randn(9 * BLOCK, generator=g) * 0.1]
    table = torch.stack([empty_partials()] * 3).to(device)
    for part in parts:
        triton_tensor_stats(part.to(device), table, [2], [-1], [], [])
    merged = derive_stats(table[2].cpu(), supported_stats())
    whole = reference_stats(torch.cat(parts))
    for stat in supported_stats():
        if not same(merged[stat], whole[stat], 1e-6):
            failures.append(f"merge {stat}: {merged[stat]} vs {whole[stat]}")
    if not torch.equal(table[:2].cpu(), torch.stack([empty_partials()] * 2)):
        failures.append("rows not asked for were written")


def check_merge_rules(device: str, failures: list[str]) -> None:
    """A row already holding values that every merge rule combines differently with the call's own
    (the fields the kernel leaves alone included) ends as ``merge_partials`` of the two."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3 * BLOCK + 5, generator=g) * torch.logspace(-6, 2, 3 * BLOCK + 5)).to(device)
    args = ([0], [0], [torch.tensor(10.0, device=device)], [GRIDS[E4M3]])
    fresh = empty_partials(device).view(1, -1)
    triton_tensor_stats(x, fresh, *args, want_moments=True)
    before = fresh[0] * 1.5 + 0.25
    before[INDEX["count"]], before[INDEX["blockwise_dr"]] = 100.0, 3.0
    merged = before.clone().view(1, -1)
    triton_tensor_stats(x, merged, *args, want_moments=True)
    want = merge_partials(torch.stack([before, fresh[0]])).cpu()
    for name in FIELDS:
        got, expected = merged[0, INDEX[name]].item(), want[INDEX[name]].item()
        if not (same(got, expected, 1e-12 if name in ("mean", "m2") else 1e-9) if name in CHAN else got == expected):
            failures.append(f"merge rule of {name}: {got} != {expected}")


def check_moments(device: str, failures: list[str]) -> None:
    """M3 and M4 (kurtosis) when asked: float64 torch's over one call and over calls merged into a row, heavy tails
    and a mean far from zero included; not asked, they stay at their identity."""
    g = torch.Generator().manual_seed(4)
    heavy = torch.randn(3 * BLOCK + 7, generator=g) / torch.rand(3 * BLOCK + 7, generator=g)
    far = 1e4 + torch.randn(2 * BLOCK + 5, generator=g)
    few = [(name, x) for name, x in cases(device) if x.numel() <= 3 * BLOCK + 123 and "float16" not in name]
    tensors = [*few, ("heavy tails", heavy.to(device)), ("mean 1e4", far.to(device))]  # a subset: the interpreter is slow
    for name, x in tensors:
        want = tensor_partials(x.cpu(), False, want_moments=True)
        pieces = x.reshape(-1).split(max(1, x.numel() // 3 + 1))
        table = torch.stack([empty_partials()] * 2).to(device)
        table[1] = one_row(x, want_moments=True)
        for piece in pieces:
            triton_tensor_stats(piece.contiguous(), table, [0], [-1], [], [], want_moments=True)
        for row, how in ((table[1].cpu(), "one call"), (table[0].cpu(), f"{len(pieces)} calls")):
            for field in ("m3", "m4"):
                scale = want[INDEX["m2"]].item() ** (1.5 if field == "m3" else 2.0)  # M3 may be near zero
                got, expected = row[INDEX[field]].item(), want[INDEX[field]].item()
                if (
                    not abs(got - expected)
                    <= 1e-5 * (abs(expected) + scale / max(1.0, want[INDEX["count"]].item()) ** 0.5) + 1e-12
                ):
                    failures.append(f"{name}, {how}: {field} {got} != {expected}")
            kurtosis = derive_stats(row, ["kurtosis"])["kurtosis"]
            expected = derive_stats(want, ["kurtosis"])["kurtosis"]
            if not same(kurtosis, expected, 1e-5):
                failures.append(f"{name}, {how}: kurtosis {kurtosis} != {expected}")
    plain = one_row(torch.randn(BLOCK + 1, generator=g).to(device))
    if plain[INDEX["m3"]].item() != 0.0 or plain[INDEX["m4"]].item() != 0.0:
        failures.append(f"M3 and M4 written when not asked: {plain[INDEX['m3']].item()}, {plain[INDEX['m4']].item()}")


def check_column_amax(device: str, failures: list[str]) -> None:
    """The channel statistics' per-column amax: torch's, NaN left out, infinities, negative zeros and subnormals
    kept, across column blocks and row tiles that do not divide the tensor."""
    g = torch.Generator().manual_seed(6)
    for rows, cols in ((1, 1), (3, 200), (300, 129), (65, 257)):
        x = torch.randn(rows, cols, generator=g) * torch.logspace(-8, 4, cols)
        x[0, 0], x[-1, -1], x[rows // 2, cols // 2] = math.nan, -math.inf, -0.0
        if cols > 3:
            x[:, 3] = torch.finfo(torch.float32).tiny / 8  # subnormal float32
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            data = x.to(dtype)
            magnitude = data.double().abs()
            want = torch.where(magnitude.isnan(), 0.0, magnitude).amax(0)
            got = triton_column_amax(data.to(device)).cpu()
            if not torch.equal(got, want):
                failures.append(f"column amax {rows}x{cols} {dtype}: {(got - want).abs().max().item()}")


def check_quantization_fields(device: str, failures: list[str]) -> None:
    """Underflows and overflows equal lowprec's casts exactly; the squared error to float64 rounding."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7 * BLOCK + 11, generator=g) * torch.logspace(-6, 3, 7 * BLOCK + 11).flip(0)
    x[::97] = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        data = x.to(dtype)
        scales = [torch.tensor(0.5), torch.tensor(3000.0), torch.tensor(1e-3)]
        formats = [E4M3, E4M3, E5M2]
        table = torch.stack([empty_partials()] * 4).to(device)
        call_out, amax_out = empty_partials(device), torch.zeros((), device=device)
        triton_tensor_stats(
            data.to(device),
            table,
            [0, 1, 2, 3],
            [-1, 0, 1, 2],
            [s.to(device) for s in scales],
            [GRIDS[f] for f in formats],
            call_out=call_out,
            amax_out=amax_out,
        )
        rows = table.cpu()
        reference = torch.stack([empty_partials()] * 4)
        grids = [GRIDS[f] for f in formats]
        torch_tensor_stats(data, reference, [0, 1, 2, 3], [-1, 0, 1, 2], scales, *map(list, zip(*grids, strict=True)), True)
        for v, (scale, fmt) in enumerate(zip(scales, formats, strict=True)):
            row = rows[v + 1]
            q = quantize_with_scale(data, scale, fmt)
            values = data.double()
            underflows = ((values != 0) & (q.data.float() == 0)).sum().item()
            overflows = ((data.float() * scale).abs() > fmt.max).sum().item()
            sq_err = (values - q.dequantize(torch.float32).double()).square().sum().item()
            checks = {"underflows": underflows, "overflows": overflows, "scale_inv_min": (1 / scale).item()}
            for field, want in checks.items():
                if row[INDEX[field]].item() != want:
                    failures.append(f"{dtype} grid {v}: {field} {row[INDEX[field]].item()} != {want}")
            if not same(row[INDEX["sq_err"]].item(), sq_err, 1e-5):
                failures.append(f"{dtype} grid {v}: sq_err {row[INDEX['sq_err']].item()} != {sq_err}")
        differs = ~((rows - reference).abs() <= 1e-5 * reference.abs() + 1e-12) & ~(rows == reference)
        if differs.any():
            failures.append(f"{dtype}: rows differ from the torch reductions at {differs.nonzero().tolist()}")
        tensor_fields = [INDEX[name] for name in filled_by("tensor")]
        other_fields = [i for i in range(len(FIELDS)) if i not in tensor_fields]
        own_fields = torch.equal(call_out.cpu()[tensor_fields], rows[0][tensor_fields])
        if not own_fields or amax_out.item() != data.float().abs().max().item():
            failures.append(f"{dtype}: call_out/amax_out {call_out.tolist()} {amax_out.item()}")
        if call_out.cpu()[other_fields].tolist() != empty_partials()[other_fields].tolist():
            failures.append(f"{dtype}: call_out quantization fields written")


def check_amax_out_ignores_nan(device: str, failures: list[str]) -> None:
    """``amax_out`` leaves NaN out (an FP8 recipe's amax, as TE's ``fmaxf``), across programs and blocks; the
    min and max fields stay NaN."""
    nan = float("nan")
    x = torch.randn(5 * BLOCK + 3, generator=torch.Generator().manual_seed(5))
    x[7], x[3 * BLOCK + 1], x[4 * BLOCK] = nan, -40.0, nan
    for name, data, want in (("NaN and -40", x, 40.0), ("only NaN", torch.full((BLOCK + 9,), nan), 0.0)):
        table, amax_out = torch.stack([empty_partials()]).to(device), torch.full((), -1.0, device=device)
        triton_tensor_stats(data.to(device), table, [0], [-1], [], [], amax_out=amax_out)
        if amax_out.item() != want or not table[0, INDEX["max"]].isnan():
            failures.append(f"amax_out {name}: {amax_out.item()} != {want} (max field {table[0, INDEX['max']].item()})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    device = parser.parse_args().device
    index_as_triton_36()
    failures: list[str] = []
    check_tensor_fields(device, failures)
    check_merging_into_rows(device, failures)
    check_merge_rules(device, failures)
    check_moments(device, failures)
    check_column_amax(device, failures)
    check_quantization_fields(device, failures)
    check_amax_out_ignores_nan(device, failures)
    print("\n".join(failures) or f"ok: {len(cases(device))} cases, {len(FIELDS)} fields")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
