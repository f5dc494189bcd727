"""What is wrong, per layer and tensor: the detectors of ``diagnose``.

Each detector looks at one kind of statistic and reports only what persists after warm-up (see
``Summary.is_problem``), except NaN and inf, reported once: where they first appeared. Each finding names the
format its layer reads the tensor in (``formats``); the checks of a per-tensor scale skip the tensors read without
one (block formats, high precision), and ``skipped_note`` says which.

The per-block checks (``blocks``) read what ``per_block_stats`` and ``block_scale_stats`` log of a block format's own
cast (unprefixed, or prefixed with the layer's own format: ``nvfp4_underflow_blocks%``; a what-if cast of another
format is not the run's and is only named in the note), each against its format's calibrated threshold:

- ``underflow_blocks%``: blocks that flush most of their values (a ``block_underflow``);
- ``saturated_blocks%``: blocks with a saturated value, under the scale rules that round down (``block_saturation``);
- ``worst_block_rel_err``: the worst block's relative error, a ``block_error`` of its own where neither of the
  others is found (a few ruined blocks are too small a share for ``underflow_blocks%``), else context;
- ``worst_block_col``: where the worst block is; one column block at most iterations after warm-up is a channel
  range the format represents worst (channels that lost their block scales, say). It does not point at an outlier
  channel that flushes its neighbours: the error is relative to the block's norm, which the outlier dominates, so
  that block's error stays small (the flushed values are below its amax over twice the element's range);
- ``worst_flushed_col`` and ``worst_block_flushed%``: where the block that flushes the largest share of its values
  is, and that share; one column block at most iterations after warm-up, in blocks that keep some of their values
  (a share under 100%), is an outlier channel setting their scale, which a ``block_underflow`` names. Blocks that
  lose all their values lost their scale instead, and tie: their column is only the last of them;
- ``scale_exp_hist_*``: the share of blocks whose scale is zero (or below 2^-32) and how many binades the others
  span. For NVFP4 they tell how blocks flush: a zero E4M3 block scale loses a whole block (one more than 2^17.8 below
  the largest), a span past E4M3's 14.8 binades of normal range means subnormal scales; the per-tensor FP32 scale,
  set by the largest block, helps neither;
- ``scale_inv_std``: the spread of the logged scales (for MX formats the E8M0 exponent, so binades), context only.

The growth checks (``growths``, the rule in ``trends``) judge kurtosis, ``outlier_channel_ratio`` and a per-tensor
scale against their own start of the run: early warnings, listed after the damage the other checks measure.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

from nvdlfw_inspect.diagnose.formats import INPUTS, MECHANISMS, SATURATING_RULES, Formats, TensorFormat, format_name
from nvdlfw_inspect.diagnose.model import Finding
from nvdlfw_inspect.diagnose.remedies import GROWTH_ADVICE
from nvdlfw_inspect.diagnose.series import Points, Run, Summary, summarize
from nvdlfw_inspect.diagnose.thresholds import FORMAT_UNDERFLOW_BLOCKS_PCT, Thresholds
from nvdlfw_inspect.diagnose.trends import Growth, growth

#: the order findings are listed in: a divergence first, then what damages values most
KINDS = (
    "nonfinite",
    "overflow",
    "underflow",
    "block_underflow",
    "block_saturation",
    "block_error",
    "scale_change",
    "dynamic_range",
    "peer_outlier",
    "kurtosis_growth",
    "outlier_channel_growth",
    "scale_drift",
)
#: the growth findings (``trends``): early warnings, listed after the damage the others measure
GROWTH_KINDS = KINDS[-3:]
#: where a scale can be read, best first: the layer's own scale, else the tensor's amax
SCALE_SOURCES = ("scale_inv_max", "cur_amax")
#: how large a tensor is, best first: its amax, else its spread or norms (which peers of one shape share)
MAGNITUDE_STATS = ("cur_amax", "max", "std", "l2_norm", "l1_norm")
#: the path parts that tell peers apart: a block's index (``layers.3``) and an expert's (``gemm_5``)
_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|(?<=gemm_)\d+$")
#: peers needed beside a layer to tell an outlier from a difference of opinion
MIN_PEERS = 2
#: layers a note lists before it counts the rest
LISTED_LAYERS = 8
#: per problem, the statistic that measures it, what stands in for it where that is not logged (and how it is
#: read), and a note
#: a statistic of a block format's cast as logged: an optional recipe prefix, its name (a histogram bin's tag:
#: ``under``, ``over``, ``0``, ``m3``, ``p2``), an optional ``_columnwise``
_BLOCK_STAT = re.compile(
    r"^(?:(?P<prefix>[a-z0-9_]+?)_)?(?P<name>underflow_blocks%|saturated_blocks%|worst_block_rel_err|worst_block_row|"
    r"worst_block_col|worst_block_flushed%|worst_flushed_row|worst_flushed_col|scale_inv_std|"
    r"scale_exp_hist_(?:under|over|0|[mp]\d+))(?P<columnwise>_columnwise)?$"
)
#: more than this share of the iterations after warm-up with the worst block (or the block that flushes most) in one
#: column block: one channel range is the worst represented (an outlier channel sets the scale of its blocks)
STABLE_COLUMN_SHARE = 0.5
#: binades of normal E4M3 below its largest value (448 down to 2**-6): NVFP4's block scales beyond are subnormal
E4M3_SCALE_BINADES = math.log2(448.0) + 6
MEASURES = (
    ("underflow", "underflows%", ("dynamic_range",), "{}", ""),
    ("overflow", "overflows%", SCALE_SOURCES, "the jumps of {}", " (overflows% exists under delayed scaling only)"),
)


def _persistence(summary: Summary, unit: str) -> str:
    """How long and how badly: the iterations over the threshold, the worst value, and the end of the run, all after
    warm-up; a larger value in the warm-up set aside comes last, as an aside. A run no longer than its warm-up has
    nothing else to show: its warm-up values, said to be so."""

    def shown(value: float) -> str:
        if math.isnan(value):  # a run that ends in NaN
            return "NaN"
        return f"x{value:.3g}" if unit == "x" else f"{value:.3g}{unit}"

    which = "of the iterations, all warm-up" if summary.warmup_only else "of the iterations after warm-up"
    text = (
        f"over {shown(summary.threshold)} in {summary.above:.0%} {which} (first {summary.first_above}), "
        f"worst {shown(summary.worst)} at {summary.worst_iteration}, {shown(summary.persistent)} at the end "
        f"(median of the last iterations)"
    )
    if summary.warmup_only:
        return f"{text}; the run is no longer than its warm-up, so these are warm-up values"
    if summary.warmup_exceeds:
        assert summary.warmup_worst is not None
        return f"{text}; {shown(summary.warmup_worst)} at {summary.warmup_worst_iteration} in warm-up, set aside"
    return text


class Detector:
    """Finds the problems of one run against ``thresholds``, each tensor in its own format (``formats``);
    ``skipped``: per layer, the formats of the tensors a per-tensor check was not applied to."""

    def __init__(self, run: Run, thresholds: Thresholds, formats: Formats):
        self.run = run
        self.thresholds = thresholds
        self.formats = formats
        self.series = run.merged
        self.warmup_end = run.first_iteration + thresholds.warmup
        self.skipped: dict[str, set[str | None]] = defaultdict(set)
        self.what_if: dict[str, set[str]] = defaultdict(set)

    def summary(self, points: Points, threshold: float) -> Summary | None:
        return summarize(points, threshold, self.warmup_end, self.thresholds.tail)

    def problem(self, points: Points, threshold: float) -> Summary | None:
        summary = self.summary(points, threshold)
        return summary if summary is not None and summary.is_problem(self.thresholds.persistence) else None

    def findings(self) -> list[Finding]:
        found = [*self.nonfinite(), *self.quantization(), *self.blocks(), *self.scale_changes(), *self.peer_outliers()]
        jumps = {(f.layer, f.tensor) for f in found if f.kind == "scale_change"}
        found += [f for f in self.growths() if f.kind != "scale_drift" or (f.layer, f.tensor) not in jumps]
        return sorted(found, key=_severity)

    def nonfinite(self) -> list[Finding]:
        """The first tensor of the run to hold NaN or inf: the earliest iteration, and in it the first in
        execution order; the tensors that followed are counted, not listed."""
        if not self.run.nonfinite:
            return []
        (layer, tensor), first = min(self.run.nonfinite.items(), key=lambda item: (item[1].iteration, item[1].position))
        own = [points for (name, kind, _), points in self.series.items() if (name, kind) == (layer, tensor)]
        last_clean = max((i for points in own for i in points if i < first.iteration), default=None)
        others = len(self.run.nonfinite) - 1
        clean = f"last logged clean at {last_clean}" if last_clean is not None else "no earlier iteration logged"
        message = (
            f"NaN or inf first at iteration {first.iteration} (its {first.stat}; {clean}), the first tensor of the run to hold "
            f"it; {others} other tensor{'s' if others != 1 else ''} followed"
        )
        context = {"last_clean": last_clean, "rank": first.rank, "tensors_affected": others + 1}
        fmt = self.formats.of(layer, tensor)
        return [Finding("nonfinite", layer, tensor, first.stat, first.iteration, message, context=context, format=fmt)]

    def quantization(self) -> list[Finding]:
        """Sustained underflow and overflow under each layer's own recipe, and, where underflows% was not
        logged to measure the damage directly, a dynamic range beyond its per-tensor FP8 element's."""
        t = self.thresholds
        found = []
        for (layer, tensor, stat), points in sorted(self.series.items()):
            if stat == "underflows%":
                fmt = self.formats.of(layer, tensor)
                label = None if fmt is None else fmt.label
                if summary := self.problem(points, t.underflow_threshold(label)):
                    message = f"{_underflow_where(fmt)}: {_persistence(summary, '%')}; {_underflow_threshold(t, fmt)}"
                    found.append(self._finding("underflow", layer, tensor, stat, summary, message))
            elif stat == "overflows%" and (summary := self.problem(points, t.overflow_pct)):
                message = f"values saturate (overflow) under delayed scaling: {_persistence(summary, '%')}"
                found.append(self._finding("overflow", layer, tensor, stat, summary, message))
            elif stat == "dynamic_range" and tensor in INPUTS and (layer, tensor, "underflows%") not in self.series:
                limit = self.formats.range_limit(layer, tensor) if self._per_tensor(layer, tensor) else None
                if limit is not None and (summary := self.problem(points, limit)):
                    message = (
                        f"its values span more bits than {self.formats.element(layer, tensor)} holds: "
                        f"{_persistence(summary, ' bits')}; underflows% was not logged to tell how many flush to zero"
                    )
                    found.append(self._finding("dynamic_range", layer, tensor, stat, summary, message))
        return found

    def blocks(self) -> list[Finding]:
        """The per-block checks of each block-format tensor's own cast (see the module's docstring), each orientation
        (``_columnwise``: the transposed copy) on its own; the statistics of what-if casts of another format, or of a
        layer whose format the records do not name, are kept for ``unjudged_note``."""
        groups: dict[tuple[str, str, str], dict[str, tuple[str, Points]]] = defaultdict(dict)
        for (layer, tensor, stat), points in self.series.items():
            match = _BLOCK_STAT.match(stat)
            if match is None:
                continue
            fmt = self.formats.of(layer, tensor)
            label = None if fmt is None else fmt.label
            if label not in FORMAT_UNDERFLOW_BLOCKS_PCT or match["prefix"] not in (None, label):
                self.what_if[layer].add(match["prefix"] or "unprefixed")
                continue
            groups[(layer, tensor, match["columnwise"] or "")][match["name"]] = (stat, points)
        found = []
        for (layer, tensor, _), stats in sorted(groups.items()):
            found += self._block_findings(layer, tensor, stats)
        return found

    def _block_findings(self, layer: str, tensor: str, stats: dict[str, tuple[str, Points]]) -> list[Finding]:
        """The findings of one orientation of one tensor's block cast (``stats``: name -> (as logged, points)): flushed
        and saturated blocks, else a worst block over its threshold; each with the worst block's place and the
        spread of the scales as context."""
        t, fmt = self.thresholds, self.formats.of(layer, tensor)
        assert fmt is not None and fmt.label is not None  # only block formats are grouped
        label, name = fmt.label, format_name(fmt.label)
        context = {**self._context(layer, tensor), **self._block_context(stats, label)}
        where = _block_where(fmt)
        found = []
        checks = (
            ("block_underflow", "underflow_blocks%", "%"),
            ("block_saturation", "saturated_blocks%", "%"),
            ("block_error", "worst_block_rel_err", ""),
        )
        for kind, stat, unit in checks:
            threshold = t.block_threshold(stat, label)
            if stat not in stats or threshold is None or (kind == "block_error" and found):
                continue  # a worst block is context where its blocks already flush or saturate
            written, points = stats[stat]
            summary = self.problem(points, threshold)
            if summary is None:
                continue
            if kind == "block_underflow":
                what = (
                    f"blocks flush their values to zero in {where} ({written}: the blocks that flush more than the "
                    "feature's block_underflow_threshold, default 50%, of their non-zero values)"
                )
            elif kind == "block_saturation":  # a threshold only under the rules that round down
                what = f"{SATURATING_RULES[label]} in {where} ({written}: the blocks holding a saturated value)"
            else:
                what = f"its worst block loses much of its values in {where} ({written}: ||q - x|| / ||x|| of the worst block)"
            source = f"{name}'s threshold {threshold:g}{unit} ({t.block_source(stat, label)})"
            message = f"{what}: {_persistence(summary, unit)}; {source}{_block_clauses(context, label, kind)}"
            assert summary.first_above is not None
            found.append(Finding(kind, layer, tensor, written, summary.first_above, message, summary, context, format=fmt))
        return found

    def _block_context(self, stats: dict[str, tuple[str, Points]], label: str) -> dict[str, Any]:
        """The worst block and the block that flushes most (the error and the share at the end of the run, the row at
        the last iteration, the column block each is in at most iterations after warm-up and at what share of them),
        the spread of the logged scales, and from the scale histogram at the last iteration the binades the block
        scales span and the % of blocks whose scale is zero or below 2^-32."""
        context: dict[str, Any] = {}
        for key in ("worst_block_rel_err", "worst_block_flushed%", "scale_inv_std"):
            summary = self.summary(stats[key][1], math.inf) if key in stats else None
            if summary is not None and math.isfinite(summary.persistent):
                context[key] = summary.persistent
        if "scale_inv_std" in context and label.startswith("mx"):
            context["scale_inv_std_unit"] = "binades (the E8M0 exponent)"
        for key in ("worst_block_row", "worst_flushed_row"):
            row = stats[key][1] if key in stats else {}
            if row and math.isfinite(row[max(row)]):
                context[key] = int(row[max(row)])
        for key in ("worst_block_col", "worst_flushed_col"):
            columns = stats[key][1] if key in stats else {}
            steady = [v for i, v in columns.items() if i >= self.warmup_end and math.isfinite(v)]
            steady = steady or [v for v in columns.values() if math.isfinite(v)]
            if steady:
                column, count = Counter(steady).most_common(1)[0]
                context[key] = int(column)
                context[f"{key}_share"] = count / len(steady)
                context[f"{key}_iterations"] = len(steady)
        bins = {
            stat.removeprefix("scale_exp_hist_"): points
            for stat, (_, points) in stats.items()
            if stat.startswith("scale_exp_hist_")
        }
        if bins:
            last = max(i for points in bins.values() for i in points)
            counts = {tag: points.get(last, 0.0) for tag, points in bins.items()}
            total = sum(counts.values())
            exponents = [_bin_exponent(tag) for tag, count in counts.items() if count > 0 and tag not in ("under", "over")]
            if total > 0:
                context["zero_scale_blocks%"] = 100.0 * counts.get("under", 0.0) / total
            if exponents:
                context["scale_span_binades"] = max(exponents) - min(exponents) + 1
        return context

    def _per_tensor(self, layer: str, tensor: str) -> bool:
        """Whether a check of a per-tensor scale applies to ``tensor`` of ``layer``; where it does not (a block
        format, high precision), the layer and format are kept for ``skipped_note``."""
        fmt = self.formats.without_tensor_scale(layer, tensor)
        if fmt is not None:
            self.skipped[layer].add(fmt.label)
        return fmt is None

    def scale_changes(self) -> list[Finding]:
        """Scales that jump between logged iterations by more than ``scale_change``: the factor of each
        step between consecutive iterations after warm-up (up or down), as a series of its own. Where
        overflows% was logged, it tells directly whether the scale lags, and this is not asked."""
        found = []
        pairs = sorted({(layer, tensor) for layer, tensor, _ in self.series})
        for layer, tensor in pairs:
            stat = next((s for s in SCALE_SOURCES if (layer, tensor, s) in self.series), None)
            if stat is None or (layer, tensor, "overflows%") in self.series or not self._per_tensor(layer, tensor):
                continue  # overflows% measures what a lagging scale does (its own finding); no per-tensor scale, none lags
            factors = _step_factors(self.series[(layer, tensor, stat)], self.warmup_end)
            summary = self.problem(factors, self.thresholds.scale_change) if factors else None
            if summary is not None:
                what = "scale" if stat == "scale_inv_max" else "amax"
                message = f"its {what} changes between logged iterations by a factor {_persistence(summary, 'x')}"
                found.append(self._finding("scale_change", layer, tensor, stat, summary, message))
        return found

    def peer_outliers(self) -> list[Finding]:
        """A tensor far larger or smaller than the same tensor in its peers (layers named alike but for their
        indices): a weight scaled x1e4 by a bad load or update, which per-tensor scaling absorbs and no other
        check sees. At each iteration, the factor between its magnitude and its peers' median, as a series."""
        groups: dict[tuple[str, str, str], dict[str, Points]] = defaultdict(dict)
        for layer, tensor in sorted({(layer, tensor) for layer, tensor, _ in self.series}):
            stat = next((s for s in MAGNITUDE_STATS if (layer, tensor, s) in self.series), None)
            if stat is not None:
                groups[(_INDEX.sub("*", layer), tensor, stat)][layer] = self.series[(layer, tensor, stat)]
        found = []
        for (kind, tensor, stat), members in groups.items():
            if len(members) <= MIN_PEERS:
                continue
            medians = _group_medians(members.values())
            for layer, points in members.items():
                factors = _peer_factors(points, medians)
                summary = self.problem(factors, self.thresholds.peer_ratio) if factors else None
                if summary is not None:
                    message = (
                        f"its {stat} differs from the same tensor's in its {len(members) - 1} peers ({kind}) by a factor "
                        f"{_persistence(summary, 'x')}; per-tensor scaling may absorb it, but a layer unlike its peers "
                        f"usually means a bad initialisation, load or update"
                    )
                    found.append(self._finding("peer_outlier", layer, tensor, stat, summary, message))
        return found

    def growths(self) -> list[Finding]:
        """Kurtosis, the outlier-channel ratio and a per-tensor scale (``scale_inv_max``, else the amax) that grow over
        the run (``trends``): they precede a divergence (outlier features, attention logits that grow), so each finding
        says from which iteration, while the loss may still look fine. As for the scale jumps, a drift is not asked where
        overflows% was logged (it measures what a growing scale does), and ``findings`` leaves out the drift of a scale
        found to jump."""
        t = self.thresholds
        found = []
        for layer, tensor in sorted({(layer, tensor) for layer, tensor, _ in self.series}):
            checks = [
                ("kurtosis_growth", "kurtosis", t.kurtosis_growth),
                ("outlier_channel_growth", "outlier_channel_ratio", t.outlier_growth),
            ]
            scale = next((s for s in SCALE_SOURCES if (layer, tensor, s) in self.series), None)
            if scale is not None and (layer, tensor, "overflows%") not in self.series and self._per_tensor(layer, tensor):
                checks.append(("scale_drift", scale, t.scale_drift))
            for kind, stat, factor in checks:
                points = self.series.get((layer, tensor, stat))
                grown = growth(points, self.warmup_end, factor, t) if points else None
                if grown is not None:
                    found.append(self._growth_finding(kind, layer, tensor, stat, points, grown))
        return found

    def _growth_finding(self, kind: str, layer: str, tensor: str, stat: str, points: Points, grown: Growth) -> Finding:
        """The finding of one growth: its onset, baseline and end in the message; for an outlier channel, which one."""
        summary = self.summary(grown.ratios(points), grown.factor)
        assert summary is not None  # a growth has finite values
        end = "NaN" if math.isnan(summary.persistent) else f"x{summary.persistent:.3g}"
        message = (
            f"its {stat} grows: over x{grown.factor:g} its baseline {grown.baseline:.3g} (the median of iterations "
            f"{grown.baseline_from} to {grown.baseline_to}) from iteration {grown.onset} on, over it in {grown.over} of "
            f"the {grown.since} logged iterations since; x{summary.worst:.3g} at worst ({summary.worst_iteration}), {end} at "
            "the end (median of the last iterations)"
        )
        context = {**self._context(layer, tensor), "baseline": grown.baseline, "onset": grown.onset}
        if kind == "outlier_channel_growth":
            message += self._channel_clause(layer, tensor, grown.onset, context)
        message += f"; what the literature gives: {GROWTH_ADVICE[kind]}"
        fmt = self.formats.of(layer, tensor)
        return Finding(kind, layer, tensor, stat, grown.onset, message, summary, context, format=fmt)

    def _channel_clause(self, layer: str, tensor: str, onset: int, context: dict[str, Any]) -> str:
        """Which channel is the outlier (``max_channel`` at its last logged iteration) and whether it stayed the same
        from the onset on, in ``context`` and as a clause of the message."""
        logged = self.series.get((layer, tensor, "max_channel"), {})
        since = [int(v) for i, v in sorted(logged.items()) if i >= onset and math.isfinite(v)]
        if not since:
            return "; log max_channel to see which channel grows"
        context["max_channel"], context["max_channel_stable"] = since[-1], len(set(since)) == 1
        if len(set(since)) == 1:
            return f"; channel {since[-1]} (max_channel) is the largest at every logged iteration since"
        return (
            f"; the largest channel moved among {len(set(since))} channels since (max_channel), channel {since[-1]} at the "
            "end: no one outlier channel"
        )

    def _finding(self, kind: str, layer: str, tensor: str, stat: str, summary: Summary, message: str) -> Finding:
        assert summary.first_above is not None  # a problem is over its threshold somewhere after warm-up
        context, fmt = self._context(layer, tensor), self.formats.of(layer, tensor)
        return Finding(kind, layer, tensor, stat, summary.first_above, message, summary, context, format=fmt)

    def _context(self, layer: str, tensor: str) -> dict[str, Any]:
        """What the remedy is chosen from: the FP8 element of its per-tensor cast, each GEMM's recipe where the
        routing records say it (``recipes``, as a plan's recipe specs), the tensor's persistent dynamic
        range and what current scaling would lose (``fp8_current_scaling_underflows%``), where they were logged."""
        context: dict[str, Any] = {"element": self.formats.element(layer, tensor)}
        recipes = self.formats.recipes(layer)
        if recipes is not None:
            context["recipes"] = recipes
        for name, stat in (("dynamic_range", "dynamic_range"), ("current_scaling_underflows", "fp8_current_scaling_underflows%")):
            points = self.series.get((layer, tensor, stat))
            summary = self.summary(points, math.inf) if points else None
            if summary is not None and math.isfinite(summary.persistent):  # a run ending in NaN: unknown
                context[name] = summary.persistent
        return context


