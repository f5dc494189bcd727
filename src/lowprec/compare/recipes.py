"""The recipes ``compare`` knows by name, and which quantization statistics each logs (the quantized ones
are made by ``lowprec.plan.recipes.named_recipe``, the names precision plans use too).

``bf16`` is the usual high-precision baseline, the forward under ``torch.autocast`` to bfloat16; ``fp32``
trains without either. Each FP8 and block recipe logs ``LogFp8TensorStats`` of its own casts, NVFP4
``LogNvfp4TensorStats`` of its own (E2M1 zero codes counted as underflows). The MX family: ``mxfp8``
(Transformer Engine's), ``mxfp8_ocp``, ``mxfp6_e3m2``, ``mxfp6_e2m3`` and ``mxfp4`` (the OCP rule, their
default) and ``mxfp4_nvidia`` (scales rounded up, as the default ``ROUND_UP`` mode of OpenAI's
triton_kernels, which gpt-oss's MXFP4 kernels come from, rounds them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lowprec.errors import LowprecValueError
from lowprec.plan.recipes import named_recipe
from lowprec.recipe import Recipe

OWN_STATS = ("underflows%", "mse")


@dataclass(frozen=True)
class Entry:
    """One comparable recipe: its label on the page, how to make it from the seed (None: high precision),
    the quantization statistics it logs, with which feature and under which prefix (``nvfp4_``), and the
    ``torch.autocast`` dtype of its forward (None: none)."""

    label: str
    make: Callable[[int], Recipe | None]
    stats: tuple[str, ...] = ()
    feature: str = "LogFp8TensorStats"
    prefix: str = ""
    autocast: torch.dtype | None = None


RECIPES: dict[str, Entry] = {
    "bf16": Entry("bf16 (torch.autocast, no FP8)", lambda seed: None, autocast=torch.bfloat16),
    "fp32": Entry("float32 (no FP8)", lambda seed: None),
    "delayed": Entry("FP8 delayed scaling", lambda seed: named_recipe("delayed"), ("underflows%", "overflows%", "mse")),
    "current": Entry("FP8 current scaling", lambda seed: named_recipe("current"), OWN_STATS),
    "mxfp8": Entry("MXFP8", lambda seed: named_recipe("mxfp8"), OWN_STATS),
    "block": Entry("FP8 block scaling", lambda seed: named_recipe("block"), OWN_STATS),
    "nvfp4": Entry("NVFP4", lambda seed: named_recipe("nvfp4", seed=seed), OWN_STATS, "LogNvfp4TensorStats", "nvfp4_"),
    "mxfp8_ocp": Entry("MXFP8 (OCP scales)", lambda seed: named_recipe("mxfp8_ocp"), OWN_STATS),
    "mxfp6_e3m2": Entry("MXFP6 E3M2", lambda seed: named_recipe("mxfp6_e3m2"), OWN_STATS),
    "mxfp6_e2m3": Entry("MXFP6 E2M3", lambda seed: named_recipe("mxfp6_e2m3"), OWN_STATS),
    "mxfp4": Entry("MXFP4", lambda seed: named_recipe("mxfp4"), OWN_STATS),
    "mxfp4_nvidia": Entry("MXFP4 (NVIDIA scales)", lambda seed: named_recipe("mxfp4_nvidia"), OWN_STATS),
}
DEFAULT_RECIPES = ("bf16", "delayed", "current", "mxfp8", "block", "nvfp4")


def parse_recipes(names: str | list[str] | tuple[str, ...]) -> list[str]:
    """Recipe names from a list or a comma-separated string, in the order given; unknown, repeated or no
    names are a ``ValueError`` naming the known ones."""
    listed = [name.strip() for name in names.split(",")] if isinstance(names, str) else list(names)
    if not listed or any(not isinstance(name, str) or not name for name in listed):
        raise LowprecValueError(f"recipes must be names from {list(RECIPES)}, got {names!r}")
    unknown = [name for name in listed if name not in RECIPES]
    if unknown:
        raise LowprecValueError(
            f"unknown recipe{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; known: {', '.join(RECIPES)}"
        )
    repeated = sorted({name for name in listed if listed.count(name) > 1})
    if repeated:
        raise LowprecValueError(f"recipe{'s' if len(repeated) > 1 else ''} given twice: {', '.join(repeated)}")
    return listed
