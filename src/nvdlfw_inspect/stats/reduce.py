"""Partials reduced across ranks with two packed all-reduces whose size does not depend on the world size.

An all-gather of every rank's rows makes each rank receive ``world - 1`` copies of them (for 672 inspected
tensors, about 280 KB per rank: 286 MB per step at 1,024 ranks); an all-reduce moves about twice the payload,
whatever the number of ranks. Every field of ``fields.LAYOUT`` merges by a rule an all-reduce can apply:

- ``MIN`` (the first all-reduce): the "min" fields, the "max" fields negated, each row's shift (below), and a
  header of the step stamps (each value with its negation, so one MIN gives minimum and maximum). NaN goes in
  as +inf (neutral) and is restored from a count in the second all-reduce: a MIN of NaN depends on the order.
- ``SUM`` (the second): the "sum" fields, the NaN counts, and the mean and M2 around a shift ``c`` every rank
  knows after the first all-reduce (the smallest finite mean of the row over the ranks):
  ``S1 = sum n_i (mean_i - c)``, ``S2 = sum m2_i + n_i (mean_i - c)^2``, so that ``mean = c + S1 / n`` and
  ``M2 = S2 - S1^2 / n``. Around a shift inside the means' range the subtraction loses no more than Chan's
  merge: a mean a million times the spread stays exact to float64 rounding. M3 and M4 travel the same way, as
  the sums of cubed and fourth-power deviations from ``c`` (``S3``, ``S4``: each rank's moments moved to ``c``,
  the binomial shift of Pébay's formulas), moved back to the merged mean in ``combine``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nvdlfw_inspect.stats.fields import INDEX, LAYOUT

SUM_FIELDS = [i for i, field in enumerate(LAYOUT) if field.merge == "sum"]
MIN_FIELDS = [i for i, field in enumerate(LAYOUT) if field.merge == "min"]
MAX_FIELDS = [i for i, field in enumerate(LAYOUT) if field.merge == "max"]
EXTREMES = MIN_FIELDS + MAX_FIELDS
COUNT, MEAN, M2, M3, M4 = (INDEX[name] for name in ("count", "mean", "m2", "m3", "m4"))
HEADER = 6  # signature, changed, step, newest: (value, -value) for signature, step and newest
MIN_WIDTH = len(EXTREMES) + 1  # per row: the extremes (max fields negated) and the shift candidate
SUM_WIDTH = len(SUM_FIELDS) + 4 + len(EXTREMES)  # per row: the sums, S1 to S4, a NaN count per extreme


@dataclass(frozen=True)
class Stamp:
    """What every rank of a group must agree on, each as (minimum, maximum) over the ranks after the first
    all-reduce: the signature of the row order it holds (-1 when its requests changed since), its step counter,
    and the newest iteration it fed (ranks that fed none aside: +inf and -inf then)."""

    signature: tuple[float, float]
    step: tuple[float, float]
    newest: tuple[float, float]

    @property
    def agreed(self) -> bool:
        return self.signature[0] == self.signature[1] and self.signature[0] >= 0

    @property
    def in_step(self) -> bool:
        fed = math.isfinite(self.newest[0]) and math.isfinite(self.newest[1])
        return self.step[0] == self.step[1] and (not fed or self.newest[0] == self.newest[1])


def pack_min(rows: torch.Tensor, signature: float, step: float, newest: float) -> torch.Tensor:
    """The first all-reduce's payload (``MIN``) of ``rows`` ``[n, FIELDS]``: header, then ``[n, MIN_WIDTH]``.
    ``newest`` -inf: this rank fed nothing."""
    newest_low, newest_high = (math.inf, math.inf) if newest == -math.inf else (newest, -newest)
    header = torch.tensor([signature, -signature, step, -step, newest_low, newest_high], dtype=torch.float64)
    extremes = torch.cat([rows[:, MIN_FIELDS], -rows[:, MAX_FIELDS]], dim=1)
    extremes = torch.where(extremes.isnan(), math.inf, extremes)  # nan_to_num would clip the infinities too
    means = rows[:, MEAN]
    candidate = torch.where((rows[:, COUNT] > 0) & means.isfinite(), means, math.inf)
    body = torch.cat([extremes, candidate.unsqueeze(1)], dim=1)
    return torch.cat([header.to(rows.device), body.reshape(-1)])


def unpack_min(reduced: torch.Tensor, n: int) -> tuple[Stamp, torch.Tensor, torch.Tensor]:
    """``(stamp, extremes [n, len(EXTREMES)] with the max fields back in sign, shift [n])`` of a reduced
    ``pack_min``; a row with no finite mean on any rank is shifted by 0."""
    h = reduced[:HEADER].tolist()
    stamp = Stamp((h[0], -h[1]), (h[2], -h[3]), (h[4], -h[5]))
    body = reduced[HEADER:].reshape(n, MIN_WIDTH)
    extremes = body[:, : len(EXTREMES)].clone()
    extremes[:, len(MIN_FIELDS) :] = -extremes[:, len(MIN_FIELDS) :]
    shift = body[:, -1]
    return stamp, extremes, torch.where(shift.isfinite(), shift, 0.0)


def pack_sum(rows: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """The second all-reduce's payload (``SUM``) of ``rows`` around ``shift``: ``[n, SUM_WIDTH]`` flat. An empty
    row adds nothing (its identity mean is not a value)."""
    count = rows[:, COUNT]
    d = torch.where(count > 0, rows[:, MEAN] - shift, 0.0)
    m2, m3, m4 = (torch.where(count > 0, rows[:, field], 0.0) for field in (M2, M3, M4))
    s1 = count * d
    s2 = m2 + count * d.square()
    s3 = m3 + 3 * d * m2 + count * d**3
    s4 = m4 + 4 * d * m3 + 6 * d.square() * m2 + count * d**4
    nans = rows[:, EXTREMES].isnan().to(torch.float64)
    return torch.cat([rows[:, SUM_FIELDS], torch.stack([s1, s2, s3, s4], dim=1), nans], dim=1).reshape(-1)


def combine(extremes: torch.Tensor, shift: torch.Tensor, reduced_sum: torch.Tensor, n: int) -> torch.Tensor:
    """The merged rows ``[n, FIELDS]`` from the unpacked first all-reduce and the reduced second one."""
    sums = reduced_sum.reshape(n, SUM_WIDTH)
    rows = torch.empty(n, len(LAYOUT), dtype=torch.float64, device=sums.device)
    rows[:, SUM_FIELDS] = sums[:, : len(SUM_FIELDS)]
    s1, s2, s3, s4 = sums[:, len(SUM_FIELDS) : len(SUM_FIELDS) + 4].unbind(1)
    nans = sums[:, len(SUM_FIELDS) + 4 :] > 0
    rows[:, EXTREMES] = torch.where(nans, math.nan, extremes.to(sums.device))
    total = rows[:, COUNT]
    safe = torch.where(total > 0, total, 1.0)
    delta = s1 / safe  # the merged mean minus the shift
    rows[:, MEAN] = torch.where(total > 0, shift.to(sums.device) + delta, 0.0)
    rows[:, M2] = torch.where(total > 0, (s2 - s1.square() / safe).clamp_min(0.0), 0.0)
    rows[:, M3] = torch.where(total > 0, s3 - 3 * delta * s2 + 2 * total * delta**3, 0.0)
    m4 = s4 - 4 * delta * s3 + 6 * delta.square() * s2 - 3 * total * delta**4
    rows[:, M4] = torch.where(total > 0, m4.clamp_min(0.0), 0.0)
    return rows
