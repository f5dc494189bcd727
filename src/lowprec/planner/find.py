"""``find_plan``: calibrate, fit, search, prove; the program behind ``nvdlfw-inspect plan``.

1. **Calibrate** (``calibrate``): the model trained ``steps`` steps in high precision, every GEMM probed in every
   candidate format at a few checkpoints.
2. **Baselines** (``compare``): high precision (float32, as the plan's unquantized GEMMs) and the whole model in the
   cheapest candidate, each with ``seeds`` seeds: the seed-to-seed spread of high precision (the standard deviation
   of its final loss, the mean of the last tenth of the losses) sets the budget, ``budget`` times it; the cheapest
   run's gap fits the damage model (``predict.fit_kappa``).
3. **Search** (``lowprec.plan.search``): the cheapest plan whose predicted gap is within the budget.
4. **Prove** (``compare``): the plan trained with the same steps and seeds; within budget when the mean gap of its
   final loss to high precision's (seed by seed) is at most the budget. If not, the prediction was short by the
   factor measured / predicted: every predicted damage is scaled by it and the search run again (where nothing was
   predicted, the GEMMs with the largest gradient error move up a format instead), at most ``rounds`` times.

Everything goes in ``out``: ``calibration.json``, ``baselines/`` and ``proof_<round>/`` (compare's pages and runs),
``plan.yaml`` (the last plan tried, lowprec's plan format: ``lowprec.autocast(plan=...)``, ``demo --plan``),
``plan.json`` (with the calibration's operand statistics, ``errors``) and ``plan.html``.
"""

from __future__ import annotations

import json
import math
import statistics
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import yaml

from lowprec.compare.runs import DATA, compare_formats, load_factory
from lowprec.demo import SIZES, ModelFactory, _factory_training, _gpt_training, check_device, optimizer_for
from lowprec.errors import LowprecValueError
from lowprec.plan.cost import FORMAT_BITS, formats_on
from lowprec.plan.search import Option, SearchResult, Unit, plan_of, search
from lowprec.planner.calibrate import HIGH_PRECISION, Calibration, calibrate
from lowprec.planner.page import render
from lowprec.planner.predict import fit_kappa, options
from nvdlfw_inspect.files import write_text_atomic

BASELINE = "fp32"  # high precision as the plan's unquantized GEMMs run it (the layers' own dtype)
PLAN_FILE, RESULT_FILE, PAGE_FILE = "plan.yaml", "plan.json", "plan.html"
#: GEMMs moved up a format per round that missed the budget
BUMPED_PER_ROUND = 3


@dataclass
class Round:
    """One plan proved: its formats, predicted and measured gap (loss units), and whether it kept the budget."""

    formats: dict[str, dict[str, str]]
    cost: float
    predicted_gap: float
    measured_gap: float | None
    within_budget: bool
    page: str
    rescaled: float | None = None  # after it: every predicted damage multiplied by this (measured / predicted)
    bumped: list[str] = field(default_factory=list)  # after it: these GEMMs moved up a format


@dataclass
class PlanSearch:
    """What ``find_plan`` found: the budget in loss units and how it was set, the fit, the front, the rounds, and the
    calibration's what-if statistics of every GEMM's operands in every candidate (``Calibration.errors``)."""

    candidates: list[str]
    cheapest: str
    noise: float
    budget_units: float
    budget: float
    baseline_loss: float
    cheapest_gap: float
    kappa: float
    front: list[dict[str, float]]
    rounds: list[Round]
    plan_file: str
    baselines_page: str
    errors: dict[str, dict[str, dict[str, float]]]

    @property
    def final(self) -> Round:
        return self.rounds[-1]


def _finals(data: dict, name: str) -> dict[int, float]:
    """A compare run's final loss per seed."""
    run = next((run for run in data["runs"] if run["name"] == name), None)
    if run is None:
        failed = [entry["error"] for entry in data.get("failed", []) if entry["name"].startswith(name)]
        raise LowprecValueError(f"the {name} run of the plan search failed: {'; '.join(failed) or 'no losses'}")
    return {int(seed): float(loss) for seed, loss in run["finals"].items()}


def _gap(finals: dict[int, float], base: dict[int, float]) -> float:
    """The mean over seeds of the final-loss gap, seed by seed (loss units)."""
    seeds = sorted(set(finals) & set(base))
    return statistics.fmean(finals[seed] - base[seed] for seed in seeds)


def _bump(units: dict[Unit, list[Option]], calibration: Calibration, result: SearchResult, count: int) -> list[Unit]:
    """The ``count`` quantized GEMMs of the plan with the largest gradient error in calibration lose their current
    option (they move up to the next option on their hull at the next search); the units bumped."""

    def error(unit: Unit) -> float:
        return calibration.update[Calibration.key(unit.layer, unit.gemm, result.chosen[unit].format)]

    quantized = [unit for unit, option in result.chosen.items() if option.format != HIGH_PRECISION]
    worst = sorted(quantized, key=lambda unit: (-error(unit), unit))
    for unit in worst[:count]:
        units[unit] = [option for option in units[unit] if option.format != result.chosen[unit].format]
    return worst[:count]


