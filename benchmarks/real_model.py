"""Cost of FP8 tensor statistics on a Hugging Face Llama-style model, as ratios to the step without debugging.

The model is ``transformers.LlamaForCausalLM`` built from a ``LlamaConfig`` (random weights, nothing is
downloaded) and passed through ``lowprec.convert``; a training step is the forward with the causal
language-model loss under ``lowprec.fp8_autocast(fp8_recipe=lowprec.DelayedScaling())``, backward, an
SGD step and, when debugging, ``debug_api.step()``. Sizes (``--size``):
  full   hidden 2048, 8 layers, 16 heads, 4 KV heads, intermediate 5376, vocabulary 32000,
         4 sequences of 2048 tokens, bf16 (the default on CUDA)
  small  hidden 256, 2 layers, 4 heads, 2 KV heads, intermediate 688, vocabulary 1000,
         2 sequences of 128 tokens, fp32 (the default on the CPU)
  tiny   hidden 64, 1 layer, 2 heads, 1 KV head, intermediate 128, vocabulary 128, 1 sequence of
         16 tokens, fp32 (checks that the benchmark runs, in seconds)

Variants, eager, timed interleaved in one process:
  no debug       debug_api never initialized
  debug idle     initialized with the statistics config below, but its section selects no layer
  stats freq 1   on every layer whose name ends in ``proj``, for activation, gradient and weight:
                 transformer_engine.LogTensorStats (min, max, mean, std, l1_norm, l2_norm, cur_amax,
                 dynamic_range) and transformer_engine.LogFp8TensorStats (underflows%, scale_inv_min,
                 scale_inv_max, mse), every step
  stats freq 10  the same every 10th step

Printed per variant: the step time (fastest of interleaved rounds of ``--steps`` steps; 10 steps hold
one freq-10 step) and its ratio to no debug; on CUDA the device kernels per step (``torch.profiler``);
on any device the ops dispatched per step (aten ops and custom ``torch.library`` ops, counted with
``harness.count_ops`` over one whole training step: forward, backward, optimizer step and
``debug_api.step()``), averaged over 10 consecutive steady-state steps, and the ops beyond the no-debug
step per inspected (layer, tensor) pair; and the host synchronizations per step, in the training work
between two ``debug_api.step()`` calls (forward, backward, optimizer) and inside ``debug_api.step()``:
on CUDA the warnings of ``torch.cuda.set_sync_debug_mode("warn")``, on the CPU (where nothing waits)
the ops that would synchronize on a GPU. Then the freq-10 steps one at a time (with and without
statistics) and the 15 op names that the freq-1 statistics add most of.

Needs ``transformers`` (``pip install -e .[bench]``). Run: ``python benchmarks/real_model.py
[--size tiny|small|full] [--device cpu|cuda] [--steps N] [--repeats R] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import re
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from harness import (
    InProcess,
    count_ops,
    count_syncs,
    debug_session,
    device_name,
    interleave,
    mean_seconds,
    synchronize,
    write_json,
)

import lowprec
import nvdlfw_inspect.api as debug_api

SIZES = {
    "full": {
        "hidden": 2048,
        "layers": 8,
        "heads": 16,
        "kv_heads": 4,
        "intermediate": 5376,
        "vocab": 32000,
        "batch": 4,
        "seq": 2048,
        "dtype": "bfloat16",
    },
    "small": {
        "hidden": 256,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "intermediate": 688,
        "vocab": 1000,
        "batch": 2,
        "seq": 128,
        "dtype": "float32",
    },
    "tiny": {
        "hidden": 64,
        "layers": 1,
        "heads": 2,
        "kv_heads": 1,
        "intermediate": 128,
        "vocab": 128,
        "batch": 1,
        "seq": 16,
        "dtype": "float32",
    },
}
TENSOR_STATS = ["min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range"]
FP8_STATS = ["underflows%", "scale_inv_min", "scale_inv_max", "mse"]
TENSORS = ["activation", "gradient", "weight"]
PROJ_LAYERS = r".*proj$"
NO_LAYER = r"^no layer has this name$"
VARIANTS = {"no debug": None, "debug idle": (NO_LAYER, 1), "stats freq 1": (PROJ_LAYERS, 1), "stats freq 10": (PROJ_LAYERS, 10)}
OPS_TARGET = 8  # ops per inspected tensor, freq 1
WARMUP_STEPS = 3  # iterations 0-2: the first step of a session asks the routing questions, iteration 0 logs
COUNTED_STEPS = 10  # iterations 3-12 (ops), then 13-22 (kernels), then syncs: each window holds one freq-10 step


def import_transformers():
    try:
        import transformers
    except ImportError as error:
        raise SystemExit(
            f"benchmarks/real_model.py needs Hugging Face transformers ({error}); install it with: pip install -e .[bench]"
        ) from None
    return transformers


def debug_config(regex: str, freq: int) -> dict:
    return {
        "stats_of_every_proj_layer": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": regex},
            "transformer_engine": {
                "LogTensorStats": {"enabled": True, "tensors": TENSORS, "stats": TENSOR_STATS, "freq": freq},
                "LogFp8TensorStats": {"enabled": True, "tensors": TENSORS, "stats": FP8_STATS, "freq": freq},
            },
        }
    }


@dataclass
class Bench:
    """A converted Llama model, its batch and optimizer, and how many (layer, tensor) pairs a
    statistics step inspects."""

    model: torch.nn.Module
    input_ids: torch.Tensor
    optimizer: torch.optim.Optimizer
    recipe: lowprec.DelayedScaling
    converted: list[str]
    inspected_layers: list[str]
    left_unconverted: list[str]

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def inspected_per_logging_step(self) -> int:
        return len(self.inspected_layers) * len(TENSORS)

    def train_fn(self) -> Callable[[], None]:
        """The training work between two ``debug_api.step()`` calls: forward, backward, optimizer."""

        def train() -> None:
            with lowprec.fp8_autocast(fp8_recipe=self.recipe):
                loss = self.model(input_ids=self.input_ids, labels=self.input_ids).loss
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

        return train

    def step_fn(self, debug: bool) -> Callable[[], None]:
        train = self.train_fn()

        def step() -> None:
            train()
            if debug:
                debug_api.step()

        return step


def build(size: dict, device: str) -> Bench:
    transformers = import_transformers()
    config = transformers.LlamaConfig(
        hidden_size=size["hidden"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"],
        intermediate_size=size["intermediate"],
        vocab_size=size["vocab"],
        max_position_embeddings=size["seq"],
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    model.to(getattr(torch, size["dtype"]))
    lowprec.convert(model)
    converted = [module.name for module in model.modules() if isinstance(module, lowprec.Linear)]
    plain = (m for m in model.named_modules() if not isinstance(m[1], lowprec.Linear))  # a lowprec.Linear is an nn.Linear
    left = [path for path, module in plain if isinstance(module, torch.nn.Linear)]
    input_ids = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    inspected = [name for name in converted if re.search(PROJ_LAYERS, name)]
    return Bench(model, input_ids, optimizer, lowprec.DelayedScaling(), converted, inspected, left)


def variant_config(variant: str) -> dict | None:
    selection = VARIANTS[variant]
    return None if selection is None else debug_config(*selection)


def time_variant(bench: Bench, variant: str, steps: int, log_dir: str) -> float:
    """Seconds per step over ``steps`` steps, after one warm-up step (iteration 0) of a new session."""
    with debug_session(variant_config(variant), log_dir) as debug:
        return mean_seconds(bench.step_fn(debug), steps, bench.device)


def kernels_per_step(step: Callable[[], None], steps: int, device: torch.device) -> float:
    """Device kernels (memory copies and sets left out) per call of ``step``, from ``torch.profiler``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    kernels = [
        event
        for event in prof.events()
        if event.device_type == DeviceType.CUDA and not event.name.startswith(("Memcpy", "Memset"))
    ]
    return len(kernels) / steps


