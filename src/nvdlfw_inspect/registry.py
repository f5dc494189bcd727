"""Namespaces and the features registered in them.

Decorators register classes at definition time (as the reference does) and tag them, so the feature loader
can register them again after ``end_debug`` cleared the registry, without executing their modules twice.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from nvdlfw_inspect.errors import RegistryError

T = TypeVar("T", bound=type)
REGISTRATION_TAG = "_nvdlfw_registration"


def api_method(func: Callable) -> Callable:
    """Mark a feature method as an API that ``debug_api.<namespace>.<name>(...)`` can route to."""
    func.is_api = True
    return func


def api_names_of(obj: Any) -> list[str]:
    """Public callables of ``obj`` marked with ``api_method``, inherited ones included."""
    names = []
    for name in dir(obj):
        if name.startswith("_"):
            continue
        try:
            attr = getattr(obj, name)
        except Exception:  # a property that fails on this instance is no API
            continue
        if callable(attr) and getattr(attr, "is_api", False):
            names.append(name)
    return names


@dataclass
class NamespaceData:
    name: str
    api: Any = None
    features: dict[str, Any] = field(default_factory=dict)
    feat_api_to_features: defaultdict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    deferred_features: list[type] = field(default_factory=list)


def _origin(cls: type) -> str:
    try:
        return f"{inspect.getfile(cls)}:{cls.__qualname__}"
    except (TypeError, OSError):
        return f"{cls.__module__}.{cls.__qualname__}"


def _instantiate(cls: type, what: str) -> Any:
    """``cls()``; registered classes are built without arguments, and a failure names the class."""
    try:
        return cls()
    except Exception as error:
        raise RegistryError(
            f"{what} ({_origin(cls)}) could not be created with no arguments: {type(error).__name__}: {error}"
        ) from error


def _tag(cls: type, kind: str, namespace: str) -> None:
    """Record a registration on ``cls`` itself (never inherited); a class may be registered more than once."""
    tags = cls.__dict__.get(REGISTRATION_TAG, ())
    if (kind, namespace) not in tags:
        setattr(cls, REGISTRATION_TAG, (*tags, (kind, namespace)))


def registrations_of(cls: type) -> tuple[tuple[str, str], ...]:
    """The ``(kind, namespace)`` registrations made by decorating ``cls`` itself."""
    return cls.__dict__.get(REGISTRATION_TAG, ())


class Registry:
    """Process-wide store of namespaces, their API objects and feature instances."""

    data: dict[str, NamespaceData] = {}

    @classmethod
    def register_feature(cls, namespace: str) -> Callable[[T], T]:
        def decorate(feature_cls: T) -> T:
            _tag(feature_cls, "feature", namespace)
            cls.add_feature(namespace, feature_cls)
            return feature_cls

        return decorate

    @classmethod
    def register_namespace_api(cls, namespace: str) -> Callable[[T], T]:
        def decorate(api_cls: T) -> T:
            _tag(api_cls, "namespace_api", namespace)
            cls.add_namespace_api(namespace, api_cls)
            return api_cls

        return decorate

    @classmethod
    def _namespace(cls, namespace: str) -> NamespaceData:
        if namespace not in cls.data:
            cls.data[namespace] = NamespaceData(namespace)
        return cls.data[namespace]

    @classmethod
    def add_feature(cls, namespace: str, feature_cls: type, replace: bool = False) -> None:
        """Register ``feature_cls`` under its class name; waits for the namespace API if there is none yet.

        A class already registered is skipped. Another class of the same name is kept out unless
        ``replace`` is set (the loader sets it: freshly loaded files win over stale registrations).
        """
        ns = cls._namespace(namespace)
        if ns.api is None:
            if all(c is not feature_cls for c in ns.deferred_features):
                ns.deferred_features = [c for c in ns.deferred_features if c.__name__ != feature_cls.__name__]
                ns.deferred_features.append(feature_cls)
            return
        existing = ns.features.get(feature_cls.__name__)
        if existing is not None:
            if type(existing) is feature_cls or not replace:
                return
            cls._remove_feature(ns, feature_cls.__name__)
        cls._instantiate_feature(ns, feature_cls)

    @staticmethod
    def _remove_feature(ns: NamespaceData, name: str) -> None:
        del ns.features[name]
        for features in ns.feat_api_to_features.values():
            if name in features:
                features.remove(name)

    @staticmethod
    def _instantiate_feature(ns: NamespaceData, feature_cls: type) -> None:
        feature = _instantiate(feature_cls, f"feature '{feature_cls.__name__}' of namespace '{ns.name}'")
        ns.features[feature_cls.__name__] = feature
        for api_name in api_names_of(feature):
            ns.feat_api_to_features[api_name].append(feature_cls.__name__)

    @classmethod
    def add_namespace_api(cls, namespace: str, api_cls: type) -> None:
        """Install an instance of ``api_cls`` as the namespace's API, then register the waiting features."""
        ns = cls._namespace(namespace)
        if type(ns.api) is not api_cls:
            ns.api = _instantiate(api_cls, f"API class '{api_cls.__name__}' of namespace '{namespace}'")
        deferred, ns.deferred_features = ns.deferred_features, []
        for feature_cls in deferred:
            cls.add_feature(namespace, feature_cls)

    @classmethod
    def add_tagged(cls, classes: list[type]) -> None:
        """Register classes carrying a registration tag; two different classes claiming one name is an error."""
        tagged = [(item, kind, namespace) for item in classes for kind, namespace in registrations_of(item)]
        seen: dict[tuple[str, str, str], type] = {}
        for item, kind, namespace in tagged:
            key = (kind, namespace, item.__name__)
            if key in seen and seen[key] is not item:
                raise RegistryError(
                    f"two different classes are registered as {kind} '{item.__name__}' in namespace "
                    f"'{namespace}': {_origin(seen[key])} and {_origin(item)}; rename one of them"
                )
            seen[key] = item
        for item, kind, namespace in tagged:
            if kind == "namespace_api":
                cls.add_namespace_api(namespace, item)
        for item, kind, namespace in tagged:
            if kind == "feature":
                cls.add_feature(namespace, item, replace=True)
        # Namespaces in load order (built-ins first), whether or not their modules ran during this load.
        order = list(dict.fromkeys(namespace for _, _, namespace in tagged))
        ordered = {name: cls.data[name] for name in order if name in cls.data}
        ordered.update(cls.data)
        cls.data.clear()
        cls.data.update(ordered)

    @classmethod
    def validate_and_init(cls) -> None:
        """Check every namespace has an API deriving from BaseNamespaceAPI, then hand it its features."""
        from nvdlfw_inspect.base import BaseNamespaceAPI

        for name, ns in cls.data.items():
            if ns.deferred_features:
                names = [c.__name__ for c in ns.deferred_features]
                raise RegistryError(
                    f"features {names} are registered in namespace '{name}', but no API class is registered "
                    f"for it; define a class decorated with @Registry.register_namespace_api(namespace='{name}') "
                    "in one of the feature_dirs"
                )
            if not isinstance(ns.api, BaseNamespaceAPI):
                raise RegistryError(f"the API of namespace '{name}' ({type(ns.api).__name__}) must inherit from BaseNamespaceAPI")
            ns.api.name = name
            ns.api.set_default_api_impl()
            ns.api.set_api_map(ns.feat_api_to_features)
            ns.api.set_features(ns.features)

    @classmethod
    def reset(cls) -> None:
        cls.data.clear()
