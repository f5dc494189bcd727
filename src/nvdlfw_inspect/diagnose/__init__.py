"""Read a run and say, per layer and tensor, what is wrong and what to change: the first NaN or inf,
sustained underflow or overflow, a dynamic range beyond the format's, a scale that keeps jumping, blocks of a block
format that flush or saturate; kurtosis, an outlier channel or a scale that grows over the run (``trends``), before
the loss diverges;
and write the config that applies the remedies. Each layer is judged in its own format (``formats``).

``diagnose(log_dir)`` returns a ``Diagnosis`` (``as_dict()`` for JSON); ``nvdlfw-inspect diagnose
LOG_DIR`` prints it and writes the config. Thresholds: ``Thresholds``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from nvdlfw_inspect.diagnose import config as remedy_config
from nvdlfw_inspect.diagnose.findings import detect, not_measured
from nvdlfw_inspect.diagnose.formats import Formats
from nvdlfw_inspect.diagnose.in_place import judge, remedies_in_place
from nvdlfw_inspect.diagnose.model import Diagnosis, Finding, InPlace, Remedy
from nvdlfw_inspect.diagnose.remedies import choose
from nvdlfw_inspect.diagnose.series import Run, collect
from nvdlfw_inspect.diagnose.thresholds import Thresholds
from nvdlfw_inspect.reading import RoutingRecord, Statistic, iter_statistics, read_routing, run_directory

__all__ = ["Diagnosis", "Finding", "InPlace", "Remedy", "Thresholds", "diagnose", "diagnose_run", "diagnose_statistics"]


def diagnose_run(
    run: Run, thresholds: Thresholds | None = None, source: str = "a run", routing: Iterable[RoutingRecord] = ()
) -> Diagnosis:
    """The diagnosis of an already collected run (the report shares its reading with this); ``routing``: the run's
    routing records (``read_routing``), which give each layer's format and from which the remedies already in place
    are judged."""
    thresholds = thresholds or Thresholds()
    routing = list(routing)
    first = run.first_iteration
    formats = Formats(routing, thresholds)
    read_prefixed_as_own(run, formats)
    detected, skipped = detect(run, thresholds, formats)
    findings = [replace(finding, remedies=tuple(choose(finding, first))) for finding in detected]
    findings, in_place = judge(run, findings, remedies_in_place(routing), thresholds)
    layers = sorted({layer for layer, _, _, _ in run.points} | {record.layer for record in routing})
    config, reasons = remedy_config.build(remedy for finding in findings for remedy in finding.remedies)
    text = remedy_config.to_yaml(config, reasons, source) if config else None
    iterations = [i for points in run.points.values() for i in (min(points), max(points)) if points]
    span = (min(iterations), max(iterations)) if iterations else None
    caution = None
    if span is not None and span[0] == span[1]:
        caution = one_iteration_caution(span[0])
    elif span is not None and span[1] < span[0] + thresholds.warmup:
        caution = warmup_caution(span, thresholds.warmup)
    return Diagnosis(findings, config, text, thresholds, span, not_measured(run, formats), in_place, layers, caution, skipped)


OWN_FORMAT_STATS = ("underflows%", "overflows%")


def read_prefixed_as_own(run: Run, formats: Formats) -> None:
    """A loss statistic logged with the prefix of the layer's own format (``nvfp4_underflows%``, as
    ``LogNvfp4TensorStats`` and ``compare`` log it) measures that layer's own cast: it is read as its bare
    ``underflows%`` where that was not logged (added to ``run.merged``, which the report's table reads too)."""
    merged = run.merged
    for layer, tensor, stat in list(merged):
        fmt = formats.of(layer, tensor)
        if fmt is None or fmt.label is None:
            continue
        own = stat.removeprefix(f"{fmt.label}_")
        if own != stat and own in OWN_FORMAT_STATS and (layer, tensor, own) not in merged:
            merged[(layer, tensor, own)] = merged[(layer, tensor, stat)]


def one_iteration_caution(iteration: int) -> str:
    """What a run whose every statistic is from one iteration cannot show, and its likely cause."""
    return (
        f"every statistic is from iteration {iteration} alone, so what persists or grows cannot be judged and no "
        "finding is no all-clear; if the run trained more than one step, debug_api.step() was never called and "
        "every step was merged into that iteration: call it once per training step, after optimizer.step()"
    )


def warmup_caution(span: tuple[int, int], warmup: int) -> str:
    """What a run no longer than its warm-up shows: its warm-up values, judged for want of any others."""
    return (
        f"every statistic is from iterations {span[0]} to {span[1]}, all in the warm-up (the first {warmup} iterations), "
        "whose values are usually transients: they are judged as they are, for want of others; run past the warm-up "
        "(or lower the warmup threshold) to tell a transient from what persists"
    )


def diagnose_statistics(
    statistics: Iterable[Statistic],
    thresholds: Thresholds | None = None,
    source: str = "a run",
    routing: Iterable[RoutingRecord] = (),
) -> Diagnosis:
    """The diagnosis of ``statistics`` given in the order the run wrote them (see ``reading``)."""
    return diagnose_run(collect(statistics), thresholds, source, routing)


def diagnose(log_dir: str | Path, thresholds: Thresholds | None = None, **overrides: Any) -> Diagnosis:
    """Read every rank's statistics in ``log_dir`` and diagnose them. Thresholds: ``thresholds``, or the
    defaults with ``overrides`` (``diagnose(log_dir, underflow_pct=5)``); see ``Thresholds``. ``log_dir`` may
    also be one of the run's statistics directories (see ``run_directory``)."""
    log_dir = run_directory(log_dir)
    if thresholds is not None and overrides:
        raise ValueError("give thresholds or keyword overrides of the defaults, not both")
    try:
        thresholds = thresholds or Thresholds(**overrides)
    except TypeError:
        unknown = sorted(set(overrides) - set(Thresholds().as_dict()))
        raise ValueError(f"unknown threshold {', '.join(unknown)}; known: {', '.join(Thresholds().as_dict())}") from None
    source = str(Path(log_dir).resolve())
    diagnosis = diagnose_statistics(iter_statistics(log_dir), thresholds, source, read_routing(log_dir))
    if diagnosis.iterations is None:
        raise ValueError(f"no statistics were logged in '{log_dir}'")
    return diagnosis