def syncs_per_step(bench: Bench, debug: bool, steps: int) -> tuple[float, float]:
    """Host synchronizations per step over ``steps`` steps: in the training work, and in ``debug_api.step()``."""
    train = bench.train_fn()
    in_train = in_step = 0
    for _ in range(steps):
        in_train += count_syncs(train, bench.device)
        if debug:
            in_step += count_syncs(debug_api.step, bench.device)
    return in_train / steps, in_step / steps


@dataclass
class Counts:
    """Ops of each counted step of one variant (iterations ``first_iteration``, ...), kernels per step, and
    host synchronizations per step (training work, ``debug_api.step()``)."""

    per_step: list[Counter[str]]
    first_iteration: int
    kernels: float | None = None
    syncs: tuple[float, float] | None = None

    def mean(self) -> dict[str, float]:
        total: Counter[str] = Counter()
        for counts in self.per_step:
            total.update(counts)
        return {name: count / len(self.per_step) for name, count in total.items()}

    def total_per_step(self) -> float:
        return sum(sum(counts.values()) for counts in self.per_step) / len(self.per_step)


def count_variant(
    bench: Bench,
    variant: str,
    log_dir: str,
    warmup: int = WARMUP_STEPS,
    steps: int = COUNTED_STEPS,
    kernels: bool = False,
    syncs: bool = False,
) -> Counts:
    """Ops of each of ``steps`` consecutive steps after ``warmup`` steps of a new session; then, when
    ``kernels``, device kernels per step over the next ``steps`` steps; then, when ``syncs``, host
    synchronizations per step over the next ``steps`` steps."""
    with debug_session(variant_config(variant), log_dir) as debug:
        step = bench.step_fn(debug)
        for _ in range(warmup):
            step()
        counts = Counts([count_ops(step) for _ in range(steps)], first_iteration=warmup)
        if kernels:
            counts.kernels = kernels_per_step(step, steps, bench.device)
        if syncs:
            counts.syncs = syncs_per_step(bench, debug, steps)
    return counts


