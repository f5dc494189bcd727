"""Namespace routers and config mappers: the contract every namespace and feature implements."""

from __future__ import annotations

import copy
import logging
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from nvdlfw_inspect.config_manager import ConfigManager
from nvdlfw_inspect.errors import ConfigLocation, closest
from nvdlfw_inspect.logging import get_logger
from nvdlfw_inspect.utils import APICacheIdentifier, SingleMessageLogger

_MISS = object()


class FeatureOutputs(list):
    """Outputs of several features for one call. A list; ``.values()`` is there for code expecting a dict."""

    def values(self) -> list:  # noqa: D102
        return list(self)


def outputs_equal(a: Any, b: Any) -> bool:
    """Structural equality that also works for tensors and containers of tensors."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(outputs_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(outputs_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


class BaseConfigAPIMapper(ABC):
    """Turns a feature's raw config into the config for one API call (or says the call is not for it)."""

    @abstractmethod
    def parse_config_and_api(self, config: dict, **kwargs: Any) -> tuple[bool, dict | None]:
        """Return ``(True, resolved_config)`` if this feature serves the call, else ``(False, None)``."""

    def validate_config(self, config: dict, location: ConfigLocation) -> None:
        """Raise a ConfigError for any mistake in this feature's config; called at ``initialize``.

        The default accepts everything; features override it so that mistakes surface before training.
        """

    def _process_tensor_config(self, cfg: dict, api_tensor_name: str) -> dict | None:
        """Resolve ``tensors``/``tensors_struct`` for one tensor. Mutates ``cfg``; callers pass a copy."""
        if "tensors_struct" in cfg:
            for item in cfg["tensors_struct"]:
                if item["tensor"] == api_tensor_name:
                    del cfg["tensors_struct"]
                    cfg.update(copy.deepcopy(item))
                    return cfg
            return None
        if "tensors" in cfg:
            tensors = cfg["tensors"]
            if isinstance(tensors, str):
                tensors = [tensors]
            if api_tensor_name in tensors:
                del cfg["tensors"]
                cfg["tensor"] = api_tensor_name
                return cfg
            return None
        raise ValueError("Provide 'tensors_struct: List[Dict]' or 'tensors: List[str]' in the config yaml.")

    def log_message_once(self, message: str, layer_name: str | None = None, level: int = logging.INFO) -> None:
        """Write ``message`` to the debug log once per call site and layer."""
        frame = sys._getframe(1)
        site = f"{frame.f_code.co_filename}.{frame.f_lineno}"
        del frame
        SingleMessageLogger.log_message_once(message, layer_name, level, call_site=site)


