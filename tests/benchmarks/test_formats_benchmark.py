"""benchmarks/formats.py times every recipe's training step and quantizer (tiny sizes here)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import formats  # noqa: E402


def test_every_recipe_is_timed_next_to_high_precision(capsys):
    args = argparse.Namespace(steps=1, repeats=1, width=32, depth=2, tokens=16)
    steps = formats.training_table(args, "cpu", torch.float32)
    quantized = formats.quantize_table(args, "cpu", 256)
    assert set(steps) == {*formats.RECIPES, *formats.PLANS} and all(seconds > 0 for seconds in steps.values())
    ours = {f"{label}{part}" for label, recipe in formats.RECIPES.items() if recipe is not None for part in ("", " both")}
    torchao = {f"{label}{part} (torchao)" for label in ("MXFP8", "NVFP4") for part in ("", " both")}  # torchao: a dev extra
    assert set(quantized) == {"copy (ceiling)", "transpose"} | ours | torchao
    out = capsys.readouterr().out
    assert "training step per recipe" in out and "NVFP4" in out and "GB/s read" in out
    budget = out.split("both / (2 rowwise + transpose)")[1].split("\n\n")[0].strip().splitlines()
    assert {line.rsplit(maxsplit=1)[0] for line in budget} == {label for label in ours if not label.endswith(" both")}
    ratios = {line.split()[0]: line.split()[1:] for line in out.split("ours / torchao")[1].strip().splitlines()}
    assert set(ratios) == {"MXFP8", "NVFP4"} and all(len(row) == 2 and float(r) > 0 for row in ratios.values() for r in row)
