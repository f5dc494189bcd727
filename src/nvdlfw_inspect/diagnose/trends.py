"""Where a statistic began to grow: the rule of the trend findings (``kurtosis_growth``, ``outlier_channel_growth``,
``scale_drift``), which warn of a divergence before the loss shows it.

A growth is judged against the run's own start, not an absolute threshold: healthy kurtosis, channel ratios and
scales differ by model and tensor, while an outlier feature or logit growth multiplies them. The baseline is the
median of the first ``Thresholds.trend_baseline`` logged finite values after warm-up; the onset is the first later
iteration that starts ``trend_steps`` consecutive values over ``factor`` x the baseline (a passing spike does not),
provided the statistic is over it in at least ``persistence`` of the logged iterations from there on (it keeps
growing rather than recovering). NaN and inf are left out: the NaN check reports where they began.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nvdlfw_inspect.diagnose.series import Points, _median_nan_last
from nvdlfw_inspect.diagnose.thresholds import Thresholds


@dataclass(frozen=True)
class Growth:
    """A statistic grown over its baseline (``baseline``, from ``baseline_from`` to ``baseline_to``) by more than
    ``factor`` from ``onset`` on; ``over``: of the ``since`` logged values from the onset on, how many were over."""

    baseline: float
    baseline_from: int
    baseline_to: int
    factor: float
    onset: int
    over: int
    since: int

    def ratios(self, points: Points) -> Points:
        """``points`` over the baseline: the series the finding's summary is made of."""
        return {i: v / self.baseline for i, v in points.items()}


def growth(points: Points, warmup_end: int, factor: float, thresholds: Thresholds) -> Growth | None:
    """Where ``points`` began to stay over ``factor`` x its baseline (see the module's docstring); None where it did not,
    or where too few values were logged after warm-up to tell (a baseline and ``trend_steps`` more)."""
    steady = sorted((i, v) for i, v in points.items() if i >= warmup_end and math.isfinite(v))
    start, steps = thresholds.trend_baseline, thresholds.trend_steps
    if len(steady) < start + steps:
        return None
    baseline = _median_nan_last([v for _, v in steady[:start]])
    if baseline <= 0:
        return None
    rest = steady[start:]
    over = [v > factor * baseline for _, v in rest]
    later = [0] * (len(rest) + 1)  # later[k]: how many of rest[k:] are over
    for k in range(len(rest) - 1, -1, -1):
        later[k] = later[k + 1] + over[k]
    for k in range(len(rest) - steps + 1):
        count = later[k]
        if all(over[k : k + steps]) and count >= thresholds.persistence * (len(rest) - k):
            return Growth(baseline, steady[0][0], steady[start - 1][0], factor, rest[k][0], count, len(rest) - k)
    return None
