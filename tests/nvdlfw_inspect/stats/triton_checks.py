"""Checks of the Triton statistics kernel, run by test_triton_partials.py in a process where
``TRITON_INTERPRET=1`` (set before Triton loads) makes the kernel run on CPU tensors."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for statref (this runs as a script)
from statref import reference_stats  # noqa: E402

from nvdlfw_inspect.stats.derive import derive_stats, supported_stats
from nvdlfw_inspect.stats.partials import FIELDS, compute_partials, merge_partials
from nvdlfw_inspect.stats.triton_partials import BLOCK, triton_partials


def same(a: float, b: float, rel: float) -> bool:
    if math.isnan(b):
        return math.isnan(a)
    if math.isinf(b):
        return a == b
    return abs(a - b) <= rel * abs(b) + 1e-12


def cases() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in (1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 123):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = (torch.randn(n, generator=g) * 3 - 1).to(dtype)
            x[: max(1, n // 10)] = 0.0
            out.append((f"n={n} {dtype}", x))
    out.append(("large mean", 1000.0 + torch.randn(5 * BLOCK, generator=g)))
    out.append(("2-D non-contiguous", torch.randn(96, 80, generator=g).t()))
    out.append(("all zeros", torch.zeros(BLOCK + 5)))
    return out


def main() -> None:
    failures = []
    for name, x in cases():
        fused = triton_partials(x)
        if fused.shape != (len(FIELDS),) or fused.dtype != torch.float64:
            failures.append(f"{name}: shape {tuple(fused.shape)} dtype {fused.dtype}")
        got = derive_stats(fused, supported_stats())
        want = reference_stats(x)
        for stat in supported_stats():
            if not same(got[stat], want[stat], 1e-5):
                failures.append(f"{name}: {stat} {got[stat]} != {want[stat]}")
        eager = compute_partials(x, {"abs_min_nonzero"})
        if not same(fused[0].item(), eager[0].item(), 0):
            failures.append(f"{name}: count differs")
    special = torch.tensor([1.0, math.inf, -2.0] + [0.5] * BLOCK)
    got = derive_stats(triton_partials(special), ["max", "min", "l1_norm", "std"])
    if not (got["max"] == math.inf and got["min"] == -2.0 and got["l1_norm"] == math.inf and math.isnan(got["std"])):
        failures.append(f"inf: {got}")
    with_nan = torch.tensor([1.0] * BLOCK + [math.nan, 2.0])
    got = derive_stats(triton_partials(with_nan), supported_stats())
    if not all(math.isnan(got[s]) for s in ("min", "max", "mean", "std", "l1_norm", "dynamic_range")):
        failures.append(f"nan: {got}")
    g = torch.Generator().manual_seed(1)  # fixed data: an unseeded mean can land near zero, where rel 1e-6 is below fp32
    halves = [torch.randn(BLOCK + 3, generator=g), torch.randn(17, generator=g) + 5]
    merged = derive_stats(merge_partials(torch.stack([triton_partials(h) for h in halves])), ["std", "mean"])
    whole = reference_stats(torch.cat(halves))
    if not (same(merged["std"], whole["std"], 1e-6) and same(merged["mean"], whole["mean"], 1e-6)):
        failures.append(f"merge: {merged} vs {whole}")
    print("\n".join(failures) or f"ok: {len(cases())} cases")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
