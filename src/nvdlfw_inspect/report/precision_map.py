"""The report's precision map: per layer and GEMM, what the GEMM consumed (each input tensor in FP8, in high
precision, or as a feature modified it) and from which iteration, from the run's routing records."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from nvdlfw_inspect.diagnose.formats import format_name
from nvdlfw_inspect.logging import ROUTING_GEMMS
from nvdlfw_inspect.reading import RoutingRecord

#: the order of a cell's parts: the GEMM operands, then the outputs a feature modifies
TENSOR_ORDER = ("activation", "weight", "gradient", "output", "dgrad", "wgrad")
_INPUTS = frozenset(("activation", "weight", "gradient"))

Part = dict[str, Any]  # {"tensor", "decision", "feature", "recipe"}, and "reason", "format" (with "format_name", in
# words) when the record gives them
Period = dict[str, Any]  # {"from": iteration, "parts": [Part, ...]}


def periods(records: Iterable[RoutingRecord]) -> list[Period]:
    """The states of one GEMM of one layer, each with the iteration it holds from: a state is the latest record of
    every tensor (outputs only while modified); a new period starts where the state changes."""
    state: dict[str, Part] = {}
    result: list[Period] = []
    by_iteration: dict[int, list[RoutingRecord]] = {}
    for record in records:
        by_iteration.setdefault(record.iteration, []).append(record)
    for iteration in sorted(by_iteration):
        for record in by_iteration[iteration]:
            if record.tensor in _INPUTS or record.decision == "modified":
                state[record.tensor] = _part(record)
            else:
                state.pop(record.tensor, None)  # an output no longer modified: nothing to show
        parts = sorted(state.values(), key=lambda part: _tensor_rank(part["tensor"]))
        if not result or result[-1]["parts"] != parts:
            result.append({"from": iteration, "parts": parts})
    return result


def _part(record: RoutingRecord) -> Part:
    """What the page shows of a record; its reason and format only where it has them."""
    part = {key: getattr(record, key) for key in ("tensor", "decision", "feature", "recipe")}
    part |= {key: getattr(record, key) for key in ("reason", "format") if getattr(record, key) is not None}
    return part if record.format is None else part | {"format_name": format_name(record.format)}


def _tensor_rank(tensor: str) -> tuple[int, str]:
    return (TENSOR_ORDER.index(tensor), "") if tensor in TENSOR_ORDER else (len(TENSOR_ORDER), tensor)


def precision_map(records: Iterable[RoutingRecord]) -> dict[str, Any]:
    """What the page's precision map draws: ``layers`` in model order (first written first), ``cells`` (per
    layer, per GEMM of ``gemms``, its periods) from the lowest rank that wrote the layer, and ``ranks_differ``, the
    layers another rank recorded otherwise (their map is that lowest rank's)."""
    grouped: dict[str, dict[int, dict[str, list[RoutingRecord]]]] = {}  # layer -> rank -> GEMM -> records
    for record in records:
        grouped.setdefault(record.layer, {}).setdefault(record.rank, {}).setdefault(record.gemm, []).append(record)
    cells, differ = [], []
    for layer, ranks in grouped.items():
        per_rank = {rank: [periods(gemms.get(gemm, ())) for gemm in ROUTING_GEMMS] for rank, gemms in ranks.items()}
        first = per_rank[min(per_rank)]
        cells.append(first)
        if any(other != first for other in per_rank.values()):
            differ.append(layer)
    return {"gemms": list(ROUTING_GEMMS), "layers": list(grouped), "cells": cells, "ranks_differ": differ}
