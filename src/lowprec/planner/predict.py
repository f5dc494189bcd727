"""From a calibration to the search's options: each GEMM's cost in each format (``lowprec.plan.cost``) and its
predicted damage to the run's final loss, ``direct + kappa x update`` (``calibrate``): the forward's loss counts as
it is, every step; the learning damage of one step adds up over the run with a weight ``kappa`` (an effective number
of steps, less than the run's: later steps repair part of it), fitted on one run in the cheapest format
(``fit_kappa``)."""

from __future__ import annotations

import math

from lowprec.plan.cost import gemm_cost, gemm_shares
from lowprec.plan.search import GEMMS, Option, Unit
from lowprec.planner.calibrate import HIGH_PRECISION, Calibration


def totals(calibration: Calibration, formats: dict[Unit, str]) -> tuple[float, float]:
    """The summed ``direct`` and ``update`` damage of a plan (``bf16`` GEMMs: none)."""
    direct = update = 0.0
    for unit, fmt in formats.items():
        if fmt != HIGH_PRECISION:
            key = Calibration.key(unit.layer, unit.gemm, fmt)
            direct += calibration.direct[key]
            update += calibration.update[key]
    return direct, update


def fit_kappa(calibration: Calibration, fmt: str, measured_gap: float) -> float:
    """``kappa`` such that the whole model in ``fmt`` is predicted to lose ``measured_gap`` (its measured final-loss
    gap to high precision): 0 where the direct damage alone explains it, or where no update damage was measured."""
    every = {Unit(layer, gemm): fmt for layer in calibration.sizes for gemm in GEMMS}
    direct, update = totals(calibration, every)
    if update <= 0 or not math.isfinite(update) or measured_gap <= direct:
        return 0.0
    return (measured_gap - direct) / update


def options(calibration: Calibration, kappa: float, gpu: str | None = None) -> dict[Unit, list[Option]]:
    """Every GEMM's options: each candidate with its cost and predicted damage, and high precision (no damage)."""
    shares = gemm_shares(calibration.sizes)
    units: dict[Unit, list[Option]] = {}
    for layer, share in shares.items():
        for gemm in GEMMS:
            choices = [Option(HIGH_PRECISION, gemm_cost(share, HIGH_PRECISION, gpu, gemm), 0.0)]
            for fmt in calibration.candidates:
                if fmt == HIGH_PRECISION:
                    continue
                key = Calibration.key(layer, gemm, fmt)
                choices.append(
                    Option(fmt, gemm_cost(share, fmt, gpu, gemm), calibration.direct[key] + kappa * calibration.update[key])
                )
            units[Unit(layer, gemm)] = choices
    return units
