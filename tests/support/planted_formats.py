"""Short runs of block-format layers with planted losses, each beside a healthy twin in the same format, for the
tests of ``diagnose``'s remedies that keep a format (``nvdlfw_inspect.diagnose.in_format``).

``FORMATS_PLAN`` gives each pair of ``lowprec.Linear`` layers its recipe:
- ``model.nvfp4``: NVFP4 without stochastic rounding; its output gradient has, in every block of 16, six values
  just under a quarter of E2M1's step above zero (0.20 to 0.245 of the block's amax / 6), which round to zero to
  nearest (37.5% of the values, over NVFP4's threshold) and are kept about half the time when rounded stochastically.
- ``model.mxfp4``: MXFP4 (E2M1, OCP scales); half of each block of 32 of its input sits 2**-7 below the block's
  largest value: under E2M1's smallest step, within E3M2's.
- ``model.mxfp8``: MXFP8 (E4M3); half of each block of its input sits 2**-21 below the block's largest value:
  beyond E4M3's 17.8 bits, within E5M2's.
- ``model.mxfp8_ocp``: MXFP8 under the OCP rule (E8M0 scales rounded down); every block of 32 of its input has its
  amax at 1.9 x a power of two, which the floored scale maps to 486, past E4M3's 448: every block saturates.
- ``model.<format>_twin``: the same recipe, Gaussian inputs and gradients.
Statistics: ``underflows%`` of every input tensor (each layer's own format), ``dynamic_range`` of each, and
``saturated_blocks%`` of the OCP layers' activations (not their weights: ``nn.Linear``'s uniform initialisation puts
most blocks' amax just under a power of two too, so the OCP rule saturates them as well, a finding of its own).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

import lowprec
import nvdlfw_inspect.api as debug_api

WIDTH, TOKENS = 64, 32
FORMATS_PLAN = {
    "rules": [
        {
            "layers": {"layer_name_regex_pattern": r"^model\.nvfp4"},
            "recipe": {"name": "nvfp4", "disable_stochastic_rounding": True},
        },
        {"layers": {"layer_name_regex_pattern": r"^model\.mxfp4"}, "recipe": "mxfp4"},
        {"layers": {"layer_name_regex_pattern": r"^model\.mxfp8_ocp"}, "recipe": "mxfp8_ocp"},
        {"layers": {"layer_name_regex_pattern": r"^model\.mxfp8"}, "recipe": "mxfp8"},
    ]
}
PLANTED = ("nvfp4", "mxfp4", "mxfp8", "mxfp8_ocp")
LAYERS = tuple(name for format_ in PLANTED for name in (format_, f"{format_}_twin"))
TENSORS = ["activation", "gradient", "weight"]


def _section(layers: str, activation_losses: list[str]) -> dict[str, Any]:
    losses = [{"tensor": tensor, "stats": activation_losses if tensor == "activation" else ["underflows%"]} for tensor in TENSORS]
    features = {
        "LogTensorStats": {"enabled": True, "tensors": TENSORS, "stats": ["dynamic_range"]},
        "LogFp8TensorStats": {"enabled": True, "tensors_struct": losses},
    }
    return {"enabled": True, "layers": {"layer_name_regex_pattern": layers}, "transformer_engine": features}


STATISTICS = {  # saturated_blocks% of the OCP layers' activations only: uniform weights saturate there too (see above)
    "formats_statistics": _section(r"^model\.(?!mxfp8_ocp)", ["underflows%"]),
    "ocp_statistics": _section(r"^model\.mxfp8_ocp", ["underflows%", "saturated_blocks%"]),
}


def user_config() -> dict[str, Any]:
    """The run's own config: its statistics, and its precision plan under ``precision_plan:``."""
    return {**copy.deepcopy(STATISTICS), "precision_plan": copy.deepcopy(FORMATS_PLAN)}


def _signs(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2, shape, generator=gen).float() * 2 - 1


def _amax_under_a_power_of_two(gen: torch.Generator) -> torch.Tensor:
    """Gaussian blocks of 32, each scaled so that its amax is 1.9 x a power of two."""
    blocks = torch.randn(TOKENS, WIDTH // 32, 32, generator=gen)
    amax = blocks.abs().amax(-1, keepdim=True)
    return (blocks * 1.9 * torch.exp2(amax.log2().floor()) / amax).reshape(TOKENS, WIDTH)


def _nvfp4_gradient(gen: torch.Generator) -> torch.Tensor:
    """Blocks of 16: the amax (6 units), nine values of 1 to 4 units, six of 0.20 to 0.245 units."""
    blocks = torch.empty(TOKENS, WIDTH // 16, 16)
    blocks[..., 0] = 6.0
    blocks[..., 1:10] = 1 + 3 * torch.rand(TOKENS, WIDTH // 16, 9, generator=gen)
    blocks[..., 10:] = 0.20 + 0.045 * torch.rand(TOKENS, WIDTH // 16, 6, generator=gen)
    return (blocks * _signs(blocks.shape, gen)).reshape(TOKENS, WIDTH) * 1e-3


def _two_level(bits: float, gen: torch.Generator) -> torch.Tensor:
    """Blocks of 32: half the values of magnitude 1 to 2, half ``2**-bits`` times that."""
    magnitudes = 1 + torch.rand(TOKENS, WIDTH // 32, 32, generator=gen)
    magnitudes[..., 16:] *= 2.0**-bits
    return (magnitudes * _signs(magnitudes.shape, gen)).reshape(TOKENS, WIDTH)


def formats_run(log_dir: Path, config: dict[str, Any] | str | Path, plan: Any, steps: int = 6) -> None:
    """The eight layers trained ``steps`` steps under ``plan`` (``FORMATS_PLAN``, or a diagnosis's config holding one)
    with the debug ``config`` (``user_config()``, or the one ``diagnose --config`` merged)."""
    config_file = str(config) if isinstance(config, (str, Path)) else config
    debug_api.initialize(config_file=config_file, feature_dirs=[lowprec.FEATURE_DIR], log_dir=str(log_dir))
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    layers = {name: lowprec.Linear(WIDTH, WIDTH, name=f"model.{name}") for name in LAYERS}
    try:
        for _ in range(steps):
            inputs = {name: torch.randn(TOKENS, WIDTH, generator=gen) for name in LAYERS}
            inputs["mxfp4"], inputs["mxfp8"] = _two_level(7, gen), _two_level(21, gen)
            inputs["mxfp8_ocp"] = _amax_under_a_power_of_two(gen)
            gradients = {name: torch.randn(TOKENS, WIDTH, generator=gen) for name in LAYERS}
            gradients["nvfp4"] = _nvfp4_gradient(gen)
            with lowprec.autocast(recipe=lowprec.Float8CurrentScaling(), plan=plan):
                outputs = [layers[name](inputs[name]) for name in LAYERS]
            torch.autograd.backward(outputs, [gradients[name] for name in LAYERS])
            debug_api.step()
    finally:
        debug_api.end_debug()
