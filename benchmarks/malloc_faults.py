"""Page faults and step time of emulated FP8 training on a CPU: glibc malloc's defaults against its thresholds pinned.

An emulated step allocates and frees buffers of megabytes (casts, decoded operands, GEMM results). glibc adapts its
thresholds as a process frees, and whether the end of a step hands the heap's top back to the OS, to fault it in
page by page in the next step, depends on how the process's allocations happen to lie. Pinning the thresholds
(``harness.PINNED_MALLOC_ENVIRONMENT``, set before Python starts) keeps freed memory mapped.

The model is ``guard_cost.py``'s MLP with no debugging: ``--depth`` ``lowprec.Linear(--width)`` layers, ``--tokens``
tokens, FP8 delayed scaling emulated, SGD. Each variant runs in a process of its own, the two alternating for
``--rounds`` rounds; each process reports its median page faults and milliseconds per step over ``--steps`` steps
after warm-up. Printed: per variant, the median over rounds and each round's values, and the step ratio pinned /
default per round, as a Markdown table with the machine, torch version, date and commit.

Run: ``python benchmarks/malloc_faults.py [--width W] [--depth D] [--tokens T] [--steps N] [--rounds R]
[--threads N]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
from guard_cost import WARMUP_STEPS, Bench
from harness import PINNED_MALLOC_ENVIRONMENT, git_commit, page_faults

VARIANTS = {"default": {}, "pinned": PINNED_MALLOC_ENVIRONMENT}


def measure(args: argparse.Namespace) -> dict[str, float]:
    """In this process: the median page faults and milliseconds per plain training step."""
    bench = Bench(argparse.Namespace(device="cpu", width=args.width, depth=args.depth, tokens=args.tokens, dtype="float32"))
    step = bench.step_fn(False)
    for _ in range(WARMUP_STEPS):
        step()
    faults, seconds = [], []
    for _ in range(args.steps):
        faults_before, start = page_faults(), time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
        faults.append(page_faults() - faults_before)
    return {"faults": statistics.median(faults), "ms": statistics.median(seconds) * 1e3}


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, float]:
    """``measure`` in a new process under ``variant``'s malloc environment."""
    command = [sys.executable, __file__, "--measure", "--width", str(args.width), "--depth", str(args.depth)]
    command += ["--tokens", str(args.tokens), "--steps", str(args.steps), "--threads", str(args.threads)]
    environment = {key: value for key, value in os.environ.items() if key not in PINNED_MALLOC_ENVIRONMENT}
    done = subprocess.run(command, env={**environment, **VARIANTS[variant]}, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(args: argparse.Namespace, rounds: list[dict[str, dict[str, float]]]) -> str:
    settings = ", ".join(f"{key}={value}" for key, value in PINNED_MALLOC_ENVIRONMENT.items())
    lines = [
        f"Emulated FP8 training on a CPU, glibc malloc: {args.depth} x lowprec.Linear({args.width}), {args.tokens} "
        f"tokens, float32, FP8 delayed scaling, no debugging; CPU ({platform.machine()}), {args.threads} threads; torch "
        f"{torch.__version__}, {datetime.date.today()}, commit {git_commit()}",
        f"each variant a process of its own, alternating, {len(rounds)} rounds; per process the median of {args.steps} "
        f"steps; pinned: {settings}",
        "",
        "| malloc | page faults per step (median of rounds) | ms per step (median of rounds) | each round: faults, ms |",
        "|---|---|---|---|",
    ]
    for variant in VARIANTS:
        faults = [found[variant]["faults"] for found in rounds]
        ms = [found[variant]["ms"] for found in rounds]
        each = "; ".join(f"{f:g}, {m:.1f}" for f, m in zip(faults, ms, strict=True))
        lines.append(f"| {variant} | {statistics.median(faults):g} | {statistics.median(ms):.1f} | {each} |")
    ratios = [found["pinned"]["ms"] / found["default"]["ms"] for found in rounds]
    lines.append(f"\nstep time pinned / default, per round: {', '.join(f'{r:.3f}' for r in ratios)}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10, help="steps per process, after warm-up")
    parser.add_argument("--rounds", type=int, default=3, help="processes per variant, alternating")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # a variant's process
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.measure:
        print(json.dumps(measure(args)))
        return
    if platform.system() != "Linux":
        parser.error("the malloc thresholds compared here are glibc's (Linux)")
    rounds = [{variant: run_variant(variant, args) for variant in VARIANTS} for _ in range(args.rounds)]
    print(markdown(args, rounds))


if __name__ == "__main__":
    main()
