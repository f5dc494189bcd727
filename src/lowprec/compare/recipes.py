"""The recipes ``compare`` knows by name, and which ``LogFp8TensorStats`` statistics each can log.

Block recipes have no own-recipe statistics yet, so they log the what-if statistics of their own format
(``mxfp8_...``, ``fp8_block_scaling_...``); NVFP4 has none, and logs only ``LogTensorStats``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lowprec.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)


@dataclass(frozen=True)
class Entry:
    """One comparable recipe: its label on the page, how to make it from the seed (None: high precision),
    and its FP8 statistics as logged (the page strips ``prefix``)."""

    label: str
    make: Callable[[int], Recipe | None]
    fp8_stats: tuple[str, ...]
    prefix: str = ""


RECIPES: dict[str, Entry] = {
    "bf16": Entry("high precision (no FP8)", lambda seed: None, ()),
    "delayed": Entry("FP8 delayed scaling", lambda seed: DelayedScaling(), ("underflows%", "overflows%", "mse")),
    "current": Entry("FP8 current scaling", lambda seed: Float8CurrentScaling(), ("underflows%", "mse")),
    "mxfp8": Entry("MXFP8", lambda seed: MXFP8BlockScaling(), ("mxfp8_underflows%", "mxfp8_mse"), "mxfp8_"),
    "block": Entry(
        "FP8 block scaling",
        lambda seed: Float8BlockScaling(),
        ("fp8_block_scaling_underflows%", "fp8_block_scaling_mse"),
        "fp8_block_scaling_",
    ),
    "nvfp4": Entry("NVFP4", lambda seed: NVFP4BlockScaling(seed=seed), ()),
}


def parse_recipes(names: str | list[str] | tuple[str, ...]) -> list[str]:
    """Recipe names from a list or a comma-separated string, in the order given; unknown, repeated or no
    names are a ``ValueError`` naming the known ones."""
    listed = [name.strip() for name in names.split(",")] if isinstance(names, str) else list(names)
    if not listed or any(not isinstance(name, str) or not name for name in listed):
        raise ValueError(f"recipes must be names from {list(RECIPES)}, got {names!r}")
    unknown = [name for name in listed if name not in RECIPES]
    if unknown:
        raise ValueError(
            f"unknown recipe{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; known: {', '.join(RECIPES)}"
        )
    repeated = sorted({name for name in listed if listed.count(name) > 1})
    if repeated:
        raise ValueError(f"recipe{'s' if len(repeated) > 1 else ''} given twice: {', '.join(repeated)}")
    return listed
