"""Remedies in place: read from routing records, judged from the statistics of what the GEMMs read."""

from __future__ import annotations

from nvdlfw_inspect.diagnose import Thresholds, diagnose_statistics
from nvdlfw_inspect.diagnose.in_place import remedies_in_place
from nvdlfw_inspect.reading import RoutingRecord, Statistic


def routed(layer: str, tensor: str, gemms: dict[str, tuple[str, str | None]], iteration: int = 0, rank: int = 0):
    return [
        RoutingRecord(rank, layer, gemm, tensor, decision, feature, True, iteration)
        for gemm, (decision, feature) in gemms.items()
    ]


HIGH = ("high_precision", "DisableFP8GEMM")
FP8 = ("fp8", None)


def series(layer: str, tensor: str, stat: str, values: list[float]) -> list[Statistic]:
    return [Statistic(0, layer, tensor, stat, i, v) for i, v in enumerate(values)]


def test_only_tensors_whose_every_gemm_goes_through_a_feature_count():
    records = [
        *routed("head", "gradient", {"dgrad": FP8, "wgrad": HIGH}),  # the demo's head: wgrad only
        *routed("qkv", "gradient", {"dgrad": HIGH, "wgrad": HIGH}),
        *routed("qkv", "activation", {"fprop": FP8, "wgrad": HIGH}),
        *routed("fc", "activation", {"fprop": ("modified", "PerTensorScaling"), "wgrad": ("modified", "PerTensorScaling")}),
        *routed("fc", "activation", {"fprop": FP8, "wgrad": FP8}, iteration=7),  # switched off later: not in place
        *routed("up", "weight", {"fprop": ("modified", "FakeQuant"), "dgrad": HIGH}, iteration=3),
    ]
    assert remedies_in_place(records) == {
        ("qkv", "gradient"): ("DisableFP8GEMM", ("dgrad", "wgrad"), 0),
        ("up", "weight"): ("DisableFP8GEMM+FakeQuant", ("fprop", "dgrad"), 3),
    }
    # one rank without it: not in place
    other_rank = routed("qkv", "gradient", {"dgrad": FP8, "wgrad": HIGH}, rank=1)
    assert ("qkv", "gradient") not in remedies_in_place([*records, *other_rank])


def test_verdicts_worked_did_not_work_and_not_measured():
    stats = [
        *series("a", "gradient", "underflows%", [90, 0, 0, 0, 0, 0, 0, 0]),
        *series("b", "activation", "underflows%", [90, 5, 6, 5, 7, 6, 5, 6]),
        *series("c", "weight", "max", [1.0] * 8),
        *series("d", "gradient", "dynamic_range", [50.0] * 8),  # beyond E5M2, underflows% not logged
    ]
    pts = ("modified", "PerTensorScaling")
    records = [
        *routed("a", "gradient", {"dgrad": HIGH, "wgrad": HIGH}),
        *routed("b", "activation", {"fprop": pts, "wgrad": pts}),
        *routed("c", "weight", {"fprop": HIGH, "dgrad": HIGH}),
        *routed("d", "gradient", {"dgrad": HIGH, "wgrad": HIGH}),
    ]
    diagnosis = diagnose_statistics(stats, Thresholds(), routing=records)
    verdicts = {entry.layer: entry for entry in diagnosis.in_place}
    assert {layer: v.verdict for layer, v in verdicts.items()} == {
        "a": "worked",
        "b": "did not work",
        "c": "not measured",
        "d": "not measured",
    }
    assert "underflows% at most 0" in verdicts["a"].message
    assert "log underflows% of weight" in verdicts["c"].message
    # b's underflow stays, and PerTensorScaling is not proposed again: its GEMMs go to high precision
    (finding,) = diagnosis.findings
    assert (finding.layer, finding.kind) == ("b", "underflow")
    assert [(r.feature, r.gemms) for r in finding.remedies] == [("DisableFP8GEMM", ("fprop", "wgrad"))]
    assert "PerTensorScaling on fprop and wgrad has been in place since iteration 0" in finding.remedies[0].reason
    # d's dynamic range no longer matters: no GEMM reads it in FP8
    assert diagnose_statistics(stats, Thresholds()).findings[-1].layer == "d"


def test_without_routing_records_nothing_is_in_place():
    stats = series("a", "gradient", "underflows%", [90, 0, 0, 0])
    assert diagnose_statistics(stats, Thresholds()).in_place == []