def _flushed_clauses(context: dict[str, Any]) -> list[str]:
    """Where the blocks that flush most are: an outlier channel's column block where they keep some of their values
    (``worst_block_flushed%`` under 100) in one column block at most iterations; nothing from one iteration."""
    share, iterations = context.get("worst_flushed_col_share"), context.get("worst_flushed_col_iterations", 0)
    if share is None:
        return ["log worst_flushed_col and worst_block_flushed% to see whether an outlier channel sets their blocks' scale"]
    column, flushed = context["worst_flushed_col"], context.get("worst_block_flushed%")
    if flushed == 100.0:
        return [
            "the blocks that flush most lose all their values (worst_block_flushed% 100%): their scales were lost, not "
            f"set by an outlier among them (such blocks tie, and column block {column} is only the last of them)"
        ]
    if iterations <= 1:
        return []
    if share <= STABLE_COLUMN_SHARE:
        return [
            f"the blocks that flush most move between column blocks (column block {column} at {share:.0%} of "
            f"{iterations} iterations): no one outlier channel sets their scale"
        ]
    where = f"the blocks that flush most are in column block {column} at most iterations ({share:.0%} of {iterations})"
    if flushed is None:
        return [
            f"{where}; log worst_block_flushed% to tell an outlier channel there (its blocks keep it) from blocks that "
            "lost their scale"
        ]
    return [f"{where}: an outlier channel there sets their scale (worst_block_flushed% {flushed:.3g}%)"]


