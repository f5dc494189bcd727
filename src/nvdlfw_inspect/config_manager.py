"""Config loading: YAML file or dict -> validated sections; which features apply to a layer.

Everything that can be checked without running the model is checked at load time, and every error
names the source, the key path, the bad value and what is allowed.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from nvdlfw_inspect.errors import ConfigError, ConfigLocation, ErrorCollector, is_int
from nvdlfw_inspect.regex_safety import SAFE_FORMS, backtracks

BASE_NAMESPACE = "base"
SECTION_KEYS = ("enabled", "layers")
# Top-level keys of a debug config that belong to another tool reading the same file: skipped, and said so.
OTHER_TOOLS_KEYS = {"precision_plan": "lowprec's precision plan (lowprec.plan.load_plan reads it from this file)"}
SELECTOR_KEYS = (
    "layer_numbers",
    "layer_types",
    "exact_layer_names",
    "layer_name_regex_pattern",
    "layer_type_regex_pattern",
)
# A whole ASCII digit run that does not follow "fc" (so "fc1" and "fc12" carry no layer number).
_DIGITS_NOT_AFTER_FC = re.compile(r"(?<!fc)(?<![0-9])[0-9]+")
_ASCII_DIGITS = re.compile(r"[0-9]+")


def require_bool(value: Any, location: ConfigLocation) -> bool:
    if not isinstance(value, bool):
        raise location.error("must be a boolean", value, [True, False])
    return value


def extract_layer_number(layer_name: str) -> int | None:
    """The layer number in a name, or None when it has none.

    The last dot-separated part made only of digits wins (``decoder.layers.3.mlp.fc1`` -> 3); without
    one, a single digit run not directly after ``fc`` is used (``Layer_3`` -> 3; ``fc1``, ``fc12`` -> None).
    """
    parts = [p for p in layer_name.split(".") if _ASCII_DIGITS.fullmatch(p)]
    if parts:
        return int(parts[-1])
    found = _DIGITS_NOT_AFTER_FC.findall(layer_name)
    return int(found[0]) if len(found) == 1 else None


def _parse_number_item(item: Any, location: ConfigLocation) -> range | None:
    """One ``layer_numbers`` entry: an int, ``"N"``, ``"A-B"`` (inclusive) or ``"all"`` (returned as None)."""
    allowed = "a non-negative int, a string 'A-B' (inclusive range), or 'all'"
    if is_int(item):
        if item < 0:
            raise location.error("layer numbers cannot be negative", item, allowed)
        return range(item, item + 1)
    if isinstance(item, str):
        text = item.strip()
        if text.lower() == "all":
            return None
        if _ASCII_DIGITS.fullmatch(text):
            return range(int(text), int(text) + 1)
        bounds = text.split("-")
        if len(bounds) == 2 and all(_ASCII_DIGITS.fullmatch(b.strip()) for b in bounds):
            low, high = int(bounds[0]), int(bounds[1])
            if low > high:
                raise location.error("range start is greater than its end", item, allowed)
            return range(low, high + 1)
    raise location.error("invalid layer number", item, allowed)


def _as_string_list(value: Any, location: ConfigLocation, what: str) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(i, str) and i for i in items):
        raise location.error(f"must be a non-empty {what} or list of them", value)
    return items


def _compile(pattern: Any, location: ConfigLocation) -> re.Pattern:
    """A layer regex of the config, refused when invalid or when its matching time explodes with the name's
    length: Python's ``re`` has no time limit, and the first routing call of a layer would hang the training."""
    if not isinstance(pattern, str):
        raise location.error("must be a regular expression string", pattern)
    try:
        compiled = re.compile(pattern)
        explodes = backtracks(pattern)
    except re.error as err:
        raise location.error(f"invalid regular expression ({err})", pattern) from None
    except RecursionError:
        raise location.error("regular expression nested too deeply for Python's re", pattern) from None
    if explodes:
        raise location.error(
            "this regular expression can take time that explodes with the length of a layer name it does not match "
            "(catastrophic backtracking: it repeats a part that can itself match in more than one way, and Python's "
            "re tries every way), so the first call of such a layer would hang",
            pattern,
            SAFE_FORMS,
        )
    return compiled


