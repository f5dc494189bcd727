"""How long the plan search takes against the number of layers (``lowprec.plan.search``): the search that
``nvdlfw-inspect plan`` runs once per round, on synthetic calibrations of 10 to 3,000 layers of three GEMMs, each
with every candidate format (bf16, current, mxfp8, mxfp6_e2m3, nvfp4: costs from ``lowprec.plan.cost``, damages drawn
at random, larger for narrower formats), at a budget of half the cheapest plan's damage, and the whole Pareto front.

Columns: units (GEMMs), the search's time and the whole front's (fastest of ``--repeats``, host milliseconds), the
front's points, and the time per unit (microseconds).

Run: ``python benchmarks/plan_search.py [--layers 10,100,1000,3000] [--repeats 5] [--seed 0]`` (prints the table as
Markdown, with the machine, date and commit).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import random
import time

from harness import git_commit

from lowprec.plan.cost import gemm_cost, gemm_shares
from lowprec.plan.search import GEMMS, Option, Unit, full_front, search

FORMATS = {"bf16": 0.0, "current": 0.3, "mxfp8": 0.2, "mxfp6_e2m3": 1.0, "nvfp4": 3.0}  # mean damage, arbitrary units


def synthetic(layers: int, seed: int) -> dict[Unit, list[Option]]:
    """``layers`` layers of random widths, each GEMM with every format of ``FORMATS``."""
    rng = random.Random(seed)
    shares = gemm_shares({f"layers.{i}": rng.choice((64, 128, 256)) * rng.choice((64, 128, 256)) for i in range(layers)})
    units = {}
    for layer, share in shares.items():
        for gemm in GEMMS:
            units[Unit(layer, gemm)] = [
                Option(fmt, gemm_cost(share, fmt), mean * rng.expovariate(1.0) * share) for fmt, mean in FORMATS.items()
            ]
    return units


def fastest(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="10,100,1000,3000", help="comma-separated layer counts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    commit = git_commit()
    print(f"plan search, {platform.processor() or platform.machine()}, {datetime.date.today()}, commit {commit}\n")
    print("| layers | GEMMs | search (ms) | whole front (ms) | front points | us per GEMM (front) |")
    print("|---|---|---|---|---|---|")
    for layers in (int(n) for n in args.layers.split(",")):
        units = synthetic(layers, args.seed)
        cheapest = sum(min(option.damage for option in choices if option.format == "nvfp4") for choices in units.values())
        searched = fastest(lambda units=units, budget=cheapest / 2: search(units, budget), args.repeats)
        front_time = fastest(lambda units=units: full_front(units), args.repeats)
        points = len(full_front(units))
        print(
            f"| {layers} | {len(units)} | {searched * 1e3:.2f} | {front_time * 1e3:.2f} | {points} | "
            f"{front_time / len(units) * 1e6:.1f} |"
        )


if __name__ == "__main__":
    main()
