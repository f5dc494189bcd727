"""The data a diagnosis is made of: a ``Finding`` (what is wrong with one tensor of one layer), its
``Remedy``s (what to change), and the ``Diagnosis`` of a run; the detectors (``findings``) and the
choice of remedies (``remedies``) both work on them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nvdlfw_inspect.diagnose.formats import TensorFormat
from nvdlfw_inspect.diagnose.series import Summary
from nvdlfw_inspect.diagnose.thresholds import Thresholds


@dataclass(frozen=True)
class Remedy:
    """One feature for one layer (None: every layer): ``feature`` on ``gemms`` (and ``tensor``, for the
    features that modify operands), with ``options`` (FakeQuant's ``quant_format``, a statistics window), and why."""

    feature: str
    layer: str | None
    gemms: tuple[str, ...]
    tensor: str | None
    reason: str
    options: tuple[tuple[str, Any], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "feature": self.feature,
            "layer": self.layer,
            "gemms": list(self.gemms),
            "tensor": self.tensor,
            "options": dict(self.options),
            "reason": self.reason,
        }


@dataclass(frozen=True)
class Finding:
    """One problem of one tensor of one layer. ``first_iteration``: where it began (the first NaN or inf,
    or the first iteration after warm-up over the threshold). ``context`` holds what the remedy is
    chosen from (the tensor's dynamic range, what current scaling would lose, the last clean iteration);
    ``format``: the format its layer reads it in (None where the routing records do not say), which the text names."""

    kind: str
    layer: str
    tensor: str
    stat: str
    first_iteration: int
    message: str
    summary: Summary | None = None
    context: dict[str, Any] = field(default_factory=dict)
    remedies: tuple[Remedy, ...] = ()
    format: TensorFormat | None = None

    @property
    def where(self) -> str:
        """The layer and, where known, the format: ``model.fc1 (NVFP4)``."""
        return self.layer if self.format is None else f"{self.layer} ({self.format})"

    def as_dict(self) -> dict[str, Any]:
        fmt = self.format
        return {
            "kind": self.kind,
            "layer": self.layer,
            "tensor": self.tensor,
            "format": None if fmt is None else fmt.label,  # the statistics name of the format its statistics describe
            "format_name": None if fmt is None else str(fmt),
            "gemm_formats": None if fmt is None else fmt.as_dict(),
            "stat": self.stat,
            "first_iteration": self.first_iteration,
            "message": self.message,
            "summary": None if self.summary is None else self.summary.as_dict(),
            "context": dict(self.context),
            "remedies": [remedy.as_dict() for remedy in self.remedies],
        }


@dataclass(frozen=True)
class InPlace:
    """A feature that every GEMM reading ``tensor`` of ``layer`` went through from iteration ``since``;
    ``verdict``: "worked", "did not work" or "not measured", explained in ``message``."""

    layer: str
    tensor: str
    feature: str
    gemms: tuple[str, ...]
    since: int
    verdict: str
    message: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "tensor": self.tensor,
            "feature": self.feature,
            "gemms": list(self.gemms),
            "since": self.since,
            "verdict": self.verdict,
            "message": self.message,
        }


@dataclass(frozen=True)
class Diagnosis:
    """The findings, the most severe first, each with its remedies; the config that applies them all
    (empty when there is nothing to change) and the same as commented YAML (None then); ``unmeasured``:
    which checks had nothing logged to read (None when none), so that no finding is not read as no problem;
    ``in_place``: the remedies the run already had, each with whether it worked; ``layers``: the names of the run's
    layers (its statistics' and routing records'), which a merged config is written for (not in ``as_dict``);
    ``caution``: why no finding may still not be an all-clear (every statistic from one iteration, or all from the
    warm-up), or None;
    ``skipped``: the layers the per-tensor FP8 checks were not applied to (block formats, high precision), or None."""

    findings: list[Finding]
    config: dict[str, Any]
    config_yaml: str | None
    thresholds: Thresholds
    iterations: tuple[int, int] | None = None
    unmeasured: str | None = None
    in_place: list[InPlace] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)
    caution: str | None = None
    skipped: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "findings": [finding.as_dict() for finding in self.findings],
            "config": self.config,
            "config_yaml": self.config_yaml,
            "thresholds": self.thresholds.as_dict(),
            "iterations": None if self.iterations is None else list(self.iterations),
            "unmeasured": self.unmeasured,
            "in_place": [entry.as_dict() for entry in self.in_place],
            "caution": self.caution,
            "skipped": self.skipped,
        }