class LayerSpec:
    """The ``layers:`` selector of a section.

    Precedence follows the reference: ``exact_layer_names`` alone, else ``layer_name_regex_pattern``
    alone (unanchored search), else ``layer_numbers`` AND ``layer_types`` (either may be absent).
    ``layer_types`` match a substring of the layer name or, exactly, one of the types the layer declared
    with ``ConfigManager.set_layer_types``; ``layer_type_regex_pattern`` is searched in both.
    """

    def __init__(self, layers: Any, location: ConfigLocation):
        if not isinstance(layers, dict):
            raise location.error("must be a mapping of layer selectors", layers, SELECTOR_KEYS)
        self.raw = dict(layers)
        self.exact_layer_names: frozenset[str] | None = None
        self.name_regex: re.Pattern | None = None
        self.all_numbers = False
        self.numbers: list[range] | None = None
        self.type_regex: re.Pattern | None = None
        self.type_names: frozenset[str] | None = None
        self.all_types = False
        collector = ErrorCollector()
        for key in layers:
            if key not in SELECTOR_KEYS:
                collector.add(location.child(key).error("unknown layer selector", key, SELECTOR_KEYS))
        if not collector.errors and not any(key in layers for key in SELECTOR_KEYS[:4]):  # a misspelt one says it all
            collector.add(location.error("needs at least one layer selector", layers, SELECTOR_KEYS[:4]))
        with collector.check():
            if "exact_layer_names" in layers:
                names = _as_string_list(layers["exact_layer_names"], location.child("exact_layer_names"), "layer name")
                self.exact_layer_names = frozenset(names)
        with collector.check():
            if "layer_name_regex_pattern" in layers:
                self.name_regex = _compile(layers["layer_name_regex_pattern"], location.child("layer_name_regex_pattern"))
        with collector.check():
            if "layer_numbers" in layers:
                self._parse_numbers(layers["layer_numbers"], location.child("layer_numbers"))
        with collector.check():
            self._parse_types(layers, location)
        collector.raise_errors()
        self.ignored_keys = self._ignored_keys()

    def _parse_types(self, layers: dict, location: ConfigLocation) -> None:
        if "layer_types" in layers and "layer_type_regex_pattern" in layers:
            raise location.error(
                "give either 'layer_types' or 'layer_type_regex_pattern', not both",
                {k: layers[k] for k in ("layer_types", "layer_type_regex_pattern")},
            )
        if "layer_types" in layers:
            types = _as_string_list(layers["layer_types"], location.child("layer_types"), "layer type")
            self.all_types = "all" in types
            self.type_names = frozenset(types)
            self.type_regex = re.compile("|".join(re.escape(t) for t in types))
        if "layer_type_regex_pattern" in layers:
            self.type_regex = _compile(layers["layer_type_regex_pattern"], location.child("layer_type_regex_pattern"))

    def _parse_numbers(self, value: Any, location: ConfigLocation) -> None:
        items = value if isinstance(value, list) else [value]
        if not items:
            raise location.error("must not be empty", value)
        ranges = [_parse_number_item(item, location) for item in items]
        self.all_numbers = any(r is None for r in ranges)
        self.numbers = [r for r in ranges if r is not None]

    def _ignored_keys(self) -> list[str]:
        """Selectors present but overridden by a stronger one (reported as a warning at load)."""
        given = [k for k in SELECTOR_KEYS if k in self.raw]
        if self.exact_layer_names is not None:
            return [k for k in given if k != "exact_layer_names"]
        if self.name_regex is not None:
            return [k for k in given if k != "layer_name_regex_pattern"]
        return []

    def matches(self, layer_name: str, layer_types: tuple[str, ...] = ()) -> bool:
        if self.exact_layer_names is not None:
            return layer_name in self.exact_layer_names
        if self.name_regex is not None:
            return self.name_regex.search(layer_name) is not None
        number_ok = True
        if self.numbers is not None and not self.all_numbers:
            number = extract_layer_number(layer_name)
            number_ok = number is not None and any(number in r for r in self.numbers)
        type_ok = True
        if self.type_regex is not None and not self.all_types:
            type_ok = self.type_regex.search(layer_name) is not None or any(
                t in self.type_names if self.type_names is not None else self.type_regex.search(t) is not None
                for t in layer_types
            )
        return number_ok and type_ok

    def signature(self) -> tuple:
        """Equal for two specs that select exactly the same layers by construction."""
        return tuple(sorted((k, repr(v)) for k, v in self.raw.items()))