def _block_where(fmt: TensorFormat) -> str:
    """The block format and how it scales (``MECHANISMS``)."""
    mechanism = MECHANISMS.get(fmt.label) if fmt.label is not None else None
    return f"{fmt.measured}" + (f", which has {mechanism}" if mechanism else "")


def _block_clauses(context: dict[str, Any], label: str, kind: str) -> str:
    """What the blocks' places and the scale histogram add: for a ``block_underflow``, an outlier channel setting the
    scale of the blocks that flush most (in one column block at most iterations) or not; one channel range the worst
    represented (the worst block in one column block at most iterations) or not; NVFP4 block scales lost or
    subnormal."""
    clauses = _flushed_clauses(context) if kind == "block_underflow" else []
    outlier = any("an outlier channel there sets their scale" in clause for clause in clauses)
    share, iterations = context.get("worst_block_col_share"), context.get("worst_block_col_iterations", 0)
    if outlier and share is not None:
        clauses.append(
            f"the largest relative error is in column block {context['worst_block_col']} (worst_block_col; an outlier "
            "dominates its own block's norm, so that block's relative error stays small)"
        )
    elif share is not None and iterations > 1 and share > STABLE_COLUMN_SHARE:
        clauses.append(
            f"the worst block is in column block {context['worst_block_col']} at most iterations ({share:.0%} of "
            f"{iterations}): the channels of that column block are the worst represented"
        )
    elif share is not None and iterations > 1:
        clauses.append(
            f"the worst block moves between column blocks (column block {context['worst_block_col']} at {share:.0%} of "
            f"{iterations} iterations): no one channel range stands out"
        )
    elif share is None:
        clauses.append("log worst_block_col to see whether one channel range is the worst represented")
    zero, span = context.get("zero_scale_blocks%", 0.0), context.get("scale_span_binades")
    if label == "nvfp4" and zero > 0:
        clauses.append(
            f"{zero:.3g}% of the blocks have a zero E4M3 scale (scale_exp_hist_under; all-zero blocks too): a block "
            f"more than 2^{E4M3_SCALE_BINADES + 3:.1f} (down to E4M3's smallest subnormal) below the largest loses its "
            "scale with all its values, which the per-tensor FP32 scale, set by the largest block, cannot help"
        )
    if label == "nvfp4" and span is not None and span > E4M3_SCALE_BINADES:
        clauses.append(
            f"its block scales span {span} binades (scale_exp_hist), past the {E4M3_SCALE_BINADES:.1f} of E4M3's normal "
            "range below its largest: the smallest blocks' scales are subnormal, with fewer significant bits"
        )
    return "".join(f"; {clause}" for clause in clauses)


