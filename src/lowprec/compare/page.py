"""The comparison page: one self-contained HTML file (no script, no network) with the loss curves of every
recipe drawn as inline SVG on shared axes, a table of losses, and per recipe the tensors that stand out.
The data it shows is embedded as JSON (``<script type="application/json" id="compare-data">``) for tools."""

from __future__ import annotations

import html
import json
import math
from typing import Any

from lowprec.compare.bottom import NOISE_FACTOR

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 780, 380, 80, 170, 20, 40

STYLE = """
body { font: 14px system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.note { color: #666; }
td.over { background: #fde0dc; color: #b42318; font-weight: 600; }
td.ok { background: #e6f4ea; }
svg text { font: 12px system-ui, sans-serif; }
"""


def _json_safe(value: Any) -> Any:
    """JSON has no NaN or infinity: NaN becomes null, infinities the strings "inf" and "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_safe(item) for item in value]
    return value


def script_json(data: Any) -> str:
    """``data`` as JSON a ``<script>`` element holds as is (``<``, ``>``, ``&`` escaped); floats exact."""
    text = json.dumps(_json_safe(data), separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def nice_ticks(low: float, high: float, count: int = 5) -> tuple[list[float], float, float]:
    """Round ticks over ``[low, high]``: a step of 1, 2 or 5 times a power of ten giving about ``count`` ticks, the
    axis widened to whole steps (so 0 is a tick whenever the axis crosses it); the ticks and the axis' ends."""
    span = high - low if high > low else abs(high) or 1.0
    raw = span / max(1, count - 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first, last = math.floor(low / step), math.ceil(high / step)
    if first == last:
        last += 1
    return [i * step for i in range(first, last + 1)], first * step, last * step


def tick_label(value: float, step: float) -> str:
    """``value`` to the step's precision; zero as ``0`` (not ``-0`` or ``1e-17``)."""
    if abs(value) < step / 2:
        return "0"
    digits = max(0, -math.floor(math.log10(step)))
    return f"{value:.{digits}f}" if step >= 1e-4 and abs(value) < 1e6 else f"{value:.3g}"


def chart(series: list[tuple[str, list[float]]], label: str, first_colour: int = 0) -> str:
    """Each named series per step as one line, on shared axes; non-finite values break the line. ``first_colour``:
    the index in ``COLOURS`` of the first series (a run keeps its colour across charts)."""
    finite = [loss for _, values in series for loss in values if math.isfinite(loss)]
    steps = max(len(values) for _, values in series)
    ticks, low, high = nice_ticks(*((min(finite), max(finite)) if finite else (0.0, 1.0)))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(step: float) -> float:
        return LEFT + plot_w * step / max(1, steps - 1)

    def y(loss: float) -> float:
        return TOP + plot_h * (high - loss) / (high - low)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" role="img">']
    parts.append(f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>')
    for value in ticks:
        text = tick_label(value, ticks[1] - ticks[0])
        parts.append(f'<text x="{LEFT - 6}" y="{y(value) + 4:.1f}" text-anchor="end">{text}</text>')
        grid = "#888" if text == "0" else "#eee"  # zero: where a difference changes sign
        parts.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y(value):.1f}" y2="{y(value):.1f}" stroke="{grid}"/>')
    for step in sorted({round(value) for value in nice_ticks(0, max(1, steps - 1))[0] if value <= steps - 1}):
        parts.append(f'<text x="{x(step):.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">{step}</text>')
    parts.append(f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 6}" text-anchor="middle">step</text>')
    middle = TOP + plot_h / 2
    parts.append(
        f'<text x="14" y="{middle}" transform="rotate(-90 14 {middle})" text-anchor="middle">{html.escape(label)}</text>'
    )
    for i, (name, values) in enumerate(series):
        colour = COLOURS[(first_colour + i) % len(COLOURS)]
        for segment in _segments(values):
            points = " ".join(f"{x(step):.1f},{y(loss):.1f}" for step, loss in segment)
            parts.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        legend_y = TOP + 16 + 18 * i
        ends = f'x1="{WIDTH - RIGHT + 12}" x2="{WIDTH - RIGHT + 32}" y1="{legend_y}" y2="{legend_y}"'
        parts.append(f'<line {ends} stroke="{colour}" stroke-width="3"/>')
        parts.append(f'<text x="{WIDTH - RIGHT + 38}" y="{legend_y + 4}">{html.escape(name)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def loss_charts(runs: list[dict]) -> str:
    """The losses; with several runs also each one's difference from the first run's, which the eye cannot
    read off curves that nearly coincide."""
    drawn = chart([(run["name"], run["loss"]) for run in runs], "loss")
    if len(runs) < 2:
        return drawn
    reference = runs[0]["loss"]
    window = max(1, len(reference) // 20)
    differences = [
        (run["name"], smoothed([a - b for a, b in zip(run["loss"], reference, strict=True)], window)) for run in runs[1:]
    ]
    label = f"loss - {runs[0]['name']} loss" + (f" (mean of {window} steps)" if window > 1 else "")
    return drawn + "\n" + chart(differences, label, first_colour=1)


def smoothed(values: list[float], window: int) -> list[float]:
    """The mean of the finite values among the last ``window`` at each step; a non-finite value stays as it is
    (it breaks the line where the run broke)."""
    out = []
    for i, value in enumerate(values):
        recent = [v for v in values[max(0, i - window + 1) : i + 1] if math.isfinite(v)]
        out.append(sum(recent) / len(recent) if math.isfinite(value) else value)
    return out


def _segments(losses: list[float]) -> list[list[tuple[int, float]]]:
    """Runs of consecutive finite losses (a single point draws nothing)."""
    segments: list[list[tuple[int, float]]] = [[]]
    for step, loss in enumerate(losses):
        if math.isfinite(loss):
            segments[-1].append((step, loss))
        elif segments[-1]:
            segments.append([])
    return [segment for segment in segments if len(segment) > 1]


def _number(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)


def _report_link(report: str | None) -> str:
    return "" if report is None else f'<a href="{html.escape(report)}">report</a>'


def _loss_table(runs: list[dict]) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(run['name'])}</td><td>{html.escape(run['label'])}</td>"
        f"<td class=num>{_number(run['loss'][0])}</td><td class=num>{_number(run['last_loss'])}</td>"
        f"<td class=num>{'' if run['step_ms'] is None else format(run['step_ms'], '.1f')}</td>"
        f"<td>{_report_link(run['report'])}</td></tr>"
        for run in runs
    )
    head = (
        "<tr><th>recipe</th><th>format</th><th>first loss</th><th>final loss (mean of the last tenth, mean over seeds)</th>"
        "<th>ms per step</th><th></th></tr>"
    )
    clocks = sorted({run["step_clock"] for run in runs if run["step_clock"]})
    note = (
        f"<p class=note>ms per step: {' and '.join(clocks)} per training step. On the CPU it is this process's CPU time "
        "(all its threads), which other processes do not inflate as they do wall time: on a busy machine the wall "
        "time ranked the recipes wrongly.</p>"
        if clocks
        else ""
    )
    return f"<table>{head}{rows}</table>{note}"


def _verdict_cell(entry: dict | None) -> str:
    if entry is None:
        return "<td>not logged</td>"
    over = entry["over"]
    limits = " or ".join(f"{used['pct']:g}%" for used in entry["thresholds"].values())
    text = f"{over} of {entry['of']} tensors over {limits}, worst {_number(entry['worst'])}%"
    return f'<td class="{"over" if over else "ok"}">{text}</td>'


def _threshold_cell(run: dict) -> str:
    """The underflow thresholds the run was judged by, each with its format and where it comes from."""
    used = run.get("over_thresholds", {}).get("underflows%", {}).get("thresholds", {})
    text = "; ".join(f"{name}: {value['pct']:g}% ({value['source']})" for name, value in used.items()) or "none"
    return f"<td>{html.escape(text)}<br><span class=note>judged by {html.escape(run['judged_by'])}</span></td>"


def verdict_table(runs: list[dict], reference: dict) -> str:
    """Each format against the baseline at a glance: its final loss gap, and per loss statistic how many tensors
    settled over ``diagnose``'s threshold for their own format (red when any did), with the thresholds used."""
    rows = []
    for run in runs:
        if run is reference:
            gap_text = "reference"
        elif run["last_loss"] is None or reference["last_loss"] is None:
            gap_text = "no loss.json"
        else:
            gap = run["last_loss"] - reference["last_loss"]
            relative = gap / reference["last_loss"] if reference["last_loss"] else math.nan
            gap_text = f"{gap:+.4f} ({relative:+.1%})"
        cells = "".join(_verdict_cell(run.get("over_thresholds", {}).get(stat)) for stat in ("underflows%", "overflows%"))
        rows.append(f"<tr><td>{html.escape(run['name'])}</td><td class=num>{gap_text}</td>{cells}{_threshold_cell(run)}</tr>")
    head = (
        f"<tr><th>recipe</th><th>final loss - {html.escape(reference['name'])}'s</th>"
        "<th>underflows% (settled, last quarter)</th><th>overflows% (settled, last quarter)</th>"
        "<th>underflow threshold (format: value, where from)</th></tr>"
    )
    return f"<h2>Verdict</h2><table>{head}{''.join(rows)}</table>"


def bottom_section(data: dict) -> str:
    """Each run's bottom line (``bottom.bottom_line``), what they are measured against, and how."""
    lines = data.get("bottom_lines", [])
    if not lines:
        return ""
    items = "".join(f"<li>{html.escape(line['text'])}</li>" for line in lines)
    how = (
        f"Against {html.escape(data['baseline'])}. Final loss: the mean of the last tenth of the logged losses; gap: the "
        "mean over seeds of the run's final loss minus the baseline's of the same seed, relative to the baseline's mean; "
        f"outside the spread when |gap| > {NOISE_FACTOR:g} x the baseline's standard deviation over seeds (relative)."
    )
    return f"<h2>Bottom line</h2><ul>{items}</ul><p class=note>{how}</p>\n"


def _outlier_tables(run: dict) -> str:
    if not run["outliers"]:
        return f"<p class=note>No FP8 statistics for {html.escape(run['name'])} (no statistic of its format exists yet).</p>"
    parts = []
    for stat, rows in run["outliers"].items():
        body = "".join(
            f"<tr><td>{html.escape(row['layer'])}</td><td>{html.escape(row['tensor'])}</td>"
            f"<td class=num>{_number(row['settled'])}</td>"
            f"<td class=num>{_number(row['worst'])} at {row['worst_iteration']}</td></tr>"
            for row in rows
        )
        head = f"<tr><th>layer</th><th>tensor</th><th>{html.escape(stat)}, last quarter (median)</th><th>worst</th></tr>"
        parts.append(f"<h4>{html.escape(stat)}</h4><table>{head}{body}</table>")
    return "".join(parts)


def _failures(failed: list[dict]) -> str:
    """The recipes that did not finish, each with its error (the page shows the others)."""
    if not failed:
        return ""
    rows = "".join(
        f"<tr><td>{html.escape(run['name'])}</td><td>{html.escape(run['label'])}</td><td>{html.escape(run['error'])}</td></tr>"
        for run in failed
    )
    return f"<h2>Failed recipes</h2><table><tr><th>recipe</th><th>format</th><th>error</th></tr>{rows}</table>\n"


def plan_sections(runs: list[dict]) -> str:
    """Each plan run's plan as it describes itself, the autocast recipe of the layers it leaves, and every layer's
    recipe per GEMM: which formats the run's curve and statistics come from."""
    parts = []
    for run in runs:
        plan = run.get("plan")
        if plan is None:
            continue
        rows = "".join(
            f"<tr><td>{html.escape(layer)}</td>{''.join(f'<td>{html.escape(recipe)}</td>' for recipe in gemms.values())}</tr>"
            for layer, gemms in plan["layers"].items()
        )
        parts.append(
            f"<h2>Precision {html.escape(run['label'])}</h2>"
            f"<p class=note>Layers it leaves to the autocast run {html.escape(plan['autocast'])}; high_precision is no "
            "cast, the layer's own dtype (float32 here, as in the quantized runs), and has no quantization statistics.</p>"
            f"<pre>{html.escape(plan['description'])}</pre>"
            f"<table><tr><th>layer</th><th>fprop</th><th>dgrad</th><th>wgrad</th></tr>{rows}</table>"
        )
    return "\n".join(parts)


def render(data: dict) -> str:
    """The page for ``data`` (``compare_formats`` makes it): title, the recipes that failed, the runs, each
    with its losses and outliers, and each plan run's plan."""
    runs = data["runs"]
    charted = [run for run in runs if run["loss"]]
    losses = f"{loss_charts(charted)}{_loss_table(charted)}" if charted else "<p class=note>No run has losses.</p>"
    reference = next((run for run in runs if run["name"] == data.get("baseline_run")), runs[0] if runs else None)
    verdict = verdict_table(runs, reference) if runs else ""
    sections = "".join(
        f"<h3>{html.escape(run['name'])}: {html.escape(run['label'])}</h3>"
        f"<p class=note>statistics: {html.escape(', '.join(run['stats']) or 'LogTensorStats only')}</p>{_outlier_tables(run)}"
        for run in runs
    )
    title = html.escape(data["title"])
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title><style>{STYLE}</style></head>\n'
        f"<body><h1>{title}</h1><p class=note>{html.escape(data['setup'])}</p>\n{bottom_section(data)}"
        f"{_failures(data.get('failed', []))}"
        f"{verdict}<h2>Loss</h2>{losses}\n{plan_sections(runs)}\n"
        f"<h2>Tensors that stand out, per format</h2><p class=note>{html.escape(data['ranking'])}</p>{sections}\n"
        f'<script type="application/json" id="compare-data">{script_json(data)}</script>\n</body></html>\n'
    )
