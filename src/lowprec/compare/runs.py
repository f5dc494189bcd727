"""``compare_formats``: the demo trained once per recipe from one seed, and the page comparing the runs.

Every run starts from the same weights and reads the same batches (``run_demo``'s ``seed``), so the loss
curves differ only by the format. Each run logs into ``out/<recipe>`` (statistics, its own report, its
config and ``loss.json``); the page is ``out/compare.html``.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import yaml

from lowprec.compare.outliers import TOP, outliers, over_thresholds
from lowprec.compare.page import render
from lowprec.compare.recipes import DEFAULT_RECIPES, RECIPES, Entry, parse_recipes
from lowprec.demo import SIZES, RunNotSaved, check_device, choose_threads, read_losses, run_demo, threads_line
from lowprec.errors import LowprecValueError
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


def _run(name: str, steps: int, size: str, seed: int, out: Path, device: str, freq: int, threads: int) -> dict:
    """Train one recipe quietly; the run's losses as it logged them, and its outliers."""
    entry = RECIPES[name]
    log_dir = out / name
    log_dir.mkdir(parents=True, exist_ok=True)
    config = write_text_atomic(log_dir / CONFIG, yaml.safe_dump(statistics_config(entry, freq), sort_keys=False), "the config")
    with contextlib.redirect_stdout(io.StringIO()):
        result = run_demo(
            steps, size, config, log_dir, device, recipe=entry.make(seed), seed=seed, autocast=entry.autocast, threads=threads
        )
    losses = read_losses(log_dir)
    statistics = list(iter_statistics(log_dir))
    return {
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
) -> Path:
    """Train the demo GPT once per recipe (names of ``RECIPES``, a list or ``"bf16,delayed"``) from ``seed``
    and write the comparison page; returns its path. Statistics are logged about 25 times per run. A recipe
    that fails is printed and named on the page with its error; the others still run. ``threads``: torch's CPU
    threads, chosen once for every run (``lowprec.demo.choose_threads``)."""
    names = parse_recipes(recipes)
    out = Path(out)
    _check(steps, size, seed, out, names)
    device = check_device(device)
    threads, why = choose_threads(threads)
    print(threads_line(threads, why), flush=True)
    freq = max(1, steps // 25)
    every = f"{freq} steps" if freq > 1 else "step"
    runs, failed = [], []
    for name in names:
        try:
            runs.append(_run(name, steps, size, seed, out, device, freq, threads))
        except RunNotSaved as error:  # trained, but its logs are cut short: its losses, and the disk named
            print(loss_line(name, error.result["losses"], error.result))
            failed.append({"name": name, "label": RECIPES[name].label, "error": f"not compared: {error}"})
            print(f"{name}: {failed[-1]['error']}")
            continue
        except Exception as error:  # one recipe's failure (a full disk, a format the device lacks) costs only it
            failed.append({"name": name, "label": RECIPES[name].label, "error": f"{type(error).__name__}: {error}"})
            print(f"{name}: failed: {failed[-1]['error']}")
            continue
        print(loss_line(name, runs[-1]["loss"], runs[-1]))
    data = {
        "title": f"Formats compared: {', '.join(names)}",
        "setup": f"demo GPT, size {size}, {steps} steps, seed {seed}, statistics every {every}; logs in {out.resolve()}",
        "ranking": f"Top {TOP} tensors per statistic by the median of the last quarter of the logged iterations; "
        "relative mse = mse / std^2. Each recipe's statistics describe its own casts (NVFP4's from "
        "LogNvfp4TensorStats); overflows% exists only under delayed scaling.",
        "steps": steps,
        "size": size,
        "seed": seed,
        "runs": runs,
        "failed": failed,
    }
    return write_text_atomic(out / PAGE, render(data), "the comparison page")