def _bin_exponent(tag: str) -> int:
    """A histogram bin's power of two (``m3``: -3, ``p2``: 2, ``0``: 0)."""
    return 0 if tag == "0" else (-1 if tag[0] == "m" else 1) * int(tag[1:])


def _underflow_where(fmt: TensorFormat | None) -> str:
    """Where values flush to zero: the format (FP8 where the records do not say) and how it scales them."""
    if fmt is None:
        return "non-zero values flush to zero in FP8"
    mechanism = MECHANISMS.get(fmt.label) if fmt.label is not None else None
    return f"non-zero values flush to zero in {fmt.measured}" + (f", which has {mechanism}" if mechanism else "")


def underflow_threshold_text(thresholds: Thresholds, label: str | None) -> str:
    """The underflows% threshold of format ``label`` and where it comes from (``Thresholds.underflow_source``)."""
    name = "FP8" if label is None else format_name(label)
    return f"{name}'s threshold {thresholds.underflow_threshold(label):g}% ({thresholds.underflow_source(label)})"


def _underflow_threshold(thresholds: Thresholds, fmt: TensorFormat | None) -> str:
    return underflow_threshold_text(thresholds, None if fmt is None else fmt.label)


def not_measured(run: Run, formats: Formats | None = None) -> str | None:
    """Which of the checks had no statistic to read in the whole run, and what stood in for it: else "no
    finding" would read as "no underflow" in a run that never logged underflows%. None when all were logged.
    Where the routing records (``formats``) name every GEMM's format, neither is asked of a run that quantizes
    nothing, and overflow not of one without delayed scaling: only its stale scale lets values saturate the way
    overflows% counts."""
    logged = {stat for _, _, stat in run.merged}
    labels = formats.labels() if formats is not None else None
    applies = {
        "underflow": labels is None or bool(labels - {None}),
        "overflow": labels is None or "fp8_delayed_scaling" in labels,
    }
    missing = [entry for entry in MEASURES if entry[1] not in logged and applies[entry[0]]]
    if not missing:
        return None
    names = " and ".join(stat for _, stat, _, _, _ in missing)
    verb, pronoun = ("were", "them") if len(missing) > 1 else ("was", "it")
    checks = []
    for problem, _, stand_ins, reading, _ in missing:
        found = [s for s in stand_ins if s in logged]
        checks.append(f"{problem} judged from {reading.format(' and '.join(found))} alone" if found else f"{problem} not checked")
    notes = "".join(note for *_, note in missing)
    return f"{names} {verb} not logged: add LogFp8TensorStats to measure {pronoun}{notes}; {', '.join(checks)}"