def find_plan(
    model: str | ModelFactory | None = None,
    size: str = "tiny",
    candidates: Sequence[str] = ("nvfp4", "mxfp8", HIGH_PRECISION),
    steps: int = 60,
    seeds: int = 3,
    budget: float = 1.0,
    gpu: str | None = None,
    out: str | Path = "./plan_logs",
    rounds: int = 2,
    checkpoints: int = 3,
    probe_batches: int = 1,
    seed: int = 0,
    device: str | None = None,
    threads: int | None = None,
) -> PlanSearch:
    """Find and prove the cheapest plan (see the module's docstring) for the demo GPT of ``size``, or ``model`` (a
    ``module:function`` or a ``ModelFactory``, as ``compare --model`` takes it)."""
    candidates = list(dict.fromkeys(candidates))
    if HIGH_PRECISION not in candidates:
        candidates.append(HIGH_PRECISION)  # the format nothing is lost in: every GEMM can fall back to it
    offered = formats_on(gpu, candidates)
    dropped = [fmt for fmt in candidates if fmt not in offered]
    if dropped:
        warnings.warn(
            f"plan: {gpu} has no published speed for {', '.join(dropped)} (no tensor cores for it, or not measured "
            "there): not searched; leave out --gpu to cost every format by the bits it reads",
            UserWarning,
            stacklevel=2,
        )
    quantized = [fmt for fmt in offered if fmt != HIGH_PRECISION]
    if not quantized:
        raise LowprecValueError(f"candidates {candidates}: none but bf16 runs on {gpu or 'any GPU'}; give a format to search")
    if seeds < 2:
        raise LowprecValueError(f"seeds must be at least 2 (the budget is in units of the seed-to-seed spread), got {seeds}")
    if not budget > 0:
        raise LowprecValueError(f"budget must be a positive number of seed-to-seed spreads, got {budget!r}")
    out = Path(out)
    earlier = [name for name in ("calibration.json", "baselines", RESULT_FILE) if (out / name).exists()]
    if earlier:
        raise LowprecValueError(
            f"out: {str(out)!r} holds an earlier plan search ({', '.join(earlier)}), whose runs compare would refuse "
            "to overwrite after the calibration: give another --out, or remove it"
        )
    out.mkdir(parents=True, exist_ok=True)
    factory = None if model is None else load_factory(model)
    device = check_device(device)
    torch.manual_seed(seed)
    training = _gpt_training(SIZES[size], device, seed) if factory is None else _factory_training(factory, device, seed)
    calibration = calibrate(training, [*quantized, HIGH_PRECISION], steps, optimizer_for, checkpoints, probe_batches, print)
    calibration.save(out / "calibration.json")

    cheapest = min(quantized, key=lambda fmt: (FORMAT_BITS[fmt], fmt))
    shared = {"steps": steps, "size": size, "seed": seed, "device": device, "threads": threads, "seeds": seeds, "model": model}
    baselines = compare_formats([BASELINE, cheapest], out=out / "baselines", **shared)
    data = json.loads((out / "baselines" / DATA).read_text())
    base = _finals(data, BASELINE)
    noise = statistics.stdev(base.values())
    cheapest_gap = _gap(_finals(data, cheapest), base)
    kappa = fit_kappa(calibration, cheapest, cheapest_gap)
    units = options(calibration, kappa, gpu)
    budget_loss = budget * noise
    front = [asdict(point) for point in search(units, 0.0).front]
    tried: list[Round] = []
    for number in range(rounds + 1):
        result = search(units, budget_loss)
        formats = result.formats()
        plan_file = write_text_atomic(
            out / PLAN_FILE, yaml.safe_dump({"precision_plan": plan_of(formats)}, sort_keys=False), "the plan"
        )
        page = compare_formats([BASELINE], out=out / f"proof_{number}", plan=str(plan_file), **shared)
        proof = json.loads((out / f"proof_{number}" / DATA).read_text())
        measured = _gap(_finals(proof, "plan"), _finals(proof, BASELINE))
        within = measured <= budget_loss
        tried.append(Round(formats, result.cost, result.damage, measured, within, str(page)))
        if within or number == rounds:
            break
        if result.damage > 0:  # the model under-predicted this plan: every damage scaled by how much, searched again
            scale = measured / result.damage
            units = {unit: [replace(o, damage=o.damage * scale) for o in choices] for unit, choices in units.items()}
            tried[-1].rescaled = scale
        else:  # nothing predicted to rescale: the GEMMs it measured worst in calibration move up a format
            tried[-1].bumped = [f"{unit.layer} {unit.gemm}" for unit in _bump(units, calibration, result, BUMPED_PER_ROUND)]
    found = PlanSearch(
        candidates=candidates,
        cheapest=cheapest,
        noise=noise,
        budget_units=budget,
        budget=budget_loss,
        baseline_loss=statistics.fmean(base.values()),
        cheapest_gap=cheapest_gap,
        kappa=kappa,
        front=front,
        rounds=tried,
        plan_file=str(plan_file),
        baselines_page=str(baselines),
        errors=calibration.errors,
    )
    write_text_atomic(out / RESULT_FILE, json.dumps(_as_dict(found), default=str, indent=1), "the plan search's result")
    write_text_atomic(out / PAGE_FILE, render(found, calibration), "the plan search's page")
    return found


def _as_dict(found: PlanSearch) -> dict[str, Any]:
    data = asdict(found)
    data["within_budget"] = found.final.within_budget
    data["noise_is_zero"] = found.noise == 0 or not math.isfinite(found.noise)
    return data
