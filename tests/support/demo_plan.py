"""A precision plan of four formats for the demo GPT of two layers (size ``tiny``), shared by the demo's and compare's
tests: what each GEMM should read its operands in, and a check of a run's routing records against it."""

from __future__ import annotations

from pathlib import Path

from nvdlfw_inspect.reading import read_routing

PLAN_YAML = r"""precision_plan:
  rules:
    - name: last block and head in high precision
      layers: {layer_name_regex_pattern: 'gpt\.(layers\.1\.|head)'}
      recipe: bf16
    - name: MLPs in NVFP4
      layers: {layer_types: [layernorm_mlp]}
      recipe: {name: nvfp4, disable_stochastic_rounding: true}
    - name: attention in MXFP8, its wgrad in FP8 current scaling
      layers: {layer_name_regex_pattern: self_attention}
      fprop: mxfp8
      dgrad: mxfp8
      wgrad: current
"""
QUANTIZED = (
    "gpt.layers.0.self_attention.layernorm_qkv",
    "gpt.layers.0.self_attention.proj",
    "gpt.layers.0.layernorm_mlp.fc1",
    "gpt.layers.0.layernorm_mlp.fc2",
)
HIGH_PRECISION = (
    "gpt.layers.1.self_attention.layernorm_qkv",
    "gpt.layers.1.self_attention.proj",
    "gpt.layers.1.layernorm_mlp.fc1",
    "gpt.layers.1.layernorm_mlp.fc2",
    "gpt.head",
)


def write_plan(directory: Path, debug_sections: str = "") -> Path:
    """The plan as a YAML file in ``directory``; with ``debug_sections``, a debug config holding it."""
    path = directory / "plan.yaml"
    path.write_text(debug_sections + PLAN_YAML)
    return path


def planned_format(layer: str, gemm: str) -> str | None:
    """The format (routing records' name) ``gemm`` of ``layer`` reads its operands in; None: high precision."""
    if layer in HIGH_PRECISION:
        return None
    if "layernorm_mlp" in layer:
        return "nvfp4"
    return "fp8_current_scaling" if gemm == "wgrad" else "mxfp8"


def check_planned_formats(log_dir: Path) -> None:
    """Every GEMM of every layer of the run in ``log_dir`` read its operands, at every step, as the plan says."""
    seen: dict[tuple[str, str], set[tuple[str, str | None]]] = {}
    for record in read_routing(log_dir):
        seen.setdefault((record.layer, record.gemm), set()).add((record.decision, record.format))
    expected = {
        (layer, gemm): {("high_precision", None) if planned_format(layer, gemm) is None else ("fp8", planned_format(layer, gemm))}
        for layer in QUANTIZED + HIGH_PRECISION
        for gemm in ("fprop", "dgrad", "wgrad")
    }
    assert seen == expected
