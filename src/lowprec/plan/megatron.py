"""Megatron-LM's precision file (``--te-precision-config-file``), read as Megatron reads it.

Its ``configs`` name recipe configs; each has ``transformer_engine_config_type: TEQuantizationParams``, a
``training_recipe`` and optionally an ``evaluation_recipe`` (absent: the training one). A recipe holds at most one
of ``fp8_quantization_recipe`` (``tensorwise``, ``blockwise``, ``mxfp8``; ``delayed`` is refused as Megatron
refuses it; ``custom`` needs Python code from a path and is not supported here) and ``fp4_quantization_recipe``
(``nvfp4``); neither is high precision. ``fp8_format`` (``e4m3`` or ``hybrid``) applies to the FP8 ones.
``override_quantized_autocast`` (default true) and ``override_nonquantized_autocast`` (default false) say whether it
replaces the recipe of a quantizing autocast, and whether it quantizes a layer no autocast quantizes.
``fp8_param``, ``fp4_param`` (weights kept in low precision) and ``tp_only_amax_red`` have no lowprec counterpart and
are warned about when set.

Its ``matchers`` (in order; the first enabled one that matches a layer name chooses its config) each have ``config``,
``type: glob`` and ``pattern`` (shell-style, ``fnmatch``); one without ``enabled: true`` is skipped, as in Megatron.

Mapping to lowprec: ``tensorwise`` -> ``Float8CurrentScaling``, ``blockwise`` -> ``Float8BlockScaling``, ``mxfp8`` ->
``MXFP8BlockScaling``, ``nvfp4`` -> ``NVFP4BlockScaling``, each with its Transformer Engine defaults.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from lowprec.errors import LowprecError
from lowprec.plan.rules import AS_TRAINING, GemmRecipes, GlobSelector, Override, PrecisionPlan, Rule
from lowprec.recipe import Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling, Recipe
from nvdlfw_inspect.errors import ConfigLocation, ErrorCollector

TOP_KEYS = ("configs", "matchers")
CONFIG_TYPE_KEY = "transformer_engine_config_type"
CONFIG_TYPES = ("TEQuantizationParams",)
CONFIG_KEYS = (CONFIG_TYPE_KEY, "training_recipe", "evaluation_recipe")
RECIPE_KEYS = (
    "fp8_quantization_recipe",
    "fp4_quantization_recipe",
    "custom_recipe_factory",
    "fp8_format",
    "override_quantized_autocast",
    "override_nonquantized_autocast",
    "tp_only_amax_red",
    "fp8_param",
    "fp4_param",
)
FP8_RECIPES = {"tensorwise": Float8CurrentScaling, "blockwise": Float8BlockScaling, "mxfp8": MXFP8BlockScaling}
FP4_RECIPES = {"nvfp4": NVFP4BlockScaling}
FP8_FORMATS = {"e4m3": Format.E4M3, "hybrid": Format.HYBRID}
MATCHER_KEYS = ("config", "type", "pattern", "enabled")
MATCHER_TYPES = ("glob",)
UNSUPPORTED_OPTIONS = ("fp8_param", "fp4_param", "tp_only_amax_red")


def looks_like_megatron(raw: Mapping) -> bool:
    """Whether a config mapping is Megatron's precision file (it has ``configs`` or ``matchers``)."""
    return any(key in raw for key in TOP_KEYS)


def parse_megatron(raw: Mapping, location: ConfigLocation) -> PrecisionPlan:
    """The plan of Megatron's precision file ``raw``; layers no enabled matcher selects keep the autocast's recipe."""
    collector = ErrorCollector()
    for key in raw:
        if key not in TOP_KEYS:
            warnings.warn(
                f"{location.source}: key '{location.child(key).key_path}' is not read (Megatron's precision file has "
                f"{' and '.join(TOP_KEYS)} only)",
                stacklevel=3,
            )
    configs: dict[str, tuple[Recipe | None, Override, Any, Override]] = {}
    raw_configs = raw.get("configs") or {}
    if not isinstance(raw_configs, Mapping):
        raise location.child("configs").error("must be a mapping of config names to configs", raw_configs)
    for name, config in raw_configs.items():
        with collector.check():
            configs[name] = _parse_config(config, location.child("configs").child(name))
    rules: list[Rule] = []
    raw_matchers = raw.get("matchers") or {}
    if not isinstance(raw_matchers, Mapping):
        raise location.child("matchers").error("must be a mapping of matcher names to matchers", raw_matchers)
    for name, matcher in raw_matchers.items():
        with collector.check():
            rule = _parse_matcher(name, matcher, location.child("matchers").child(name), configs, raw_configs)
            if rule is not None:
                rules.append(rule)
    collector.raise_errors()
    return PrecisionPlan(tuple(rules), source=location.source, dialect="megatron")


