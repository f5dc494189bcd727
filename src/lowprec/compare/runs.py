"""``compare_formats``: the demo (or the user's model) trained once per recipe and seed, and the page comparing
the runs; ``compare_dirs``: the same page for runs that already exist.

For one seed every run starts from the same weights and reads the same batches (``run_demo``'s ``seed``), so the
loss curves differ only by the format. Each run logs into ``out/<recipe>`` (``out/<recipe>/seed<k>`` with several
seeds: statistics, its own report, its config and ``loss.json``); the page is ``out/compare.html``. A precision
plan runs as one more, in ``out/plan``. Each recipe's bottom line (``bottom.bottom_line``) is printed and heads the page.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import statistics
from collections.abc import Mapping
from pathlib import Path

import torch
import yaml

import lowprec
from lowprec.compare.bottom import bottom_line, final_loss
from lowprec.compare.outliers import TOP, outliers, over_thresholds, run_format
from lowprec.compare.page import render
from lowprec.compare.recipes import DEFAULT_RECIPES, PLAN_RUN, RECIPES, Entry, parse_recipes, plan_entry
from lowprec.demo import (
    EVERY_LAYER,
    GPT_LAYERS,
    SIZES,
    ModelFactory,
    RunNotSaved,
    check_device,
    choose_threads,
    gemm_layers,
    model_gemm_layers,
    plan_statistics_config,
    planned_recipes,
    read_losses,
    run_demo,
    threads_line,
    user_model,
)
from lowprec.errors import LowprecValueError
from lowprec.plan import GEMMS, PrecisionPlan, load_plan
from lowprec.plan.recipes import describe
from nvdlfw_inspect.diagnose.formats import Formats, format_name
from nvdlfw_inspect.diagnose.thresholds import Thresholds
from nvdlfw_inspect.errors import is_int
from nvdlfw_inspect.files import write_text_atomic
from nvdlfw_inspect.reading import Statistic, iter_statistics, read_routing

TENSORS = ("activation", "gradient", "weight")
PAGE = "compare.html"
DATA = "compare.json"  # the page's data (runs, final losses per seed, bottom lines), for programs on top
CONFIG = "compare_config.yaml"


def statistics_config(entry: Entry, freq: int, layers: str = GPT_LAYERS) -> dict:
    """``LogTensorStats`` and the recipe's quantization statistics for every GEMM operand of the ``layers`` (a regex:
    the GPT's, or ``EVERY_LAYER`` for a model of the user's own, whose layer names compare cannot know)."""
    features: dict = {
        "LogTensorStats": {"enabled": True, "tensors": list(TENSORS), "stats": ["max", "std", "dynamic_range"], "freq": freq}
    }
    if entry.stats:
        features[entry.feature] = {"enabled": True, "tensors": list(TENSORS), "stats": list(entry.stats), "freq": freq}
    section = {"enabled": True, "layers": {"layer_name_regex_pattern": layers}, "transformer_engine": features}
    return {"compare_statistics": section}


def _plan_run(
    plan: str | os.PathLike | Mapping | PrecisionPlan,
    recipe: str | None,
    layers: Mapping[str, tuple[str, ...]],
    what: str,
    seed: int,
) -> tuple[str, Entry]:
    """The plan's run; a ``ValueError`` when the plan quantizes none of the ``layers`` of the model (``what``, in words)
    under that autocast (a run that repeats the high-precision one: a Megatron plan changes only quantized layers
    unless it overrides high precision)."""
    precision_plan = load_plan(plan)
    label = Path(plan).name if isinstance(plan, (str, os.PathLike)) else precision_plan.source
    entry = plan_entry(precision_plan, label, recipe)
    autocast_recipe = entry.make(seed)
    planned = planned_recipes(precision_plan, layers, autocast_recipe)
    if all(recipes.of(gemm) is None for recipes in planned.values() for gemm in GEMMS):
        why = (
            "its rules give no quantized recipe, or do not override high precision (Megatron's "
            "override_nonquantized_autocast: false does not): give its run an autocast recipe (plan_recipe, --plan-recipe)"
            if autocast_recipe is None
            else "its rules keep every layer in high precision"
        )
        raise LowprecValueError(
            f"{precision_plan.source} quantizes no GEMM of {what} under an autocast of {describe(autocast_recipe)}: "
            f"{why}; its run would repeat a high-precision one"
        )
    return PLAN_RUN, entry


def _check(steps: int, size: str, seed: int, seeds: int, out: Path, names: list[str]) -> None:
    """Every argument, before the first run starts: a bad one should not cost the runs before it."""
    if not is_int(steps) or steps < 1:
        raise LowprecValueError(f"steps must be a positive integer, got {steps!r}")
    if size not in SIZES:
        raise LowprecValueError(f"size must be one of {list(SIZES)}, got {size!r}")
    if not is_int(seed) or seed < 0:
        raise LowprecValueError(f"seed must be a non-negative integer, got {seed!r}")
    if not is_int(seeds) or seeds < 1:
        raise LowprecValueError(f"seeds (--seeds) must be a positive integer, got {seeds!r}")
    taken = [name for name in names if (out / name).exists() and any((out / name).iterdir())]
    if taken:
        raise LowprecValueError(f"{out} already holds runs of {', '.join(taken)}: give another out directory or remove them")


def load_factory(spec: str | ModelFactory) -> ModelFactory:
    """``spec``, ``"module:function"`` (``--model``), imported; a callable is returned as it is. A spec that does not
    import, or names no callable, is a ``LowprecValueError`` naming ``--model``, the value and what is expected."""
    if callable(spec):
        return spec
    expected = "module:function, an importable function returning (model, batch_fn)"
    module_name, _, attribute = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not module_name or not attribute:
        raise LowprecValueError(f"--model must be {expected} (e.g. mypkg.models:make), got {spec!r}")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise LowprecValueError(f"--model {spec!r}: {error}; expected {expected}") from None
    if not callable(factory):
        raise LowprecValueError(f"--model {spec!r} is a {type(factory).__name__}, not a function; expected {expected}")
    return factory


def _judged_by(log_dir: Path, stats: list[Statistic]) -> tuple[Formats | None, str | None, str]:
    """How a run's tensors are judged: the formats its routing records give each layer (None when they name
    none), the format its statistics prefix names, and that choice in words."""
    records = read_routing(log_dir)
    prefix, label = run_format(stats)
    if not any(stat.stat.endswith(("underflows%", "overflows%")) for stat in stats):
        return None, None, "nothing: no underflows% or overflows% logged (high precision, or not asked for)"
    if any(record.format for record in records):
        return Formats(records, Thresholds()), label, "each tensor by its own layer's format (routing records)"
    if label is not None:
        return None, label, f"the format its statistics prefix names ({prefix})"
    return None, None, "no format recorded: diagnose's default underflow_pct"


def _run(
    name: str,
    entry: Entry,
    steps: int,
    size: str,
    seed: int,
    log_dir: Path,
    device: str,
    freq: int,
    threads: int,
    factory: ModelFactory | None,
    layers: Mapping[str, tuple[str, ...]],
) -> dict:
    """Train one recipe (or plan) with one seed, quietly; what the run logged (losses, statistics) and its cost.
    ``layers``: the model's GEMM layers, against which a plan is resolved."""
    log_dir.mkdir(parents=True, exist_ok=True)
    recipe = entry.make(seed)
    planned = None if entry.plan is None else planned_recipes(entry.plan, layers, recipe)
    selected = GPT_LAYERS if factory is None else EVERY_LAYER
    if planned is not None:
        wanted = plan_statistics_config(planned, freq, selected)
    else:
        wanted = statistics_config(entry, freq, selected)
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
            factory=factory,
        )
    run = {
        "seed": seed,
        "dir": log_dir,
        "loss": read_losses(log_dir),
        "step_ms": result["step_ms"],
        "step_clock": result["step_clock"],
        "report": result["report"],
        "statistics": list(iter_statistics(log_dir)),
    }
    if planned is not None:
        run["plan"] = {
            "description": result["plan"],
            "autocast": describe(recipe),
            "layers": {layer: {gemm: describe(recipes.of(gemm)) for gemm in GEMMS} for layer, recipes in planned.items()},
        }
    return run


