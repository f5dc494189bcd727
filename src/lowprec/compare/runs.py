"""``compare_formats``: the demo trained once per recipe from one seed, and the page comparing the runs.

Every run starts from the same weights and reads the same batches (``run_demo``'s ``seed``), so the loss
curves differ only by the format. Each run logs into ``out/<recipe>`` (statistics, its own report, its
config and ``loss.json``); the page is ``out/compare.html``. A precision plan runs as one more, in ``out/plan``.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Mapping
from pathlib import Path

import yaml

from lowprec.compare.outliers import TOP, outliers, over_thresholds
from lowprec.compare.page import render
from lowprec.compare.recipes import DEFAULT_RECIPES, PLAN_RUN, RECIPES, Entry, parse_recipes, plan_entry
from lowprec.demo import (
    SIZES,
    RunNotSaved,
    check_device,
    choose_threads,
    plan_statistics_config,
    planned_recipes,
    read_losses,
    run_demo,
    threads_line,
)
from lowprec.errors import LowprecValueError
from lowprec.plan import GEMMS, PrecisionPlan, load_plan
from lowprec.plan.recipes import describe
from nvdlfw_inspect.errors import is_int
from nvdlfw_inspect.files import write_text_atomic
from nvdlfw_inspect.reading import iter_statistics

TENSORS = ("activation", "gradient", "weight")
PAGE = "compare.html"
CONFIG = "compare_config.yaml"


def statistics_config(entry: Entry, freq: int) -> dict:
    """``LogTensorStats`` and the recipe's quantization statistics for every GEMM operand of the GPT."""
    features: dict = {
        "LogTensorStats": {"enabled": True, "tensors": list(TENSORS), "stats": ["max", "std", "dynamic_range"], "freq": freq}
    }
    if entry.stats:
        features[entry.feature] = {"enabled": True, "tensors": list(TENSORS), "stats": list(entry.stats), "freq": freq}
    section = {"enabled": True, "layers": {"layer_name_regex_pattern": r"gpt\..*"}, "transformer_engine": features}
    return {"compare_statistics": section}


def _plan_run(plan: str | os.PathLike | Mapping | PrecisionPlan, recipe: str | None, size: str, seed: int) -> tuple[str, Entry]:
    """The plan's run; a ``ValueError`` when the plan quantizes no GEMM of the demo GPT under that autocast (a run that
    repeats the high-precision one: a Megatron plan changes only quantized layers unless it overrides high precision)."""
    precision_plan = load_plan(plan)
    label = Path(plan).name if isinstance(plan, (str, os.PathLike)) else precision_plan.source
    entry = plan_entry(precision_plan, label, recipe)
    autocast_recipe = entry.make(seed)
    planned = planned_recipes(precision_plan, SIZES[size], autocast_recipe)
    if all(recipes.of(gemm) is None for recipes in planned.values() for gemm in GEMMS):
        why = (
            "its rules give no quantized recipe, or do not override high precision (Megatron's "
            "override_nonquantized_autocast: false does not): give its run an autocast recipe (plan_recipe, --plan-recipe)"
            if autocast_recipe is None
            else "its rules keep every layer in high precision"
        )
        raise LowprecValueError(
            f"{precision_plan.source} quantizes no GEMM of the demo GPT under an autocast of {describe(autocast_recipe)}: "
            f"{why}; its run would repeat a high-precision one"
        )
    return PLAN_RUN, entry


def _check(steps: int, size: str, seed: int, out: Path, names: list[str]) -> None:
    """Every argument, before the first run starts: a bad one should not cost the runs before it."""
    if not is_int(steps) or steps < 1:
        raise LowprecValueError(f"steps must be a positive integer, got {steps!r}")
    if size not in SIZES:
        raise LowprecValueError(f"size must be one of {list(SIZES)}, got {size!r}")
    if not is_int(seed) or seed < 0:
        raise LowprecValueError(f"seed must be a non-negative integer, got {seed!r}")
    taken = [name for name in names if (out / name).exists() and any((out / name).iterdir())]
    if taken:
        raise LowprecValueError(f"{out} already holds runs of {', '.join(taken)}: give another out directory or remove them")