def inspected_per_step(bench: Bench, variant: str, first_iteration: int, steps: int) -> float:
    """(layer, tensor) pairs inspected per step, averaged over iterations ``first_iteration`` onwards."""
    selection = VARIANTS[variant]
    if selection is None or selection[0] == NO_LAYER:
        return 0.0
    freq = selection[1]
    logging_steps = sum(1 for iteration in range(first_iteration, first_iteration + steps) if iteration % freq == 0)
    return bench.inspected_per_logging_step * logging_steps / steps


def measure_ops(
    bench: Bench,
    log_dir: str,
    warmup: int = WARMUP_STEPS,
    steps: int = COUNTED_STEPS,
    kernels: bool = False,
    syncs: bool = False,
) -> tuple[dict[str, Counts], dict[str, float]]:
    """Per variant: its ``Counts``, and the inspected (layer, tensor) pairs per step they cover."""
    counts = {variant: count_variant(bench, variant, log_dir, warmup, steps, kernels, syncs) for variant in VARIANTS}
    inspected = {variant: inspected_per_step(bench, variant, warmup, steps) for variant in VARIANTS}
    return counts, inspected


def extra_per_inspected(counts: dict[str, Counts], inspected: dict[str, float], variant: str) -> float | None:
    """Ops per step beyond the no-debug step, per inspected (layer, tensor) pair; None when none is inspected."""
    if inspected[variant] == 0:
        return None
    extra = counts[variant].total_per_step() - counts["no debug"].total_per_step()
    return extra / inspected[variant]


