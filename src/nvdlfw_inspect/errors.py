"""Exceptions raised for user mistakes, and the config location every config error names."""

from __future__ import annotations

import contextlib
import difflib
import itertools
import reprlib
from collections.abc import Iterable, Iterator
from typing import Any

_NO_VALUE = object()
MAX_MESSAGE_CHARS = 2000
MAX_VALUE_CHARS = 400


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer: an ``int`` but not a ``bool`` (Python's ``True`` is the int 1,
    a config's ``true`` is no number)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """Whether ``value`` is an ``int`` or a ``float``, not a ``bool`` (see ``is_int``)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def shorten(text: str, limit: int) -> str:
    """``text`` cut in the middle to at most about ``limit`` characters: its start names the source and
    key path, its end what is allowed, and a hostile input must not make a message of megabytes."""
    if len(text) <= limit:
        return text
    head, tail = limit * 3 // 4, limit // 4
    return f"{text[:head]} ...[{len(text) - head - tail} characters cut]... {text[len(text) - tail :]}"


class _ShortRepr(reprlib.Repr):
    """A repr bounded in depth and width (a value built from YAML aliases may be huge) that, unlike
    ``reprlib``, keeps a dict's own key order, the order of the config file."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 4
        self.maxtuple = self.maxlist = self.maxarray = self.maxdict = self.maxset = self.maxfrozenset = self.maxdeque = 12
        self.maxstring = self.maxother = 160
        self.maxlong = 40

    def repr_dict(self, x: dict, level: int) -> str:
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        items = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}" for k, v in itertools.islice(x.items(), self.maxdict)]
        if len(x) > self.maxdict:
            items.append("...")
        return "{" + ", ".join(items) + "}"


_SHORT_REPR = _ShortRepr()


def short_repr(value: Any) -> str:
    """``repr(value)`` for error messages, at most about ``MAX_VALUE_CHARS`` characters."""
    return shorten(_SHORT_REPR.repr(value), MAX_VALUE_CHARS)


class NvdlfwInspectError(Exception):
    """Base class of every error this framework raises on purpose; its message is at most about
    ``MAX_MESSAGE_CHARS`` characters, whatever the input."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # kwargs: the builtin bases' own (ImportError's name and path, AttributeError's name and obj)
        super().__init__(*(shorten(a, MAX_MESSAGE_CHARS) if isinstance(a, str) else a for a in args), **kwargs)


class ConfigError(NvdlfwInspectError, ValueError):
    """A config file or dict is invalid; the message names the source, key path, value and what is allowed."""

    key_path: tuple[str, ...] = ()  # where in the config, when known
    line: int | None = None  # 1-based line and column where the YAML parser stopped, for a syntax error
    column: int | None = None


class ConfigErrors(ConfigError):
    """Several independent mistakes of one config found in one pass; ``errors`` holds each, in the order found."""

    def __init__(self, errors: list[ConfigError]):
        super().__init__(f"{len(errors)} errors in the config:\n" + "\n".join(f"  {error}" for error in errors))
        self.errors = errors
        self.key_path = errors[0].key_path


class ErrorCollector:
    """Runs independent checks of a config, each up to its first error, and raises what they found together,
    so that a config with six mistakes is fixed in one round instead of six."""

    def __init__(self) -> None:
        self.errors: list[ConfigError] = []

    def add(self, error: ConfigError) -> None:
        """Keep ``error`` (each of them, for a ``ConfigErrors``) unless the same message is already kept: options
        shared by several tensors or GEMMs are checked once per tensor, and reported once."""
        for one in error.errors if isinstance(error, ConfigErrors) else [error]:
            if all(str(one) != str(kept) for kept in self.errors):
                self.errors.append(one)

    @contextlib.contextmanager
    def check(self) -> Iterator[None]:
        """One independent check: a ``ConfigError`` it raises is kept, and the caller goes on."""
        try:
            yield
        except ConfigError as error:
            self.add(error)

    def raise_errors(self) -> None:
        """Raise the one error kept, or a ``ConfigErrors`` of all of them; nothing if none."""
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            raise ConfigErrors(self.errors)


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
        suggestions: Iterable[str] = (),
    ) -> ConfigError:
        """Build (not raise) a ConfigError for this location. A string ``value`` close to one of the allowed
        strings, or of ``suggestions`` (for ``allowed`` given as a pattern), gets a "did you mean"."""
        parts = [f"{self.source}: key '{self.key_path}': {problem}"]
        if value is not _NO_VALUE:
            parts.append(f"got {short_repr(value)}")
        candidates = list(suggestions)
        if allowed is not None:
            if isinstance(allowed, str):
                parts.append(f"allowed: {allowed}")
            else:
                allowed = list(allowed)
                parts.append("allowed: " + ", ".join(short_repr(a) for a in allowed))
                candidates += [a for a in allowed if isinstance(a, str)]
        if value is not _NO_VALUE and isinstance(value, str) and candidates:
            hint = closest(value, candidates)
            if hint is not None and hint != value:
                parts.append(f"did you mean {hint!r}?")
        error = ConfigError("; ".join(parts))
        error.key_path = self.path
        return error


class AlreadyInitializedError(NvdlfwInspectError, RuntimeError, ValueError):
    """``initialize`` was called twice without ``end_debug`` in between."""


class DistributedDesyncError(NvdlfwInspectError, RuntimeError):
    """The ranks of a statistics reduction group are not in the same ``debug_api.step()``: one skipped
    or repeated it, or did not answer within ``collective_timeout``. Names the ranks and iterations."""


class DistributedDesyncWarning(UserWarning):
    """A rank of a statistics reduction group went away: warned, not raised, as the run goes on without it (the
    other ranks log their own statistics of that group from then on). Names the ranks."""


class UnsafeLogPathError(NvdlfwInspectError, OSError):
    """A log file's path goes through a symbolic link out of ``log_dir`` (or is a link itself): following it
    would truncate and overwrite a file outside the log directory. Names the link and its target."""


class LogDirInUseError(NvdlfwInspectError, RuntimeError):
    """Another live process holds the same ``log_dir`` at the same rank: a second run there would truncate its
    logs, and both would write as one rank. Names the holder's pid and host."""


class NonFiniteError(NvdlfwInspectError, FloatingPointError):
    """A step computed NaN or inf (``NonfiniteGuard`` with ``on_nonfinite: raise``). Names the first layer, GEMM,
    tensor and micro-batch in execution order, and the step; those are None when only another rank saw it."""

    def __init__(
        self,
        message: str,
        layer: str | None = None,
        gemm: str | None = None,
        tensor: str | None = None,
        micro_batch: int | None = None,
        step: int | None = None,
    ):
        super().__init__(message)
        self.layer, self.gemm, self.tensor, self.micro_batch, self.step = layer, gemm, tensor, micro_batch, step


class PoisonedCheckpointError(NvdlfwInspectError, RuntimeError):
    """A checkpoint was to be saved after a step computed NaN or inf (``debug_api.run_poisoned()``): it would keep
    the poisoned state. Names the first non-finite tensor."""
