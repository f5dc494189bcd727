"""Short FP8 runs of small ``lowprec`` layers with planted problems, logged with LogTensorStats and
LogFp8TensorStats, for the tests of ``diagnose`` and the report.

``planted_run``: five independent layers under delayed scaling, each fed its own trouble:
- ``model.grow``: its input grows 8x per step, so the delayed scale lags and the activation overflows;
- ``model.deep``: its output gradient spans 2**-40..1, beyond E5M2's range, and underflows;
- ``model.shrink``: its output gradient shrinks 16x per step, so the scale, kept by the history's
  largest amax, lags and the gradient underflows though its range fits E5M2;
- ``model.wide``: its input spans 2**-26..1, beyond E4M3's range but within E5M2's, and underflows;
- ``model.clean``: normal values, no problem.
``nan_run``: ``model.fc1`` feeds ``model.fc2``; from step ``nan_step`` on, fc2's input holds a NaN.
``outlier_channel_run``: ``model.proj``'s input has one channel 1e4 times the others (LLMs' massive
activations), so per-tensor scaling set by it flushes several % of the other channels to zero.
``scaled_weight_run``: four blocks alike; the weight of ``model.layers.2.0`` is scaled x1e4, which per-tensor
scaling absorbs: only its peers show it.
``mixed_formats_run``: four layers under a precision plan (``MIXED_PLAN``), each input spanning 2**-26..1:
``model.fp8`` in FP8 current scaling (the default), ``model.nvfp4`` in NVFP4, ``model.mixed`` with an MXFP8
fprop and NVFP4 dgrad and wgrad (its output gradient spans 2**-40..1, beyond every FP8 format's range), ``model.hp``
in high precision; underflows% of the activations (of the layers with a recipe), dynamic range of every input.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

import lowprec
import nvdlfw_inspect.api as debug_api

STATS = {
    "LogTensorStats": {
        "enabled": True,
        "tensors": ["activation", "gradient", "weight"],
        "stats": ["max", "cur_amax", "dynamic_range"],
    },
    "LogFp8TensorStats": {
        "enabled": True,
        "tensors": ["activation", "gradient", "weight"],
        "stats": ["underflows%", "overflows%", "scale_inv_max"],
    },
}
LAYERS = ("grow", "deep", "shrink", "wide", "clean")
WIDTH, TOKENS = 32, 16


def stats_config() -> dict:
    return {"statistics": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "transformer_engine": STATS}}


def _start(log_dir: Path, extra: dict | None) -> None:
    config = {**stats_config(), **(extra or {})}
    debug_api.initialize(config_file=config, feature_dirs=[lowprec.FEATURE_DIR], log_dir=str(log_dir))


def planted_run(log_dir: Path, steps: int = 16, extra: dict | None = None) -> None:
    """The five layers trained ``steps`` steps; ``extra``: more config sections (a diagnosis's remedies)."""
    _start(log_dir, extra)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    layers = {name: lowprec.Linear(WIDTH, WIDTH, name=f"model.{name}") for name in LAYERS}

    def normal() -> torch.Tensor:
        return torch.randn(TOKENS, WIDTH, generator=gen)

    def spanning(bits: float) -> torch.Tensor:
        return torch.exp2(-bits * torch.rand(TOKENS, WIDTH, generator=gen)) * normal().sign()

    deep_gradient = spanning(40)
    try:
        for step in range(steps):
            x = {name: normal() for name in LAYERS} | {"grow": normal() * 8.0**step, "wide": spanning(26)}
            dy = {name: normal() for name in LAYERS} | {"deep": deep_gradient, "shrink": normal() * 16.0**-step}
            with lowprec.fp8_autocast(fp8_recipe=lowprec.DelayedScaling()):
                outputs = [layers[name](x[name]) for name in LAYERS]
            torch.autograd.backward(outputs, [dy[name] for name in LAYERS])
            debug_api.step()
    finally:
        debug_api.end_debug()


def nan_run(log_dir: Path, steps: int = 12, nan_step: int = 9) -> None:
    """Two chained layers; fc2's input holds a NaN from ``nan_step`` on (the weights are not updated, so
    fc1 stays finite throughout)."""
    _start(log_dir, None)
    torch.manual_seed(0)
    fc1, fc2 = lowprec.Linear(WIDTH, WIDTH, name="model.fc1"), lowprec.Linear(WIDTH, WIDTH, name="model.fc2")
    try:
        for step in range(steps):
            with lowprec.fp8_autocast(fp8_recipe=lowprec.DelayedScaling()):
                hidden = fc1(torch.randn(TOKENS, WIDTH))
                if step >= nan_step:
                    hidden = hidden.index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(math.nan))
                fc2(hidden).float().sum().backward()
            debug_api.step()
    finally:
        debug_api.end_debug()


