"""Cost of the lowprec engine and its debug hooks, as ratios measured side by side in one run.

1. Debug initialized with features only on *other* layers vs debug not initialized, for an 8-layer
   MLP of ``lowprec.Linear`` in high precision and in FP8 (emulated on the CPU). Target: within 2%.
2. On a CUDA GPU: one training step (forward and backward) in FP8 (delayed and current scaling, and
   delayed with plain torch casts instead of the fused Triton kernels) vs bf16 ``torch.nn.Linear``,
   eager, and compiled with ``torch.compile`` (bf16, lowprec FP8 current scaling, torchao's
   ``Float8Linear`` when torchao is installed), for an 8192x8192 layer and for an 8-layer MLP of width
   4096, 8192 tokens. Targets: the 8192 layer's FP8 step at least 1.3x faster than bf16; compiled, at
   least as fast as torchao's compiled Float8Linear.
3. On a CUDA GPU: the bandwidth of quantizing a 128 MiB bf16 tensor, next to a plain copy.

``--tiny`` runs every table, the GPU ones included, on the CPU at tiny sizes (compiled with
``aot_eager``): it checks that the code runs, not its speed. ``--json PATH`` also writes the key numbers.

Run: ``python benchmarks/engine.py [--steps N] [--repeats R] [--width W] [--depth D] [--tokens T]
[--gpu-tokens T] [--compile-backend B] [--tiny] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import copy
import tempfile

import torch
from harness import InProcess, device_name, interleave, mean_seconds, print_ratio_table, write_json

import lowprec
import nvdlfw_inspect.api as debug_api
from lowprec import kernels
from lowprec.formats.elements import E4M3
from lowprec.quant import per_tensor

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
# The GPU tables' sizes: an 8192x8192 layer, an 8 x Linear(4096) MLP, a 128 MiB cast; tiny ones for --tiny.
GPU_TABLE_SIZES = {
    "full": {"layer": 8192, "mlp_width": 4096, "mlp_depth": 8, "cast_side": 8192},
    "tiny": {"layer": 64, "mlp_width": 32, "mlp_depth": 2, "cast_side": 256},
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

    return mean_seconds(one_step, steps, batch.device)  # the warm-up step asks the routing questions


def idle_debug_table(args: argparse.Namespace, device: str, dtype: torch.dtype) -> dict[str, float]:
    """Step time of idle debugging over no debugging, per precision (``hp``, ``fp8``)."""
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
    ratios = {}
    for precision in ("hp", "fp8"):
        plan = [
            (f"no debug, {precision}", worker, f"plain-{precision}"),
            (f"idle debug, {precision}", worker, f"idle-{precision}"),
        ]
        fastest = interleave(plan, args.repeats)
        title = f"\n{args.depth} x lowprec.Linear({args.width}), {args.tokens} tokens, {dtype}, {device}: debug idle vs off"
        print_ratio_table(title, fastest, f"no debug, {precision}", {})
        ratios[precision] = fastest[f"idle debug, {precision}"] / fastest[f"no debug, {precision}"]
    return ratios


def torchao_float8(reference: torch.nn.Module) -> tuple[torch.nn.Module | None, str]:
    """A copy of ``reference`` converted by torchao's ``convert_to_float8_training`` (dynamic scaling),
    or ``(None, why)`` when torchao is not installed."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as error:
        return None, f"torchao not installed ({error})"
    return convert_to_float8_training(copy.deepcopy(reference)), ""