def skipped_note(skipped: dict[str, set[str | None]]) -> str | None:
    """Which layers the checks of a per-tensor scale skipped, by why (``Detector.skipped``): else a block-format
    layer without findings would read as checked. None when none was skipped."""
    named = {layer: ", ".join(sorted(format_name(label) for label in labels if label)) for layer, labels in skipped.items()}
    block = [f"{layer} ({names})" for layer, names in named.items() if names]
    high = [layer for layer, names in named.items() if not names]
    parts = []
    if block:
        why = "each block has its own scale; underflows% measures what they lose"
        parts.append(f"to block formats ({why}): {_listed(sorted(block))}")
    if high:
        parts.append(f"to high precision (no recipe casts it): {_listed(sorted(high))}")
    if not parts:
        return None
    return (
        "the checks of a per-tensor FP8 scale (a dynamic range against FP8E4M3's or FP8E5M2's, scale jumps), which do not "
        f"apply {'; nor '.join(parts)}"
    )


def unjudged_note(what_if: dict[str, set[str]]) -> str | None:
    """Which layers' per-block statistics were not judged (``Detector.what_if``): what-if casts of another format
    than the layer's (by prefix), or statistics of a layer whose routing records name no block format. None if none."""
    if not what_if:
        return None
    listed = [f"{layer} ({', '.join(sorted(prefixes))})" for layer, prefixes in sorted(what_if.items())]
    return (
        "the per-block checks (underflow_blocks%, saturated_blocks%, worst_block_rel_err), which judge a block format's "
        "own cast, not what-if casts of another format nor layers whose routing records name no block format: "
        f"{_listed(listed)}; log them without a recipe prefix on layers that run the format to judge them"
    )