def _parse_config(config: Any, location: ConfigLocation) -> tuple[Recipe | None, Override, Any, Override]:
    """``(training recipe, its override, evaluation recipe or AS_TRAINING, its override)``."""
    if not isinstance(config, Mapping):
        raise location.error("a config must be a mapping", config, CONFIG_KEYS)
    collector = ErrorCollector()
    for key in config:
        if key not in CONFIG_KEYS:
            collector.add(location.child(key).error("unknown key of a TEQuantizationParams config", key, CONFIG_KEYS))
    if CONFIG_TYPE_KEY not in config:
        collector.add(location.error(f"missing required key '{CONFIG_TYPE_KEY}'", dict(config), CONFIG_KEYS))
    elif config[CONFIG_TYPE_KEY] not in CONFIG_TYPES:
        collector.add(location.child(CONFIG_TYPE_KEY).error("unsupported config type", config[CONFIG_TYPE_KEY], CONFIG_TYPES))
    if "training_recipe" not in config:
        collector.add(location.error("missing required key 'training_recipe'", dict(config), CONFIG_KEYS))
    training, training_override = None, Override(True, False)
    eval_choice, eval_override = AS_TRAINING, training_override
    with collector.check():
        if "training_recipe" in config:
            training, training_override = _parse_recipe(config["training_recipe"], location.child("training_recipe"))
    with collector.check():
        if "evaluation_recipe" in config:
            eval_choice, eval_override = _parse_recipe(config["evaluation_recipe"], location.child("evaluation_recipe"))
    collector.raise_errors()
    if eval_choice is AS_TRAINING:
        eval_override = training_override
    return training, training_override, eval_choice, eval_override


def _flag(recipe: Mapping, key: str, default: bool, location: ConfigLocation) -> bool:
    value = recipe.get(key, default)
    if not isinstance(value, bool):
        raise location.child(key).error("must be a boolean", value, [True, False])
    return value


def _parse_recipe(recipe: Any, location: ConfigLocation) -> tuple[Recipe | None, Override]:
    if recipe is None:
        recipe = {}
    if not isinstance(recipe, Mapping):
        raise location.error("a TEQuantizationRecipe must be a mapping ({} for high precision)", recipe, RECIPE_KEYS)
    for key in recipe:
        if key not in RECIPE_KEYS:
            raise location.child(key).error("unknown key of a TEQuantizationRecipe", key, RECIPE_KEYS)
    override = Override(
        _flag(recipe, "override_quantized_autocast", True, location),
        _flag(recipe, "override_nonquantized_autocast", False, location),
    )
    for key in UNSUPPORTED_OPTIONS:
        if _flag(recipe, key, False, location):
            warnings.warn(
                f"{location.source}: key '{location.child(key).key_path}': lowprec has no counterpart; ignored", stacklevel=5
            )
    fp8, fp4 = recipe.get("fp8_quantization_recipe"), recipe.get("fp4_quantization_recipe")
    if fp8 is not None and fp4 is not None:
        raise location.error(
            "fp8_quantization_recipe and fp4_quantization_recipe are mutually exclusive", {"fp8": fp8, "fp4": fp4}
        )
    fmt = recipe.get("fp8_format", "e4m3")
    if fmt not in FP8_FORMATS:
        raise location.child("fp8_format").error("unsupported fp8_format", fmt, FP8_FORMATS)
    if fp8 is not None:
        if fp8 not in FP8_RECIPES:
            why = {
                "delayed": "delayed scaling is not in scope of Megatron's per-module precision file",
                "custom": "a custom recipe factory (Python code) is not supported by lowprec",
            }.get(fp8, "unknown fp8_quantization_recipe")
            raise location.child("fp8_quantization_recipe").error(why, fp8, FP8_RECIPES)
        return _made(FP8_RECIPES[fp8], location, fp8_format=FP8_FORMATS[fmt]), override
    if fp4 is not None:
        if fp4 not in FP4_RECIPES:
            why = (
                "a custom recipe factory (Python code) is not supported by lowprec"
                if fp4 == "custom"
                else "unknown fp4_quantization_recipe"
            )
            raise location.child("fp4_quantization_recipe").error(why, fp4, FP4_RECIPES)
        return _made(FP4_RECIPES[fp4], location), override
    return None, override


def _made(cls: type[Recipe], location: ConfigLocation, **kwargs: Any) -> Recipe:
    try:
        return cls(**kwargs)
    except LowprecError as err:
        raise location.error(f"{cls.__name__} refuses these options: {err}", kwargs) from None


def _parse_matcher(name: Any, matcher: Any, location: ConfigLocation, configs: dict, raw_configs: Mapping) -> Rule | None:
    if not isinstance(matcher, Mapping):
        raise location.error("a matcher must be a mapping", matcher, MATCHER_KEYS)
    unknown = [key for key in matcher if key not in MATCHER_KEYS]
    if unknown:
        names, read = ", ".join(map(str, unknown)), ", ".join(MATCHER_KEYS)
        warnings.warn(f"{location.source}: key '{location.key_path}': {names} not read (Megatron reads {read})", stacklevel=4)
    enabled = matcher.get("enabled", False)
    if not isinstance(enabled, bool):
        raise location.child("enabled").error("must be a boolean", enabled, [True, False])
    if not enabled:
        return None
    for key in ("type", "pattern", "config"):
        if key not in matcher:
            raise location.error(f"missing required key '{key}'", dict(matcher), MATCHER_KEYS)
    if matcher["type"] not in MATCHER_TYPES:
        raise location.child("type").error("unsupported matcher type", matcher["type"], MATCHER_TYPES)
    pattern = matcher["pattern"]
    if not isinstance(pattern, str):
        raise location.child("pattern").error("must be a glob pattern string", pattern)
    config = matcher["config"]
    if config not in raw_configs:
        raise location.child("config").error("names no config", config, list(raw_configs))
    if config not in configs:
        raise location.child("config").error("names a config that has errors (see them)", config)
    training, training_override, eval_choice, eval_override = configs[config]
    return Rule(
        f"matcher {name!r} (glob {pattern!r} -> config {config!r})",
        GlobSelector(pattern),
        GemmRecipes.every(training),
        eval_choice,
        training_override,
        eval_override,
    )
