"""benchmarks/plan_table.py: the three runs of the README's precision-plan table (one step of the tiny GPT here), and
what its columns mean."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import plan_table  # noqa: E402

BLOCK_0 = ("self_attention.layernorm_qkv", "self_attention.proj", "layernorm_mlp.fc1", "layernorm_mlp.fc2")


def test_the_three_runs_and_their_underflows(tmp_path):
    args = argparse.Namespace(size="tiny", steps=1, freq=1, seed=0, threads=1)
    high, everywhere, planned = plan_table.runs(args, tmp_path)
    assert [(row.label, row.nvfp4_layers, row.layers) for row in (high, everywhere, planned)] == [
        ("high precision", 0, 9),
        ("NVFP4 everywhere", 9, 9),
        ("NVFP4, last block + head in BF16", 4, 9),  # block 1 (of 2) and the head in high precision
    ]
    assert high.underflows == {"activation": 0.0, "gradient": 0.0} and high.per_layer == {}
    assert everywhere.underflows["activation"] > 1 and everywhere.underflows["gradient"] > 1
    # the plan run's block 0 computes its first forward from the same weights and batch as NVFP4 everywhere
    for name in BLOCK_0:
        key = (f"gpt.layers.0.{name}", "activation")
        assert planned.per_layer[key] == everywhere.per_layer[key] > 0
    assert {layer for layer, _ in planned.per_layer} == {f"gpt.layers.0.{name}" for name in BLOCK_0}
    for tensor in ("activation", "gradient"):  # over every layer, those in high precision counting 0
        nvfp4 = [value for (_, t), value in planned.per_layer.items() if t == tensor]
        assert planned.underflows[tensor] == pytest.approx(sum(nvfp4) / 9)
        assert planned.underflows_nvfp4[tensor] == pytest.approx(sum(nvfp4) / 4)
    table = plan_table.markdown([high, everywhere, planned]).splitlines()
    assert len(table) == 5 and table[2].startswith("| high precision | 0 of 9 |") and table[2].endswith(" |")
    assert f"| {planned.final_loss:.4f} | {planned.underflows['activation']:.2f} |" in table[4]
