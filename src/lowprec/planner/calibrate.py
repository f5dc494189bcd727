"""The calibration run of the plan search: the model trained in high precision, and at a few checkpoints, for every
GEMM of every layer (a ``Unit``) and every candidate format, what that GEMM alone in that format does to the loss.

Two measurements per probe, from the checkpoint's weights:

- ``direct``: the forward loss, on a batch the run does not train on, with the GEMM in the format (fprop only;
  dgrad and wgrad do not touch the forward): what the format costs every step's loss, as long as it is used;
- ``update``: the error the format puts in the step's gradient (every parameter's, on another batch), as its
  squared norm relative to the gradient's, ``||g_format - g||^2 / ||g||^2``: what reaches learning, from the
  forward's activations (fprop) or from the gradients dgrad and wgrad compute. Errors of different GEMMs are
  independent, so their squared norms add up.

A probe is a real forward and backward through the format (``lowprec.autocast`` with a one-rule plan), so it sees
every effect of the cast, stochastic rounding included, with no model of how errors propagate; measuring the
loss one optimizer step later instead was tried and drowns in the step's own noise (its effects are ~1e-5 of the
loss on the demo GPT). Each is the mean over the checkpoints and probe batches, ``direct`` clipped at 0 (a format
is not credited for luck). How much loss a unit of ``update`` costs over a run is fitted later, on one run in the
cheapest format (``planner.predict``).

Beside the probes, the reference backward of each probe batch captures every GEMM's operands, whose casts in each
candidate give the what-if statistics of ``planner.operands`` (``errors``): why a format damages a GEMM.
"""

from __future__ import annotations

import json
import math
import re
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import lowprec
from lowprec.errors import LowprecValueError
from lowprec.modules.base import gemm_sizes
from lowprec.plan import UnusedPlanRuleWarning, load_plan
from lowprec.plan.search import GEMMS
from lowprec.planner.operands import captured_operands, operand_errors

HIGH_PRECISION = "bf16"


