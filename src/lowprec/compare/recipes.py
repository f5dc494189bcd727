"""The recipes ``compare`` knows by name, and which quantization statistics each logs (the quantized ones
are made by ``lowprec.plan.recipes.named_recipe``, the names precision plans use too).

``bf16`` is the usual high-precision baseline, the forward under ``torch.autocast`` to bfloat16; ``fp32``
trains without either. Each FP8 and block recipe logs ``LogFp8TensorStats`` of its own casts, NVFP4
``LogNvfp4TensorStats`` of its own (E2M1 zero codes counted as underflows). The MX family: ``mxfp8``
(Transformer Engine's), ``mxfp8_ocp``, ``mxfp6_e3m2``, ``mxfp6_e2m3`` and ``mxfp4`` (the OCP rule, their
default) and ``mxfp4_nvidia`` (scales rounded up, as the default ``ROUND_UP`` mode of OpenAI's
triton_kernels, which gpt-oss's MXFP4 kernels come from, rounds them).

A precision plan runs as one more entry (``plan_entry``): the layers its rules select in its formats, the others
under the autocast's recipe, high precision (float32, as the quantized runs' unquantized parts) unless a recipe is
named; its ``LogFp8TensorStats`` describe each layer's own format.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lowprec.demo import PLAN_STATS
from lowprec.errors import LowprecValueError
from lowprec.plan import PrecisionPlan
from lowprec.plan.recipes import named_recipe
from lowprec.recipe import Recipe

OWN_STATS = ("underflows%", "mse")


@dataclass(frozen=True)
class Entry:
    """One comparable recipe: its label on the page, how to make it from the seed (None: high precision),
    the quantization statistics it logs, with which feature and under which prefix (``nvfp4_``), the
    ``torch.autocast`` dtype of its forward (None: none), and the precision plan it trains under (None: none;
    ``make`` then gives the recipe of the layers the plan leaves to the autocast)."""

    label: str
    make: Callable[[int], Recipe | None]
    stats: tuple[str, ...] = ()
    feature: str = "LogFp8TensorStats"
    prefix: str = ""
    autocast: torch.dtype | None = None
    plan: PrecisionPlan | None = None


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


PLAN_RUN = "plan"
"""The name of the precision plan's run: its directory and its name on the page."""


def autocast_recipes() -> list[str]:
    """The names a plan run's autocast may take: the quantized recipes (the high-precision ones are the default)."""
    return [name for name, entry in RECIPES.items() if entry.make(0) is not None]


def plan_entry(plan: PrecisionPlan, label: str, recipe: str | None = None) -> Entry:
    """The plan's run, labelled ``plan: <label>``: the layers it leaves to the autocast run ``recipe`` (a name of
    ``autocast_recipes``; None: high precision). Its statistics describe each layer's own format."""
    if recipe is not None and recipe not in autocast_recipes():
        raise LowprecValueError(
            f"the plan run's autocast recipe must be one of {', '.join(autocast_recipes())} (or none: high precision), "
            f"got {recipe!r}"
        )
    make = RECIPES[recipe].make if recipe is not None else (lambda seed: None)
    return Entry(f"plan: {label}", make, PLAN_STATS, plan=plan)
