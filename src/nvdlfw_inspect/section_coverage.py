"""Config sections that select no layer. Such a section does nothing, and nothing else would say so: a
selector written for another model (``layer_types: [fc1]`` where the layers are ``model.0`` and ``model.2``)
logs no statistic and raises no error. Each is warned about once, as soon as the layer names are known:
when ``infer_and_assign_layer_names`` names the model, else at the end of the first ``step()``.
"""

from __future__ import annotations

from collections.abc import Mapping

from nvdlfw_inspect.config_manager import ConfigManager, ConfigSpec
from nvdlfw_inspect.errors import short_repr
from nvdlfw_inspect.logging import say_once

MAX_NAMES_SHOWN = 12


def warn_sections_selecting_none_of(layers: Mapping[str, tuple[str, ...]]) -> None:
    """Warn about each section whose selectors match none of ``layers`` (name -> the types it declares),
    the layers of a model just named."""
    specs = [spec for spec in _not_warned() if not any(spec.layer_spec.matches(name, types) for name, types in layers.items())]
    _warn(specs, f"none of the {len(layers)} layers of the model ({_shown(layers)})")


def warn_sections_never_matched() -> None:
    """Warn about each section that no layer calling the debug API matched so far (the end of the first step)."""
    layers = ConfigManager.routed_layers
    specs = [spec for spec in _not_warned() if spec.name not in ConfigManager.matched_sections]
    if layers:
        _warn(specs, f"none of the {len(layers)} layers that called the debug API in the first step ({_shown(layers)})")
    else:
        _warn(specs, "no layer: none called the debug API in the first step (are its layers debuggable and named?)")


def _not_warned() -> list[ConfigSpec]:
    """The loaded sections not warned about yet."""
    warned = ConfigManager.warned_sections
    return [spec for spec in ConfigManager.configs.values() if spec.layer_spec is not None and spec.name not in warned]


def _warn(specs: list[ConfigSpec], what: str) -> None:
    for spec in specs:
        ConfigManager.warned_sections.add(spec.name)
        say_once(
            f"{ConfigManager.source}: section '{spec.name}' selects no layer: its selectors "
            f"{short_repr(spec.layer_spec.raw)} match {what}; its features do nothing",
            call_site=__name__,
        )


def _shown(layers: Mapping[str, tuple[str, ...]]) -> str:
    """Layer names with their declared types in brackets, the first ``MAX_NAMES_SHOWN`` of them."""
    first = list(layers.items())[:MAX_NAMES_SHOWN]
    shown = [f"{name} [{', '.join(types)}]" if types else name for name, types in first]
    if len(layers) > MAX_NAMES_SHOWN:
        shown.append(f"... {len(layers) - MAX_NAMES_SHOWN} more")
    return ", ".join(shown)