class ConfigSpec:
    """One enabled section: its name, layer selector and ``{namespace: {Feature: raw config}}``.

    The loader builds it whole; code written for the reference builds it empty (``ConfigSpec()``), fills
    it with ``initialize(section)`` and empties it with ``reset()``, so both ways are supported.
    """

    def __init__(
        self,
        name: str = "",
        layer_spec: LayerSpec | None = None,
        extension_config: dict[str, dict[str, dict]] | None = None,
    ):
        self.name = name
        self.enabled = True  # the loader keeps enabled sections only
        self.layer_spec = layer_spec
        self.extension_config = {} if extension_config is None else extension_config

    def initialize(self, cfg: Any) -> None:
        """Take ``enabled`` and the ``layers`` selector from a section dict. Its features are not read:
        checking them needs the registered namespaces, which is ``ConfigManager.load_config``'s work."""
        location = ConfigLocation(f"config section {self.name!r}" if self.name else "config section")
        if not isinstance(cfg, dict):
            raise location.error("a section must be a mapping with 'enabled' and 'layers'", cfg)
        for key in SECTION_KEYS:
            if key not in cfg:
                raise location.error(f"missing required key '{key}'")
        self.enabled = require_bool(cfg["enabled"], location.child("enabled"))
        self.layer_spec = LayerSpec(cfg["layers"], location.child("layers"))

    def features(self) -> list[tuple[str, str]]:
        """``(namespace, Feature)`` of each feature the section configures, enabled or not (either way it claims
        the feature for its layers)."""
        return [(ns, feature) for ns, features in self.extension_config.items() for feature in features]

    def reset(self) -> None:
        """Forget the selector and features, leaving the spec as ``ConfigSpec()`` made it."""
        self.enabled = True
        self.layer_spec = None
        self.extension_config = {}


def _read_config(config: Any) -> tuple[str, Any]:
    """Return ``(source description, parsed content)`` for a file path or a dict."""
    if isinstance(config, dict):
        try:
            # A private copy: later changes to the caller's dict cannot bypass validation.
            return "config dict", copy.deepcopy(config)
        except RecursionError:
            raise ConfigError("config dict: nested too deeply") from None
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        source = f"config file {str(path)!r}"
        if path.is_dir():
            raise FileNotFoundError(f"{source} is a directory; give the path of a YAML file")
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {str(path)!r} (current directory: {os.getcwd()})")
        from nvdlfw_inspect.config_yaml import load_yaml  # PyYAML loads only when a file is read

        return source, load_yaml(path, source)
    raise TypeError(f"config must be a file path (str or pathlib.Path) or a dict, got {type(config).__name__}")


def _read_sections(config: Any) -> tuple[str, dict, ConfigLocation]:
    """The config's source description, its sections, and the location of its top level."""
    source, raw = _read_config(config)
    top = ConfigLocation(source)
    if raw is None or raw == {}:
        raise top.error("the config is empty; it needs at least one section with 'enabled' and 'layers'")
    if not isinstance(raw, dict):
        raise top.error("the config must be a mapping of section names to sections", type(raw).__name__)
    return source, raw, top


def read_sections(config: Any) -> tuple[str, dict]:
    """The config's source description and its sections, read as ``initialize`` reads them (YAML errors name the
    file and line; an empty config, or one that is no mapping, is a ``ConfigError``)."""
    source, raw, _ = _read_sections(config)
    return source, raw


def _parse_sections(
    raw: dict,
    top: ConfigLocation,
    registry_data: dict,
    unusable: Mapping[str, str],
    warnings: list[str],
    layers: Sequence[str] = (),
) -> tuple[list[ConfigSpec], list[ConfigError]]:
    """The enabled sections' specs and every error: each section, feature and key is checked on its own; given
    ``layers`` (the names a run logged), two sections configuring one feature for one of them is an error too."""
    specs: list[ConfigSpec] = []
    collector = ErrorCollector()
    for name, section in raw.items():
        with collector.check():
            spec = _parse_section(str(name), section, top.child(name), registry_data, unusable, warnings)
            if spec is not None:
                specs.append(spec)
    for error in conflicts_on_layers(specs, top, layers):
        collector.add(error)
    return specs, collector.errors