class BaseNamespaceAPI(ABC):
    """Routes ``debug_api.<namespace>.<api>(layer_name, **kwargs)`` to the features configured for the layer.

    Routing results are cached per call site, layer and the API's cacheable kwargs; the cache stores
    which feature method and resolved config serve the call, never the answer itself.
    """

    def __init__(self) -> None:
        self.namespace_features: dict[str, Any] = {}
        self.api_to_features_map: dict[str, list[str]] = {}
        self._api_cache: dict[str | None, Any] = {}
        self._default_api_impl: Any = None
        self._default_api_map: dict[str, Any] = {}
        self._cacheable_api_kwargs_map: dict[str, list[str]] = {}
        self.name: str | None = None

    # --- set up by the registry -------------------------------------------------------------
    def set_default_api_impl(self) -> None:
        impl = self._default_api_impl
        self._default_api_map = {}
        if impl is None:
            return
        for name in dir(impl):
            attr = getattr(impl, name)
            if not name.startswith("_") and callable(attr):
                self._default_api_map[name] = attr

    def set_api_map(self, api_to_features_map: dict[str, list[str]]) -> None:
        self.api_to_features_map = api_to_features_map

    def set_features(self, features: dict[str, Any]) -> None:
        self.namespace_features = features

    def api_names(self) -> set[str]:
        """Every API this namespace can route: those of its features and of its default implementation."""
        return set(self.api_to_features_map) | set(self._default_api_map)

    # --- hooks a namespace implements ---------------------------------------------------------
    @abstractmethod
    def input_assertions_hook(self, api_name: str, **kwargs: Any) -> None:
        """Raise if the kwargs of a call are incomplete; runs on every call."""

    @abstractmethod
    def routing_condition(
        self, api_name: str, config: dict, layer_name: str, feature_obj: Any, **kwargs: Any
    ) -> tuple[bool, dict | None]:
        """Whether ``feature_obj`` (configured with ``config``) serves this call, and its resolved config."""

    @abstractmethod
    def output_assertions_hook(self, api_name: str, ret: Any, **kwargs: Any) -> None:
        """Raise if a feature returned something the namespace cannot use."""

    @abstractmethod
    def is_multiple_feature_invocation_allowed(self, api_name: str) -> bool:
        """Whether several features may serve one call of ``api_name``."""

    def handle_multi_feature_output(
        self, api_name: str, multi_feature_outputs: list, features_to_invoke: dict, **kwargs: Any
    ) -> Any:
        """Combine the outputs of several features; by default they must all be equal."""
        first = multi_feature_outputs[0]
        if not all(outputs_equal(first, out) for out in multi_feature_outputs[1:]):
            raise ValueError(
                f"Different outputs when invoking multiple features per API call is not allowed. Features "
                f"{list(features_to_invoke)} for {self.name}.{api_name} returned {multi_feature_outputs!r}."
            )
        return first

    def call_feature(self, call: Any, feat_config: dict, layer_name: str, **kwargs: Any) -> Any:
        """The single place where a feature (or default) method is invoked."""
        return call(feat_config, layer_name, **kwargs)

    def validate_feature_config(self, feature_name: str, feature_obj: Any, config: dict, location: ConfigLocation) -> None:
        """Validate one feature's config at ``initialize``; delegates to the feature's ``validate_config``."""
        validate = getattr(feature_obj, "validate_config", None)
        if validate is not None:
            validate(config, location)

    def no_feature_served(self, api_name: str, layer_name: str, configured: dict[str, dict], **kwargs: Any) -> None:
        """Called when features ``configured`` for the layer (name -> raw config) implement ``api_name`` but none
        serves this call; at most once per cached call. A namespace whose callers name what they pass (a tensor
        a user chose) says so here; the default says nothing (layers ask routing questions no config answers)."""

    def step(self) -> None:
        """Called by ``debug_api.step()`` after the iteration counter advanced."""

    def end_debug(self) -> None:
        """Called by ``debug_api.end_debug()``."""

    # --- routing ----------------------------------------------------------------------------
    def route_api(self, layer_name: str | None = None, api_name: str | None = None, **kwargs: Any) -> Any:
        self.input_assertions_hook(api_name, **kwargs)
        uid = APICacheIdentifier.get_unique_identifier(self._cacheable_api_kwargs_map, layer_name, api_name, **kwargs)
        route = _MISS if uid is None else self._api_cache.get(uid, _MISS)
        if route is _MISS:
            route = self._resolve(uid, layer_name, api_name, kwargs)
            if uid is not None:
                self._api_cache[uid] = route
        return self._follow(route, api_name, layer_name, kwargs)

    def bind(self, layer_name: str, api_name: str, **routing_kwargs: Any) -> Callable[..., Any]:
        """``route_api`` for ``layer_name`` and ``api_name`` with ``routing_kwargs`` (exactly the keyword arguments its
        routing depends on: the API's cacheable ones), its features chosen once, now, as a function of the call's
        other keyword arguments. For a caller that makes the same call many times (a layer, at every step): each call
        then costs what the features do, not the routing's work again."""
        keys = self._cacheable_api_kwargs_map.get(api_name)
        if keys is None or set(keys) != routing_kwargs.keys():
            raise ValueError(
                f"{self.name}.{api_name} is bound with the keyword arguments its routing depends on, "
                f"{'none known (it is routed per call)' if keys is None else sorted(keys)}; got {sorted(routing_kwargs)}"
            )
        APICacheIdentifier.save_call_details()
        self.input_assertions_hook(api_name, **routing_kwargs)
        uid = APICacheIdentifier.get_unique_identifier(self._cacheable_api_kwargs_map, layer_name, api_name, **routing_kwargs)
        route = self._resolve(uid, layer_name, api_name, routing_kwargs)
        if isinstance(route, tuple) and route[0] is not None:  # one feature (the common case, made direct)
            feature_name, method, cfg = route

            def call_feature(**kwargs: Any) -> Any:
                kwargs.update(routing_kwargs)
                return self._call_checked(feature_name, method, api_name, cfg, layer_name, kwargs)

            return call_feature

        def call(**kwargs: Any) -> Any:
            kwargs.update(routing_kwargs)
            return self._follow(route, api_name, layer_name, kwargs)

        return call

    def _resolve(self, uid: str | None, layer_name: str | None, api_name: str, kwargs: dict) -> Any:
        """Which features serve this call: None (nobody, and no default), ``(None, default method, {})``,
        ``(feature name, method, resolved config)`` or a list of those for several features. Said once in the debug
        log."""
        logger = get_logger()
        if uid not in logger.logged_api_encountered:
            logger.logged_api_encountered.add(uid)
            logger.log_message(
                f"Debug API call '{api_name}' encountered at the line: {APICacheIdentifier.get_call_details()}",
                level=logging.DEBUG,
            )
        ConfigManager.note_routed(layer_name, self.name)
        features_to_invoke, configured = self._select_features(layer_name, api_name, kwargs)
        if not features_to_invoke:
            if configured:
                self.no_feature_served(api_name, layer_name, configured, **kwargs)
            default = self._default_api_map.get(api_name)
            return None if default is None else (None, default, {})
        if len(features_to_invoke) > 1:
            if not self.is_multiple_feature_invocation_allowed(api_name):
                raise ValueError(
                    f"Only 1 feature may serve {self.name}.{api_name} for layer '{layer_name}', but "
                    f"{list(features_to_invoke)} are enabled for {kwargs_summary(kwargs)}; "
                    "select the layer in only one of them"
                )
            self._log_executed(api_name, f"Debug API call '{api_name}' found and multiple debug features were executed.")
            return [(name, getattr(self.namespace_features[name], api_name), cfg) for name, cfg in features_to_invoke.items()]
        ((feature_name, cfg),) = features_to_invoke.items()
        self._log_executed(
            api_name, f"Debug API call '{api_name}' found and the corresponding debug feature '{feature_name}' was called."
        )
        return feature_name, getattr(self.namespace_features[feature_name], api_name), cfg

    def _follow(self, route: Any, api_name: str, layer_name: str | None, kwargs: dict) -> Any:
        """Call what ``_resolve`` chose."""
        if route is None:
            return {}
        if isinstance(route, list):
            return self._call_several(api_name, route, layer_name, kwargs)
        feature_name, method, cfg = route
        if feature_name is None:  # the namespace's default
            return self.call_feature(method, cfg, layer_name, **kwargs)
        return self._call_checked(feature_name, method, api_name, cfg, layer_name, kwargs)

    def _select_features(self, layer_name: str | None, api_name: str, kwargs: dict) -> tuple[dict[str, dict], dict[str, dict]]:
        """The features that serve this call (name -> resolved config), and those enabled for the layer that
        implement ``api_name`` (name -> raw config), served or not."""
        layer_config = ConfigManager.get_config_for_layer(layer_name).get(self.name, {})
        features_to_invoke: dict[str, dict] = {}
        configured: dict[str, dict] = {}
        for feature_name in self.api_to_features_map.get(api_name, ()):
            cfg = layer_config.get(feature_name)
            if not cfg or not cfg.get("enabled"):
                continue
            configured[feature_name] = cfg
            status, resolved = self.routing_condition(api_name, cfg, layer_name, self.namespace_features[feature_name], **kwargs)
            if status:
                features_to_invoke[feature_name] = resolved or cfg
        return features_to_invoke, configured

    def serving_features(self, layer_name: str, api_name: str, **kwargs: Any) -> list[str]:
        """The names of the features that ``route_api`` calls for this call (none: the namespace's default
        answers), in the order the namespace registered them: who made a routing decision, without asking the
        features again."""
        self.input_assertions_hook(api_name, **kwargs)
        return list(self._select_features(layer_name, api_name, kwargs)[0])

    def _call_several(self, api_name: str, several: list[tuple[str, Any, dict]], layer_name: str, kwargs: dict) -> Any:
        """Call every feature of ``several`` (name, method, resolved config) and combine their outputs."""
        outputs = FeatureOutputs()
        for feature_name, method, cfg in several:
            outputs.append(self._call_checked(feature_name, method, api_name, cfg, layer_name, kwargs))
        features = {feature_name: cfg for feature_name, _, cfg in several}
        return self.handle_multi_feature_output(api_name, outputs, features, **kwargs)

    def _call_checked(self, feature_name: str, method: Any, api_name: str, cfg: dict, layer_name: str, kwargs: dict) -> Any:
        """One feature's call, on every path (first call or cached): an error names the feature, and its output
        passes the namespace's ``output_assertions_hook``."""
        try:
            out = self.call_feature(method, cfg, layer_name, **kwargs)
        except Exception as error:
            error.add_note(f"raised by feature {self.name}.{feature_name}, API {api_name}, layer '{layer_name}'")
            raise
        self.output_assertions_hook(api_name, out, **kwargs)
        return out

    def _log_executed(self, api_name: str, message: str) -> None:
        logger = get_logger()
        if api_name not in logger.logged_api_executed:
            logger.logged_api_executed.add(api_name)
            logger.log_message(message, level=logging.DEBUG)

    def __getattr__(self, api_name: str) -> Any:
        if api_name.startswith("_"):
            raise AttributeError(api_name)
        known = self.__dict__.get("api_to_features_map", {}).keys() | self.__dict__.get("_default_api_map", {}).keys()
        if api_name in known:
            router = self.__dict__[api_name] = partial(self.route_api, api_name=api_name)  # found directly from now on
            return router
        hint = closest(api_name, known)
        suffix = f"; did you mean '{hint}'?" if hint else ""
        raise AttributeError(
            f"namespace '{self.__dict__.get('name')}' has no API '{api_name}'; known APIs: {sorted(known)}{suffix}"
        )


def kwargs_summary(kwargs: dict) -> str:
    """Short text of call kwargs for error messages, tensors shown by shape."""
    parts = []
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            value = f"Tensor{tuple(value.shape)}"
        parts.append(f"{key}={value}")
    return "(" + ", ".join(parts) + ")"