def training_table(
    args: argparse.Namespace, title: str, reference: torch.nn.Module, ours: torch.nn.Module, width: int, device: str
) -> tuple[dict[str, float], dict[str, str]]:
    """One training step (forward, backward) of ``reference`` in bf16 and of ``ours`` in FP8, eager and
    compiled (``torch.compile``, ``args.compile_backend``), next to torchao's compiled Float8Linear.
    Returns the seconds per step of each variant, and why a variant was not timed."""
    x = torch.randn(args.gpu_tokens, width, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.ones(args.gpu_tokens, width, device=device, dtype=torch.bfloat16)
    recipes = {"delayed": lowprec.DelayedScaling(), "current": lowprec.Float8CurrentScaling()}
    torchao_layer, torchao_missing = torchao_float8(reference)
    layers = {"bf16": reference, "torchao": torchao_layer}
    compiled: dict[str, torch.nn.Module] = {}

    def layer_for(name: str, compile_it: bool) -> torch.nn.Module:
        layer = layers.get(name, ours)
        if not compile_it:
            return layer
        if name not in compiled:
            compiled[name] = torch.compile(layer, backend=args.compile_backend, fullgraph=name != "delayed")
        return compiled[name]

    def run(variant: str) -> float:
        name, *flags = variant.split("-")
        recipe = recipes.get(name)
        layer = layer_for(name, "compiled" in flags)
        kernels.set_kernel_mode("emulated" if "unfused" in flags else "auto")

        def one_step():
            with lowprec.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
                layer(x).backward(grad)

        try:
            return mean_seconds(one_step, args.steps, device)
        finally:
            kernels.set_kernel_mode("auto")

    if torchao_layer is not None:
        try:  # a third-party comparison: torchao failing on this torch must not cost our figures
            run("torchao-compiled")
        except Exception as error:
            torchao_layer, torchao_missing = None, f"torchao failed: {type(error).__name__}: {str(error)[:300]}"
    worker = InProcess(run)
    plan = [
        ("torch.nn.Linear bf16", worker, "bf16"),
        ("lowprec FP8 delayed", worker, "delayed"),
        ("lowprec FP8 current", worker, "current"),
        ("delayed, torch casts", worker, "delayed-unfused"),
        ("torch.nn.Linear bf16 compiled", worker, "bf16-compiled"),
        ("lowprec FP8 current compiled", worker, "current-compiled"),
    ]
    missing = {}
    if torchao_layer is not None:
        plan.append(("torchao Float8Linear compiled", worker, "torchao-compiled"))
    else:
        missing["torchao Float8Linear compiled"] = torchao_missing
    fastest = interleave(plan, args.repeats)
    heading = f"\n{title}, {args.gpu_tokens} tokens, one training step, {device_name(device)}"
    print_ratio_table(heading, fastest, "torch.nn.Linear bf16", missing)
    bf16 = fastest["torch.nn.Linear bf16"]
    print(
        f"bf16 step / FP8 step: delayed {bf16 / fastest['lowprec FP8 delayed']:.2f}x, "
        f"current {bf16 / fastest['lowprec FP8 current']:.2f}x faster; compiled: bf16 "
        f"{fastest['torch.nn.Linear bf16 compiled'] * 1e3:.2f} ms, lowprec FP8 current "
        f"{fastest['lowprec FP8 current compiled'] * 1e3:.2f} ms"
        + (f", torchao {fastest['torchao Float8Linear compiled'] * 1e3:.2f} ms" if torchao_layer is not None else "")
    )
    return fastest, missing


def gpu_linear_tables(args: argparse.Namespace, device: str, sizes: dict[str, int]) -> dict:
    """The FP8 vs bf16 training tables and the cast bandwidth table on ``device``; their key numbers."""
    torch.manual_seed(0)
    size = sizes["layer"]
    reference = torch.nn.Linear(size, size, device=device, dtype=torch.bfloat16)
    ours = lowprec.Linear(size, size, name="big", device=device, params_dtype=torch.bfloat16)
    layer, missing = training_table(args, f"Linear {size}x{size}", reference, ours, size, device)
    torchao_ms = layer.get("torchao Float8Linear compiled")
    del reference, ours
    width, depth = sizes["mlp_width"], sizes["mlp_depth"]
    reference = torch.nn.Sequential(*[torch.nn.Linear(width, width, device=device, dtype=torch.bfloat16) for _ in range(depth)])
    ours = mlp(width, depth, device, torch.bfloat16)
    mlp_steps, _ = training_table(args, f"MLP {depth} x Linear({width})", reference, ours, width, device)
    del reference, ours
    cast = cast_bandwidth_table(args, device, sizes["cast_side"])

    def speedups(fastest: dict[str, float]) -> dict[str, float]:
        bf16 = fastest["torch.nn.Linear bf16"]
        return {recipe: bf16 / fastest[f"lowprec FP8 {recipe}"] for recipe in ("delayed", "current")}

    return {
        "layer": f"Linear {size}x{size}",
        "mlp": f"{depth} x Linear({width})",
        "tokens": args.gpu_tokens,
        "layer_ms": {label: seconds * 1e3 for label, seconds in layer.items()},
        "mlp_ms": {label: seconds * 1e3 for label, seconds in mlp_steps.items()},
        "layer_fp8_speedup": speedups(layer),
        "mlp_fp8_speedup": speedups(mlp_steps),
        "layer_compiled_fp8_current_ms": layer["lowprec FP8 current compiled"] * 1e3,
        "layer_torchao_compiled_ms": torchao_ms * 1e3 if torchao_ms is not None else None,
        "torchao_missing_reason": missing.get("torchao Float8Linear compiled"),
        "cast_mib": 2 * sizes["cast_side"] ** 2 / 2**20,
        "cast_tbps": {label: rate / 1e12 for label, rate in cast.items()},
    }


def cast_bandwidth_table(args: argparse.Namespace, device: str, side: int) -> dict[str, float]:
    """Bytes per second of quantizing a ``side`` x ``side`` bf16 tensor (bytes read plus bytes written),
    next to a copy."""
    x = torch.randn(side, side, device=device, dtype=torch.bfloat16)
    size = x.numel() * x.element_size()
    delayed = per_tensor.DelayedScalingQuantizer(E4M3, lowprec.DelayedScaling())
    current = per_tensor.CurrentScalingQuantizer(E4M3)
    # (label, work, bytes moved): a copy reads and writes 128 MiB; a cast with its transpose reads
    # 128 MiB and writes two 64 MiB FP8 copies; current scaling reads the tensor once more for its amax
    variants = {
        "copy (ceiling)": (lambda: x.clone(), 2 * size),
        "delayed cast + transpose": (lambda: delayed.quantize(x, transpose=True), 2 * size),
        "delayed cast": (lambda: delayed.quantize(x), 1.5 * size),
        "current cast + transpose": (lambda: current.quantize(x, transpose=True), 3 * size),
    }
    print(f"\nQuantizing a {size / 2**20:g} MiB bf16 tensor ({side}x{side}) to E4M3, {device_name(device)}")
    print(f"{'variant':<28} {'us':>8} {'GB/s':>8} {'of copy':>8}")
    seconds = {
        label: min(mean_seconds(work, args.steps * 5, device) for _ in range(args.repeats))
        for label, (work, _) in variants.items()
    }
    rates = {label: moved / seconds[label] for label, (_, moved) in variants.items()}
    for label, rate in rates.items():
        print(f"{label:<28} {seconds[label] * 1e6:>8.1f} {rate / 1e9:>8.0f} {rate / rates['copy (ceiling)']:>8.2f}")
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--gpu-tokens", type=int, default=8192, help="tokens per step of the GPU tables")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compiled variants")
    parser.add_argument("--tiny", action="store_true", help="every table on the CPU at tiny sizes: checks the code paths")
    parser.add_argument("--json", help="also write the key numbers to this JSON file (for scripts/gpu_check.sh)")
    args = parser.parse_args()
    if args.tiny:
        args.steps, args.repeats, args.width, args.depth, args.tokens, args.gpu_tokens = 1, 1, 32, 2, 16, 32
        args.compile_backend = "aot_eager"
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    idle = {f"cpu {key}": ratio for key, ratio in idle_debug_table(args, "cpu", torch.float32).items()}
    if device == "cuda":
        idle |= {f"cuda {key}": ratio for key, ratio in idle_debug_table(args, "cuda", torch.bfloat16).items()}
    measures = {"idle_debug_ratio": idle}
    if device == "cuda" or args.tiny:
        measures |= gpu_linear_tables(args, device, GPU_TABLE_SIZES["tiny" if args.tiny else "full"])
    else:
        print("\nFP8 vs bf16 training steps and cast bandwidth: not measured (no CUDA device)")
    if args.json:
        write_json(args.json, "engine", device_name(device), measures)


if __name__ == "__main__":
    main()
