"""Step-time cost of the debug framework on a plain PyTorch MLP (CPU), as ratios to the plain step.

Variants, timed interleaved in one run (ours and the reference ``nvdlfw-inspect`` 0.2.2 each in its
own environment; the reference is installed into ``benchmarks/.reference-venv`` on first use):
  plain        no hooks, no framework
  *-no-match   hooks call debug_api.log_tensor_stats, but the config selects no layer
  *-stats      LogTensorStats (six statistics) of every layer's input on every step

Run: ``python benchmarks/overhead_base.py [--steps N] [--repeats R] [--width W] [--depth D] [--tokens T]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness import Worker, interleave, print_ratio_table, reference_python, serve

SIX = ["min", "max", "mean", "std", "l1_norm", "l2_norm"]


def build(width: int, depth: int, hooks: bool) -> torch.nn.Sequential:
    import nvdlfw_inspect.api as debug_api

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    if hooks:
        for i, layer in enumerate(model):

            def log_input(_module, args, name=f"layer{i}"):
                debug_api.log_tensor_stats(layer_name=name, tensor=args[0], tensor_name="activation")

            layer.register_forward_pre_hook(log_input)
    return model


def config(regex: str) -> dict:
    return {
        "stats": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": regex},
            "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": SIX, "freq": 1},
        }
    }


def time_steps(model: torch.nn.Module, batch: torch.Tensor, steps: int, debug: bool) -> float:
    """Mean seconds per training step (forward, backward, SGD update, debug step)."""
    import nvdlfw_inspect.api as debug_api

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    start = time.perf_counter()
    for _ in range(steps):
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if debug:
            debug_api.step()
    return (time.perf_counter() - start) / steps


def run_variant(variant: str, args: argparse.Namespace, log_dir: str) -> float:
    """Time one variant in this process, with whichever ``nvdlfw_inspect`` this environment has."""
    import nvdlfw_inspect.api as debug_api

    batch = torch.randn(args.tokens, args.width)
    if variant == "plain":
        return time_steps(build(args.width, args.depth, hooks=False), batch, args.steps, debug=False)
    regex = "nothing_matches" if variant == "no-match" else r"layer\d+"
    debug_api.initialize(config_file=config(regex), log_dir=log_dir)
    try:
        return time_steps(build(args.width, args.depth, hooks=True), batch, args.steps, debug=True)
    finally:
        debug_api.end_debug()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per timing")
    parser.add_argument("--repeats", type=int, default=5, help="timings per variant (median reported)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = ["--steps", str(args.steps), "--width", str(args.width), "--depth", str(args.depth), "--tokens", str(args.tokens)]
    if args.worker:
        with tempfile.TemporaryDirectory() as log_dir:
            serve(lambda variant: run_variant(variant, args, log_dir))
        return

    ours = Worker(sys.executable, Path(__file__), shape)
    plan = [("plain", ours, "plain"), ("ours-no-match", ours, "no-match"), ("ours-stats", ours, "stats")]
    missing = {}
    ref_python, reason = reference_python()
    workers = [ours]
    if ref_python is not None:
        reference = Worker(ref_python, Path(__file__), shape)
        workers.append(reference)
        plan += [("reference-no-match", reference, "no-match"), ("reference-stats", reference, "stats")]
    else:
        missing = {"reference-no-match": reason, "reference-stats": reason}
    try:
        medians = interleave(plan, args.repeats)
    finally:
        for worker in workers:
            worker.close()
    title = f"MLP {args.depth} x Linear({args.width}), {args.tokens} tokens, fp32, CPU, {torch.get_num_threads()} threads"
    print_ratio_table(title, medians, "plain", missing)


if __name__ == "__main__":
    main()
