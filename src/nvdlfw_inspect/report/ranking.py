"""The report's "Most at risk" table: per layer and tensor, what persists of its quantization losses.

A row holds the tensor's underflows%, overflows% and dynamic range (those that were logged, none
shown as zero), each with its value at the end of the run (the median of the last quarter after
warm-up), its threshold, how many iterations were over it, and its worst value after warm-up with the iteration
(the warm-up's worst beside it where larger). Rows are ranked on the losses at the end against their thresholds, not
on a maximum: a statistic over its threshold only in warm-up (iteration 0, where delayed scaling's scale is still 1)
is a warm-up transient, never a caution. Each row names the format
its layer reads the tensor in; the dynamic range of a tensor read without a per-tensor scale (block formats, high
precision) is shown without a threshold, as no FP8 element's range bounds it.
"""

from __future__ import annotations

import math
from typing import Any

from nvdlfw_inspect.diagnose.findings import GROWTH_KINDS
from nvdlfw_inspect.diagnose.formats import Formats
from nvdlfw_inspect.diagnose.model import Finding
from nvdlfw_inspect.diagnose.series import Run, Summary, summarize

TOP_RISKS = 25
LOSSES = ("underflows%", "overflows%")
RANGE = "dynamic_range"


def threshold_of(stat: str, layer: str, tensor: str, formats: Formats) -> float | None:
    """The threshold of a statistic of the layer's own recipe; None for others (what-if recipes, plain
    statistics, and the dynamic range of a tensor without a per-tensor FP8 cast: GEMM outputs, which stay in high
    precision, block formats)."""
    if stat == "underflows%":  # the threshold of the format the layer reads the tensor in
        fmt = formats.of(layer, tensor)
        return formats.thresholds.underflow_threshold(None if fmt is None else fmt.label)
    if stat == "overflows%":
        return formats.thresholds.overflow_pct
    return formats.range_limit(layer, tensor) if stat == RANGE else None


def json_value(value: float) -> float | str | None:
    """Six significant digits (the page shows five; this halves its size). JSON has no NaN or
    infinity: NaN becomes null, infinities the strings "inf" and "-inf"."""
    if math.isnan(value):
        return None
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return float(f"{value:.6g}")


def _cell(summary: Summary) -> dict[str, Any]:
    return {
        "persistent": json_value(summary.persistent),
        "threshold": None if math.isinf(summary.threshold) else json_value(summary.threshold),  # inf: not judged
        "above": json_value(summary.above),
        "worst": json_value(summary.worst),
        "worst_iteration": summary.worst_iteration,
        "warmup_only": summary.warmup_only,  # the run is no longer than its warm-up: its values stand in
        "warmup_worst": None if summary.warmup_worst is None else json_value(summary.warmup_worst),
        "warmup_worst_iteration": summary.warmup_worst_iteration,
    }


def _finding_label(finding: Finding) -> str:
    """A finding's mark in the table: a problem, or for a growth (``trends``) an early warning, its kind and onset."""
    if finding.kind in GROWTH_KINDS:
        return f"{finding.stat}: early warning, {finding.kind} from iteration {finding.first_iteration}"
    return f"{finding.stat}: problem"


def _labels(cells: dict[str, Summary], found: list[Finding], persistence: float) -> tuple[bool, list[str]]:
    """Per statistic what it is, from the diagnosis's own findings: a problem where ``diagnose`` found one (an early
    warning, with its kind and onset, where that was a growth), a
    caution for a dynamic range beyond its format's while underflows% (logged, under its threshold) measures the
    loss, else a transient (over after warm-up, not persistently) or a warm-up transient (over in warm-up alone).
    Whether any was a caution."""
    problems = {finding.stat for finding in found}
    caution, labels = False, list(dict.fromkeys(map(_finding_label, found)))
    for stat, summary in cells.items():
        if stat in problems:
            continue
        if summary.is_problem(persistence):  # only a measured range: diagnose judges it by underflows%
            caution = True
            labels.append(f"{stat}: caution, beyond the format's range (underflows% measures the loss)")
        elif summary.is_transient(persistence):
            labels.append(f"{stat}: transient")
        elif summary.is_warmup_transient(persistence):
            labels.append(f"{stat}: warm-up transient")
    return caution, labels


def _score(cells: dict[str, Summary]) -> tuple[float, float]:
    """How many times its threshold the worst loss ends at (the dynamic range where no loss was logged),
    and the largest fraction of iterations over a threshold."""
    ranked = [cells[s] for s in LOSSES if s in cells] or list(cells.values())
    ratio = max(s.persistent / s.threshold if s.threshold > 0 else float(s.persistent > 0) for s in ranked)
    return ratio, max(s.above for s in ranked)


def risk_rows(run: Run, formats: Formats, findings: list[Finding]) -> list[dict[str, Any]]:
    """The rows of the table, ranked by the diagnosis's rules: NaN or inf (earliest first), then the tensors
    with findings in the diagnosis's order, then cautions, then the rest, each by how far over its threshold its
    losses end and then for how long they were over."""
    thresholds = formats.thresholds
    warmup_end = run.first_iteration + thresholds.warmup
    cells: dict[tuple[str, str], dict[str, Summary]] = {}
    for (layer, tensor, stat), points in run.merged.items():
        threshold = threshold_of(stat, layer, tensor, formats)
        if threshold is None and stat == RANGE and formats.without_tensor_scale(layer, tensor) is not None:
            threshold = math.inf  # shown, never over: no per-tensor scale to judge it against
        summary = None if threshold is None else summarize(points, threshold, warmup_end, thresholds.tail)
        if summary is not None:
            cells.setdefault((layer, tensor), {})[stat] = summary
    found: dict[tuple[str, str], list[Finding]] = {}
    for finding in findings:
        if finding.kind != "nonfinite":
            found.setdefault((finding.layer, finding.tensor), []).append(finding)
    order = {key: index for index, key in enumerate(found)}
    ranked = []
    for layer, tensor in set(cells) | set(run.nonfinite) | set(found):
        tensor_cells = cells.get((layer, tensor), {})
        first = run.nonfinite.get((layer, tensor))
        ratio, above = _score(tensor_cells) if tensor_cells else (0.0, 0.0)
        caution, labels = _labels(tensor_cells, found.get((layer, tensor), []), thresholds.persistence)
        if first:
            rank: tuple = (0, first.iteration, first.position)
        elif (layer, tensor) in order:
            rank = (1, order[(layer, tensor)], 0.0)
        else:
            rank = (2 if caution else 3, -ratio, -above)
        fmt = formats.of(layer, tensor)
        row = {
            "layer": layer,
            "tensor": tensor,
            "format": None if fmt is None else str(fmt),
            "stats": {stat: _cell(summary) for stat, summary in tensor_cells.items()},
            "nonfinite": None if first is None else first.iteration,
            "problem": first is not None or (layer, tensor) in order,
            "caution": caution,
            "status": labels,
        }
        ranked.append(((*rank, layer, tensor), row))
    ranked.sort(key=lambda pair: pair[0])
    return [row for _, row in ranked[:TOP_RISKS]]
