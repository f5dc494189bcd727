"""Exceptions raised for user mistakes, and the config location every config error names."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

_NO_VALUE = object()


class NvdlfwInspectError(Exception):
    """Base class of every error this framework raises on purpose."""


class ConfigError(NvdlfwInspectError, ValueError):
    """A config file or dict is invalid; the message names the source, key path, value and what is allowed."""

    key_path: tuple[str, ...] = ()  # where in the config, when known


class FeatureLoadError(NvdlfwInspectError, ImportError):
    """A feature directory or feature file could not be loaded."""


class RegistryError(NvdlfwInspectError, TypeError):
    """Namespaces or features were registered inconsistently."""


class NotInitializedError(NvdlfwInspectError, RuntimeError, AttributeError):
    """The debug API was used before ``initialize``.

    It is also an ``AttributeError`` so that ``hasattr(debug_api, name)`` answers False instead of raising.
    """


class UnknownAPIError(NvdlfwInspectError, AttributeError, ValueError):
    """No namespace or API of that name exists."""


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most similar to ``name``, used for "did you mean" hints."""
    matches = difflib.get_close_matches(str(name), [str(c) for c in candidates], n=1, cutoff=0.6)
    return matches[0] if matches else None


class ConfigLocation:
    """Where a value sits in a config: the source (file path or dict) and the key path down to it."""

    def __init__(self, source: str, path: tuple[str, ...] = ()):
        self.source = source
        self.path = path

    def child(self, key: Any) -> ConfigLocation:
        return ConfigLocation(self.source, self.path + (str(key),))

    @property
    def key_path(self) -> str:
        return ".".join(self.path) if self.path else "<top level>"

    def error(
        self,
        problem: str,
        value: Any = _NO_VALUE,
        allowed: Iterable[Any] | str | None = None,
    ) -> ConfigError:
        """Build (not raise) a ConfigError for this location."""
        parts = [f"{self.source}: key '{self.key_path}': {problem}"]
        if value is not _NO_VALUE:
            parts.append(f"got {value!r}")
        if allowed is not None:
            if isinstance(allowed, str):
                parts.append(f"allowed: {allowed}")
            else:
                allowed = list(allowed)
                parts.append("allowed: " + ", ".join(repr(a) for a in allowed))
                if value is not _NO_VALUE and isinstance(value, str):
                    hint = closest(value, [a for a in allowed if isinstance(a, str)])
                    if hint is not None:
                        parts.append(f"did you mean {hint!r}?")
        error = ConfigError("; ".join(parts))
        error.key_path = self.path
        return error


class AlreadyInitializedError(NvdlfwInspectError, RuntimeError, ValueError):
    """``initialize`` was called twice without ``end_debug`` in between."""
