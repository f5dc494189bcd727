"""Namespaces and the features registered in them.

Decorators register classes at definition time (as the reference does) and tag them, so the feature loader
can register them again after ``end_debug`` cleared the registry, without executing their modules twice.

Which registration wins when ``initialize`` loads two classes of one name (see ``Registry.add_tagged``):

* Directories named in ``feature_dirs`` take precedence over those loaded by default (the built-in one and
  those a library registered, as ``lowprec`` does for ``transformer_engine``). If a directory of
  ``feature_dirs`` registers a namespace's API, the whole namespace comes from ``feature_dirs``: the API and
  features that default directories registered in it are set aside (they were written for the other API).
  Otherwise a feature from ``feature_dirs`` replaces a default one of the same name.
* Among directories of one kind, the first registration wins (``feature_dirs`` in the order given), as in
  the reference: a copied directory, or another install of a package already loaded, is harmless.
* A class loaded from a directory replaces another of its name that was registered on import, outside any
  loaded directory (a second install imported by name, a class redefined in a notebook).

Every registration left out is named in one ``RegistrationWarning``, also written to the debug log.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from nvdlfw_inspect.base import BaseNamespaceAPI
from nvdlfw_inspect.errors import RegistryError
from nvdlfw_inspect.logging import get_logger

T = TypeVar("T", bound=type)
REGISTRATION_TAG = "_nvdlfw_registration"
Tagged = tuple[type, str, str]  # (class, kind, namespace)


class RegistrationWarning(UserWarning):
    """Some registrations of a class name were left out; the message names each and the one used."""


class LoadedClasses(list):
    """Tagged classes in load order, as the loader returns them; ``from_user`` holds those defined in the
    user's ``feature_dirs``, which take precedence over classes of directories loaded by default."""

    def __init__(self, classes: Iterable[type] = (), from_user: Iterable[type] = ()):
        super().__init__(classes)
        self.from_user = frozenset(from_user)


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
    unusable: dict[str, str] = {}  # namespaces set aside at the last initialize -> why
    loaded_namespaces: set[str] = set()  # namespaces that the last load's directories registered in

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
        """Register classes carrying a registration tag, resolving clashes as the module docstring says."""
        from_user = classes.from_user if isinstance(classes, LoadedClasses) else frozenset()
        tagged = [(item, kind, namespace) for item in classes for kind, namespace in registrations_of(item)]
        notes: list[str] = []
        loaded = {item for item, _, _ in tagged}
        cls.loaded_namespaces = {namespace for _, _, namespace in tagged}
        tagged = cls._set_aside_for_user_apis(tagged, from_user, notes)
        winners = _winners(tagged, from_user, notes)
        cls._note_replaced_import_registrations(winners, loaded, notes)
        for (kind, namespace, _), item in winners.items():
            if kind == "namespace_api":
                cls.add_namespace_api(namespace, item)
        for (kind, namespace, _), item in winners.items():
            if kind == "feature":
                cls.add_feature(namespace, item, replace=True)
        cls._order_namespaces(tagged)
        if notes:
            _warn("registrations left out at initialize: " + "; ".join(notes))

    @classmethod
    def _note_replaced_import_registrations(cls, winners: dict, loaded: set[type], notes: list[str]) -> None:
        """Note each winner replacing a different class that its module registered on import, outside this load."""
        for (kind, namespace, _), item in winners.items():
            current = cls._registered(kind, namespace, item.__name__)
            if current not in (None, item) and current not in loaded:
                notes.append(f"{_what(kind, item, namespace)}: {_origin(item)} replaces {_origin(current)}, registered on import")

    @classmethod
    def _registered(cls, kind: str, namespace: str, name: str) -> type | None:
        """The class registered now as the namespace's API, or as its feature ``name`` (maybe still waiting)."""
        ns = cls.data.get(namespace)
        if ns is None:
            return None
        if kind == "namespace_api":
            return None if ns.api is None else type(ns.api)
        if name in ns.features:
            return type(ns.features[name])
        return next((c for c in ns.deferred_features if c.__name__ == name), None)

    @classmethod
    def _set_aside_for_user_apis(cls, tagged: list[Tagged], from_user: frozenset[type], notes: list[str]) -> list[Tagged]:
        """``tagged`` without the default directories' registrations in namespaces whose API ``feature_dirs``
        registers; those also leave the registry (their modules may have registered them on import)."""
        taken_over = {namespace for item, kind, namespace in tagged if kind == "namespace_api" and item in from_user}
        kept = []
        for namespace in taken_over:
            aside = {item for item, _, ns in tagged if ns == namespace and item not in from_user}
            if aside:
                cls._drop(namespace, aside)
                names = sorted(_origin(item) for item in aside)
                notes.append(f"namespace '{namespace}' comes from feature_dirs; default registrations set aside: {names}")
        for item, kind, namespace in tagged:
            if namespace not in taken_over or item in from_user:
                kept.append((item, kind, namespace))
        return kept

    @classmethod
    def _drop(cls, namespace: str, classes: set[type]) -> None:
        """Remove what ``classes`` registered in ``namespace`` (its API is replaced by the winner's)."""
        ns = cls._namespace(namespace)
        for name in [name for name, feature in ns.features.items() if type(feature) in classes]:
            cls._remove_feature(ns, name)
        ns.deferred_features = [c for c in ns.deferred_features if c not in classes]

    @classmethod
    def _order_namespaces(cls, tagged: list[Tagged]) -> None:
        """Namespaces in load order (built-ins first), whether or not their modules ran during this load."""
        order = list(dict.fromkeys(namespace for _, _, namespace in tagged))
        ordered = {name: cls.data[name] for name in order if name in cls.data}
        ordered.update(cls.data)
        cls.data.clear()
        cls.data.update(ordered)

    @classmethod
    def validate_and_init(cls) -> None:
        """Hand each namespace whose API derives from BaseNamespaceAPI its features. A namespace without a
        usable API raises if a loaded directory registered in it; one registered only on import (a module
        imported for another purpose, a test module) is set aside with one warning, and only a config using
        it fails, naming why (``unusable``)."""
        cls.unusable = {}
        for name, ns in list(cls.data.items()):
            if ns.deferred_features:
                names = [c.__name__ for c in ns.deferred_features]
                problem = (
                    f"features {names} are registered in namespace '{name}', but no API class is registered "
                    f"for it; define a class decorated with @Registry.register_namespace_api(namespace='{name}') "
                    "in one of the feature_dirs"
                )
            elif not isinstance(ns.api, BaseNamespaceAPI):
                problem = f"the API of namespace '{name}' ({type(ns.api).__name__}) must inherit from BaseNamespaceAPI"
            else:
                ns.api.name = name
                ns.api.set_default_api_impl()
                ns.api.set_api_map(ns.feat_api_to_features)
                ns.api.set_features(ns.features)
                continue
            if name in cls.loaded_namespaces:
                raise RegistryError(problem)
            cls.unusable[name] = problem
            del cls.data[name]
            _warn(f"namespace '{name}', registered on import, set aside: {problem}")

    @classmethod
    def reset(cls) -> None:
        cls.data.clear()
        cls.unusable.clear()
        cls.loaded_namespaces.clear()


