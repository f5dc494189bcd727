"""Shared helpers for the lowprec debug tests: start a debug session and run one training step of a layer."""

from __future__ import annotations

from pathlib import Path

import torch

import lowprec
import nvdlfw_inspect.api as debug_api

CURRENT = lowprec.Float8CurrentScaling()


def start(config: dict | str | Path, log_dir: Path, **kwargs) -> None:
    debug_api.initialize(config_file=config, feature_dirs=[lowprec.FEATURE_DIR], log_dir=log_dir, **kwargs)


def section(features: dict, layers: dict | None = None) -> dict:
    """One config section selecting every layer (or ``layers``) with ``transformer_engine`` features."""
    return {"sec": {"enabled": True, "layers": layers or {"layer_name_regex_pattern": ".*"}, "transformer_engine": features}}


def make_linear(name: str = "lin", in_f: int = 32, out_f: int = 24) -> lowprec.Linear:
    torch.manual_seed(0)
    return lowprec.Linear(in_f, out_f, name=name)


def train_step(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, recipe=CURRENT, fp8: bool = True):
    """Forward and backward once; returns ``(y, dx, dw)`` with grads reset first."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    with lowprec.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
        y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad
