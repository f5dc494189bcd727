"""The bottom line of each compared run: how far its final loss is from the baseline's, whether that is more than
the seed-to-seed noise, and which tensors' quantization the error most likely comes from.

- final loss: the mean of the last ``max(1, ceil(n / 10))`` of a run's ``n`` logged losses (its last tenth);
- gap: the mean over seeds of (the run's final loss - the baseline's final loss of the same seed), relative to the
  mean of the baseline's final losses;
- noise: the standard deviation over seeds of the baseline's final loss (``statistics.stdev``), relative to its mean;
  it takes two seeds or more;
- the gap is outside the noise when ``|gap| > NOISE_FACTOR x noise``, else within it;
- the tensors: the run's top tensors by relative mse (``outliers``), else by underflows%.
"""

from __future__ import annotations

import math
import statistics

#: how many seed-to-seed standard deviations a gap must exceed to be more than noise
NOISE_FACTOR = 2.0
#: how many tensors a bottom line names
CAUSES = 3


def final_loss(losses: list[float]) -> float:
    """The mean of the last tenth of ``losses`` (at least one); NaN when any of them is not finite."""
    tail = losses[-max(1, math.ceil(len(losses) / 10)) :]
    return sum(tail) / len(tail) if tail and all(math.isfinite(loss) for loss in tail) else math.nan


def causes(run_outliers: dict[str, list[dict]]) -> str:
    """The run's top ``CAUSES`` tensors by relative mse, else underflows%, in words; "" when it logged neither."""
    stat = next((name for name in ("relative mse", "underflows%") if run_outliers.get(name)), None)
    if stat is None:
        return ""
    named = ", ".join(f"{row['layer']} {row['tensor']} ({row['settled']:.3g})" for row in run_outliers[stat][:CAUSES])
    return f"most of the error from ({stat}): {named}"


def bottom_line(run: dict, baseline: dict, baseline_words: str) -> dict:
    """``run`` against ``baseline`` (each with ``finals``: seed -> final loss, and ``outliers``): the gap, the noise
    (None with one seed), whether the gap is outside it, and the sentence saying so."""
    seeds = sorted(set(run["finals"]) & set(baseline["finals"]))
    base = [baseline["finals"][seed] for seed in seeds]
    line = {"name": run["name"], "gap": None, "noise": None, "outside": None, "seeds": len(seeds)}
    cause = causes(run["outliers"])
    if not seeds:
        line["text"] = f"{run['name']}: no loss shared with {baseline_words} (loss.json missing): no loss gap"
    elif not all(math.isfinite(value) for value in [*base, *(run["finals"][seed] for seed in seeds)]):
        line["text"] = f"{run['name']}: a final loss is not finite (the run or {baseline_words} diverged): no loss gap"
    else:
        mean = statistics.fmean(base)
        line["gap"] = gap = statistics.fmean(run["finals"][seed] - baseline["finals"][seed] for seed in seeds) / mean
        text = f"{run['name']}: final loss {gap:+.1%} vs {baseline_words}"
        if len(seeds) < 2:
            text += ", one seed: no noise estimate, run --seeds 3 to get one"
        else:
            line["noise"] = noise = statistics.stdev(base) / mean
            line["outside"] = outside = abs(gap) > NOISE_FACTOR * noise
            where = "outside" if outside else "within"
            text += (
                f", {where} the seed-to-seed spread of {baseline_words} ({NOISE_FACTOR:g} x {noise:.2%} = "
                f"{NOISE_FACTOR * noise:.2%}, {len(seeds)} seeds)"
            )
        line["text"] = text
    if cause:
        line["text"] += f"; {cause}"
    return line