def _listed(names: list[str]) -> str:
    more = len(names) - LISTED_LAYERS
    return ", ".join(names[:LISTED_LAYERS]) + (f" and {more} more layer{'s' if more > 1 else ''}" if more > 0 else "")


def _group_medians(members: Iterable[Points]) -> Points:
    """``{iteration: median}`` of the magnitudes of a group's positive finite values at each iteration where at
    least ``MIN_PEERS + 1`` members have one: computed once per group, so the peer check is linear in the layers."""
    magnitudes: dict[int, list[float]] = defaultdict(list)
    for points in members:
        for iteration, value in points.items():
            if math.isfinite(value) and value != 0:
                magnitudes[iteration].append(abs(value))
    return {i: statistics.median(values) for i, values in magnitudes.items() if len(values) > MIN_PEERS}


def _peer_factors(points: Points, medians: Points) -> Points:
    """``{iteration: max(v / m, m / v)}`` where ``m`` is the median magnitude of the tensor and its peers at that
    iteration (of at least ``MIN_PEERS`` peers; itself included, one odd layer cannot drag the median of three
    toward it), for positive finite values."""
    factors = {}
    for iteration, value in points.items():
        value = abs(value)
        median = medians.get(iteration)
        if median is not None and math.isfinite(value) and value > 0:
            factors[iteration] = max(value / median, median / value)
    return factors


