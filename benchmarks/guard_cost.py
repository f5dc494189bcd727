"""Cost of ``NonfiniteGuard`` alone on a training step of ``lowprec`` layers, as ratios to no debugging.

The model is an MLP of ``--depth`` ``lowprec.Linear(--width)`` layers; a training step is the forward under
``lowprec.fp8_autocast(fp8_recipe=lowprec.DelayedScaling())`` (emulated on the CPU), backward, an SGD step and,
when debugging, ``debug_api.step()``. Variants, timed interleaved in one process:
  no debug     debug_api never initialized
  debug idle   initialized with the guard's config, but its section selects no layer
  guard only   transformer_engine.NonfiniteGuard on every layer: its six GEMM tensors (activation, weight,
               output, gradient, dgrad, wgrad; the first layer has no dgrad) checked for NaN and inf, every step

Printed per variant: the step time (fastest of ``--repeats`` interleaved rounds of ``--steps`` steps) and its
ratio to no debug (target for guard only: at most 1.02x); the ops dispatched per step (aten ops, counted exactly
with ``harness.count_ops``, a ``TorchDispatchMode``, over whole steps) and the ops beyond the no-debug step per
guarded tensor; the host's Python work as function calls per step (Python and builtin,
``harness.count_python_calls``: exact where timings drift) and those beyond the no-debug step per guarded tensor;
the host synchronizations per step in the training work (forward, backward, optimizer) and inside
``debug_api.step()`` (on CUDA the warnings of ``torch.cuda.set_sync_debug_mode``, on the CPU the ops that would
synchronize on a GPU: ``.item()``, host data into a tensor); and the host reads inside ``debug_api.step()``
(``Tensor.item``, ``tolist``, ``cpu``, ``numpy`` and the conversions to Python numbers, with the values they read):
the guard's one read of its flag. Then the paired ratio, steadier where the machine's speed drifts between rounds:
in one session, the guarded model and an identical one its section does not select, alternating step by step
(``--pairs`` pairs); the median and quartiles of guarded / other, and each model's page faults per step. On a CPU
with glibc, twice: with malloc's defaults, under which whether a step's end hands the heap's top back to the OS (to
fault it in again) depends on how the process's allocations happen to lie, so that either model may pay ~10% for it
by chance; then with its thresholds pinned (``harness.pin_malloc_thresholds``), which leaves the guard's own cost.
Then the ops the guard adds, by name. The tables are Markdown, with the machine, torch version, date and commit.

Run: ``python benchmarks/guard_cost.py [--device cpu|cuda] [--width W] [--depth D] [--tokens T] [--dtype D]
[--steps N] [--repeats R] [--pairs P] [--threads N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import platform
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from harness import (
    InProcess,
    count_ops,
    count_python_calls,
    count_syncs,
    debug_session,
    device_name,
    git_commit,
    interleave,
    mean_seconds,
    page_faults,
    pin_malloc_thresholds,
    synchronize,
    write_json,
)

import lowprec
import nvdlfw_inspect.api as debug_api

NO_LAYER = r"^no layer has this name$"
VARIANTS = {"no debug": None, "debug idle": NO_LAYER, "guard only": r".*"}
GUARDED_PER_LAYER = 6  # activation, weight, output, gradient, dgrad, wgrad
TARGET_RATIO = 1.02
WARMUP_STEPS = 3
COUNTED_STEPS = 5
DEFAULTS = {
    "cuda": {"width": 4096, "depth": 8, "tokens": 8192, "dtype": "bfloat16"},
    "cpu": {"width": 256, "depth": 8, "tokens": 256, "dtype": "float32"},
}
# Python-level reads of a tensor's values on the host (the guard's verdict makes one per step).
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")
MALLOC_SETTINGS = {
    "default": "glibc's defaults (thresholds adapt as the process frees)",
    "pinned": "thresholds pinned (harness.pin_malloc_thresholds: freed memory stays mapped)",
}


def guard_config(regex: str) -> dict:
    return {
        "guard": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": regex},
            "transformer_engine": {"NonfiniteGuard": {"enabled": True}},
        }
    }


class Bench:
    """The MLP, its batch and optimizer, and the training step of one variant."""

    def __init__(self, args: argparse.Namespace, prefix: str = "mlp"):
        dtype = getattr(torch, args.dtype)
        torch.manual_seed(0)
        self.device = torch.device(args.device)
        layers = [
            lowprec.Linear(args.width, args.width, name=f"{prefix}.{i}", device=args.device, params_dtype=dtype)
            for i in range(args.depth)
        ]
        self.model = torch.nn.Sequential(*layers)
        self.batch = torch.randn(args.tokens, args.width, device=args.device, dtype=dtype)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.recipe = lowprec.DelayedScaling()
        self.guarded = args.depth * GUARDED_PER_LAYER - 1  # the first layer computes no dgrad: its input needs none

    def train(self) -> None:
        """The training work between two ``debug_api.step()`` calls: forward, backward, optimizer."""
        with lowprec.fp8_autocast(fp8_recipe=self.recipe):
            out = self.model(self.batch)
        out.float().square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def step_fn(self, debug: bool) -> Callable[[], None]:
        def step() -> None:
            self.train()
            if debug:
                debug_api.step()

        return step


def variant_config(variant: str) -> dict | None:
    regex = VARIANTS[variant]
    return None if regex is None else guard_config(regex)


def time_variant(bench: Bench, variant: str, steps: int, log_dir: str, cpu_seconds: list[float]) -> float:
    with debug_session(variant_config(variant), log_dir) as debug:
        return mean_seconds(bench.step_fn(debug), steps, bench.device, cpu_seconds)


class Paired(NamedTuple):
    """``paired_ratios``: one ratio per pair of steps; per model, the median page faults of its steps."""

    ratios: list[float]
    faults: dict[str, float]


def paired_ratios(bench: Bench, args: argparse.Namespace, pairs: int, log_dir: str) -> Paired:
    """Per pair of steps, the guarded model's step time over that of an identical model the guard's section does not
    select (its layers named ``other.*``: the plain path), in one debug session, the two alternating step by step
    (each pair's order swapped). Where the machine's speed drifts by more than the guard costs between the interleaved
    rounds (this VM: +-8% at 1024 wide), each pair still sees one speed."""
    other = Bench(args, prefix="other")
    ratios = []
    faults: dict[str, list[int]] = {"guarded": [], "other": []}
    with debug_session(guard_config(r"^mlp\."), log_dir):
        steps = {"guarded": bench.step_fn(True), "other": other.step_fn(True)}
        for _ in range(WARMUP_STEPS):
            steps["guarded"](), steps["other"]()
        for pair in range(pairs):
            seconds = {}
            for name in ("guarded", "other") if pair % 2 == 0 else ("other", "guarded"):
                synchronize(bench.device)
                faults_before, start = page_faults(), time.perf_counter()
                steps[name]()
                synchronize(bench.device)
                seconds[name] = time.perf_counter() - start
                faults[name].append(page_faults() - faults_before)
            ratios.append(seconds["guarded"] / seconds["other"])
    return Paired(ratios, {name: statistics.median(counts) for name, counts in faults.items()})


@contextlib.contextmanager
def counting_host_reads() -> Iterator[Counter[str]]:
    """Counts ``calls`` of the Python-level host reads (``READS``) and the ``values`` they read."""
    counts: Counter[str] = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name: str, original: Callable) -> Callable:
        def read(self: torch.Tensor, *args, **kwargs):
            counts["calls"] += 1
            counts["values"] += self.numel()
            return original(self, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def measure_variant(bench: Bench, variant: str, log_dir: str) -> dict:
    """Ops per step (mean of ``COUNTED_STEPS`` steps after ``WARMUP_STEPS``), syncs per step in the training work
    and in ``debug_api.step()``, and the host reads (calls, values) per ``debug_api.step()``."""
    with debug_session(variant_config(variant), log_dir) as debug:
        step = bench.step_fn(debug)
        for _ in range(WARMUP_STEPS):
            step()
        ops: Counter[str] = Counter()
        for _ in range(COUNTED_STEPS):
            ops.update(count_ops(step))
        python_calls = sum(count_python_calls(step) for _ in range(COUNTED_STEPS))
        syncs_train = syncs_step = 0
        reads: Counter[str] = Counter()
        for _ in range(COUNTED_STEPS):
            syncs_train += count_syncs(bench.train, bench.device)
            if debug:
                syncs_step += count_syncs(debug_api.step, bench.device)
                bench.train()
                with counting_host_reads() as step_reads:
                    debug_api.step()
                reads.update(step_reads)
    return {
        "ops": {name: count / COUNTED_STEPS for name, count in ops.items()},
        "python_calls": python_calls / COUNTED_STEPS,
        "syncs_train": syncs_train / COUNTED_STEPS,
        "syncs_in_step": syncs_step / COUNTED_STEPS if debug else None,
        "reads_in_step": reads["calls"] / COUNTED_STEPS if debug else None,
        "values_read_in_step": reads["values"] / COUNTED_STEPS if debug else None,
    }


class Results(NamedTuple):
    """Everything measured, for the Markdown tables and the JSON: per variant the fastest round's seconds per step,
    the CPU time ratios (None on a GPU) and ``measure_variant``'s counts; the paired ratio's ``summary`` per malloc
    setting (``MALLOC_SETTINGS``)."""

    fastest: dict[str, float]
    cpu_ratios: dict[str, float] | None
    measured: dict[str, dict]
    paired: dict[str, dict]


def quartiles(ratios: list[float]) -> dict[str, float]:
    """Median and quartiles of the paired ratios."""
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    return {"median": median, "q1": q1, "q3": q3, "pairs": len(ratios)}


def summary(paired: Paired) -> dict:
    """The paired ratios' ``quartiles`` and the models' page faults per step."""
    return {**quartiles(paired.ratios), "page_faults_per_step": paired.faults}


def markdown(args: argparse.Namespace, bench: Bench, results: Results) -> str:
    fastest, cpu_ratios, measured, paired = results
    cuda = bench.device.type == "cuda"
    machine = torch.cuda.get_device_name() if cuda else f"CPU ({platform.machine()}), {torch.get_num_threads()} threads"
    base_ops = sum(measured["no debug"]["ops"].values())
    base_calls = measured["no debug"]["python_calls"]
    sync_label = "syncs" if cuda else "sync ops*"
    lines = [
        f"NonfiniteGuard cost: {args.depth} x lowprec.Linear({args.width}), {args.tokens} tokens, {args.dtype}, FP8 "
        f"delayed scaling, {machine}; torch {torch.__version__}, {datetime.date.today()}, commit {git_commit()}",
        f"step time: fastest of {args.repeats} interleaved rounds of {args.steps} steps (CPU time ratio: the same "
        "rounds' least process CPU time per step, which other load on a shared machine does not stretch); ops: aten "
        "ops dispatched per "
        f"step, mean of steps {WARMUP_STEPS}-{WARMUP_STEPS + COUNTED_STEPS - 1}; {bench.guarded} guarded tensors per "
        f"step ({args.depth} layers x {GUARDED_PER_LAYER}, less the first layer's dgrad)",
        "",
        "| variant | ms/step | ratio | CPU time ratio | ops/step | extra ops | extra ops per guarded tensor | "
        f"Python calls/step | extra Python calls per guarded tensor | {sync_label}/step (training) | {sync_label} in "
        "step() | host reads in step() (values) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    for variant in VARIANTS:
        m, seconds = measured[variant], fastest[variant]
        ops = sum(m["ops"].values())
        guard = variant == "guard only"
        per_guarded = f"{(ops - base_ops) / bench.guarded:.1f}" if guard else "-"
        calls = m["python_calls"]
        calls_per_guarded = f"{(calls - base_calls) / bench.guarded:.1f}" if guard else "-"
        in_step = "-" if m["syncs_in_step"] is None else f"{m['syncs_in_step']:g}"
        reads = "-" if m["reads_in_step"] is None else f"{m['reads_in_step']:g} ({m['values_read_in_step']:g})"
        cpu_ratio = "-" if cpu_ratios is None else f"{cpu_ratios[variant]:.3f}"
        lines.append(
            f"| {variant} | {seconds * 1e3:.2f} | {seconds / fastest['no debug']:.3f} | {cpu_ratio} | {ops:.0f} "
            f"| {ops - base_ops:+.0f} "
            f"| {per_guarded} | {calls:.0f} | {calls_per_guarded} | {m['syncs_train']:g} | {in_step} | {reads} |"
        )
    lines += [
        "\npaired steps (the guarded model against an identical one its section does not select, alternating step by "
        "step in one session): guarded / other",
        "",
        "| malloc | pairs | median | quartiles | page faults per step: guarded | other |",
        "|---|---|---|---|---|---|",
    ]
    for setting, measure in paired.items():
        faults = measure["page_faults_per_step"]
        lines.append(
            f"| {MALLOC_SETTINGS[setting]} | {measure['pairs']} | {measure['median']:.3f} | {measure['q1']:.3f}-"
            f"{measure['q3']:.3f} | {faults['guarded']:g} | {faults['other']:g} |"
        )
    if not cuda:
        lines.append(
            "\n\\* sync ops: the CPU's proxy for host synchronizations, the ops that would wait for a GPU "
            "(`.item()`: aten::_local_scalar_dense; host data into a tensor: aten::lift_fresh)"
        )
    base, guard = measured["no debug"]["ops"], measured["guard only"]["ops"]
    added = sorted(((guard.get(name, 0) - base.get(name, 0), name) for name in guard | base), key=lambda row: (-row[0], row[1]))
    lines += ["", "| op the guard adds | per step | per guarded tensor |", "|---|---|---|"]
    lines += [f"| {name} | {extra:+g} | {extra / bench.guarded:.2f} |" for extra, name in added if extra != 0]
    return "\n".join(lines)


def json_measures(args: argparse.Namespace, bench: Bench, results: Results) -> dict:
    fastest, cpu_ratios, measured, paired = results
    ops = {variant: sum(measured[variant]["ops"].values()) for variant in VARIANTS}
    return {
        "paired_step_ratio": paired,
        "model": f"{args.depth} x lowprec.Linear({args.width}), {args.tokens} tokens, {args.dtype}",
        "ms_per_step": {variant: fastest[variant] * 1e3 for variant in VARIANTS},
        "step_ratio": {variant: fastest[variant] / fastest["no debug"] for variant in VARIANTS},
        "cpu_time_ratio": cpu_ratios,
        "ops_per_step": ops,
        "guarded_tensors_per_step": bench.guarded,
        "extra_ops_per_guarded_tensor": (ops["guard only"] - ops["no debug"]) / bench.guarded,
        "extra_python_calls_per_guarded_tensor": (measured["guard only"]["python_calls"] - measured["no debug"]["python_calls"])
        / bench.guarded,
        "syncs_method": "CUDA sync debug mode warnings" if bench.device.type == "cuda" else "CPU proxy",
        "syncs_train_per_step": {variant: measured[variant]["syncs_train"] for variant in VARIANTS},
        "syncs_in_step_per_step": {variant: measured[variant]["syncs_in_step"] for variant in VARIANTS},
        "host_reads_in_step": measured["guard only"]["reads_in_step"],
        "values_read_in_step": measured["guard only"]["values_read_in_step"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", type=int)
    parser.add_argument("--depth", type=int)
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=10, help="steps per timing round")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (fastest reported: noise only adds time)")
    parser.add_argument("--pairs", type=int, default=60, help="pairs of steps for the paired ratio")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--json", help="also write the key numbers to this JSON file (for scripts/gpu_check.sh)")
    args = parser.parse_args()
    if args.pairs < 2:
        parser.error(f"--pairs must be at least 2 (quartiles need two ratios), got {args.pairs}")
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.threads:
        torch.set_num_threads(args.threads)
    bench = Bench(args)
    with tempfile.TemporaryDirectory() as log_dir:
        cpu_samples: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
        worker = InProcess(lambda variant: time_variant(bench, variant, args.steps, log_dir, cpu_samples[variant]))
        fastest = interleave([(variant, worker, variant) for variant in VARIANTS], args.repeats)
        # interleave's warm-up round is no sample, as for the wall clock; on a GPU process time counts only the host's
        # work, not the step's cost
        cpu = {variant: min(samples[1:]) for variant, samples in cpu_samples.items()}
        cpu_ratios = None if bench.device.type == "cuda" else {variant: cpu[variant] / cpu["no debug"] for variant in VARIANTS}
        measured = {variant: measure_variant(bench, variant, log_dir) for variant in VARIANTS}
        paired = {"default": summary(paired_ratios(bench, args, args.pairs, log_dir))}
        # then with the heap kept mapped: the guard's own cost, not where it leaves the allocator (a one-way switch)
        if bench.device.type == "cpu":
            if pin_malloc_thresholds():
                paired["pinned"] = summary(paired_ratios(bench, args, args.pairs, log_dir))
            else:
                print("paired steps with malloc's thresholds pinned: not measured (no glibc mallopt in this process)")
    results = Results(fastest, cpu_ratios, measured, paired)
    print(markdown(args, bench, results))
    ratio = fastest["guard only"] / fastest["no debug"]
    on_cpu = "" if cpu_ratios is None else f", CPU time ratio {cpu_ratios['guard only']:.3f}"
    medians = "; ".join(f"{setting} malloc {measure['median']:.3f}" for setting, measure in paired.items())
    print(f"\nguard only: step ratio to no debug {ratio:.3f}{on_cpu}; paired steps: {medians} (target: at most {TARGET_RATIO})")
    if args.json:
        write_json(args.json, "guard_cost", device_name(args.device), json_measures(args, bench, results))


if __name__ == "__main__":
    main()