def print_table(title: str, fastest: dict[str, float], counts: dict[str, Counts], inspected: dict[str, float]) -> None:
    cuda = counts["no debug"].kernels is not None
    syncs = counts["no debug"].syncs is not None
    sync_label = "syncs" if cuda else "sync ops*"
    base_ops = counts["no debug"].total_per_step()
    print(title)
    header = f"{'variant':<15} {'ms/step':>9} {'ratio':>7}"
    header += f" {'kernels/step':>13}" if cuda else ""
    header += f" {'ops/step':>10} {'extra ops':>10} {'inspected':>10} {'extra ops/inspected':>20}"
    header += f" {sync_label + '/step':>15} {sync_label + ' in step()':>19}" if syncs else ""
    print(header)
    for variant in VARIANTS:
        seconds, variant_counts = fastest[variant], counts[variant]
        ops = variant_counts.total_per_step()
        per_inspected = extra_per_inspected(counts, inspected, variant)
        row = f"{variant:<15} {seconds * 1e3:>9.2f} {seconds / fastest['no debug']:>7.3f}"
        row += f" {variant_counts.kernels:>13.1f}" if cuda else ""
        row += f" {ops:>10.1f} {ops - base_ops:>+10.1f} {inspected[variant]:>10.1f}"
        row += f" {per_inspected:>20.1f}" if per_inspected is not None else f" {'-':>20}"
        row += f" {variant_counts.syncs[0]:>15.1f} {variant_counts.syncs[1]:>19.1f}" if variant_counts.syncs else ""
        print(row)
    if syncs:
        where = "in the training work (forward, backward, optimizer), and inside debug_api.step()"
        if cuda:
            print(f"syncs: host synchronizations per step (torch.cuda.set_sync_debug_mode warnings) {where}")
        else:
            print(
                f"* sync ops: CPU proxy for host synchronizations, the ops that would wait for a GPU (.item(): "
                f"aten::_local_scalar_dense; host data into a tensor: aten::lift_fresh) per step {where}"
            )


def print_freq10_steps(counts: dict[str, Counts], bench: Bench) -> None:
    freq10, base = counts["stats freq 10"], counts["no debug"].total_per_step()
    parts = []
    for offset, step_counts in enumerate(freq10.per_step):
        iteration = freq10.first_iteration + offset
        logging = iteration % 10 == 0
        if any(part[0] == logging for part in parts):
            continue
        parts.append((logging, iteration, sum(step_counts.values())))
    for logging, iteration, ops in sorted(parts):
        what = "with statistics" if logging else "without statistics"
        line = f"stats freq 10, iteration {iteration} ({what}): {ops} ops ({ops - base:+.1f} vs no debug"
        if logging:
            line += f", {(ops - base) / bench.inspected_per_logging_step:.1f} per inspected tensor"
        print(line + ")")


def op_breakdown(counts: dict[str, Counts], top: int = 15) -> list[tuple[str, float, float, float]]:
    """``(op, no-debug count, freq-1 count, extra)`` per step for the ``top`` ops the freq-1 statistics add most of."""
    base, stats = counts["no debug"].mean(), counts["stats freq 1"].mean()
    rows = [(name, base.get(name, 0.0), stats.get(name, 0.0)) for name in stats | base]
    rows = [(name, before, after, after - before) for name, before, after in rows]
    return sorted(rows, key=lambda row: (-row[3], row[0]))[:top]


def print_breakdown(counts: dict[str, Counts], inspected: dict[str, float], top: int = 15) -> None:
    rows = op_breakdown(counts, top)
    print(f"\nops per step that stats freq 1 adds to no debug, top {top} by extra count")
    print(f"{'op':<40} {'no debug':>10} {'freq 1':>10} {'extra':>10} {'per inspected':>14}")
    for name, base, stats, extra in rows:
        print(f"{name:<40} {base:>10.1f} {stats:>10.1f} {extra:>+10.1f} {extra / inspected['stats freq 1']:>14.2f}")


