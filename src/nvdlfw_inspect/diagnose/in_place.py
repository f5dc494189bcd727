"""Remedies already in place: which tensors every GEMM reads through a feature (high precision, or a feature's
operand) according to the run's routing records, and whether that worked.

A remedy is in place for a layer's input tensor when, on every rank, each GEMM that reads the tensor takes it
from a feature (``DisableFP8GEMM``, ``PerTensorScaling``, ``FakeQuant``, ...) or runs the recipe of a precision plan
rule ``diagnose`` wrote for that tensor (``in_format``; its routing records name the rule) at the end of the run. The
quantization statistics of such a tensor measure what those GEMMs read (``LogFp8TensorStats``), so it worked
when no finding about the tensor remains and its statistics were logged after the remedy began.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from nvdlfw_inspect.diagnose.findings import GROWTH_KINDS
from nvdlfw_inspect.diagnose.formats import INPUTS, TENSOR_GEMMS
from nvdlfw_inspect.diagnose.in_format import PLAN_FEATURE, rule_tensors
from nvdlfw_inspect.diagnose.model import Finding, InPlace, Remedy
from nvdlfw_inspect.diagnose.series import Run
from nvdlfw_inspect.diagnose.thresholds import Thresholds
from nvdlfw_inspect.reading import RoutingRecord

MEASURED_BY = ("underflows%", "overflows%", "underflow_blocks%", "saturated_blocks%")  # what remedies are chosen from
#: findings about the FP8 cast: a tensor no GEMM reads in the recipe's FP8 cannot have them any more
CAST_FINDINGS = ("dynamic_range",)
STRONGEST = "DisableFP8GEMM"
ESCALATED = (
    "underflow",
    "overflow",
    "scale_change",
    "block_underflow",
    "block_saturation",
    "block_error",
)  # the findings a stronger precision setting repairs


def remedies_in_place(records: Iterable[RoutingRecord]) -> dict[tuple[str, str], tuple[str, tuple[str, ...], int]]:
    """``{(layer, tensor): (feature, gemms, since)}`` for each input tensor whose every GEMM reads it through a
    feature at the end of the run on every rank (features joined with "+" when its GEMMs use different ones)."""
    last: dict[tuple[int, str, str, str], RoutingRecord] = {}
    for record in records:
        key = (record.rank, record.layer, record.tensor, record.gemm)
        if key not in last or record.iteration >= last[key].iteration:
            last[key] = record
    by_tensor: dict[tuple[str, str], dict[tuple[int, str], RoutingRecord]] = {}
    for (rank, layer, tensor, gemm), record in last.items():
        if tensor in INPUTS:
            by_tensor.setdefault((layer, tensor), {})[(rank, gemm)] = record
    found = {}
    for (layer, tensor), decisions in by_tensor.items():
        ranks = {rank for rank, _ in decisions}
        gemms = TENSOR_GEMMS[tensor]
        covered = [decisions.get((rank, gemm)) for rank in ranks for gemm in gemms]
        through = [None if r is None else _through(r) for r in covered]
        if all(through):
            since = max(r.iteration for r in covered if r is not None)
            found[(layer, tensor)] = ("+".join(sorted(set(through))), gemms, since)  # type: ignore[arg-type]
    return found


def _through(record: RoutingRecord) -> str | None:
    """What ``record``'s GEMM reads its tensor through: a feature (high precision, or its operand), or a precision
    plan rule ``diagnose`` wrote for that tensor (``PLAN_FEATURE``); None for the run's own default."""
    if record.feature and record.decision in ("high_precision", "modified"):
        return record.feature
    written_for = rule_tensors(record.plan_rule)
    if written_for is not None and written_for[0] == record.layer and record.tensor in written_for[1]:
        return PLAN_FEATURE
    return None


def judge(
    run: Run,
    findings: list[Finding],
    in_place: dict[tuple[str, str], tuple[str, tuple[str, ...], int]],
    thresholds: Thresholds,
) -> tuple[list[Finding], list[InPlace]]:
    """The findings that still stand, and a verdict on every remedy in place. A finding about the FP8 cast of a
    tensor no GEMM reads in FP8 any more is dropped; a finding that persists despite a remedy gets the strongest
    one (high precision) instead of the same again. Statistics count from the remedy's first iteration after warm-up."""
    remaining, verdicts = [], []
    warmup_end = run.first_iteration + thresholds.warmup
    open_findings = {(f.layer, f.tensor): f for f in findings if f.kind not in GROWTH_KINDS}  # growth: the model's
    for finding in findings:
        place = in_place.get((finding.layer, finding.tensor))
        if place is None:
            remaining.append(finding)
        elif finding.kind not in CAST_FINDINGS:
            remaining.append(_escalated(finding, place))
    for (layer, tensor), (feature, gemms, since) in in_place.items():
        named = feature.replace(PLAN_FEATURE, "the precision plan rule diagnose wrote for it")
        where = f"{layer} {tensor}: {named} on {' and '.join(gemms)} since iteration {since}"
        start = max(since, warmup_end)
        finding = open_findings.get((layer, tensor))
        measured = {
            stat: [v for i, v in run.merged[(layer, tensor, stat)].items() if i >= start]
            for stat in MEASURED_BY
            if (layer, tensor, stat) in run.merged
        }
        measured = {stat: values for stat, values in measured.items() if values}
        if finding is not None and finding.kind not in CAST_FINDINGS:
            verdict = "did not work"
            message = f"{where}: did not work, {finding.kind} ({finding.stat}) remains: {finding.message}"
        elif measured:
            shown = ", ".join(f"{stat} at most {max(values):.3g}" for stat, values in measured.items())
            shown += f" after iteration {start}" if start > since else ""
            verdict, message = "worked", f"{where}: worked, what its GEMMs read loses little ({shown}, under the thresholds)"
        else:
            verdict = "not measured"
            message = f"{where}: not measured; log underflows% of {tensor} with LogFp8TensorStats to see its effect"
        verdicts.append(InPlace(layer, tensor, feature, gemms, since, verdict, message))
    return remaining, verdicts


def _escalated(finding: Finding, place: tuple[str, tuple[str, ...], int]) -> Finding:
    """``finding`` with the strongest remedy when the one in place did not work (nothing more when it is that one)."""
    feature, gemms, since = place
    if finding.kind not in ESCALATED or PLAN_FEATURE in feature.split("+"):
        return finding  # a plan rule's next rung is already the finding's remedy: it was chosen from the recipe run
    if STRONGEST in feature.split("+"):
        message = f"{finding.message}; its GEMMs already read it in high precision ({feature}), so the FP8 cast is not the cause"
        return replace(finding, message=message)
    why = (
        f"{feature} on {' and '.join(gemms)} has been in place since iteration {since} and {finding.kind} remains, so the "
        f"GEMMs that read it ({' and '.join(gemms)}) run in high precision."
    )
    return replace(finding, remedies=(Remedy(STRONGEST, finding.layer, gemms, None, why),))