def _winners(tagged: list[Tagged], from_user: frozenset[type], notes: list[str]) -> dict[tuple[str, str, str], type]:
    """The class used for each feature name, and the one API, of each namespace: one from ``feature_dirs`` over a
    default one, else the first; every class left out is noted."""
    winners: dict[tuple[str, str, str], type] = {}
    for item, kind, namespace in tagged:
        key = (kind, namespace, item.__name__ if kind == "feature" else "")
        current = winners.setdefault(key, item)
        if current is item:
            continue
        what = _what(kind, item, namespace)
        if item in from_user and current not in from_user:
            winners[key] = item
            notes.append(f"{what}: {_origin(item)} from feature_dirs replaces {_origin(current)}")
        else:
            notes.append(f"{what} registered twice: {_origin(current)} is used, {_origin(item)} ignored")
    return winners


def _what(kind: str, item: type, namespace: str) -> str:
    return f"{f'feature {item.__name__!r}' if kind == 'feature' else 'the API'} of namespace '{namespace}'"


def _warn(message: str) -> None:
    """One warning, in the debug log when a session is starting and as a Python warning (each text shown once)."""
    with contextlib.suppress(RuntimeError):  # no debug log outside initialize
        get_logger().log_message(message, logging.WARNING)
    warnings.warn(message, RegistrationWarning, stacklevel=2)