def _step_factors(points: Points, warmup_end: int) -> Points:
    """``{iteration: max(v / previous, previous / v)}`` over consecutive positive finite values after warm-up."""
    steady = sorted((i, v) for i, v in points.items() if i >= warmup_end and math.isfinite(v) and v > 0)
    return {i: max(v / p, p / v) for (_, p), (i, v) in zip(steady, steady[1:], strict=False)}


def _severity(finding: Finding) -> tuple[int, float, float, str, str]:
    """Kind first, then how many times its threshold the persistent value is (a run ending in NaN first), then
    for how long it was over."""
    summary = finding.summary
    if summary is None:
        return KINDS.index(finding.kind), 0.0, 0.0, finding.layer, finding.tensor
    ratio = summary.persistent / summary.threshold if summary.threshold > 0 and not math.isnan(summary.persistent) else math.inf
    return KINDS.index(finding.kind), -ratio, -summary.above, finding.layer, finding.tensor


def detect(run: Run, thresholds: Thresholds, formats: Formats) -> tuple[list[Finding], str | None]:
    """Every problem of ``run``, the most severe first, without remedies; and which layers the checks of a per-tensor
    scale skipped (``skipped_note``)."""
    detector = Detector(run, thresholds, formats)
    found = detector.findings()  # fills the detector's notes
    notes = [note for note in (skipped_note(detector.skipped), unjudged_note(detector.what_if)) if note]
    return found, "; ".join(notes) or None