@dataclass
class Calibration:
    """What a calibration measured: each GEMM layer's weight elements, the candidates, the checkpoints, and per
    ``"layer|gemm|format"`` the mean ``direct`` and ``update`` damage (loss units, at least 0) and their samples, and
    per operand of that GEMM the mean of its what-if statistics (``planner.operands.ERROR_STATS``) over the probe
    batches (``errors``: empty in calibrations saved before they were measured)."""

    sizes: dict[str, int]
    candidates: list[str]
    checkpoints: list[int]
    losses: list[float]
    direct: dict[str, float] = field(default_factory=dict)
    update: dict[str, float] = field(default_factory=dict)
    samples: dict[str, list[list[float]]] = field(default_factory=dict)  # key -> [[direct, update] per sample]
    seconds: float = 0.0
    errors: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # key -> operand -> stat -> mean

    @staticmethod
    def key(layer: str, gemm: str, fmt: str) -> str:
        return f"{layer}|{gemm}|{fmt}"

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(asdict(self), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        return cls(**json.loads(Path(path).read_text()))


Training = tuple[torch.nn.Module, Callable[[int], Any], Callable[[Any], torch.Tensor]]
"""``(model, batch(step), loss_of(batch))``, as ``lowprec.demo`` sets up the GPT or a factory's model."""


def _probe_plan(layer: str, gemm: str, fmt: str) -> Any:
    return load_plan({"rules": [{"name": f"probe {fmt}", "layers": {"exact_layer_names": [layer]}, gemm: fmt}]})


def calibrate(
    training: Training,
    candidates: Sequence[str],
    steps: int,
    make_optimizer: Callable[[torch.nn.Module, int], tuple[torch.optim.Optimizer, Any]],
    checkpoints: int = 3,
    probe_batches: int = 1,
    progress: Callable[[str], None] | None = None,
) -> Calibration:
    """Train ``training`` ``steps`` steps in high precision; after ``checkpoints`` evenly spaced steps (the last one
    included), probe every GEMM of every layer in every candidate but ``bf16`` on ``probe_batches`` batches each.
    ``make_optimizer(model, steps)``: the run's optimizer and learning-rate schedule."""
    model, batch, loss_of = training
    wanted = [fmt for fmt in candidates if fmt != HIGH_PRECISION]
    if not wanted:
        raise LowprecValueError(f"candidates {list(candidates)}: give at least one format besides bf16 to calibrate")
    if not 1 <= checkpoints <= steps:
        raise LowprecValueError(f"checkpoints must be between 1 and steps={steps}, got {checkpoints}")
    sizes = gemm_sizes(model)
    if not sizes:
        raise LowprecValueError("the model has no lowprec GEMM layer: convert it with lowprec.convert first")
    probes = [(layer, gemm, fmt) for layer in sizes for gemm in GEMMS for fmt in wanted]
    at = sorted({max(1, round(steps * (i + 1) / checkpoints)) for i in range(checkpoints)})
    optimizer, schedule = make_optimizer(model, steps)
    samples: dict[tuple[str, str, str], list[tuple[float, float]]] = {key: [] for key in probes}
    error_samples: list[dict[tuple[str, str, str], dict[str, dict[str, float]]]] = []
    losses: list[float] = []
    started = time.perf_counter()
    extra = steps  # the probes' batches: drawn past the training steps (drawing them moves on the batch order)
    for step in range(steps):
        loss = loss_of(batch(step))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step + 1 in at:
            for _ in range(probe_batches):
                train_batch, eval_batch, extra = batch(extra), batch(extra + 1), extra + 2
                error_samples.append(_probe(model, loss_of, train_batch, eval_batch, probes, samples, wanted))
            if progress is not None:
                progress(f"calibration: step {step + 1}/{steps}, {len(probes)} probes done")
    direct, update = {}, {}
    for (layer, gemm, fmt), values in samples.items():
        if values:
            key = Calibration.key(layer, gemm, fmt)
            direct[key] = max(0.0, sum(v[0] for v in values) / len(values))
            update[key] = max(0.0, sum(v[1] for v in values) / len(values))
    _from_peers(samples, direct, update)
    recorded = {Calibration.key(*key): [list(v) for v in values] for key, values in samples.items()}
    seconds = time.perf_counter() - started
    errors = _mean_errors(error_samples)
    return Calibration(sizes, list(candidates), at, losses, direct, update, recorded, seconds, errors)


def _mean_errors(
    error_samples: list[dict[tuple[str, str, str], dict[str, dict[str, float]]]],
) -> dict[str, dict[str, dict[str, float]]]:
    """Each statistic's mean over the probe batches whose backward ran the GEMM."""
    means: dict[str, dict[str, dict[str, float]]] = {}
    for key in dict.fromkeys(key for sample in error_samples for key in sample):
        runs = [sample[key] for sample in error_samples if key in sample]
        means[Calibration.key(*key)] = {
            operand: {stat: sum(run[operand][stat] for run in runs) / len(runs) for stat in stats}
            for operand, stats in runs[0].items()
        }
    return means


_EXPERT = re.compile(r"gemm_\d+$")


def _from_peers(samples: dict[tuple[str, str, str], list[tuple[float, float]]], direct: dict, update: dict) -> None:
    """A GEMM no probe batch ran (an expert no token was routed to) takes the largest damage of its peers (the same
    layer's other experts) in the same format and direction, else the largest of any GEMM: not measured is not free.
    Said once, with how many."""
    missing = [key for key, values in samples.items() if not values]
    for layer, gemm, fmt in missing:
        peers = [
            Calibration.key(other, gemm, fmt)
            for other, g, f in samples
            if (g, f) == (gemm, fmt) and samples[(other, g, f)] and _EXPERT.sub("", other) == _EXPERT.sub("", layer)
        ]
        pool = peers or [Calibration.key(*other) for other in samples if other[1:] == (gemm, fmt) and samples[other]]
        key = Calibration.key(layer, gemm, fmt)
        direct[key] = max((direct[p] for p in pool), default=math.inf)
        update[key] = max((update[p] for p in pool), default=math.inf)
    if missing:
        layers = sorted({layer for layer, _, _ in missing})
        warnings.warn(
            f"calibration: {len(layers)} GEMM layer(s) ran on no probe batch (experts no token was routed to: "
            f"{', '.join(layers[:4])}{' ...' if len(layers) > 4 else ''}); each takes the largest damage of its peers, "
            "so the search keeps it no narrower than them: give more --probe-batches or a larger batch to measure it",
            UserWarning,
            stacklevel=3,
        )


def _probe(
    model: torch.nn.Module,
    loss_of: Callable[[Any], torch.Tensor],
    train_batch: Any,
    eval_batch: Any,
    probes: list[tuple[str, str, str]],
    samples: dict[tuple[str, str, str], list[tuple[float, float]]],
    formats: Sequence[str],
) -> dict[tuple[str, str, str], dict[str, dict[str, float]]]:
    """Every probe from the current weights (which no probe changes), on one pair of batches; the what-if
    statistics of ``formats`` on the operands of the reference backward."""
    parameters = [p for p in model.parameters() if p.requires_grad]

    def gradient(plan: Any) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnusedPlanRuleWarning)  # an expert this batch does not reach: asked below
            with lowprec.autocast(enabled=False, plan=plan):
                loss = loss_of(train_batch)
        loss.backward()
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).double() for p in parameters])

    with torch.no_grad():
        clean = loss_of(eval_batch).item()
    with captured_operands(model) as operands:
        reference = gradient(None)
    errors = operand_errors(operands, formats)
    del operands  # every layer's activation and gradient: not held through the probes
    energy = reference.square().sum().item()
    for layer, gemm, fmt in probes:
        plan = _probe_plan(layer, gemm, fmt)  # a fresh plan: whether the layer ran is whether the plan resolved it
        error = (gradient(plan) - reference).square().sum().item() / energy if energy > 0 else 0.0
        if layer not in plan.resolved():
            continue  # the GEMM did not run on this batch: no sample
        direct = 0.0
        if gemm == "fprop":
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore", UnusedPlanRuleWarning)
                with lowprec.autocast(enabled=False, plan=plan):
                    direct = loss_of(eval_batch).item() - clean
        update = error
        if math.isfinite(direct) and math.isfinite(update):
            samples[(layer, gemm, fmt)].append((direct, update))
        else:  # a format that makes the loss or the gradient NaN or infinite: as bad as can be measured
            samples[(layer, gemm, fmt)].append((math.inf, math.inf))
    model.zero_grad(set_to_none=True)
    return errors
