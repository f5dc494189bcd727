"""benchmarks/engine.py's training table runs every variant, compiled ones included (on the CPU here,
with a fast backend; the GPU figures are measured on a GPU)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import engine  # noqa: E402

import lowprec  # noqa: E402


def test_training_table_times_eager_and_compiled_variants(capsys):
    torch._dynamo.reset()
    args = argparse.Namespace(gpu_tokens=32, steps=1, repeats=1, compile_backend="aot_eager")
    reference = torch.nn.Linear(32, 32, dtype=torch.bfloat16)
    ours = lowprec.Linear(32, 32, name="big", params_dtype=torch.bfloat16)
    fastest, missing = engine.training_table(args, "Linear 32x32", reference, ours, 32, "cpu")
    assert {"lowprec FP8 current compiled", "torch.nn.Linear bf16 compiled", "lowprec FP8 delayed"} <= set(fastest)
    assert all(seconds > 0 for seconds in fastest.values())
    out = capsys.readouterr().out
    assert "Linear 32x32, 32 tokens, one training step, cpu" in out and "lowprec FP8 current compiled" in out
    assert "torchao Float8Linear compiled" in out  # timed, or listed with why it was not
    assert ("torchao Float8Linear compiled" in fastest) != ("torchao Float8Linear compiled" in missing)
