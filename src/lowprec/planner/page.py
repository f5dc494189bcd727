"""``plan.html``: what ``find_plan`` found, on one self-contained page: the budget and how it was set, each round's
predicted and measured gap, the Pareto front of cost against predicted damage, the plan as a map of layers x GEMMs
coloured by format, and why each GEMM got its format (its measured damage in every candidate, and what each
candidate's cast does to its operands)."""

from __future__ import annotations

import html
from typing import Any

from lowprec.compare.page import STYLE, nice_ticks, tick_label
from lowprec.plan.cost import FORMAT_BITS
from lowprec.plan.search import GEMMS
from lowprec.planner.calibrate import HIGH_PRECISION, Calibration

#: a colour per format, from the narrowest (warm) to high precision (grey)
FORMAT_COLOURS = {
    "mxfp4": "#d62728",
    "mxfp4_nvidia": "#e377c2",
    "nvfp4": "#ff7f0e",
    "mxfp6_e2m3": "#bcbd22",
    "mxfp6_e3m2": "#b5a642",
    "mxfp8": "#2ca02c",
    "mxfp8_ocp": "#17becf",
    "current": "#1f77b4",
    "delayed": "#9467bd",
    "block": "#8c564b",
    HIGH_PRECISION: "#999999",
}
WIDTH, HEIGHT, MARGIN = 520, 300, 50


def front_chart(front: list[dict[str, float]], chosen: tuple[float, float], budget: float) -> str:
    """The front as points (cost, predicted damage), the budget as a line, the chosen plan ringed."""
    costs = [p["cost"] for p in front] + [chosen[0]]
    damages = [p["damage"] for p in front] + [chosen[1], budget]
    xticks, xlow, xhigh = nice_ticks(min(costs), max(costs))
    yticks, ylow, yhigh = nice_ticks(0.0, max(damages))

    def x(value: float) -> float:
        return MARGIN + (value - xlow) / ((xhigh - xlow) or 1) * (WIDTH - 2 * MARGIN)

    def y(value: float) -> float:
        return HEIGHT - MARGIN - (value - ylow) / ((yhigh - ylow) or 1) * (HEIGHT - 2 * MARGIN)

    parts = [f'<svg width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="Pareto front">']
    parts.append(
        f'<rect x="{MARGIN}" y="{MARGIN}" width="{WIDTH - 2 * MARGIN}" height="{HEIGHT - 2 * MARGIN}" fill="none" stroke="#ccc"/>'
    )
    step_x, step_y = (xticks[1] - xticks[0] if len(xticks) > 1 else 1), (yticks[1] - yticks[0] if len(yticks) > 1 else 1)
    for tick in xticks:
        parts.append(
            f'<text x="{x(tick):.1f}" y="{HEIGHT - MARGIN + 16}" text-anchor="middle" font-size="11">'
            f"{tick_label(tick, step_x)}</text>"
        )
    for tick in yticks:
        parts.append(
            f'<text x="{MARGIN - 6}" y="{y(tick) + 4:.1f}" text-anchor="end" font-size="11">{tick_label(tick, step_y)}</text>'
        )
    parts.append(
        f'<line x1="{MARGIN}" x2="{WIDTH - MARGIN}" y1="{y(budget):.1f}" y2="{y(budget):.1f}" stroke="#d62728" '
        f'stroke-dasharray="4 3"/><text x="{WIDTH - MARGIN}" y="{y(budget) - 4:.1f}" text-anchor="end" font-size="11" '
        'fill="#d62728">budget</text>'
    )
    points = " ".join(f"{x(p['cost']):.1f},{y(p['damage']):.1f}" for p in front)
    parts.append(f'<polyline points="{points}" fill="none" stroke="#1f77b4"/>')
    parts += [f'<circle cx="{x(p["cost"]):.1f}" cy="{y(p["damage"]):.1f}" r="2.5" fill="#1f77b4"/>' for p in front]
    ring = 'r="7" fill="none" stroke="#000" stroke-width="2"'
    parts.append(f'<circle cx="{x(chosen[0]):.1f}" cy="{y(chosen[1]):.1f}" {ring}/>')
    parts.append(
        f'<text x="{WIDTH / 2}" y="{HEIGHT - 12}" text-anchor="middle" font-size="12">'
        "cost (BF16 everywhere: 1 per GEMM direction)</text>"
    )
    parts.append(
        f'<text x="14" y="{HEIGHT / 2}" font-size="12" transform="rotate(-90 14 {HEIGHT / 2})" text-anchor="middle">'
        "predicted gap (loss)</text>"
    )
    return "".join(parts) + "</svg>"


def plan_map(formats: dict[str, dict[str, str]]) -> str:
    """Layers x GEMMs, each cell in its format's colour."""
    rows = "".join(
        f"<tr><td>{html.escape(layer)}</td>"
        + "".join(
            f'<td style="background:{FORMAT_COLOURS.get(gemms.get(gemm, ""), "#fff")};color:#fff">'
            f"{html.escape(gemms.get(gemm, '-'))}</td>"
            for gemm in GEMMS
        )
        + "</tr>"
        for layer, gemms in formats.items()
    )
    return f"<table><tr><th>layer</th>{''.join(f'<th>{gemm}</th>' for gemm in GEMMS)}</tr>{rows}</table>"