def _run(name: str, entry: Entry, steps: int, size: str, seed: int, out: Path, device: str, freq: int, threads: int) -> dict:
    """Train one recipe (or plan) quietly; the run's losses as it logged them, and its outliers."""
    log_dir = out / name
    log_dir.mkdir(parents=True, exist_ok=True)
    recipe = entry.make(seed)
    planned = None if entry.plan is None else planned_recipes(entry.plan, SIZES[size], recipe)
    wanted = statistics_config(entry, freq) if planned is None else plan_statistics_config(planned, freq)
    config = write_text_atomic(log_dir / CONFIG, yaml.safe_dump(wanted, sort_keys=False), "the config")
    with contextlib.redirect_stdout(io.StringIO()):
        result = run_demo(
            steps,
            size,
            config,
            log_dir,
            device,
            recipe=recipe,
            seed=seed,
            autocast=entry.autocast,
            threads=threads,
            plan=entry.plan,
        )
    losses = read_losses(log_dir)
    statistics = list(iter_statistics(log_dir))
    run = {
        "name": name,
        "label": entry.label,
        "stats": list(entry.stats),
        "loss": losses,
        "last_loss": result["last_loss"],
        "step_ms": result["step_ms"],
        "step_clock": result["step_clock"],
        "report": f"{name}/{result['report'].name}",
        "outliers": outliers(statistics, entry.prefix),
        "over_thresholds": over_thresholds(statistics, entry.prefix),
    }
    if planned is not None:
        run["plan"] = {
            "description": result["plan"],
            "autocast": describe(recipe),
            "layers": {layer: {gemm: describe(recipes.of(gemm)) for gemm in GEMMS} for layer, recipes in planned.items()},
        }
    return run


def loss_line(name: str, losses: list[float], run: dict) -> str:
    """What a recipe that trained prints: its first and last loss and the cost of a step."""
    cost = f"{run['step_ms']:.0f} ms of {run['step_clock']} per step"
    return f"{name}: loss {losses[0]:.3f} -> {run['last_loss']:.3f} ({cost})"


def compare_formats(
    recipes: str | list[str] | tuple[str, ...] = DEFAULT_RECIPES,
    steps: int = 100,
    size: str = "tiny",
    out: str | Path = "./compare_logs",
    seed: int = 0,
    device: str | None = None,
    threads: int | None = None,
    plan: str | os.PathLike | Mapping | PrecisionPlan | None = None,
    plan_recipe: str | None = None,
) -> Path:
    """Train the demo GPT once per recipe (names of ``RECIPES``, a list or ``"bf16,delayed"``) from ``seed``
    and write the comparison page; returns its path. Statistics are logged about 25 times per run. A recipe
    that fails is printed and named on the page with its error; the others still run. ``threads``: torch's CPU
    threads, chosen once for every run (``lowprec.demo.choose_threads``).

    ``plan``: a precision plan (a YAML path, a debug config with a ``precision_plan:`` key, a mapping or a
    ``PrecisionPlan``) trained as one more run, last, named ``plan`` and labelled ``plan: <file name>``: the layers
    its rules select in its formats, the others under ``plan_recipe`` (a quantized name of ``RECIPES``; None: high
    precision, float32 without ``torch.autocast`` as the quantized runs' unquantized parts). Its statistics describe
    each layer's own format (``lowprec.demo.plan_statistics_config``); the page shows the plan and each layer's
    GEMM recipes."""
    names = parse_recipes(recipes)
    out = Path(out)
    if plan_recipe is not None and plan is None:
        raise LowprecValueError(f"plan_recipe={plan_recipe!r} is the autocast recipe of a plan's run: give the plan too")
    _check(steps, size, seed, out, names + ([PLAN_RUN] if plan is not None else []))
    entries = [(name, RECIPES[name]) for name in names]
    if plan is not None:
        entries.append(_plan_run(plan, plan_recipe, size, seed))
    device = check_device(device)
    threads, why = choose_threads(threads)
    print(threads_line(threads, why), flush=True)
    freq = max(1, steps // 25)
    every = f"{freq} steps" if freq > 1 else "step"
    runs, failed = [], []
    for name, entry in entries:
        try:
            runs.append(_run(name, entry, steps, size, seed, out, device, freq, threads))
        except RunNotSaved as error:  # trained, but its logs are cut short: its losses, and the disk named
            print(loss_line(name, error.result["losses"], error.result))
            failed.append({"name": name, "label": entry.label, "error": f"not compared: {error}"})
            print(f"{name}: {failed[-1]['error']}")
            continue
        except Exception as error:  # one recipe's failure (a full disk, a format the device lacks) costs only it
            failed.append({"name": name, "label": entry.label, "error": f"{type(error).__name__}: {error}"})
            print(f"{name}: failed: {failed[-1]['error']}")
            continue
        print(loss_line(name, runs[-1]["loss"], runs[-1]))
    data = {
        "title": f"Formats compared: {', '.join(entry.label if entry.plan else name for name, entry in entries)}",
        "setup": f"demo GPT, size {size}, {steps} steps, seed {seed}, statistics every {every}; logs in {out.resolve()}",
        "ranking": f"Top {TOP} tensors per statistic by the median of the last quarter of the logged iterations; "
        "relative mse = mse / std^2. Each recipe's statistics describe its own casts (NVFP4's from "
        "LogNvfp4TensorStats), a plan run's each layer's own format (none for its layers in high precision); "
        "overflows% exists only under delayed scaling.",
        "steps": steps,
        "size": size,
        "seed": seed,
        "runs": runs,
        "failed": failed,
    }
    return write_text_atomic(out / PAGE, render(data), "the comparison page")
