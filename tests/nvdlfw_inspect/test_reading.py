"""Reading a run's statistics back: malformed records are skipped and named, once per file, and
``read_stats`` holds a large log in a fraction of its size."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

pytest.importorskip("pandas")  # imported before the memory is traced: read_stats needs it

import nvdlfw_inspect  # noqa: E402
import nvdlfw_inspect.api as debug_api  # noqa: E402
from nvdlfw_inspect.cli import main  # noqa: E402
from nvdlfw_inspect.reading import (  # noqa: E402
    RoutingRecord,
    SkippedRecordsWarning,
    TornLineWarning,
    iter_statistics,
    read_routing,
)

RECORDS = "nvdlfw_inspect_statistics_jsonl"
ITERATIONS = 400  # of 192 records each: a log of 10 MB


def record(number: int, **fields: object) -> str:
    return json.dumps({"layer": "model.fc1", "tensor": "activation", "stat": "max", "iteration": number, "value": 1.5} | fields)


@pytest.fixture
def malformed(log_dir: Path) -> Path:
    """Rank 0 with four records of a wrong type among good ones; a directory named like rank 1's file."""
    (log_dir / RECORDS / "nvdlfw_inspect_globalrank-1.jsonl").mkdir(parents=True)
    bad = [record(2, layer=7), record(3, value=[1]), record(4, iteration="4"), record(5, rank=None)]
    lines = [record(0), record(1), *bad, record(6)]
    (log_dir / RECORDS / "nvdlfw_inspect_globalrank-0.jsonl").write_text("\n".join(lines) + "\n")
    return log_dir


def test_malformed_records_are_skipped_and_named_once_per_file(malformed):
    with pytest.warns(SkippedRecordsWarning) as caught:
        assert [s.iteration for s in iter_statistics(malformed)] == [0, 1, 6]
    assert [str(w.message) for w in caught] == [
        f"{malformed / RECORDS / 'nvdlfw_inspect_globalrank-1.jsonl'}: skipped: not a file (a statistics file is a file)",
        f"{malformed / RECORDS / 'nvdlfw_inspect_globalrank-0.jsonl'}:3: skipped 4 lines, this the first, holding no "
        f"statistics record (layer is 7, not a string): {record(2, layer=7)!r}",
    ]
    with pytest.warns(SkippedRecordsWarning):
        assert nvdlfw_inspect.read_stats(malformed).iteration.tolist() == [0, 1, 6]


@pytest.mark.parametrize("command", ["report", "diagnose"])
def test_the_commands_go_on_past_malformed_records(malformed, command, capsys):
    assert main([command, str(malformed)]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if line.startswith(f"nvdlfw-inspect {command}: warning:")]
    assert len(warned) == 2 and "globalrank-1.jsonl: skipped: not a file" in warned[0]
    assert "globalrank-0.jsonl:3: skipped 4 lines" in warned[1] and "layer is 7, not a string" in warned[1]


def test_read_stats_holds_a_large_log_in_less_than_its_size(log_dir):
    """A 10 MB log: a list of records took 3.5 times its size, the columns take about 0.8 of it."""
    path = log_dir / RECORDS / "nvdlfw_inspect_globalrank-0.jsonl"
    path.parent.mkdir(parents=True)
    names = [
        (f"model.layers.{layer}.mlp.fc1", tensor, stat)
        for layer in range(24)
        for tensor in ("activation", "gradient")
        for stat in ("max", "min", "std", "underflows%")
    ]
    with path.open("w") as file:
        for iteration in range(ITERATIONS):
            file.write(
                "".join(
                    f'{{"layer": "{layer}", "tensor": "{tensor}", "stat": "{stat}", "iteration": {iteration}, '
                    f'"value": {iteration / 7 + i}, "rank": 0}}\n'
                    for i, (layer, tensor, stat) in enumerate(names)
                )
            )
    size = path.stat().st_size
    tracemalloc.start()
    try:
        frame = nvdlfw_inspect.read_stats(log_dir)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(frame) == ITERATIONS * len(names) and frame.value.iloc[-1] == (ITERATIONS - 1) / 7 + len(names) - 1
    assert frame.layer.iloc[-1] == "model.layers.23.mlp.fc1" and frame.iteration.iloc[-1] == ITERATIONS - 1
    assert peak < size, f"read_stats peaked at {peak / size:.2f}x the log's size ({size / 2**20:.0f} MiB)"


def routing(iteration: int, **fields: object) -> str:
    good = {"layer": "m.fc", "gemm": "wgrad", "tensor": "gradient", "decision": "high_precision", "feature": "Off"}
    return json.dumps(good | {"recipe": True, "iteration": iteration, "rank": 1} | fields)


def test_a_routing_records_reason_is_written_only_when_given_and_read_back(log_dir):
    stats = {"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max"]}}
    debug_api.initialize(
        config_file={"s": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}} | stats}, log_dir=log_dir
    )
    fields = {"gemm": "fprop", "tensor": "weight", "decision": "high_precision", "feature": None, "recipe": True}
    debug_api.log_routing(layer="m.attn", **fields, iteration=0, reason="not converted: fused attention")
    debug_api.log_routing(layer="m.fc", **fields, iteration=0)
    with pytest.raises(TypeError, match="reason must be a non-empty string or None, got 3"):
        debug_api.log_routing(layer="m.fc", **fields, iteration=0, reason=3)
    debug_api.end_debug()
    lines = (log_dir / "nvdlfw_inspect_routing_jsonl" / "routing_globalrank-0.jsonl").read_text().splitlines()
    assert ["reason" in json.loads(line) for line in lines] == [True, False]  # older lines keep their format
    assert [record.reason for record in read_routing(log_dir)] == ["not converted: fused attention", None]


def test_routing_records_are_read_bad_and_torn_lines_skipped_and_named(log_dir):
    assert read_routing(log_dir) == []  # a run without them (older versions, other frameworks)
    path = log_dir / "nvdlfw_inspect_routing_jsonl" / "routing_globalrank-1.jsonl"
    path.parent.mkdir(parents=True)
    lines = [routing(0), routing(1, decision="bf16"), routing(2, recipe="yes"), routing(3, feature=None)]
    path.write_text("\n".join(lines) + "\n" + routing(4)[:30])
    with pytest.warns(SkippedRecordsWarning) as caught:
        records = read_routing(path.parent)  # one of the run's directories stands for the run
    assert records == [
        RoutingRecord(1, "m.fc", "wgrad", "gradient", "high_precision", "Off", True, 0),
        RoutingRecord(1, "m.fc", "wgrad", "gradient", "high_precision", None, True, 3),
    ]
    assert [type(w.message) for w in caught] == [TornLineWarning, SkippedRecordsWarning]
    assert str(caught[1].message).startswith(
        f"{path}:2: skipped 2 lines, this the first, holding no routing record (decision is 'bf16', not one of fp8,"
    )