def json_measures(size_name: str, fastest: dict[str, float], counts: dict[str, Counts], inspected: dict[str, float]) -> dict:
    """The numbers scripts/gpu_check.sh compares with its targets (kernels: None on the CPU)."""
    cuda = counts["no debug"].kernels is not None
    kernels = {variant: counts[variant].kernels for variant in VARIANTS}
    ops = {variant: counts[variant].total_per_step() for variant in VARIANTS}
    return {
        "size": size_name,
        "ms_per_step": {variant: fastest[variant] * 1e3 for variant in VARIANTS},
        "step_ratio": {variant: fastest[variant] / fastest["no debug"] for variant in VARIANTS},
        "kernels_per_step": kernels,
        "kernels_ratio_stats_freq_1": kernels["stats freq 1"] / kernels["no debug"] if cuda else None,
        "ops_per_step": ops,
        "ops_ratio_stats_freq_1": ops["stats freq 1"] / ops["no debug"],
        "extra_ops_per_inspected_stats_freq_1": extra_per_inspected(counts, inspected, "stats freq 1"),
        "syncs_method": "CUDA sync debug mode warnings" if cuda else "CPU proxy: ops that would synchronize on a GPU",
        "syncs_train_per_step": {variant: counts[variant].syncs[0] for variant in VARIANTS},
        "syncs_in_step_per_step": {variant: counts[variant].syncs[1] for variant in VARIANTS},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=sorted(SIZES), help="model size (default: full on CUDA, small on the CPU)")
    parser.add_argument("--steps", type=int, default=10, help="steps per timing (10 hold one freq-10 step)")
    parser.add_argument("--repeats", type=int, default=5, help="timing rounds per variant (fastest reported)")
    parser.add_argument("--json", help="also write the key numbers to this JSON file (for scripts/gpu_check.sh)")
    args = parser.parse_args()
    size_name = args.size or ("full" if args.device == "cuda" else "small")
    size = SIZES[size_name]
    import_transformers()
    bench = build(size, args.device)
    with tempfile.TemporaryDirectory() as log_dir:
        worker = InProcess(lambda variant: time_variant(bench, variant, args.steps, log_dir))
        fastest = interleave([(variant, worker, variant) for variant in VARIANTS], args.repeats)
        counts, inspected = measure_ops(bench, log_dir, kernels=args.device == "cuda", syncs=True)

    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"Llama-style model ({size_name}): hidden {size['hidden']}, {size['layers']} layers, {size['heads']} heads, "
        f"{size['kv_heads']} KV heads, intermediate {size['intermediate']}, vocabulary {size['vocab']}, "
        f"{size['batch']} x {size['seq']} tokens, {size['dtype']}, FP8 delayed scaling, {where}"
    )
    print(
        f"lowprec.convert: {len(bench.converted)} Linear layers converted, {len(bench.left_unconverted)} left as "
        f"torch.nn.Linear; {len(bench.inspected_layers)} match {PROJ_LAYERS!r} x {len(TENSORS)} tensors = "
        f"{bench.inspected_per_logging_step} inspected tensors per statistics step"
    )
    title = (
        f"\nstep time: fastest of {args.repeats} interleaved rounds of {args.steps} steps; ops: aten and custom ops "
        f"dispatched per step, mean of iterations {WARMUP_STEPS}-{WARMUP_STEPS + COUNTED_STEPS - 1}"
    )
    print_table(title, fastest, counts, inspected)
    per_inspected = extra_per_inspected(counts, inspected, "stats freq 1")
    print(f"\nops per inspected tensor, stats freq 1: {per_inspected:.1f} (target: at most {OPS_TARGET})")
    print_freq10_steps(counts, bench)
    print_breakdown(counts, inspected)
    if args.json:
        write_json(args.json, "real_model", device_name(args.device), json_measures(size_name, fastest, counts, inspected))


if __name__ == "__main__":
    main()