def conflicts_on_layers(specs: Sequence[ConfigSpec], top: ConfigLocation, layers: Sequence[str]) -> list[ConfigError]:
    """Each two sections that configure one feature for one of ``layers``: the error routing that layer raises.
    Only real names decide it: selectors that could overlap on a name no layer has are no conflict (the reference
    loads such configs), so this is checked at routing and, given a run's names, by ``validate --layers-from``."""
    shared: dict[tuple[str, str], list[str]] = {}  # (first, second) -> their layers, in order
    for layer in layers:
        owner: dict[tuple[str, str], str] = {}
        for spec in specs:
            if not spec.layer_spec.matches(layer):
                continue
            for feature in spec.features():
                first = owner.setdefault(feature, spec.name)
                if first != spec.name:
                    shared.setdefault((first, spec.name), []).append(layer)
    errors = []
    for (first, second), names in shared.items():
        both = sorted(set(configured_by(specs, first)) & set(configured_by(specs, second)))
        errors.append(
            top.error(
                f"sections '{first}' and '{second}' both configure {both} for layers of the run such as "
                f"{list(dict.fromkeys(names))[:5]}; a layer may get each feature from one section only"
            )
        )
    return errors


def configured_by(specs: Sequence[ConfigSpec], name: str) -> list[str]:
    """The features (``namespace.Feature``) of the section called ``name``."""
    return [f"{ns}.{feature}" for spec in specs if spec.name == name for ns, feature in spec.features()]


def named_overlaps(specs: Sequence[ConfigSpec]) -> list[str]:
    """Each two sections that configure one feature for the same layers by construction: the same selector, or
    an exact layer name both give. Only advice: routing a layer both select raises (as in the reference), a name
    no layer has never does. Found by hashing, in time linear in the sections, so ``initialize`` checks any config
    (``section_overlaps.possible_overlaps`` compares every pair, for ``validate``)."""
    first_of: dict[tuple, str] = {}
    found: dict[tuple[str, str], tuple[set[str], str]] = {}  # (first, second) -> (features, which layers)
    for spec in specs:
        names = sorted(spec.layer_spec.exact_layer_names or ())
        keys = [(("selector", spec.layer_spec.signature()), "the same layers")]
        keys += [(("name", name), f"layer {name!r}") for name in names]
        for namespace, feature in spec.features():
            for key, which in keys:
                first = first_of.setdefault((namespace, feature, key), spec.name)
                if first != spec.name:
                    features, _ = found.setdefault((first, spec.name), (set(), which))
                    features.add(f"{namespace}.{feature}")
    return [
        f"sections '{first}' and '{second}' both configure {sorted(features)} for {which}: routing a layer both select "
        "raises an error (a layer may get each feature from one section only); merge the two sections or narrow "
        "one's selector"
        for (first, second), (features, which) in found.items()
    ]


class ConfigCheck(NamedTuple):
    """What checking a config found: its errors, its warnings (selectors ignored, every section disabled), its
    enabled sections (meaningful when there is no error), its source and the names of all its sections."""

    errors: list[ConfigError]
    warnings: list[str]
    specs: list[ConfigSpec]
    source: str = ""
    section_names: list[str] = []


def check_config(
    config: Any, registry_data: dict, unusable: Mapping[str, str] | None = None, layers: Sequence[str] = ()
) -> ConfigCheck:
    """Every error of ``config`` at once (see ``_parse_sections``) with its warnings; ``unusable``: the namespaces
    set aside at loading (``Registry.unusable``) -> why, named in the error of a section using one; ``layers``:
    layer names (a run's) on which two sections must not both configure a feature."""
    try:
        source, raw, top = _read_sections(config)
    except ConfigError as error:
        return ConfigCheck([error], [], [])
    warnings: list[str] = []
    for key in OTHER_TOOLS_KEYS.keys() & raw.keys():
        raw = {name: section for name, section in raw.items() if name != key}
        warnings.append(f"{source}: key '{key}' is no debug section but {OTHER_TOOLS_KEYS[key]}: the debug framework skips it")
    specs, errors = _parse_sections(raw, top, registry_data, unusable or {}, warnings, layers)
    if not specs and not errors:
        warnings.append(f"{source}: every section is disabled; no feature is active")
    return ConfigCheck(errors, warnings, specs, source, [str(name) for name in raw])


