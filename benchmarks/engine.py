"""Cost of the lowprec engine and its debug hooks, as ratios measured side by side in one run.

1. Debug initialized with features only on *other* layers vs debug not initialized, for an 8-layer
   MLP of ``lowprec.Linear`` in high precision and in FP8 (emulated on the CPU). Target: within 2%.
2. On a CUDA GPU: one training step (forward and backward) of a ``lowprec.Linear`` in FP8 (delayed and
   current scaling) vs ``torch.nn.Linear`` in bf16, 8192x8192 weight, 8192 tokens, both eager.

Run: ``python benchmarks/engine.py [--steps N] [--repeats R] [--width W] [--depth D] [--tokens T]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from harness import InProcess, interleave, print_ratio_table

import lowprec
import nvdlfw_inspect.api as debug_api

OTHER_LAYERS_ONLY = {
    "elsewhere": {
        "enabled": True,
        "layers": {"layer_name_regex_pattern": r"^decoder\."},
        "transformer_engine": {
            "DisableFP8GEMM": {"enabled": True, "gemms": ["fprop"]},
            "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max"]},
        },
    }
}


def mlp(width: int, depth: int, device: str, dtype: torch.dtype) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *[lowprec.Linear(width, width, name=f"mlp.{i}", device=device, params_dtype=dtype) for i in range(depth)]
    )


def step_time(model: torch.nn.Module, batch: torch.Tensor, steps: int, fp8: bool, debug: bool) -> float:
    """Seconds per training step (forward, backward, and debug_api.step when debugging)."""

    def one_step():
        with lowprec.fp8_autocast(enabled=fp8):
            model(batch).float().square().mean().backward()
        if debug:
            debug_api.step()

    one_step()  # warm-up: the first step asks the routing questions
    synchronize(batch.device)
    start = time.perf_counter()
    for _ in range(steps):
        one_step()
    synchronize(batch.device)
    return (time.perf_counter() - start) / steps


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def idle_debug_table(args: argparse.Namespace, device: str, dtype: torch.dtype) -> None:
    model = mlp(args.width, args.depth, device, dtype)
    batch = torch.randn(args.tokens, args.width, device=device, dtype=dtype)
    log_dir = tempfile.mkdtemp()

    def run(variant: str) -> float:
        fp8 = variant.endswith("fp8")
        if not variant.startswith("idle"):
            return step_time(model, batch, args.steps, fp8, debug=False)
        debug_api.initialize(config_file=OTHER_LAYERS_ONLY, log_dir=log_dir)
        try:
            return step_time(model, batch, args.steps, fp8, debug=True)
        finally:
            debug_api.end_debug()

    worker = InProcess(run)
    for precision in ("hp", "fp8"):
        plan = [
            (f"no debug, {precision}", worker, f"plain-{precision}"),
            (f"idle debug, {precision}", worker, f"idle-{precision}"),
        ]
        fastest = interleave(plan, args.repeats)
        title = f"\n{args.depth} x lowprec.Linear({args.width}), {args.tokens} tokens, {dtype}, {device}: debug idle vs off"
        print_ratio_table(title, fastest, f"no debug, {precision}", {})


def gpu_linear_table(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        print("\nFP8 vs bf16 Linear: not measured (no CUDA device)")
        return
    size, tokens = 8192, 8192
    torch.manual_seed(0)
    reference = torch.nn.Linear(size, size, device="cuda", dtype=torch.bfloat16)
    ours = lowprec.Linear(size, size, name="big", device="cuda", params_dtype=torch.bfloat16)
    x = torch.randn(tokens, size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    recipes = {"delayed": lowprec.DelayedScaling(), "current": lowprec.Float8CurrentScaling()}

    def run(variant: str) -> float:
        layer = reference if variant == "bf16" else ours
        recipe = recipes.get(variant)

        def one_step():
            with lowprec.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
                layer(x).backward(torch.ones(tokens, size, device="cuda", dtype=torch.bfloat16))

        one_step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            one_step()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / args.steps

    worker = InProcess(run)
    plan = [
        ("torch.nn.Linear bf16", worker, "bf16"),
        ("lowprec FP8 delayed", worker, "delayed"),
        ("lowprec FP8 current", worker, "current"),
    ]
    fastest = interleave(plan, args.repeats)
    title = f"\nLinear {size}x{size}, {tokens} tokens, one training step, eager, {torch.cuda.get_device_name()}"
    print_ratio_table(title, fastest, "torch.nn.Linear bf16", {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    idle_debug_table(args, "cpu", torch.float32)
    if torch.cuda.is_available():
        idle_debug_table(args, "cuda", torch.bfloat16)
    gpu_linear_table(args)


if __name__ == "__main__":
    main()
