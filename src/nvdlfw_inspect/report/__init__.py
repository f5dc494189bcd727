"""One self-contained HTML file that shows a run's statistics: which layer and which GEMM tensor goes
wrong, and when.

The page embeds the data as JSON and draws it with its own script (no network, no libraries): first the run's first
non-finite value (``NonfiniteGuard``'s finding where the run had the guard, else the first statistic logged as NaN or
inf) and every early warning (the diagnosis's growth findings, each from where it began), then the
diagnosis (what is wrong, what to change, and the config that does it), a table of the
tensors most at risk ranked on what persists, the precision map (which GEMM read which tensor in FP8, in
high precision or as a feature modified it, from the routing records), heatmaps of layer x iteration for underflows%,
overflows% and dynamic range across the page, coloured against the thresholds of the diagnosis (a
statistic without one on its map's own range) on the values after warm-up (the warm-up's drawn faded, outside
the scale, unless the run is all warm-up), and per layer each logged statistic over the
iterations, forward tensors beside backward ones.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

from nvdlfw_inspect.diagnose import diagnose_run
from nvdlfw_inspect.diagnose.findings import GROWTH_KINDS
from nvdlfw_inspect.diagnose.formats import Formats
from nvdlfw_inspect.diagnose.model import Finding
from nvdlfw_inspect.diagnose.series import collect
from nvdlfw_inspect.diagnose.thresholds import Thresholds
from nvdlfw_inspect.files import write_text_atomic
from nvdlfw_inspect.reading import (
    NonfiniteRecord,
    RoutingRecord,
    Statistic,
    first_nonfinite_record,
    iter_statistics,
    read_nonfinite,
    read_routing,
    run_directory,
)
from nvdlfw_inspect.report.precision_map import precision_map
from nvdlfw_inspect.report.ranking import json_value, risk_rows, threshold_of

FORWARD = ("activation", "weight", "output")
BACKWARD = ("gradient", "dgrad", "wgrad")
HEATMAP_STATS = ("underflows%", "overflows%", "dynamic_range")
_SLOT = re.compile(r"\{\{(STYLE|SCRIPT|TITLE|DATA)\}\}")


def heatmap_kind(stat: str) -> str | None:
    """Which heatmap a statistic belongs to (``fp8_current_scaling_underflows%`` -> ``underflows%``)."""
    base = stat.removesuffix("_columnwise")
    return next((kind for kind in HEATMAP_STATS if base == kind or base.endswith("_" + kind)), None)


def natural_order(names: Iterable[str]) -> list[str]:
    """Names sorted with their numbers compared as numbers: ``layers.2`` before ``layers.10``."""
    return sorted(
        names, key=lambda name: [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]
    )


def report_data(
    statistics: Iterable[Statistic],
    title: str,
    thresholds: Thresholds | None = None,
    routing: Iterable[RoutingRecord] = (),
    nonfinite: Iterable[NonfiniteRecord] = (),
) -> dict[str, Any]:
    """What the page draws: layers, one series per (layer, tensor, stat, rank), the run's first non-finite value (from
    ``NonfiniteGuard``'s ``nonfinite`` records, else the statistics) and its early warnings, the diagnosis (findings
    and the config of remedies as ``nvdlfw-inspect diagnose`` gives them, the remedies in place), the risk table and the precision
    map of the ``routing`` records, which also give each layer's format (the risk table's, and the thresholds of its
    statistics). Series that share their iterations (most do) point to one list in ``iterations`` by index."""
    thresholds = thresholds or Thresholds()
    routing = list(routing)
    formats = Formats(routing, thresholds)
    run = collect(statistics)
    layers = natural_order({layer for layer, _, _, _ in run.points})
    index = {name: i for i, name in enumerate(layers)}
    series = []
    iteration_lists: dict[tuple[int, ...], int] = {}
    for (layer, tensor, stat, rank), values in sorted(run.points.items()):
        iterations = tuple(sorted(values))
        direction = "forward" if tensor in FORWARD else "backward" if tensor in BACKWARD else "other"
        series.append(
            {
                "layer": index[layer],
                "tensor": tensor,
                "stat": stat,
                "rank": rank,
                "direction": direction,
                "heatmap": heatmap_kind(stat),
                "threshold": threshold_of(stat, layer, tensor, formats),  # the diagnosis's: the heatmap's colours
                "it": iteration_lists.setdefault(iterations, len(iteration_lists)),
                # json_value's rounding inlined for finite values (v - v == 0): a call per value cost a second
                "v": [float(f"{v:.6g}") if v - v == 0 else json_value(v) for v in map(values.__getitem__, iterations)],
            }
        )
    diagnosis = diagnose_run(run, thresholds, title, routing)
    return {
        "title": title,
        "first_nonfinite": first_nonfinite(nonfinite, diagnosis.findings),
        "early_warnings": early_warnings(diagnosis.findings),
        "layers": layers,
        "ranks": sorted({rank for _, _, _, rank in run.points}),
        "iterations": [list(iterations) for iterations in iteration_lists],
        "series": series,
        "risks": risk_rows(run, formats, diagnosis.findings),
        "findings": [finding.as_dict() for finding in diagnosis.findings],
        "config_yaml": diagnosis.config_yaml,
        "unmeasured": diagnosis.unmeasured,
        "caution": diagnosis.caution,
        "skipped": diagnosis.skipped,
        "in_place": [entry.as_dict() for entry in diagnosis.in_place],
        "thresholds": thresholds.as_dict(),
        "warmup_end": run.first_iteration + thresholds.warmup,  # the heatmaps' colour scales start here
        "precision_map": precision_map(routing),
    }


def first_nonfinite(records: Iterable[NonfiniteRecord], findings: list[Finding]) -> dict[str, Any] | None:
    """Where the run first held NaN or inf: ``NonfiniteGuard``'s earliest finding (``source`` "guard": its step as
    ``iteration``, layer, GEMM, tensor, micro-batch and rank; a rank that saw it itself before one told of another's),
    else the statistics' (``source`` "statistics": the first tensor whose statistic was NaN or inf, as the diagnosis
    found it); None where neither holds one."""
    first = first_nonfinite_record(records)
    if first is not None:
        return {"source": "guard"} | first._asdict()
    found = next((f for f in findings if f.kind == "nonfinite"), None)
    if found is None:
        return None
    where = {"layer": found.layer, "tensor": found.tensor, "stat": found.stat, "iteration": found.first_iteration}
    return {"source": "statistics"} | where | {"rank": found.context.get("rank")}


def early_warnings(findings: list[Finding]) -> list[dict[str, Any]]:
    """The growth findings (``trends``), the earliest onset first: each one's layer, tensor, kind, statistic and the
    iteration where it began."""
    growths = sorted((f for f in findings if f.kind in GROWTH_KINDS), key=lambda f: (f.first_iteration, f.layer, f.tensor))
    return [
        {"layer": f.layer, "tensor": f.tensor, "kind": f.kind, "stat": f.stat, "iteration": f.first_iteration} for f in growths
    ]


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def render(data: dict[str, Any]) -> str:
    """The HTML page: the template with style, script, title and data put in its slots.

    The template alone is split at its ``{{SLOT}}`` markers, so text that the data brings (a layer named
    ``{{TITLE}}``, a backslash in the log directory) is never taken for a marker."""
    values = {
        "STYLE": _asset("report.css"),
        "SCRIPT": _asset("report.js"),
        "TITLE": html.escape(data["title"]),
        "DATA": _script_json(data),
    }
    parts = _SLOT.split(_asset("template.html"))
    return "".join(values[part] if i % 2 else part for i, part in enumerate(parts))


def _script_json(data: Any) -> str:
    """``data`` as JSON that an HTML ``<script>`` element holds as is: ``<``, ``>`` and ``&`` written as
    ``\\u`` escapes, so no ``</script>`` or ``<!--`` in a name can end or bend the element."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def write_report(log_dir: str | Path, output: str | Path | None = None) -> Path:
    """Read every rank's statistics in ``log_dir`` and write the report (default ``{log_dir}/report.html``).
    ``log_dir`` may also be one of the run's statistics directories (see ``run_directory``). A page that cannot
    be written (full disk, unwritable directory) is a ``WriteError``; a previous page there stays whole."""
    log_dir = run_directory(log_dir)
    output = Path(output) if output is not None else Path(log_dir) / "report.html"
    title = f"Statistics of {Path(log_dir).resolve()}"
    data = report_data(iter_statistics(log_dir), title, routing=read_routing(log_dir), nonfinite=read_nonfinite(log_dir))
    if not data["series"]:
        raise ValueError(f"no statistics were logged in '{log_dir}'")
    return write_text_atomic(output, render(data), "the report")
