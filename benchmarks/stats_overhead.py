"""Step-time cost of tensor statistics on a plain PyTorch MLP, as ratios to the plain step.

Variants, timed interleaved in one run (ours and the reference ``nvdlfw-inspect`` 0.2.2 each in its
own environment; the reference is installed into ``benchmarks/.reference-venv`` on first use, or taken
from ``$NVDLFW_INSPECT_REFERENCE_PATH``, see ``harness.reference_python``):
  plain        no hooks, no framework
  *-no-match   hooks call debug_api.log_tensor_stats, but the config selects no layer
  *-stats      LogTensorStats (six statistics) of every layer's input on every step
  ours-early   the same six and the early-warning ones (kurtosis, rms, outlier_channel_ratio, max_channel)

Also the time spent inside the debug calls alone (``*-calls``), which varies far less between runs
than whole step times. Then the bandwidth of our one-pass statistics on a 128 MiB bf16 tensor
(``--bandwidth-mib``), with M3 and M4 (kurtosis) and of the channel statistics' column amax, next to a plain copy.
Defaults: on CUDA the issue's model (8 x Linear(4096), 8192 tokens, bf16); on the CPU a model sized
for it (8 x Linear(1024), 512 tokens, fp32).

Run: ``python benchmarks/stats_overhead.py [--device cpu|cuda] [--steps N] [--repeats R] [--width W]
[--depth D] [--tokens T] [--bandwidth-mib M] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from harness import Worker, device_name, interleave, print_ratio_table, reference_python, serve, synchronize, write_json

SIX = ["min", "max", "mean", "std", "l1_norm", "l2_norm"]
EARLY = ["kurtosis", "rms", "outlier_channel_ratio", "max_channel"]
DEFAULTS = {
    "cuda": {"width": 4096, "tokens": 8192, "dtype": "bfloat16"},
    "cpu": {"width": 1024, "tokens": 512, "dtype": "float32"},
}


class Clock:
    """Seconds spent inside the debug calls (``log_tensor_stats`` and ``step``): the host-side cost
    itself, free of the run-to-run noise in whole step times."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def call(self, fn: Callable[..., object], *args: object, **kwargs: object) -> None:
        start = time.perf_counter()
        fn(*args, **kwargs)
        self.seconds += time.perf_counter() - start


def build(width: int, depth: int, hooks: bool, device: str, dtype: torch.dtype, clock: Clock) -> torch.nn.Sequential:
    import nvdlfw_inspect.api as debug_api

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)]).to(device, dtype)
    if hooks:
        for i, layer in enumerate(model):

            def log_input(_module, args, name=f"layer{i}"):
                clock.call(debug_api.log_tensor_stats, layer_name=name, tensor=args[0], tensor_name="activation")

            layer.register_forward_pre_hook(log_input)
    return model


def config(regex: str, stats: list[str]) -> dict:
    return {
        "stats": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": regex},
            "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": stats, "freq": 1},
        }
    }


def time_steps(model: torch.nn.Module, batch: torch.Tensor, steps: int, debug: bool, clock: Clock) -> float:
    """Mean seconds per training step (forward, backward, SGD update, debug step)."""
    import nvdlfw_inspect.api as debug_api

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    synchronize(batch.device)
    start = time.perf_counter()
    for _ in range(steps):
        model(batch).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if debug:
            clock.call(debug_api.step)
    synchronize(batch.device)
    return (time.perf_counter() - start) / steps


def run_variant(variant: str, args: argparse.Namespace, log_dir: str) -> float:
    """Time one variant in this process, with whichever ``nvdlfw_inspect`` this environment has."""
    import nvdlfw_inspect.api as debug_api

    dtype = getattr(torch, args.dtype)
    batch = torch.randn(args.tokens, args.width, device=args.device, dtype=dtype)
    clock = Clock()
    if variant == "plain":
        model = build(args.width, args.depth, False, args.device, dtype, clock)
        return time_steps(model, batch, args.steps, False, clock)
    regex = "nothing_matches" if variant == "no-match" else r"layer\d+"
    debug_api.initialize(config_file=config(regex, SIX + EARLY if variant == "early" else SIX), log_dir=log_dir)
    try:
        model = build(args.width, args.depth, True, args.device, dtype, clock)
        step_seconds = time_steps(model, batch, args.steps, True, clock)
    finally:
        debug_api.end_debug()
    return clock.seconds / args.steps if variant == "stats-calls" else step_seconds