def outlier_channel_run(log_dir: Path, steps: int = 10) -> None:
    _start(log_dir, None)
    torch.manual_seed(0)
    proj = lowprec.Linear(WIDTH, WIDTH, name="model.proj")
    scale = torch.ones(WIDTH)
    scale[3] = 1e4
    try:
        for _ in range(steps):
            with lowprec.fp8_autocast(fp8_recipe=lowprec.DelayedScaling()):
                proj(torch.randn(TOKENS * 8, WIDTH) * scale).float().sum().backward()
            debug_api.step()
    finally:
        debug_api.end_debug()


def scaled_weight_run(log_dir: Path, steps: int = 6) -> None:
    """Magnitudes only (max and std of weights and activations), as a run without FP8 statistics logs them."""
    magnitudes = {"LogTensorStats": {"enabled": True, "tensors": ["weight", "activation"], "stats": ["max", "std"]}}
    config = {"weights": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "transformer_engine": magnitudes}}
    debug_api.initialize(config_file=config, feature_dirs=[lowprec.FEATURE_DIR], log_dir=str(log_dir))
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH)) for _ in range(4))
    model = lowprec.convert(torch.nn.ModuleDict({"layers": blocks}))
    with torch.no_grad():
        model.layers[2][0].weight.mul_(1e4)
    try:
        for _ in range(steps):
            x = torch.randn(TOKENS, WIDTH)
            with lowprec.fp8_autocast(fp8_recipe=lowprec.Float8CurrentScaling()):
                for block in model.layers:
                    x = torch.tanh(block(x))
            x.sum().backward()
            debug_api.step()
    finally:
        debug_api.end_debug()


MIXED_PLAN = {
    "rules": [
        {"layers": {"exact_layer_names": ["model.nvfp4"]}, "recipe": {"name": "nvfp4", "disable_stochastic_rounding": True}},
        {"layers": {"exact_layer_names": ["model.mixed"]}, "fprop": "mxfp8", "dgrad": "nvfp4", "wgrad": "nvfp4"},
        {"layers": {"exact_layer_names": ["model.hp"]}, "recipe": "high_precision"},
    ]
}
MIXED_LAYERS = ("fp8", "nvfp4", "mixed", "hp")


def mixed_formats_run(log_dir: Path, steps: int = 6) -> None:
    """The four layers of ``MIXED_PLAN`` trained ``steps`` steps (see the module's docstring)."""
    ranges = {"LogTensorStats": {"enabled": True, "tensors": ["activation", "gradient", "weight"], "stats": ["dynamic_range"]}}
    losses = {"LogFp8TensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["underflows%"]}}
    config = {
        "ranges": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "transformer_engine": ranges},
        "losses": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": "model.(fp8|nvfp4|mixed)"},
            "transformer_engine": losses,
        },
    }
    debug_api.initialize(config_file=config, feature_dirs=[lowprec.FEATURE_DIR], log_dir=str(log_dir))
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    layers = {name: lowprec.Linear(WIDTH, WIDTH, name=f"model.{name}") for name in MIXED_LAYERS}

    def spanning(bits: float) -> torch.Tensor:
        return torch.exp2(-bits * torch.rand(TOKENS, WIDTH, generator=gen)) * torch.randn(TOKENS, WIDTH, generator=gen).sign()

    try:
        for _ in range(steps):
            with lowprec.autocast(recipe=lowprec.Float8CurrentScaling(), plan=MIXED_PLAN):
                outputs = [layers[name](spanning(26)) for name in MIXED_LAYERS]
            gradients = [spanning(40) if name == "mixed" else torch.randn(TOKENS, WIDTH, generator=gen) for name in MIXED_LAYERS]
            torch.autograd.backward(outputs, gradients)
            debug_api.step()
    finally:
        debug_api.end_debug()