def find_config_errors(
    config: Any, registry_data: dict, unusable: Mapping[str, str] | None = None, layers: Sequence[str] = ()
) -> list[ConfigError]:
    """The errors of ``check_config``."""
    return check_config(config, registry_data, unusable, layers).errors


def _first_with_the_others(errors: list[ConfigError]) -> ConfigError:
    """The first error, raised by ``initialize`` as ever, with the others in a note of its traceback."""
    first = errors[0]
    if len(errors) > 1:
        others = "\n".join(f"  {error}" for error in errors[1:])
        first.add_note(f"{len(errors) - 1} more error{'s' if len(errors) > 2 else ''} in the config:\n{others}")
    return first


class ConfigManager:
    """Holds the validated sections of the current run and answers which features apply to a layer."""

    configs: dict[str, ConfigSpec] = {}
    layer_name_to_config_cache: dict[str, dict] = {}
    layer_types: dict[str, tuple[str, ...]] = {}
    source: str = ""
    section_names: list[str] = []
    warnings: list[str] = []
    # What routing learned (``section_coverage`` warns about sections that select no layer):
    routed_layers: dict[str, tuple[str, ...]] = {}  # layers that asked which features apply -> their types
    matched_sections: set[str] = set()  # sections that selected one of them
    routed_namespaces: dict[str, set[str]] = {}  # layer -> the namespaces it routed a call in
    warned_sections: set[str] = set()  # sections already warned about

    @classmethod
    def load_config(cls, config: Any, registry_data: dict, unusable: Mapping[str, str] | None = None) -> None:
        """Parse and validate ``config`` against the registered namespaces and features (``unusable``: as in
        ``find_config_errors``)."""
        checked = check_config(config, registry_data, unusable)
        if checked.errors:
            raise _first_with_the_others(checked.errors)
        cls.configs = {spec.name: spec for spec in checked.specs}
        cls.layer_name_to_config_cache = {}
        cls.source = checked.source
        cls.section_names = checked.section_names
        cls.warnings = checked.warnings + [f"{checked.source}: {overlap}" for overlap in named_overlaps(checked.specs)]
        cls.routed_layers, cls.matched_sections, cls.warned_sections, cls.routed_namespaces = {}, set(), set(), {}

    _load_config = load_config

    @classmethod
    def set_layer_types(cls, layer_name: str, *types: str) -> None:
        """Declare type names of a layer that ``layer_types`` selectors also match (e.g. its class)."""
        if not isinstance(layer_name, str) or not all(isinstance(t, str) for t in types):
            raise TypeError(f"set_layer_types needs a layer name and type names as strings, got {layer_name!r}, {types!r}")
        if cls.layer_types.get(layer_name) == types:  # layers declare theirs at each routing round
            return
        cls.layer_types[layer_name] = tuple(types)
        cls.layer_name_to_config_cache.pop(layer_name, None)

    @classmethod
    def note_routed(cls, layer_name: str, namespace: str) -> None:
        """Record that ``layer_name`` routed a call in ``namespace``: a section whose features are in a namespace
        its layers never call does nothing for them (``section_coverage`` says so)."""
        cls.routed_namespaces.setdefault(layer_name, set()).add(namespace)

    @classmethod
    def get_config_for_layer(cls, layer_name: str) -> dict[str, dict[str, dict]]:
        """``{namespace: {Feature: raw config}}`` merged over every section that selects the layer."""
        if not isinstance(layer_name, str):
            raise TypeError(f"layer_name must be a string, got {layer_name!r} ({type(layer_name).__name__})")
        cached = cls.layer_name_to_config_cache.get(layer_name)
        if cached is not None:
            return cached
        types = cls.layer_types.get(layer_name, ())
        cls.routed_layers[layer_name] = types
        merged: dict[str, dict[str, dict]] = {}
        owner: dict[tuple[str, str], str] = {}
        for spec in cls.configs.values():
            if not spec.layer_spec.matches(layer_name, types):
                continue
            cls.matched_sections.add(spec.name)
            for namespace, features in spec.extension_config.items():
                for feature, feature_cfg in features.items():
                    previous = owner.get((namespace, feature))
                    if previous is not None:
                        raise ConfigError(
                            f"{cls.source}: sections '{previous}' and '{spec.name}' both configure "
                            f"{namespace}.{feature} for layer '{layer_name}'; a layer may get each feature "
                            "from one section only"
                        )
                    owner[(namespace, feature)] = spec.name
                    merged.setdefault(namespace, {})[feature] = feature_cfg
        cls.layer_name_to_config_cache[layer_name] = merged
        return merged

    @classmethod
    def enabled_features(cls) -> Iterator[tuple[str, str, dict]]:
        """``(namespace, Feature, raw config)`` of each feature a loaded section enables, whatever layers it selects."""
        for spec in cls.configs.values():
            for namespace, features in spec.extension_config.items():
                for feature, feature_cfg in features.items():
                    if feature_cfg.get("enabled"):
                        yield namespace, feature, feature_cfg

    @classmethod
    def reset(cls) -> None:
        cls.configs = {}
        cls.layer_name_to_config_cache = {}
        cls.layer_types = {}
        cls.source = ""
        cls.section_names = []
        cls.warnings = []
        cls.routed_layers, cls.matched_sections, cls.warned_sections, cls.routed_namespaces = {}, set(), set(), {}


