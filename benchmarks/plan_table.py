"""The README's precision-plan table: the demo GPT trained from one seed three ways, and what each costs the loss and
how much of its GEMM inputs it flushes to zero.

1. ``high precision``: no quantization (float32 on the CPU, the demo's dtype);
2. ``NVFP4 everywhere``: every GEMM in ``NVFP4BlockScaling`` (stochastic rounding of gradients seeded by ``--seed``);
3. ``NVFP4, last block + head in BF16``: the same recipe under a precision plan whose one rule keeps the last
   ``TransformerLayer`` and the output head in high precision (``bf16`` in a plan: the layer's own dtype, float32 here).

Each run is ``lowprec.demo.run_demo`` (same seed: same weights, same batches) with ``plan_statistics_config``'s
statistics every ``--freq`` steps. Columns: the final loss (mean of the last 10 steps); ``act. / grad. underflows%``:
per layer, the % of the tensor's elements that are non-zero and that the GEMMs read as zero in the layer's own format
(``LogFp8TensorStats`` without a prefix; NVFP4: E2M1 zero codes), settled as ``compare`` settles it (the median of
the last quarter of the logged iterations), then the mean over the model's GEMM layers, a layer in high precision
counting 0 (it loses nothing), and the mean over the NVFP4 layers alone; the process CPU time per step.

Run: ``python benchmarks/plan_table.py [--size small] [--steps 100] [--freq 5] [--seed 0] [--threads 1] [--out DIR]``
(prints the table as Markdown, with the machine, date and commit).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import platform
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from harness import git_commit

from lowprec.compare.outliers import collect, settled
from lowprec.demo import SIZES, gemm_layers, plan_statistics_config, planned_recipes, run_demo
from lowprec.plan import GEMMS, PrecisionPlan, load_plan, named_recipe
from nvdlfw_inspect.reading import iter_statistics

ROOT = Path(__file__).resolve().parents[1]
TENSORS = ("activation", "gradient")


def last_block_plan(size: str) -> dict:
    """The plan of the third run: the last TransformerLayer and the head in high precision, the rest the autocast's."""
    last = SIZES[size].layers - 1
    rule = {
        "name": "last block and head in BF16",
        "layers": {"layer_name_regex_pattern": rf"gpt\.(layers\.{last}\.|head$)"},
        "recipe": "bf16",
    }
    return {"rules": [rule]}


@dataclass(frozen=True)
class Row:
    label: str
    nvfp4_layers: int
    layers: int
    final_loss: float
    underflows: dict[str, float]  # tensor -> mean over every GEMM layer (high precision: 0)
    underflows_nvfp4: dict[str, float]  # tensor -> mean over the NVFP4 layers
    per_layer: dict[tuple[str, str], float]  # (layer, tensor) -> settled underflows%
    step_ms: float


def train(name: str, label: str, plan: PrecisionPlan, nvfp4: bool, args: argparse.Namespace, out: Path) -> Row:
    """One run of the demo into ``out/name`` under ``plan`` (empty: the autocast's recipe everywhere), NVFP4 or high
    precision."""
    recipe = named_recipe("nvfp4", seed=args.seed) if nvfp4 else None
    planned = planned_recipes(plan, gemm_layers(SIZES[args.size]), recipe)
    log_dir = out / name
    log_dir.mkdir(parents=True, exist_ok=True)
    config = log_dir / "config.yaml"
    config.write_text(yaml.safe_dump(plan_statistics_config(planned, args.freq), sort_keys=False))
    with contextlib.redirect_stdout(io.StringIO()):
        result = run_demo(
            args.steps,
            args.size,
            config,
            log_dir,
            "cpu",
            recipe=recipe,
            seed=args.seed,
            threads=args.threads,
            plan=plan if plan.rules else None,
        )
    series = collect(iter_statistics(log_dir), "").get("underflows%", {})
    per_layer = {key: settled(points) for key, points in series.items() if key[1] in TENSORS}
    quantized = [name for name, recipes in planned.items() if any(recipes.of(gemm) is not None for gemm in GEMMS)]
    missing = [(layer, tensor) for layer in quantized for tensor in TENSORS if (layer, tensor) not in per_layer]
    if missing:
        raise RuntimeError(f"{label}: no underflows% logged for {missing[:4]}: raise --steps or lower --freq")
    return Row(
        label,
        len(quantized),
        len(planned),
        result["last_loss"],
        {t: sum(per_layer.get((layer, t), 0.0) for layer in planned) / len(planned) for t in TENSORS},
        {t: statistics.mean(per_layer[(layer, t)] for layer in quantized) if quantized else 0.0 for t in TENSORS},
        per_layer,
        result["step_ms"],
    )


def runs(args: argparse.Namespace, out: Path) -> list[Row]:
    """The three runs, in the table's order."""
    plan = load_plan(last_block_plan(args.size))
    return [
        train("high_precision", "high precision", PrecisionPlan(), False, args, out),
        train("nvfp4", "NVFP4 everywhere", PrecisionPlan(), True, args, out),
        train("nvfp4_last_block_bf16", "NVFP4, last block + head in BF16", plan, True, args, out),
    ]


def markdown(rows: list[Row]) -> str:
    head = (
        "| run | NVFP4 layers | final loss | act. underflows% | grad. underflows% | act. / grad. underflows%, NVFP4 layers "
        "| ms per step |\n|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {row.label} | {row.nvfp4_layers} of {row.layers} | {row.final_loss:.4f} | {row.underflows['activation']:.2f} "
        f"| {row.underflows['gradient']:.2f} | "
        + (f"{row.underflows_nvfp4['activation']:.2f} / {row.underflows_nvfp4['gradient']:.2f}" if row.nvfp4_layers else "none")
        + f" | {row.step_ms:.0f} |"
        for row in rows
    ]
    return "\n".join([head, *lines])


def setup(args: argparse.Namespace) -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"{cores}-core CPU ({platform.machine()}), Python {platform.python_version()}, torch {torch.__version__}, "
        f"{datetime.date.today().isoformat()}, commit {git_commit()}; demo GPT size {args.size}, {args.steps} steps, seed "
        f"{args.seed}, {args.threads} thread(s), statistics every {args.freq} steps"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--freq", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="where the runs log (default: a temporary directory)")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        out = Path(args.out) if args.out else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        rows = runs(args, out)
    print(setup(args))
    print()
    print(markdown(rows))


if __name__ == "__main__":
    main()
