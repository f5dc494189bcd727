"""benchmarks/harness.count_ops, and the op counts of benchmarks/real_model.py on a tiny Llama."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from harness import count_ops, count_python_calls  # noqa: E402

TINY = {"hidden": 64, "layers": 1, "heads": 2, "kv_heads": 1, "intermediate": 128, "vocab": 128, "batch": 1, "seq": 16}


@torch.library.custom_op("lowprec_benchmark_test::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x.mul(2).add(0)


def test_count_python_calls_counts_python_functions_and_builtins():
    def inner() -> int:
        return len([])

    def outer() -> None:
        inner()
        inner()

    assert count_python_calls(outer) == 5  # outer, inner twice, len twice
    assert count_python_calls(lambda: None) == 1


def test_count_ops_counts_each_dispatched_op():
    assert count_ops(lambda: torch.ones(3).add(1).mul(2)) == {"aten::ones": 1, "aten::add.Tensor": 1, "aten::mul.Tensor": 1}


def test_count_ops_sees_backward_and_custom_ops_once():
    x = torch.ones(3, requires_grad=True)
    backward = count_ops(lambda: x.mul(2).sum().backward())
    assert backward["aten::mul.Tensor"] == 2  # forward, and the gradient of mul in backward
    assert backward["aten::sum"] == 1 and backward["aten::ones_like"] == 1
    # a torch.library op counts as itself; the ops of its implementation are not counted again
    assert count_ops(lambda: twice(torch.ones(3))) == {"aten::ones": 1, "lowprec_benchmark_test::twice": 1}


def test_missing_transformers_exits_with_the_install_command(monkeypatch):
    import real_model

    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    with pytest.raises(SystemExit) as exited:
        real_model.import_transformers()
    assert "pip install -e .[bench]" in str(exited.value.code)


@pytest.fixture
def one_thread():
    """A tiny model gains nothing from threads, and on a busy machine they wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_op_counts_of_a_tiny_llama_are_consistent(tmp_path, one_thread):
    pytest.importorskip("transformers")
    import real_model

    bench = real_model.build({**TINY, "dtype": "float32"}, "cpu")
    assert bench.left_unconverted == []
    assert len(bench.converted) == 8  # q, k, v, o, gate, up, down and lm_head
    assert len(bench.inspected_layers) == 7 and bench.inspected_per_logging_step == 21
    counts, inspected = real_model.measure_ops(bench, str(tmp_path), warmup=3, steps=10)
    assert inspected == {"no debug": 0, "debug idle": 0, "stats freq 1": 21, "stats freq 10": 2.1}  # iteration 10 logs

    base = counts["no debug"].total_per_step()
    assert {sum(step.values()) for step in counts["no debug"].per_step} == {base}  # steady state
    assert 0 <= counts["debug idle"].total_per_step() - base <= 10  # idle debug: nothing, or a few ops
    freq1 = counts["stats freq 1"].total_per_step()
    assert freq1 > base
    per_inspected = real_model.extra_per_inspected(counts, inspected, "stats freq 1")
    assert 0 < per_inspected < math.inf

    # freq 10: iteration 10 costs what a freq-1 step does, the other nine what idle debug does
    freq10 = {3 + i: sum(step.values()) for i, step in enumerate(counts["stats freq 10"].per_step)}
    assert freq10.pop(10) == freq1
    assert set(freq10.values()) == {counts["debug idle"].total_per_step()}
    assert real_model.extra_per_inspected(counts, inspected, "stats freq 10") == pytest.approx(per_inspected)

    rows = real_model.op_breakdown(counts, top=1000)
    assert sum(extra for *_, extra in rows) == pytest.approx(freq1 - base)
    extras = [extra for *_, extra in rows]
    assert extras == sorted(extras, reverse=True) and extras[0] > 0