def is_layer_in_cfg(layer_name: str, spec: ConfigSpec) -> bool:
    """Whether the section ``spec`` selects ``layer_name``, the types it declared with
    ``ConfigManager.set_layer_types`` included; the same answer ``get_config_for_layer`` acts on."""
    if not isinstance(layer_name, str):
        raise TypeError(f"layer_name must be a string, got {layer_name!r} ({type(layer_name).__name__})")
    if not isinstance(spec, ConfigSpec):
        raise TypeError(f"spec must be a ConfigSpec, got {type(spec).__name__}")
    if spec.layer_spec is None:
        raise ValueError("the ConfigSpec has no layer selector: call spec.initialize(section) first")
    return spec.layer_spec.matches(layer_name, ConfigManager.layer_types.get(layer_name, ()))


def _parse_section(
    name: str, section: Any, location: ConfigLocation, registry_data: dict, unusable: Mapping[str, str], warnings: list[str]
) -> ConfigSpec | None:
    """The section's spec, None when it is disabled; raises every error of its keys (a section whose
    ``enabled`` is missing or not a boolean is checked as if it were enabled)."""
    if not isinstance(section, dict):
        raise location.error("a section must be a mapping with 'enabled', 'layers' and features", section)
    collector = ErrorCollector()
    if "enabled" not in section:
        collector.add(location.error("missing required key 'enabled'"))
    elif section["enabled"] is False:
        return None
    with collector.check():
        if "enabled" in section:
            require_bool(section["enabled"], location.child("enabled"))
    layer_spec = None
    if "layers" not in section:
        collector.add(location.error("missing required key 'layers'"))
    with collector.check():
        if "layers" in section:
            layer_spec = LayerSpec(section["layers"], location.child("layers"))
    extension_config: dict[str, dict[str, dict]] = {}
    for key, value in section.items():
        if key not in SECTION_KEYS:
            with collector.check():
                _parse_section_key(extension_config, str(key), value, location.child(key), registry_data, unusable, section)
    collector.raise_errors()
    if layer_spec.ignored_keys:
        warnings.append(
            f"{location.source}: key '{location.child('layers').key_path}': selectors {layer_spec.ignored_keys} "
            "are ignored because a stronger selector (exact_layer_names, then layer_name_regex_pattern) is given"
        )
    return ConfigSpec(name, layer_spec, extension_config)


def _parse_section_key(
    extension_config: dict,
    key: str,
    value: Any,
    location: ConfigLocation,
    registry_data: dict,
    unusable: Mapping[str, str],
    section: dict,
) -> None:
    """A section key besides ``enabled`` and ``layers`` (of ``section``), with its ``value``: a namespace of
    features, or a base-namespace feature."""
    base_features = registry_data[BASE_NAMESPACE].features if BASE_NAMESPACE in registry_data else {}
    if key in registry_data:
        if not isinstance(value, dict) or not value:
            raise location.error(f"namespace '{key}' must map feature names to feature configs", value)
        collector = ErrorCollector()
        for feature, feature_cfg in value.items():
            with collector.check():
                _add_feature(extension_config, key, str(feature), feature_cfg, location.child(feature), registry_data)
        collector.raise_errors()
    elif key in base_features:
        _add_feature(extension_config, BASE_NAMESPACE, key, value, location, registry_data)
    elif key in unusable:
        raise location.error(f"namespace set aside at loading: {unusable[key]}", key)
    elif owners := [ns for ns, data in registry_data.items() if key in data.features]:
        raise location.error(
            f"{key} is a feature of namespace {' and '.join(map(repr, owners))}, not of the base namespace: write it "
            f"under '{owners[0]}:' in the section ({owners[0]}: {{{key}: {{enabled: True, ...}}}})",
            key,
        )
    elif key in _feature_keys(registry_data):
        raise location.error(
            f"'{key}' is an option of a feature, not of a section: write it in the config of the feature it is for, "
            f"{_feature_example(section, key, registry_data)}",
            key,
        )
    else:
        allowed = [*SECTION_KEYS, *sorted(registry_data), *sorted(base_features)]
        raise location.error(
            f"not a namespace nor a feature of the base namespace{_unloaded_namespace_fix(key, value)}", key, allowed
        )


