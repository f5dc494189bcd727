"""The ``base`` namespace: framework-agnostic features reached as ``debug_api.<api>(layer_name, ...)``."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from nvdlfw_inspect.base import BaseConfigAPIMapper, BaseNamespaceAPI
from nvdlfw_inspect.config_manager import ConfigManager
from nvdlfw_inspect.errors import ConfigLocation, ErrorCollector, closest
from nvdlfw_inspect.logging import say_once
from nvdlfw_inspect.registry import Registry


class PerConfig:
    """Values a feature works out once per resolved config: the router hands the same config object to every
    call it routes there. Keyed by identity; each config is kept alive, so that its id stays its own."""

    def __init__(self) -> None:
        self._values: dict[int, tuple[dict, Any]] = {}

    def get(self, config: dict, compute: Callable[[dict], Any]) -> Any:
        cached = self._values.get(id(config))
        if cached is None or cached[0] is not config:
            cached = self._values[id(config)] = (config, compute(config))
        return cached[1]


class GenericConfigAPIMapper(BaseConfigAPIMapper):
    """Tensor selection for a feature, in one of two shapes:

    tensors: [activation, gradient]          # the same options for every listed tensor
    tensors_struct:                          # per-tensor options, overriding the feature-level ones
      - tensor: activation
        stats: [mean]
    """

    tensor_config_docstring = __doc__
    #: keys allowed at the feature level, or None to skip the check (for features with free-form keys)
    config_keys: frozenset[str] | None = None
    #: keys allowed in a ``tensors_struct`` item, or None to skip the check
    tensor_struct_keys: frozenset[str] | None = None

    def parse_config_and_api(self, config: dict, **kwargs: Any) -> tuple[bool, dict | None]:
        processed = copy.deepcopy(config)
        if kwargs.get("tensor_parsing"):
            processed = self._process_tensor_config(processed, kwargs["tensor_name"])
        else:
            processed = None
        if not processed:
            return False, None
        processed.pop("enabled", None)
        return True, processed

    def validate_config(self, config: dict, location: ConfigLocation) -> None:
        collector = ErrorCollector()
        with collector.check():
            check_keys(config, self.config_keys, location)
        with collector.check():
            for view, where in tensor_views(config, location, collector):
                with collector.check():
                    check_keys(view, self.tensor_struct_keys, where, ignore=set(config) | {"tensor"})
                with collector.check():
                    self.validate_tensor_config(view, where)
        collector.raise_errors()

    def validate_tensor_config(self, config: dict, location: ConfigLocation) -> None:
        """Validate the options one tensor resolves to; features override this."""


def check_keys(config: dict, allowed: frozenset[str] | None, location: ConfigLocation, ignore: set = frozenset()) -> None:
    """Raise for every key of ``config`` outside ``allowed`` (None: any key) and ``ignore``."""
    if allowed is None:
        return
    collector = ErrorCollector()
    for key in config:
        if key not in allowed and key not in ignore:
            collector.add(location.child(key).error("unknown key", key, sorted(allowed)))
    collector.raise_errors()


def tensor_views(
    config: dict, location: ConfigLocation, collector: ErrorCollector | None = None
) -> list[tuple[dict, ConfigLocation]]:
    """Validate the ``tensors``/``tensors_struct`` grammar; return each tensor's resolved options and location.

    A ``tensors_struct`` item's view reports its own keys at the item's location. Errors of single items go
    to ``collector`` when one is given (the other items' views are still returned), else they are raised.
    """
    if "tensors_struct" in config and "tensors" in config:
        raise location.error("give either 'tensors' or 'tensors_struct', not both", sorted(config))
    if "tensors_struct" in config:
        items = config["tensors_struct"]
        struct_loc = location.child("tensors_struct")
        if not isinstance(items, list) or not items:
            raise struct_loc.error("must be a non-empty list of mappings, each with a 'tensor' key", items)
        shared = {k: v for k, v in config.items() if k not in ("tensors_struct", "tensors", "enabled")}
        views = []
        own = collector or ErrorCollector()
        for i, item in enumerate(items):
            item_loc = struct_loc.child(i)
            if not isinstance(item, dict) or not isinstance(item.get("tensor"), str):
                own.add(item_loc.error("each item must be a mapping with a string 'tensor' key", item))
            elif any(isinstance(other, dict) and other.get("tensor") == item["tensor"] for other in items[:i]):
                own.add(item_loc.child("tensor").error("this tensor already has an item in tensors_struct", item["tensor"]))
            else:
                views.append(({**shared, **item}, ItemLocation(item_loc, location, set(item))))
        if collector is None:
            own.raise_errors()
        return views
    if "tensors" in config:
        tensors = config["tensors"]
        if isinstance(tensors, str):
            tensors = [tensors]
        if not isinstance(tensors, list) or not tensors or not all(isinstance(t, str) for t in tensors):
            raise location.child("tensors").error("must be a non-empty list of tensor names", config["tensors"])
        return [(config, location)]
    raise location.error("needs 'tensors: [names]' or 'tensors_struct: [{tensor: name, ...}]'")


def selected_tensor_names(config: dict) -> list[str]:
    """The tensor names a validated feature config selects (``tensors`` or ``tensors_struct``)."""
    if "tensors_struct" in config:
        return [item["tensor"] for item in config["tensors_struct"]]
    tensors = config.get("tensors", [])
    return [tensors] if isinstance(tensors, str) else list(tensors)


class ItemLocation(ConfigLocation):
    """Location of one ``tensors_struct`` (or ``gemms_struct``) item: keys it defines are reported there, others at
    the feature."""

    def __init__(self, item: ConfigLocation, feature: ConfigLocation, own_keys: set[str]):
        super().__init__(item.source, item.path)
        self._feature = feature
        self._own_keys = own_keys

    def child(self, key: Any) -> ConfigLocation:
        if key in self._own_keys:
            return super().child(key)
        return self._feature.child(key)


@Registry.register_namespace_api(namespace="base")
class GenericFrameworkAPI(BaseNamespaceAPI):
    """Routes base-namespace APIs such as ``debug_api.log_tensor_stats(layer_name, tensor=..., tensor_name=...)``."""

    _required_kwargs = {"log_tensor_stats": ("tensor", "tensor_name")}

    def __init__(self) -> None:
        super().__init__()
        self._cacheable_api_kwargs_map = {"log_tensor_stats": ["tensor_name"]}

    def input_assertions_hook(self, api_name: str, **kwargs: Any) -> None:
        for key in self._required_kwargs.get(api_name, ()):
            if key not in kwargs:
                raise TypeError(f"debug_api.{api_name}() needs the keyword argument '{key}'")

    def routing_condition(
        self, api_name: str, config: dict, layer_name: str, feature_obj: Any, **kwargs: Any
    ) -> tuple[bool, dict | None]:
        return feature_obj.parse_config_and_api(config, tensor_parsing=True, **kwargs)

    def output_assertions_hook(self, api_name: str, ret: Any, **kwargs: Any) -> None:
        pass

    def is_multiple_feature_invocation_allowed(self, api_name: str) -> bool:
        return False

    def no_feature_served(self, api_name: str, layer_name: str, configured: dict[str, dict], **kwargs: Any) -> None:
        """A tensor name that no feature of the config selects (``activations`` for ``activation``) would log nothing,
        every step: said once per layer and name, with the names the layer's features do select. A name selected for
        other layers only is a choice of the config (gradients of the last layer only), not said."""
        tensor_name = kwargs.get("tensor_name")
        if tensor_name is None or tensor_name in self._selected_anywhere(api_name):
            return
        selected = sorted({name for cfg in configured.values() for name in selected_tensor_names(cfg)})
        hint = closest(tensor_name, selected)
        features = f"features {sorted(configured)} select" if len(configured) > 1 else f"feature {next(iter(configured))} selects"
        say_once(
            f"layer '{layer_name}': debug_api.{api_name}(tensor_name={tensor_name!r}) logs nothing: no section of the "
            f"config selects that tensor name; the layer's {features} the tensors {selected}"
            + (f"; did you mean {hint!r}?" if hint else ""),
            call_site=__name__,
        )

    def _selected_anywhere(self, api_name: str) -> set[str]:
        """The tensor names some enabled feature implementing ``api_name`` selects, in any section."""
        features = self.api_to_features_map.get(api_name, ())
        return {
            name
            for spec in ConfigManager.configs.values()
            for feature, cfg in spec.extension_config.get(self.name, {}).items()
            if feature in features and cfg.get("enabled")
            for name in selected_tensor_names(cfg)
        }