def _mean_curve(curves: list[list[float]]) -> list[float]:
    """The mean over runs at each step that every run logged."""
    return [statistics.fmean(values) for values in zip(*curves, strict=False)] if curves else []


def merged(name: str, label: str, stats: list[str], prefix: str, seed_runs: list[dict], out: Path) -> dict:
    """One recipe's page entry from its runs, one per seed: its loss (the mean over seeds at each step), final losses
    per seed (``bottom.final_loss``) and their mean, the outliers and verdict of its statistics pooled (the worst seed
    at each iteration), each tensor judged by its own format."""
    pooled = [stat for run in seed_runs for stat in run["statistics"]]
    formats, label_format, judged_by = _judged_by(seed_runs[0]["dir"], pooled)
    with_loss = [run for run in seed_runs if run["loss"]]
    finals = {run["seed"]: final_loss(run["loss"]) for run in with_loss}
    costs = [run["step_ms"] for run in seed_runs if run.get("step_ms") is not None]
    report = seed_runs[0]["report"]
    entry = {
        "name": name,
        "label": label,
        "stats": stats,
        "loss": seed_runs[0]["loss"] if len(seed_runs) == 1 else _mean_curve([run["loss"] for run in with_loss]),
        "finals": finals,
        "last_loss": statistics.fmean(finals.values()) if finals else None,
        "step_ms": statistics.fmean(costs) if costs else None,
        "step_clock": seed_runs[0].get("step_clock"),
        "report": None if report is None else os.path.relpath(report, out),
        "seeds": [{"seed": run["seed"], "dir": str(run["dir"]), "final_loss": finals.get(run["seed"])} for run in seed_runs],
        "outliers": outliers(pooled, prefix),
        "over_thresholds": over_thresholds(pooled, prefix, label_format, formats),
        "judged_by": judged_by,
    }
    if "plan" in seed_runs[0]:
        entry["plan"] = seed_runs[0]["plan"]
    return entry


