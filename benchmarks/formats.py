"""What trying a number format costs: each recipe's emulated training step next to high precision, and
the bandwidth of quantizing one tensor in each format, measured side by side in one run.

1. A training step (zero the gradients, forward, backward, an SGD step) of an MLP of ``lowprec.Linear`` under
   each recipe (FP8 delayed and current scaling, MXFP8, FP8 block scaling, NVFP4) as a ratio to the same step in
   high precision. The optimizer step changes the weights, so every step casts them anew, as in training
   (without it the layers' weight caches would serve one cast for the whole run).
   On the CPU every recipe is emulated; on a CUDA GPU per-tensor FP8 runs ``torch._scaled_mm`` and the
   block recipes are emulated (quantize, dequantize, GEMM in high precision). Two precision plans (``PLANS``) run
   beside them: FP8 current scaling with the last layer in BF16, and NVFP4 with the last layer in MXFP8 (the plan's
   real step time against BF16 and NVFP4 everywhere that issue 37 asks of a GPU).
2. Quantizing a bf16 tensor (128 MiB on CUDA, 8 MiB on the CPU) with each format's activation quantizer,
   rowwise and in both orientations (``both`` rows: rowwise and columnwise, as every activation and gradient
   of a training step needs), as GB/s of bytes read next to a plain copy's and a transposing copy's. A table
   gives each format's both-orientation time over two rowwise casts and a transpose (the goal: at most 1).
   On CUDA each rowwise cast runs the fused Triton kernels, and again as the torch emulation (``(torch)`` rows,
   ``lowprec.set_kernel_mode("emulated")``) to show what the fusion saves. When torchao is installed, its eager
   ``to_mx`` (MXFP8, E4M3, blocks of 32) and ``nvfp4_quantize`` (with a per-tensor scale from the amax, as
   ours) run beside them, rowwise and on the tensor and its contiguous transpose (``both``), and a last table
   gives ours / torchao's time of each (below 1: ours is faster).

``--tiny`` runs the CPU tables at tiny sizes (checks that the code runs, not its speed); ``--json PATH``
also writes the key numbers of the last device's tables.

Run: ``python benchmarks/formats.py [--steps N] [--repeats R] [--width W] [--depth D] [--tokens T]
[--tiny] [--json PATH]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from harness import InProcess, device_name, interleave, mean_seconds, print_ratio_table, synchronize, write_json

import lowprec
from lowprec import kernels

RECIPES = {
    "high precision": None,
    "FP8 delayed": lowprec.DelayedScaling(),
    "FP8 current": lowprec.Float8CurrentScaling(),
    "MXFP8": lowprec.MXFP8BlockScaling(),
    "FP8 block scaling": lowprec.Float8BlockScaling(),
    "NVFP4": lowprec.NVFP4BlockScaling(),
}


#: precision plans timed beside the recipes (training table only): the autocast recipe, and the plan's rules. On a Hopper
#: GPU only per-tensor FP8 has kernels, so the plan that can be faster there keeps the last layer in BF16 and runs the
#: rest in FP8 with current scaling; the other mixes the block formats (emulated on a GPU, as NVFP4 everywhere is).
PLANS = {
    "plan: FP8 current, last layer BF16": (lowprec.Float8CurrentScaling(), "high_precision"),
    "plan: NVFP4, last layer MXFP8": (lowprec.NVFP4BlockScaling(), "mxfp8"),
}


def last_layer_plan(depth: int, recipe: str) -> dict:
    return {"rules": [{"layers": {"exact_layer_names": [f"mlp.{depth - 1}"]}, "recipe": recipe}]}


def mlp(width: int, depth: int, device: str, dtype: torch.dtype) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers = [lowprec.Linear(width, width, name=f"mlp.{i}", device=device, params_dtype=dtype) for i in range(depth)]
    return torch.nn.Sequential(*layers)


def training_table(args: argparse.Namespace, device: str, dtype: torch.dtype) -> dict[str, float]:
    model = mlp(args.width, args.depth, device, dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    batch = torch.randn(args.tokens, args.width, device=device, dtype=dtype)

    def run(label: str) -> float:
        recipe, last = PLANS.get(label, (RECIPES.get(label), None))
        plan = last_layer_plan(args.depth, last) if last is not None else None

        def one_step():
            optimizer.zero_grad(set_to_none=True)
            with lowprec.autocast(enabled=recipe is not None, recipe=recipe, plan=plan):
                model(batch).float().square().mean().backward()
            optimizer.step()

        return mean_seconds(one_step, args.steps, device)

    worker = InProcess(run)
    fastest = interleave([(label, worker, label) for label in [*RECIPES, *PLANS]], args.repeats)
    title = f"\n{args.depth} x lowprec.Linear({args.width}), {args.tokens} tokens, {dtype}, {device}: training step per recipe"
    print_ratio_table(title, fastest, "high precision", {})
    return fastest


def unfused(cast, x: torch.Tensor):
    """``cast(x)`` with the fused Triton kernels off: the torch emulation."""
    saved = kernels.set_kernel_mode("emulated")
    try:
        return cast(x)
    finally:
        kernels.set_kernel_mode(saved)


def torchao_casts(x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """torchao's eager MXFP8 and NVFP4 quantization of ``x`` (``label``) and of ``x`` and its transpose
    (``label both``), keyed by the label of our recipe they match; empty (said once) when torchao is not installed."""
    try:
        from torchao.prototype.mx_formats.mx_tensor import to_mx
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
    except ImportError as error:
        print(f"torchao columns: not measured (torchao not installed: {error})")
        return {}

    def mxfp8(y: torch.Tensor) -> object:
        return to_mx(y, torch.float8_e4m3fn, 32)

    def nvfp4(y: torch.Tensor) -> object:
        return nvfp4_quantize(y, 16, per_tensor_amax_to_scale(y.abs().amax().float()))

    casts = {}
    for label, cast in (("MXFP8", mxfp8), ("NVFP4", nvfp4)):
        casts[label] = lambda cast=cast: cast(x)
        casts[f"{label} both"] = lambda cast=cast: (cast(x), cast(x.t().contiguous()))
    return casts


def quantize_table(args: argparse.Namespace, device: str, side: int) -> dict[str, float]:
    """Seconds per quantization of a ``side`` x ``side`` bf16 tensor by each recipe's activation
    quantizer, rowwise and in both orientations, by torchao's matching casts, and a copy's and a transpose's."""
    x = torch.randn(side, side, device=device, dtype=torch.bfloat16)
    size = x.numel() * x.element_size()
    work = {"copy (ceiling)": lambda: x.clone(), "transpose": lambda: x.t().contiguous()}
    for label, recipe in RECIPES.items():
        if recipe is not None:
            quantizer = recipe.quantizers("bench")["activation"]
            work[label] = lambda quantizer=quantizer: quantizer.quantize(x)
            work[f"{label} both"] = lambda quantizer=quantizer: quantizer.quantize(x, transpose=True)
            if device == "cuda":
                work[f"{label} (torch)"] = lambda quantizer=quantizer: unfused(quantizer.quantize, x)
    theirs = torchao_casts(x)
    work.update({f"{label} (torchao)": cast for label, cast in theirs.items()})
    seconds = {label: float("inf") for label in work}
    for _ in range(args.repeats):  # interleaved rounds: a busy machine slows every variant alike
        for label, fn in work.items():
            seconds[label] = min(seconds[label], mean_seconds(fn, args.steps, device))
            synchronize(device)
    print(f"\nQuantizing a {size / 2**20:g} MiB bf16 tensor ({side}x{side}), {device}")
    print(f"{'variant':<32} {'ms':>9} {'GB/s read':>10} {'of copy':>8}")
    copy_rate = size / seconds["copy (ceiling)"]
    for label, value in seconds.items():
        print(f"{label:<32} {value * 1e3:>9.2f} {size / value / 1e9:>10.2f} {size / value / copy_rate:>8.2f}")
    print(f"\n{'format':<20} {'both / (2 rowwise + transpose)':>31}")
    for label, recipe in RECIPES.items():
        if recipe is not None:
            budget = 2 * seconds[label] + seconds["transpose"]
            print(f"{label:<20} {seconds[f'{label} both'] / budget:>31.2f}")
    if theirs:
        print(f"\n{'format':<12} {'rowwise':>8} {'both':>8}   ours / torchao")
        for label in ("MXFP8", "NVFP4"):
            ratios = [seconds[f"{label}{part}"] / seconds[f"{label}{part} (torchao)"] for part in ("", " both")]
            print(f"{label:<12} {ratios[0]:>8.3g} {ratios[1]:>8.3g}")  # 3 digits: a ratio under 0.005 is no 0.00
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--tiny", action="store_true", help="the CPU tables at tiny sizes: checks the code paths")
    parser.add_argument("--json", help="also write the key numbers to this JSON file (for scripts/gpu_check.sh)")
    args = parser.parse_args()
    if args.tiny:
        args.steps, args.repeats, args.width, args.depth, args.tokens = 1, 1, 32, 2, 16
    device, side = "cpu", 256 if args.tiny else 2048
    steps = training_table(args, device, torch.float32)
    seconds = quantize_table(args, device, side)
    if torch.cuda.is_available() and not args.tiny:
        args.width, args.tokens = 4096, 8192
        device, side = "cuda", 8192
        steps = training_table(args, device, torch.bfloat16)
        seconds = quantize_table(args, device, side)
    elif not args.tiny:
        print("\nCUDA tables: not measured (no CUDA device)")
    if args.json:
        size = 2 * side**2
        measures = {
            "model": f"{args.depth} x lowprec.Linear({args.width}), {args.tokens} tokens",
            "step_ratio": {label: value / steps["high precision"] for label, value in steps.items()},
            "quantize_mib": size / 2**20,
            "quantize_tbps": {label: size / value / 1e12 for label, value in seconds.items()},
        }
        write_json(args.json, "formats", device_name(device), measures)


if __name__ == "__main__":
    main()
