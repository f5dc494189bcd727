"""The layers whose quantization stands out in one run: per statistic, the tensors with the highest median
over the last quarter of the logged iterations (what the run settled into, not warm-up transients).

``mse`` is ranked relative to the tensor's variance (``mse / std**2``, ``std`` from ``LogTensorStats``), so
gradients, whose values are tiny, compete with activations on equal terms.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable

from nvdlfw_inspect.diagnose.formats import Formats, format_name
from nvdlfw_inspect.diagnose.thresholds import CALIBRATED_UNDERFLOW_PCT, Thresholds
from nvdlfw_inspect.reading import Statistic

TOP = 5
RANKED = ("underflows%", "overflows%", "relative mse")

Series = dict[tuple[str, str], dict[int, float]]  # (layer, tensor) -> iteration -> value


def collect(stats: Iterable[Statistic], prefix: str) -> dict[str, Series]:
    """Series per statistic name, ``prefix`` stripped (``nvfp4_mse`` -> ``mse``), the worst rank per iteration."""
    series: dict[str, Series] = defaultdict(lambda: defaultdict(dict))
    for stat in stats:
        points = series[stat.stat.removeprefix(prefix)][(stat.layer, stat.tensor)]
        points[stat.iteration] = max(points.get(stat.iteration, -math.inf), stat.value)
    return series


def relative_mse(series: dict[str, Series]) -> Series:
    """``mse / std**2`` where both were logged at the same iteration and the variance is not zero."""
    result: Series = {}
    for key, mse in series.get("mse", {}).items():
        std = series.get("std", {}).get(key, {})
        points = {it: value / std[it] ** 2 for it, value in mse.items() if std.get(it)}
        if points:
            result[key] = points
    return result


def settled(points: dict[int, float]) -> float:
    """The median of the last quarter of the iterations (at least one)."""
    values = [points[it] for it in sorted(points)]
    return statistics.median(values[-max(1, len(values) // 4) :])


def top_tensors(series: Series, top: int = TOP) -> list[dict]:
    """The ``top`` tensors by settled value (NaN or infinite first), with their worst value and its iteration."""
    rows = []
    for (layer, tensor), points in series.items():
        worst = max(points, key=lambda it: points[it])
        rows.append(
            {"layer": layer, "tensor": tensor, "settled": settled(points), "worst": points[worst], "worst_iteration": worst}
        )
    rows.sort(key=lambda row: (not math.isfinite(row["settled"]), _finite(row["settled"])), reverse=True)
    return rows[:top]


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0


def outliers(stats: Iterable[Statistic], prefix: str = "") -> dict[str, list[dict]]:
    """Per ranked statistic that the run logged (its name after ``prefix``), its top tensors."""
    series = collect(stats, prefix)
    ranked = {"underflows%": series.get("underflows%", {}), "overflows%": series.get("overflows%", {})}
    ranked["relative mse"] = relative_mse(series)
    return {name: top_tensors(ranked[name]) for name in RANKED if ranked[name]}


def run_format(stats: Iterable[Statistic]) -> tuple[str, str | None]:
    """The statistics prefix of a run's quantization statistics (``nvfp4_`` of ``nvfp4_underflows%``; ``""`` when
    unprefixed) and the format it names (None: none, or a prefix that is no known format)."""
    prefixes = {stat.stat[: -len(name)] for stat in stats for name in ("underflows%", "mse") if stat.stat.endswith(name)}
    prefix = "" if "" in prefixes or not prefixes else sorted(prefixes)[0]
    label = prefix.removesuffix("_")
    return prefix, label if label in CALIBRATED_UNDERFLOW_PCT else None


def over_thresholds(
    stats: Iterable[Statistic], prefix: str = "", label: str | None = None, formats: Formats | None = None
) -> dict[str, dict]:
    """Per loss statistic the run logged (underflows%, overflows%), against ``diagnose``'s default thresholds: how many
    tensors settled over it, of how many, the worst settled value, and each threshold used with where it comes from.
    underflows% is judged per tensor by its own format's threshold (``Thresholds.underflow_threshold``): the format
    its routing records give (``formats``; a plan run's layers differ), else the run's ``label``."""
    series = collect(stats, prefix)
    defaults = Thresholds()
    verdict = {}
    for stat in ("underflows%", "overflows%"):
        judged = []
        for (layer, tensor), points in series.get(stat, {}).items():
            if stat == "overflows%":
                judged.append((settled(points), defaults.overflow_pct, "delayed scaling", "overflow_pct"))
                continue
            own = None if formats is None else formats.of(layer, tensor)
            fmt = own.label if own is not None and own.label is not None else label
            judged.append(
                (
                    settled(points),
                    defaults.underflow_threshold(fmt),
                    format_name(fmt) if fmt else "unknown format",
                    defaults.underflow_source(fmt),
                )
            )
        if judged:
            values = [value for value, *_ in judged]
            over = [value for value, threshold, *_ in judged if not value <= threshold]  # NaN counts as over
            worst = max(values, key=lambda value: (not math.isfinite(value), _finite(value)))
            used = {name: {"pct": threshold, "source": source} for _, threshold, name, source in judged}
            verdict[stat] = {"over": len(over), "of": len(values), "worst": worst, "thresholds": used}
    return verdict
