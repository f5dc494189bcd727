"""Shared by the training-loop integration tests: a tiny converted Llama, its data, the debug config, a precision
plan, and the records a run logged."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import tiny_llama_config

import lowprec
import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.reading import iter_statistics, read_routing

RECIPE = lowprec.Float8CurrentScaling()  # stateless: an evaluation cannot change the next training step's scales
STEPS = 3  # optimizer steps
ACCUMULATION = 2  # micro-batches per optimizer step
BATCH = 2
SEQUENCE = 8
VOCAB = 128
INSPECTED = [f"model.model.layers.{i}.{path}" for i in (0, 1) for path in ("self_attn.q_proj", "mlp.down_proj")]
TENSORS = ("activation", "gradient", "weight")
STATS = ("max", "l1_norm")
CONFIG = f"""\
stats:
  enabled: True
  layers:
    layer_name_regex_pattern: "(q_proj|down_proj)$"
  transformer_engine:
    LogTensorStats:
      enabled: True
      stats: [{", ".join(STATS)}]
      tensors: [{", ".join(TENSORS)}]
"""


PLANNED_WGRAD = "model.model.layers.1.mlp.down_proj"
PLAN_YAML = f"""\
precision_plan:
  rules:
    - name: q_proj in NVFP4
      layers: {{layer_name_regex_pattern: 'q_proj$'}}
      recipe: nvfp4
    - name: layer 1's down_proj wgrad in MXFP8
      layers: {{exact_layer_names: [{PLANNED_WGRAD}]}}
      wgrad: mxfp8
"""


def planned_format(layer: str, gemm: str) -> str:
    """The format each GEMM reads its operands in under ``PLAN_YAML`` and ``RECIPE`` (current scaling)."""
    if layer.endswith("q_proj"):
        return "nvfp4"
    return "mxfp8" if (layer, gemm) == (PLANNED_WGRAD, "wgrad") else "fp8_current_scaling"


def config_file(tmp_path: Path, plan: bool = False) -> Path:
    """The debug config; with ``plan``, holding the precision plan as well (its ``precision_plan:`` key)."""
    path = tmp_path / "config.yaml"
    path.write_text(CONFIG + (PLAN_YAML if plan else ""))
    return path


def check_planned_formats(log_dir: Path) -> None:
    """Every GEMM of every layer read both its operands, at every step, in the format ``planned_format`` gives it."""
    formats: dict[tuple[str, str], set[str]] = {}
    for record in read_routing(log_dir):
        formats.setdefault((record.layer, record.gemm), set()).add(record.format)
    assert len(formats) == 15 * 3  # 2 x (q, k, v, o, gate, up, down) and lm_head, 3 GEMMs each
    assert formats == {(layer, gemm): {planned_format(layer, gemm)} for layer, gemm in formats}


def tiny_llama(convert: bool = True) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=VOCAB))
    return lowprec.convert(model) if convert else model


def samples(count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``count`` causal-LM samples (``input_ids``, ``labels``) of ``SEQUENCE`` tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(VOCAB, (count, SEQUENCE), generator=generator)
    return [{"input_ids": row, "labels": row} for row in ids]


def train_samples() -> list[dict[str, torch.Tensor]]:
    return samples(STEPS * ACCUMULATION * BATCH, seed=1)


def eval_samples() -> list[dict[str, torch.Tensor]]:
    return samples(3 * BATCH, seed=2)


def logged(log_dir: Path) -> dict[tuple[str, str, str, int], float]:
    """``{(layer, tensor, stat, iteration): value}``; each record's key must be new (one record per step)."""
    out: dict[tuple[str, str, str, int], float] = {}
    for record in iter_statistics(log_dir):
        key = (record.layer, record.tensor, record.stat, record.iteration)
        assert key not in out, f"logged twice: {key}"
        out[key] = record.value
    return out


def check_one_record_per_optimizer_step(log_dir: Path) -> dict[tuple[str, str, str, int], float]:
    """The run in ``log_dir`` ended and logged each statistic of each inspected tensor once per optimizer step, at
    iterations 0 to STEPS - 1, under the names of the unwrapped model; returns the records."""
    assert debug_api.DEBUG_MANAGER is None, "the run was not ended"
    records = logged(log_dir)
    expected = {(layer, tensor, stat, i) for layer in INSPECTED for tensor in TENSORS for stat in STATS for i in range(STEPS)}
    assert set(records) == expected, (
        f"unexpected records {sorted(set(records) - expected)[:4]}, missing {sorted(expected - set(records))[:4]}"
    )
    return records