# The keys of a feature's config in the framework's grammar (features may take more: ``_feature_keys``).
FEATURE_KEYS = frozenset(
    {"tensors", "tensors_struct", "gemms", "gemms_struct", "stats", "freq", "start_step", "end_step", "start_end_list"}
)


def _feature_keys(registry_data: dict) -> frozenset[str]:
    """``FEATURE_KEYS`` and the keys the loaded features declare (``config_keys``, ``option_keys``)."""
    declared = [
        getattr(feature, attribute, None) or ()
        for data in registry_data.values()
        for feature in data.features.values()
        for attribute in ("config_keys", "option_keys")
    ]
    return FEATURE_KEYS.union(*declared) - {"enabled"}


def _feature_example(section: dict, key: str, registry_data: dict) -> str:
    """Where ``key`` goes: under the first feature the section configures (as a key path), else an example."""
    for name, value in section.items():
        if name in SECTION_KEYS or not isinstance(value, dict):
            continue
        if name in registry_data and value:
            return f"e.g. '{name}.{next(iter(value))}.{key}'"
        if BASE_NAMESPACE in registry_data and name in registry_data[BASE_NAMESPACE].features:
            return f"e.g. '{name}.{key}'"
    return f"e.g. LogTensorStats: {{enabled: True, {key}: ...}} (under 'transformer_engine:' for lowprec's layers)"


def _unloaded_namespace_fix(key: str, value: Any) -> str:
    """How to load the namespace ``key`` when it looks like one that is not loaded: a library's (named), or any
    mapping of feature names to feature configs."""
    if key == "transformer_engine":
        return (
            " ('transformer_engine' is the namespace of lowprec's features, not loaded: pass "
            "feature_dirs=[lowprec.FEATURE_DIR] to initialize, or `import lowprec` before it, which registers them for "
            "every initialize; on the command line, the installed nvdlfw-inspect command loads them, or give "
            "--feature-dirs DIR with the DIR that `python -c 'import lowprec; print(lowprec.FEATURE_DIR)'` prints)"
        )
    if isinstance(value, dict) and value and all(isinstance(cfg, dict) for cfg in value.values()):
        return (
            " (if it is a namespace, pass the directory of its features: feature_dirs=[DIR] to initialize, "
            "--feature-dirs DIR on the command line)"
        )
    return ""


def _add_feature(
    extension_config: dict, namespace: str, feature: str, cfg: Any, location: ConfigLocation, registry_data: dict
) -> None:
    """Check one feature's config (one without ``enabled`` is checked as if enabled) and add it."""
    ns = registry_data[namespace]
    if feature not in ns.features:
        raise location.error(f"unknown feature of namespace '{namespace}'", feature, sorted(ns.features))
    if feature in extension_config.get(namespace, {}):
        raise location.error(f"feature {namespace}.{feature} is configured twice in this section")
    if not isinstance(cfg, dict):
        raise location.error("a feature config must be a mapping with at least 'enabled'", cfg)
    collector = ErrorCollector()
    if "enabled" not in cfg:
        collector.add(location.error("missing required key 'enabled'"))
    with collector.check():
        if "enabled" in cfg:
            require_bool(cfg["enabled"], location.child("enabled"))
    if cfg.get("enabled") is not False:
        with collector.check():
            ns.api.validate_feature_config(feature, ns.features[feature], cfg, location)
    collector.raise_errors()
    extension_config.setdefault(namespace, {})[feature] = cfg