def bottom_lines(runs: list[dict], baseline: dict | None) -> tuple[list[dict], str]:
    """Each run's bottom line against ``baseline`` (a high-precision run), else against the first run, and what the
    runs are measured against, in words."""
    if not runs:
        return [], ""
    if baseline is None:
        baseline = runs[0]
        words = f"{baseline['name']} (no high-precision run: compared with the first run, {baseline['name']})"
    else:
        words = f"high precision ({baseline['name']})"
    return [bottom_line(run, baseline, words) for run in runs if run is not baseline], words


def loss_line(name: str, losses: list[float], run: dict) -> str:
    """What a recipe that trained prints: its first and last loss and the cost of a step."""
    cost = f"{run['step_ms']:.0f} ms of {run['step_clock']} per step"
    return f"{name}: loss {losses[0]:.3f} -> {final_loss(losses):.3f} ({cost})"


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
    seeds: int = 1,
    model: str | ModelFactory | None = None,
) -> Path:
    """Train the demo GPT once per recipe (names of ``RECIPES``, a list or ``"bf16,delayed"``) and seed, and write the
    comparison page; returns its path. Statistics are logged about 25 times per run. A run that fails is printed and
    named on the page with its error; the others still run. ``threads``: torch's CPU threads, chosen once for every
    run (``lowprec.demo.choose_threads``).

    ``seeds``: every recipe trains with the seeds ``seed`` to ``seed + seeds - 1`` (weights and batches), into
    ``out/<recipe>/seed<k>`` when more than one. Each recipe's bottom line (``bottom``) against the high-precision
    run (``bf16`` or ``fp32``, the first given; else the first run) is printed and heads the page.

    ``model``: train the user's model instead of the GPT: ``"module:function"`` or the function itself, returning
    ``(model, batch_fn)`` (``lowprec.demo.ModelFactory``); checked once before any run. Its statistics select every
    layer; ``size`` is then unused. A ``plan`` is resolved against its layers as ``lowprec.convert`` names them (the
    model made once more for that, before any run). ``lowprec.compare.zoo`` holds two such models, a small Llama
    (``lowprec.compare.zoo:llama``) and a small Mixtral (``lowprec.compare.zoo:moe``).

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
    _check(steps, size, seed, seeds, out, names + ([PLAN_RUN] if plan is not None else []))
    factory = None if model is None else load_factory(model)
    layers, what = gemm_layers(SIZES[size]), "the demo GPT"
    if factory is not None:
        torch.manual_seed(seed)
        made, _ = user_model(factory, f"--model {model!r}")  # its contract checked before any run
        if plan is not None:  # the plan is resolved against its layers as the runs convert and name them
            layers, what = model_gemm_layers(lowprec.convert(made)), f"the model of --model {model!r}"
    entries = [(name, RECIPES[name]) for name in names]
    if plan is not None:
        entries.append(_plan_run(plan, plan_recipe, layers, what, seed))
    device = check_device(device)
    threads, why = choose_threads(threads)
    print(threads_line(threads, why), flush=True)
    freq = max(1, steps // 25)
    every = f"{freq} steps" if freq > 1 else "step"
    chosen = list(range(seed, seed + seeds))
    runs, failed, baseline = [], [], None
    for name, entry in entries:
        seed_runs = []
        for k in chosen:
            run_name = name if seeds == 1 else f"{name} seed{k}"
            log_dir = out / name if seeds == 1 else out / name / f"seed{k}"
            try:
                seed_runs.append(_run(name, entry, steps, size, k, log_dir, device, freq, threads, factory, layers))
            except RunNotSaved as error:  # trained, but its logs are cut short: its losses, and the disk named
                print(loss_line(run_name, error.result["losses"], error.result))
                failed.append({"name": run_name, "label": entry.label, "error": f"not compared: {error}"})
                print(f"{run_name}: {failed[-1]['error']}")
                continue
            except Exception as error:  # one run's failure (a full disk, a format the device lacks) costs only it
                failed.append({"name": run_name, "label": entry.label, "error": f"{type(error).__name__}: {error}"})
                print(f"{run_name}: failed: {failed[-1]['error']}")
                continue
            print(loss_line(run_name, seed_runs[-1]["loss"], seed_runs[-1]))
        if seed_runs:
            runs.append(merged(name, entry.label, list(entry.stats), entry.prefix, seed_runs, out))
            if baseline is None and entry.plan is None and entry.make(0) is None:
                baseline = runs[-1]
    lines, against = bottom_lines(runs, baseline)
    for line in lines:
        print(line["text"])
    what = "demo GPT, size " + size if factory is None else f"the model of {model!r} (statistics of every layer, .*)"
    seeded = f"seed {seed}" if seeds == 1 else f"seeds {seed} to {seed + seeds - 1}"
    data = {
        "title": f"Formats compared: {', '.join(entry.label if entry.plan else name for name, entry in entries)}",
        "setup": f"{what}, {steps} steps, {seeded}, statistics every {every}; logs in {out.resolve()}",
        "ranking": RANKING,
        "steps": steps,
        "size": size,
        "seed": seed,
        "seeds": chosen,
        "baseline": against,
        "baseline_run": (baseline or runs[0])["name"] if runs else None,
        "bottom_lines": lines,
        "runs": runs,
        "failed": failed,
    }
    page = write_text_atomic(out / PAGE, render(data), "the comparison page")  # the page first: what people read
    write_text_atomic(out / DATA, json.dumps(data, default=str), "the comparison's data")
    return page


RANKING = (
    f"Top {TOP} tensors per statistic by the median of the last quarter of the logged iterations (with several seeds "
    "the worst seed at each iteration); relative mse = mse / std^2. Each recipe's statistics describe its own casts "
    "(NVFP4's from LogNvfp4TensorStats), a plan run's each layer's own format (none for its layers in high precision); "
    "overflows% exists only under delayed scaling."
)


def _existing_run(log_dir: Path, out: Path) -> dict | None:
    """A run directory's page entry, or None (said why) when it holds no statistics; without ``loss.json`` it has no
    loss (said)."""
    try:
        stats = list(iter_statistics(log_dir))
    except (OSError, ValueError) as error:
        stats, why = [], str(error)
    else:
        why = "no statistics logged"
    if not stats:
        print(f"{log_dir}: skipped, {why}; give a run directory a debug run wrote (statistics under its log dir)")
        return None
    try:
        losses = read_losses(log_dir)
    except FileNotFoundError:
        print(f"{log_dir}: no loss.json: no loss curve or loss gap for it (compare and the demo write one)")
        losses = []
    prefix, _ = run_format(stats)
    formats = {record.format for record in read_routing(log_dir) if record.recipe}
    label = ", ".join(sorted(format_name(fmt) for fmt in formats if fmt)) or format_name(run_format(stats)[1])
    report = log_dir / "report.html"
    run = {"seed": 0, "dir": log_dir, "loss": losses, "report": report if report.is_file() else None, "statistics": stats}
    stats_names = sorted({stat.stat.removeprefix(prefix) for stat in stats if stat.stat.endswith(("underflows%", "mse"))})
    entry = merged(log_dir.name, label, stats_names, prefix, [run], out)
    entry["high_precision"] = not formats and not stats_names
    return entry


def compare_dirs(dirs: list[str | Path], out: str | Path = "./compare_logs") -> Path:
    """The comparison page of runs that already exist (each a log directory of a debug run; ``loss.json`` optional),
    without training, written to ``out/compare.html``; returns its path. Each run is named after its directory,
    judged by the formats its routing records give (else its statistics prefix); the first high-precision run
    (no quantization statistics, no format recorded) is the baseline, else the first directory given (said)."""
    paths = [Path(d) for d in dirs]
    out = Path(out)
    if not paths:
        raise LowprecValueError("compare DIR ...: give at least one run directory")
    missing = [str(path) for path in paths if not path.is_dir()]
    if missing:
        raise LowprecValueError(f"compare DIR ...: not a directory: {', '.join(missing)}")
    names = [path.name for path in paths]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise LowprecValueError(f"compare DIR ...: runs are named after their directories, and {', '.join(repeated)} repeats")
    inside = [str(path) for path in paths if out.resolve() == path.resolve() or path.resolve() in out.resolve().parents]
    if inside:
        raise LowprecValueError(f"--out {str(out)!r} is inside the input run {', '.join(inside)}: give another --out")
    out.mkdir(parents=True, exist_ok=True)
    runs = [run for run in (_existing_run(path, out) for path in paths) if run is not None]
    baseline = next((run for run in runs if run["high_precision"]), None)
    for run in runs:
        del run["high_precision"]
    lines, against = bottom_lines(runs, baseline)
    for line in lines:
        print(line["text"])
    data = {
        "title": f"Runs compared: {', '.join(run['name'] for run in runs)}",
        "setup": f"existing runs, not trained here: {', '.join(str(path.resolve()) for path in paths)}",
        "ranking": RANKING,
        "baseline": against,
        "baseline_run": (baseline or runs[0])["name"] if runs else None,
        "bottom_lines": lines,
        "runs": runs,
        "failed": [],
    }
    return write_text_atomic(out / PAGE, render(data), "the comparison page")
