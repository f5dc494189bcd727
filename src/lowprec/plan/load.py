"""``load_plan``: a precision plan from a file, a mapping or a plan, in lowprec's format or Megatron's.

The format is told by the keys: a ``precision_plan`` key (a debug config may hold one; only that key is read),
or a mapping of only ``default``, ``eval`` and ``rules``, is lowprec's (``lowprec.plan.format``); ``configs`` or
``matchers`` is Megatron's precision file (``lowprec.plan.megatron``), read as Megatron reads it.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lowprec.errors import LowprecTypeError
from lowprec.plan.format import PLAN_KEYS, parse_plan
from lowprec.plan.megatron import TOP_KEYS, looks_like_megatron, parse_megatron
from lowprec.plan.rules import PrecisionPlan
from nvdlfw_inspect.errors import ConfigError, ConfigLocation

PLAN_KEY = "precision_plan"


def load_plan(source: str | os.PathLike | Mapping | PrecisionPlan) -> PrecisionPlan:
    """The precision plan of a YAML file's path, a mapping, or a ``PrecisionPlan`` (returned as is). Every mistake
    is a ``nvdlfw_inspect.errors.ConfigError`` naming the source, the key path, the value and what is allowed."""
    if isinstance(source, PrecisionPlan):
        return source
    description, raw = _read(source)
    top = ConfigLocation(description)
    if not isinstance(raw, Mapping) or not raw:
        raise top.error(
            f"holds no precision plan: expected a mapping with a '{PLAN_KEY}' key, or Megatron's {' and '.join(TOP_KEYS)}",
            raw,
        )
    if PLAN_KEY in raw:
        return parse_plan(raw[PLAN_KEY], top.child(PLAN_KEY))
    if looks_like_megatron(raw):
        return parse_megatron(raw, top)
    if all(key in PLAN_KEYS for key in raw):
        return parse_plan(raw, top)
    raise top.error(
        f"holds no precision plan: expected a '{PLAN_KEY}' key (or its body: {', '.join(PLAN_KEYS)}), or Megatron's "
        f"{' and '.join(TOP_KEYS)}",
        list(raw),
    )


def _read(source: Any) -> tuple[str, Any]:
    if isinstance(source, Mapping):
        try:
            return "precision plan dict", copy.deepcopy(dict(source))
        except RecursionError:
            raise ConfigError("precision plan dict: nested too deeply") from None
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        description = f"precision plan file {str(path)!r}"
        if not path.is_file():
            raise FileNotFoundError(f"{description} not found or not a file (current directory: {os.getcwd()})")
        from nvdlfw_inspect.config_yaml import load_yaml

        return description, load_yaml(path, description)
    raise LowprecTypeError(
        f"a precision plan must be a YAML file path, a mapping or a lowprec.plan.PrecisionPlan, got {type(source).__name__}"
    )
