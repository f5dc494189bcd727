"""Config sections that select no layer. Such a section does nothing, and nothing else would say so: a
selector written for another model (``layer_types: [fc1]`` where the layers are ``model.0`` and ``model.2``)
logs no statistic and raises no error. Each is warned about once, as soon as the layer names are known:
when ``infer_and_assign_layer_names`` names the model, else at the end of the first ``step()``.

Likewise a section whose features are in a namespace its layers never call: ``LogTensorStats`` written
directly in the section is the ``base`` namespace's, which ``lowprec`` layers do not call (they call
``transformer_engine``). Warned about at the end of the first ``step()``, naming the namespace to use.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping, Sequence

from nvdlfw_inspect.config_manager import BASE_NAMESPACE, ConfigManager, ConfigSpec
from nvdlfw_inspect.errors import short_repr
from nvdlfw_inspect.logging import say_once
from nvdlfw_inspect.registry import Registry

TE_NAMESPACE = "transformer_engine"  # the namespace of Transformer Engine's and lowprec's layers
MAX_NAMES_SHOWN = 12
MAX_CLOSEST = 3


def warn_sections_selecting_none_of(layers: Mapping[str, tuple[str, ...]]) -> None:
    """Warn about each section whose selectors match none of ``layers`` (name -> the types it declares),
    the layers of a model just named."""
    specs = [spec for spec in _not_warned() if not any(spec.layer_spec.matches(name, types) for name, types in layers.items())]
    _warn(specs, f"none of the {len(layers)} layers of the model", layers)


def warn_sections_never_matched() -> None:
    """Warn about each section that no layer calling the debug API matched so far (the end of the first step)."""
    layers = ConfigManager.routed_layers
    specs = [spec for spec in _not_warned() if spec.name not in ConfigManager.matched_sections]
    if layers:
        _warn(specs, f"none of the {len(layers)} layers that called the debug API in the first step", layers)
    else:
        none = "no layer: none called the debug API in the first step (are its layers debuggable and named?"
        te = [spec for spec in specs if TE_NAMESPACE in spec.extension_config]
        _warn([spec for spec in specs if spec not in te], f"{none})")
        # a plain PyTorch model's layers call no namespace: said here, as nvdlfw_inspect never imports lowprec
        _warn(
            te,
            f"{none} {TE_NAMESPACE} features are called by Transformer Engine or lowprec layers: if the model is "
            "plain PyTorch, convert it first with model = lowprec.convert(model))",
        )


def warn_features_in_namespaces_not_called() -> None:
    """Warn about each section and namespace of its features that layers it selects never routed a call in while
    calling another namespace (the end of the first step): those features do nothing for them."""
    for spec in ConfigManager.configs.values():
        if spec.layer_spec is None:
            continue
        selected = {
            layer: called
            for layer, called in ConfigManager.routed_namespaces.items()
            if spec.layer_spec.matches(layer, ConfigManager.layer_types.get(layer, ()))
        }
        for namespace, features in spec.extension_config.items():
            missed = {layer: called for layer, called in selected.items() if namespace not in called}
            if missed:
                _warn_namespace_not_called(spec, namespace, sorted(features), missed)


def _warn_namespace_not_called(spec: ConfigSpec, namespace: str, features: list[str], missed: dict[str, set[str]]) -> None:
    called = sorted(set().union(*missed.values()))
    where = " (written directly in the section)" if namespace == BASE_NAMESPACE else ""
    fix = next(
        (f"; write them under '{other}:' in the section" for other in called if _has_features(other, features)),
        f"; features of {', '.join(repr(other) for other in called)}: {_features_of(called)}",
    )
    say_once(
        f"{ConfigManager.source}: section '{spec.name}' configures {features} of namespace '{namespace}'{where}, but "
        f"{len(missed)} layer{'s' if len(missed) > 1 else ''} it selects ({_shown(dict.fromkeys(missed, ()))}) "
        f"called the debug API only in namespace {', '.join(repr(other) for other in called)}; these features do "
        f"nothing for {'them' if len(missed) > 1 else 'it'}{fix}",
        call_site=__name__,
    )


def base_features_on_routed_layers(specs: Sequence[ConfigSpec], routed: Collection[str]) -> list[str]:
    """For ``validate --layers-from``: each section whose base-namespace features select layers of a run whose
    GEMMs a library routed (``routed``: the layers of its routing records a feature or recipe decided). Such
    layers call the library's namespace, so the features do nothing for them, as the run's own warning said."""
    said = []
    for spec in specs:
        features = sorted(spec.extension_config.get(BASE_NAMESPACE, {}))
        selected = [layer for layer in routed if spec.layer_spec.matches(layer)] if features else []
        if not selected:
            continue
        homes = [ns for ns in Registry.data if ns != BASE_NAMESPACE and _has_features(ns, features)]
        fix = f"write them under '{homes[0]}:' in the section" if homes else "write them under the library's namespace"
        said.append(
            f"section '{spec.name}' configures {features} of namespace '{BASE_NAMESPACE}' (written directly in the "
            f"section), but {len(selected)} layer{'s' if len(selected) > 1 else ''} of the run it selects "
            f"({_shown(dict.fromkeys(selected, ()))}) had {'their' if len(selected) > 1 else 'its'} GEMMs routed by "
            f"a library, which calls its own namespace, not '{BASE_NAMESPACE}': these features do nothing for "
            f"{'them' if len(selected) > 1 else 'it'}; {fix}"
        )
    return said


def _has_features(namespace: str, features: list[str]) -> bool:
    data = Registry.data.get(namespace)
    return data is not None and all(feature in data.features for feature in features)


def _features_of(namespaces: list[str]) -> list[str]:
    return sorted({feature for ns in namespaces if ns in Registry.data for feature in Registry.data[ns].features})


def _not_warned() -> list[ConfigSpec]:
    """The loaded sections not warned about yet."""
    warned = ConfigManager.warned_sections
    return [spec for spec in ConfigManager.configs.values() if spec.layer_spec is not None and spec.name not in warned]


def _warn(specs: list[ConfigSpec], what: str, layers: Mapping[str, tuple[str, ...]] | None = None) -> None:
    """Say for each of ``specs`` that it matches ``what``, then (when given) the ``layers``: those closest to the names
    it wrote first, so that the one meant is not hidden in the "... N more" of a long list."""
    for spec in specs:
        ConfigManager.warned_sections.add(spec.name)
        listed = ""
        if layers:
            closest = _closest_names(spec, list(layers))
            listed = (
                f" (did you mean {' or '.join(map(repr, closest))}? all: {_shown(layers)})" if closest else f" ({_shown(layers)})"
            )
        say_once(
            f"{ConfigManager.source}: section '{spec.name}' selects no layer: its selectors "
            f"{short_repr(spec.layer_spec.raw)} match {what}{listed}; its features do nothing",
            call_site=__name__,
        )


def _closest_names(spec: ConfigSpec, names: list[str]) -> list[str]:
    """The layer names closest to each of the section's ``exact_layer_names``: those that end with it or that it ends
    with (a prefix such as ``model.`` that Lightning or PEFT wrappers add, or one too many), else the most similar."""
    found: list[str] = []
    for written in sorted(spec.layer_spec.exact_layer_names or ()):
        ends = [name for name in names if name.endswith(f".{written}") or written.endswith(f".{name}")]
        found += ends[:MAX_CLOSEST] or difflib.get_close_matches(written, names, n=MAX_CLOSEST, cutoff=0.6)
    return list(dict.fromkeys(found))[:MAX_CLOSEST]


def _shown(layers: Mapping[str, tuple[str, ...]]) -> str:
    """Layer names with their declared types in brackets, the first ``MAX_NAMES_SHOWN`` of them."""
    first = list(layers.items())[:MAX_NAMES_SHOWN]
    shown = [f"{name} [{', '.join(types)}]" if types else name for name, types in first]
    if len(layers) > MAX_NAMES_SHOWN:
        shown.append(f"... {len(layers) - MAX_NAMES_SHOWN} more")
    return ", ".join(shown)
