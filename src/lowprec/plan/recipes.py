"""Recipes by name: the short names lowprec's commands and precision plans share, and recipe specs with options.

A recipe spec is one of:

- a short name: ``delayed``, ``current``, ``mxfp8``, ``block``, ``nvfp4``, ``mxfp8_ocp``, ``mxfp6_e3m2``,
  ``mxfp6_e2m3``, ``mxfp4``, ``mxfp4_nvidia`` (``NAMED``);
- a recipe class name: ``DelayedScaling``, ``Float8CurrentScaling``, ``MXFP8BlockScaling``, ``MXBlockScaling``,
  ``Float8BlockScaling``, ``NVFP4BlockScaling`` (``lowprec.recipe``), each with its defaults;
- ``high_precision`` (or ``bf16``, Megatron's and Transformer Engine's word for it): no cast, the GEMMs run in
  the layer's own dtype (``bf16`` does not cast a float32 layer to bfloat16);
- a mapping ``{name: <one of the above>, <option>: <value>, ...}``: the options are the recipe class's fields
  (``fp8_format`` as ``E4M3``, ``E5M2`` or ``HYBRID``), over the defaults of the name;
- a ``lowprec.Recipe`` object, or None for high precision (a plan given as a Python mapping).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from lowprec.errors import LowprecError, LowprecValueError
from lowprec.recipe import (
    RECIPES,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXBlockScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)
from nvdlfw_inspect.errors import ConfigLocation

NAMED: dict[str, tuple[type[Recipe], dict[str, Any]]] = {
    "delayed": (DelayedScaling, {}),
    "current": (Float8CurrentScaling, {}),
    "mxfp8": (MXFP8BlockScaling, {}),
    "block": (Float8BlockScaling, {}),
    "nvfp4": (NVFP4BlockScaling, {}),
    "mxfp8_ocp": (MXBlockScaling, {"element": "e4m3", "scale_rule": "ocp"}),
    "mxfp6_e3m2": (MXBlockScaling, {"element": "e3m2"}),
    "mxfp6_e2m3": (MXBlockScaling, {"element": "e2m3"}),
    "mxfp4": (MXBlockScaling, {"element": "e2m1"}),
    "mxfp4_nvidia": (MXBlockScaling, {"element": "e2m1", "scale_rule": "nvidia"}),
}
"""Short recipe names: the class and the options it is made with."""

CLASSES: dict[str, type[Recipe]] = {cls.__name__: cls for cls in RECIPES}
HIGH_PRECISION_NAMES = ("high_precision", "bf16")
"""Names of no cast at all: the layer's GEMMs run in its own dtype."""

ALL_NAMES = (*HIGH_PRECISION_NAMES, *NAMED, *CLASSES)


def named_recipe(name: str, **options: Any) -> Recipe:
    """The recipe of short or class name ``name`` with ``options`` over its defaults; a ``LowprecValueError``
    names the known names, or the recipe's own complaint about an option."""
    cls, defaults = _class_of(name)
    if cls is None:
        raise LowprecValueError(f"unknown recipe {name!r}; known: {', '.join(ALL_NAMES)}")
    unknown = [key for key in options if key not in _fields(cls)]
    if unknown:
        raise LowprecValueError(
            f"{cls.__name__} has no option {', '.join(map(repr, unknown))}; its options: {', '.join(_fields(cls))}"
        )
    return cls(**{**defaults, **options})


def _class_of(name: str) -> tuple[type[Recipe] | None, dict[str, Any]]:
    if name in NAMED:
        return NAMED[name]
    return CLASSES.get(name), {}


def _fields(cls: type[Recipe]) -> dict[str, dataclasses.Field]:
    return {field.name: field for field in dataclasses.fields(cls)}


def _option(field: dataclasses.Field, value: Any, location: ConfigLocation) -> Any:
    """A config value as the field takes it: a ``Format`` field takes its name too (any case)."""
    if isinstance(field.default, Format) and isinstance(value, str):
        by_name = {fmt.name: fmt for fmt in Format}
        if value.upper() not in by_name:
            raise location.error("unknown format", value, [fmt.name for fmt in Format])
        return by_name[value.upper()]
    return value


def parse_recipe(spec: Any, location: ConfigLocation) -> Recipe | None:
    """The recipe a spec (see the module's docstring) names, None for high precision; a ``ConfigError`` at
    ``location`` names the bad value and what is allowed."""
    if spec is None or isinstance(spec, Recipe):
        return spec
    if isinstance(spec, str):
        return _made(spec, {}, location, location)
    if isinstance(spec, Mapping):
        if "name" not in spec:
            raise location.error("a recipe mapping needs a 'name'", dict(spec), ALL_NAMES)
        options = {key: value for key, value in spec.items() if key != "name"}
        return _made(spec["name"], options, location.child("name"), location)
    raise location.error("must be a recipe name or a mapping {name: ..., <option>: ...}", spec, ALL_NAMES)


def _made(name: Any, options: dict[Any, Any], name_location: ConfigLocation, location: ConfigLocation) -> Recipe | None:
    if not isinstance(name, str) or (name not in ALL_NAMES):
        raise name_location.error("unknown recipe", name, ALL_NAMES)
    if name in HIGH_PRECISION_NAMES:
        if options:
            raise location.error(f"{name!r} (no cast) takes no options", options)
        return None
    cls, defaults = _class_of(name)
    fields = _fields(cls)
    kwargs = dict(defaults)
    for key, value in options.items():
        if key not in fields:
            raise location.child(key).error(f"unknown option of {cls.__name__}", key, list(fields))
        kwargs[key] = _option(fields[key], value, location.child(key))
    try:
        return cls(**kwargs)
    except (LowprecError, TypeError) as err:
        raise location.error(f"{cls.__name__} refuses these options: {err}", {"name": name, **options}) from None


def _changed(recipe: Recipe) -> dict[str, Any]:
    """The options of ``recipe`` that differ from its class's defaults."""
    return {
        field.name: getattr(recipe, field.name)
        for field in dataclasses.fields(recipe)
        if getattr(recipe, field.name) != field.default
    }


def describe(recipe: Recipe | None) -> str:
    """A recipe in a few words, for messages: its class and the options that differ from the defaults (a format by
    its name, ``Format.E4M3``, not its elements' whole repr)."""
    if recipe is None:
        return "high_precision"
    changed = [f"{name}={_short(value)}" for name, value in _changed(recipe).items()]
    return f"{type(recipe).__name__}({', '.join(changed)})"


def spec_of(recipe: Recipe) -> dict[str, Any]:
    """``recipe`` as a plan's recipe spec, ``{name: <class>, <option>: <value>}`` with the options that differ from the
    defaults (a format by its name): what ``parse_recipe`` makes the same recipe of, and what routing records carry
    so that ``diagnose`` can write a remedy that changes one option and keeps the others."""
    options = {name: value.name if isinstance(value, Format) else value for name, value in _changed(recipe).items()}
    return {"name": type(recipe).__name__, **options}


def _short(value: Any) -> str:
    return f"Format.{value.name}" if isinstance(value, Format) else repr(value)
