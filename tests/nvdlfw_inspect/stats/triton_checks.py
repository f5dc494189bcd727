"""Checks of the Triton statistics kernel, run by test_triton_partials.py in a process where
``TRITON_INTERPRET=1`` (set before Triton loads) makes the kernel run on CPU tensors."""

from __future__ import annotations

import math
import sys

import torch

from nvdlfw_inspect.stats.derive import derive_stats, supported_stats
from nvdlfw_inspect.stats.partials import FIELDS, compute_partials, merge_partials
from nvdlfw_inspect.stats.triton_partials import BLOCK, triton_partials


def same(a: float, b: float, rel: float) -> bool:
    if math.isnan(b):
        return math.isnan(a)
    if math.isinf(b):
        return a == b
    return abs(a - b) <= rel * abs(b) + 1e-12


def float64_stats(x: torch.Tensor) -> dict[str, float]:
    """Every statistic from the float64 copy of x, computed with torch's float64 reductions."""
    v = x.double().reshape(-1)
    nonzero = v.abs()[v != 0]
    amax = v.abs().max().item()
    out = {
        "min": v.min().item(),
        "max": v.max().item(),
        "mean": v.mean().item(),
        "std": v.std().item() if v.numel() > 1 else math.nan,
        "l1_norm": v.abs().sum().item(),
        "l2_norm": v.norm().item(),
        "cur_amax": amax,
        "dynamic_range": math.log2(amax) - math.log2(nonzero.min().item()) if nonzero.numel() else 0.0,
    }
    if v.isnan().any():
        out = {k: math.nan if k != "l1_norm" and k != "l2_norm" else out[k] for k in out}
    return out


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
        want = float64_stats(x)
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
    halves = [torch.randn(BLOCK + 3), torch.randn(17) + 5]
    merged = derive_stats(merge_partials(torch.stack([triton_partials(h) for h in halves])), ["std", "mean"])
    whole = float64_stats(torch.cat(halves))
    if not (same(merged["std"], whole["std"], 1e-6) and same(merged["mean"], whole["mean"], 1e-6)):
        failures.append(f"merge: {merged} vs {whole}")
    print("\n".join(failures) or f"ok: {len(cases())} cases")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