def seconds_per_call(fn: Callable[[], object], device: str, repeats: int = 20) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def print_bandwidth(device: str, mib: int) -> dict[str, float]:
    """Bytes per second read by ``compute_partials`` of a ``mib`` MiB bf16 tensor, with M3 and M4 too, by the
    channel statistics' ``column_amax`` of it (4096 columns), and moved by a copy (read + write) of it."""
    from nvdlfw_inspect.stats.catalog import column_amax
    from nvdlfw_inspect.stats.kernels import compute_partials

    x = torch.randn(mib * 2**19, device=device, dtype=torch.bfloat16)
    size = x.numel() * x.element_size()
    work = {
        "compute_partials": (lambda: compute_partials(x), size),
        "compute_partials + M3, M4": (lambda: compute_partials(x, {"m3", "m4"}), size),
        "column_amax": (lambda: column_amax(x.view(-1, 4096)), size),
        "copy (read + write)": (lambda: x.clone(), 2 * size),
    }
    print(f"\nstatistics pass on a {mib} MiB bf16 tensor ({device})")
    print(f"{'kernel':<28} {'ms':>9} {'GB/s':>9}")
    rates = {}
    for label, (fn, moved) in work.items():
        seconds = seconds_per_call(fn, device)
        rates[label] = moved / seconds
        print(f"{label:<28} {seconds * 1e3:>9.2f} {moved / seconds / 1e9:>9.1f}")
    return rates


def print_overhead_ratio(fastest: dict[str, float], calls: dict[str, float]) -> None:
    """Our overhead as a fraction of the reference's: from whole step times, and from the time inside
    the debug calls (the same cost, measured without the step-to-step noise)."""
    if "reference-stats" not in fastest:
        return
    ours = fastest["ours-stats"] - fastest["plain"]
    reference = fastest["reference-stats"] - fastest["plain"]
    print(
        f"\noverhead, ours / reference, from step times:        {ours / reference:.3f} "
        f"(ours {ours * 1e3:.2f} ms, reference {reference * 1e3:.2f} ms per step)"
    )
    ours, reference = calls["ours-calls"], calls["reference-calls"]
    print(
        f"overhead, ours / reference, time in debug calls:    {ours / reference:.3f} "
        f"(ours {ours * 1e3:.2f} ms, reference {reference * 1e3:.2f} ms per step)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=10, help="steps per timing")
    parser.add_argument("--repeats", type=int, default=5, help="timings per variant (median reported)")
    parser.add_argument("--width", type=int)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"])
    parser.add_argument("--bandwidth-mib", type=int, default=128, help="size of the bf16 tensor of the bandwidth table")
    parser.add_argument("--json", help="also write the key numbers to this JSON file (for scripts/gpu_check.sh)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    shape = ["--device", args.device, "--steps", str(args.steps), "--width", str(args.width), "--depth", str(args.depth)]
    shape += ["--tokens", str(args.tokens), "--dtype", args.dtype]
    if args.worker:
        with tempfile.TemporaryDirectory() as log_dir:
            serve(lambda variant: run_variant(variant, args, log_dir))
        return

    ours = Worker(sys.executable, Path(__file__), shape)
    plan = [("plain", ours, "plain"), ("ours-no-match", ours, "no-match"), ("ours-stats", ours, "stats")]
    plan += [("ours-early", ours, "early"), ("ours-calls", ours, "stats-calls")]
    missing = {}
    ref_python, reason = reference_python()
    workers = [ours]
    if ref_python is not None:
        reference = Worker(ref_python, Path(__file__), shape)
        workers.append(reference)
        plan += [("reference-no-match", reference, "no-match"), ("reference-stats", reference, "stats")]
        plan += [("reference-calls", reference, "stats-calls")]
    else:
        missing = {"reference-no-match": reason, "reference-stats": reason}
    try:
        fastest = interleave(plan, args.repeats)
    finally:
        for worker in workers:
            worker.close()
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    title = f"MLP {args.depth} x Linear({args.width}), {args.tokens} tokens, {args.dtype}, {where}"
    calls = {label: fastest.pop(label) for label in ("ours-calls", "reference-calls") if label in fastest}
    print_ratio_table(title, fastest, "plain", missing)
    print_overhead_ratio(fastest, calls)
    rates = print_bandwidth(args.device, args.bandwidth_mib)
    if args.json:
        reference = fastest.get("reference-stats")
        measures = {
            "model": title,
            "ms_per_step": {label: seconds * 1e3 for label, seconds in fastest.items()},
            "step_ratio_ours_stats": fastest["ours-stats"] / fastest["plain"],
            "step_ratio_ours_early": fastest["ours-early"] / fastest["plain"],
            "step_ratio_reference_stats": reference / fastest["plain"] if reference is not None else None,
            "reference_missing_reason": missing.get("reference-stats"),
            "bandwidth_mib": args.bandwidth_mib,
            "stats_bandwidth_tbps": rates["compute_partials"] / 1e12,
            "moments_bandwidth_tbps": rates["compute_partials + M3, M4"] / 1e12,
            "column_amax_bandwidth_tbps": rates["column_amax"] / 1e12,
            "copy_bandwidth_tbps": rates["copy (read + write)"] / 1e12,
        }
        write_json(args.json, "stats_overhead", device_name(args.device), measures)


if __name__ == "__main__":
    main()