def reasons(calibration: Calibration, formats: dict[str, dict[str, str]], kappa: float) -> str:
    """Per GEMM: its format, its measured damage in every candidate (``direct + kappa x update``, and the two) beside
    what each candidate's cast does to its operands (``planner.operands``), and why it got its format in a sentence."""
    candidates = [fmt for fmt in calibration.candidates if fmt != HIGH_PRECISION]
    head = "".join(f"<th>{html.escape(fmt)}: predicted (direct, gradient error); operands</th>" for fmt in candidates)
    rows = []
    for layer, gemms in formats.items():
        for gemm in GEMMS:
            cells = []
            for fmt in candidates:
                key = Calibration.key(layer, gemm, fmt)
                direct, update = calibration.direct[key], calibration.update[key]
                operands = "".join(
                    f"<br>{name}: {stats['rel_mse']:.2g}, {_share(stats)}"
                    for name, stats in calibration.errors.get(key, {}).items()
                )
                cells.append(f"<td>{direct + kappa * update:.3g} ({direct:.2g}, {update:.2g}){operands}</td>")
            why = html.escape(_why(calibration, layer, gemm, gemms[gemm], kappa))
            rows.append(
                f"<tr><td>{html.escape(layer)}</td><td>{gemm}</td><td><b>{html.escape(gemms[gemm])}</b></td>"
                f"{''.join(cells)}<td>{why}</td></tr>"
            )
    return f"<table><tr><th>layer</th><th>GEMM</th><th>format</th>{head}<th>why</th></tr>{''.join(rows)}</table>"


def _share(stats: dict[str, float]) -> str:
    """The larger of an operand's shares of values flushed to zero and clipped."""
    if stats["saturation%"] > stats["underflow%"]:
        return f"{stats['saturation%']:.3g}% clipped"
    return f"{stats['underflow%']:.3g}% flushed"


def _why(calibration: Calibration, layer: str, gemm: str, chosen: str, kappa: float) -> str:
    """One sentence: what the next cheaper candidate does to the GEMM's worst-hit operand (the largest share flushed
    or clipped) and was predicted to cost, and the format kept; where none is cheaper, the same of the format kept."""
    cheaper = [fmt for fmt in calibration.candidates if FORMAT_BITS[fmt] < FORMAT_BITS[chosen]]
    fmt = max(cheaper, key=lambda f: FORMAT_BITS[f]) if cheaper else chosen
    key = Calibration.key(layer, gemm, fmt)
    damage = f"predicted damage {calibration.direct[key] + kappa * calibration.update[key]:.3g}"
    errors = calibration.errors.get(key)
    if errors:
        name, stats = max(errors.items(), key=lambda item: max(item[1]["underflow%"], item[1]["saturation%"]))
        damage = f"on the {name}, {_share(stats)} (relative mse {stats['rel_mse']:.2g}), {damage}"
    if cheaper:
        return f"{fmt} {damage}; kept {chosen}"
    return f"{fmt} {damage}, the cheapest candidate; kept"


def _after(entry: Any) -> str:
    """What a round that missed the budget changed for the next."""
    if entry.rescaled is not None:
        return f"damages scaled x{entry.rescaled:.3g} (measured / predicted)"
    if entry.bumped:
        return f"moved up a format: {html.escape(', '.join(entry.bumped))}"
    return "-"


def render(found: Any, calibration: Calibration) -> str:
    """The page of a ``PlanSearch``."""
    final = found.final
    verdict = "within" if final.within_budget else "NOT within"
    rounds = "".join(
        f"<tr><td>{number}</td><td>{r.cost:.3f}</td><td>{r.predicted_gap:+.4f}</td>"
        f"<td>{'-' if r.measured_gap is None else f'{r.measured_gap:+.4f}'}</td><td>{'yes' if r.within_budget else 'no'}</td>"
        f'<td>{_after(r)}</td><td><a href="{html.escape(r.page)}">compare page</a></td></tr>'
        for number, r in enumerate(found.rounds)
    )
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>Precision plan search</title><style>{STYLE}
td, th {{ padding: 2px 6px; }}</style></head><body>
<h1>Precision plan search</h1>
<p>Budget: {found.budget_units:g} x the seed-to-seed spread of high precision's final loss ({found.noise:.4g}) =
{found.budget:.4g} loss. The whole model in {html.escape(found.cheapest)} lost {found.cheapest_gap:+.4g}
(<a href="{html.escape(found.baselines_page)}">baselines</a>); the damage model, direct + kappa x gradient error, fitted on
it: kappa = {found.kappa:.4g}.</p>
<p><b>The plan ({html.escape(found.plan_file)}): measured gap {final.measured_gap:+.4g}, predicted {final.predicted_gap:+.4g},
{verdict} the budget</b>, at cost {final.cost:.3f} (BF16 everywhere: 3).</p>
<h2>Rounds</h2><table><tr><th>round</th><th>cost</th><th>predicted gap</th><th>measured gap</th><th>within</th>
<th>then</th><th></th></tr>{rounds}</table>
<h2>Pareto front</h2>{front_chart(found.front, (final.cost, final.predicted_gap), found.budget)}
<h2>The plan</h2>{plan_map(final.formats)}
<h2>Why each GEMM got its format</h2>
<p class=note>Predicted damage to the final loss of each GEMM alone in each format, from the calibration probes:
direct (the forward's loss, fprop only) and the relative squared error of the gradient; under each, the GEMM's operands
cast in that format on the calibration's real tensors: relative mse ||q(x) - x||<sup>2</sup> / ||x||<sup>2</sup> and
the larger of the shares of non-zero values flushed to zero and clipped to their block's largest magnitude.</p>
{reasons(calibration, final.formats, found.kappa)}
</body></html>"""
