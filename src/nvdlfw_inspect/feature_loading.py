"""Load feature directories and collect the namespace APIs and features they register.

Every ``*.py`` file below a feature directory is executed. A directory that is an importable package is
imported by its dotted name, so its classes are the same objects that a normal ``import`` gives. Any
other directory is loaded file by file under private names (``nvdlfw_inspect._features.<dir>_<hash>.<file>``),
so that a feature file named like another module (``smtplib.py``) never takes that module's place in
``sys.modules``; while a file runs, ``import sibling`` finds the file beside it, as if the directory were
on ``sys.path``. Modules are never executed twice; registration tags let the registry be rebuilt after
``end_debug``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from nvdlfw_inspect.errors import FeatureLoadError
from nvdlfw_inspect.registry import LoadedClasses, registrations_of

BUILTIN_FEATURE_DIR = Path(__file__).parent / "debug_features"
PRIVATE_PACKAGE = "nvdlfw_inspect._features"
_NON_IDENTIFIER = re.compile(r"\W")
# Bare names under which feature files imported their siblings during the current load: kept until
# its end (a file may import a module of a directory loaded before it), then removed.
_sibling_aliases: dict[str, ModuleType] = {}
_default_feature_dirs: list[Path] = []


def register_default_feature_dir(directory: str | os.PathLike) -> None:
    """Load ``directory`` at every ``initialize`` as if it were in ``feature_dirs``.

    Libraries that ship a namespace (``lowprec`` does for ``transformer_engine``) call this on import,
    so that configs naming their features work without extra ``feature_dirs``.
    """
    path = Path(directory).resolve()
    if not path.is_dir():
        raise FeatureLoadError(f"default feature directory not found: {str(path)!r}")
    if path not in _default_feature_dirs:
        _default_feature_dirs.append(path)


def normalize_feature_dirs(feature_dirs: Any) -> list[Path]:
    """Accept None, a path, or a list/tuple of paths; every path must be an existing directory."""
    if feature_dirs is None or feature_dirs == "":
        return []
    if isinstance(feature_dirs, (str, os.PathLike)):
        feature_dirs = [feature_dirs]
    if not isinstance(feature_dirs, (list, tuple)):
        raise TypeError(f"feature_dirs must be a path or a list of paths, got {type(feature_dirs).__name__}")
    dirs = []
    for entry in feature_dirs:
        if not isinstance(entry, (str, os.PathLike)):
            raise TypeError(f"feature_dirs entries must be paths, got {entry!r}")
        if os.fspath(entry) == "":
            raise FeatureLoadError(f"feature_dirs contains an empty path: {feature_dirs!r}")
        path = Path(entry)
        if path.exists() and not path.is_dir():
            raise FeatureLoadError(f"feature directory {str(path)!r} is not a directory")
        if not path.is_dir():
            raise FeatureLoadError(f"feature directory not found: {str(path)!r} (current directory: {os.getcwd()})")
        dirs.append(path.resolve())
    return dirs


def load_feature_dirs(dirs: list[Path]) -> LoadedClasses:
    """Import every ``*.py`` file under the built-in, the default and the given directories; return the tagged
    classes in load order, marking those defined in ``dirs`` (see ``registry`` for their precedence)."""
    classes: dict[type, None] = {}
    from_user: set[type] = set()
    try:
        for directory in _load_order(dirs):
            for module in _load_directory(directory):
                for value in list(vars(module).values()):
                    if isinstance(value, type) and registrations_of(value):
                        classes.setdefault(value)
                        if directory in dirs and value.__module__ == module.__name__:
                            from_user.add(value)
    finally:
        _drop_sibling_aliases()
    return LoadedClasses(classes, from_user)


def _load_order(dirs: list[Path]) -> list[Path]:
    """The built-in directory, the default ones the user did not name, then ``dirs`` in the user's order."""
    defaults = [d for d in _default_feature_dirs if d not in dirs]
    return list(dict.fromkeys([BUILTIN_FEATURE_DIR, *defaults, *dirs]))


def _drop_sibling_aliases() -> None:
    """Remove the bare names of the load, so that none shadows another module afterwards."""
    for name, module in _sibling_aliases.items():
        if sys.modules.get(name) is module:
            del sys.modules[name]
    _sibling_aliases.clear()


def _python_files(directory: Path) -> list[Path]:
    """Every ``*.py`` file below ``directory``, skipping ``__pycache__`` and hidden entries (``.ipynb_checkpoints``)."""
    return sorted(
        p
        for p in directory.rglob("*.py")
        if not any(part == "__pycache__" or part.startswith(".") for part in p.relative_to(directory).parts)
    )


def _package_name(directory: Path) -> str | None:
    """The dotted name under which ``directory`` is importable as a package, if it is."""
    parts: list[str] = []
    current = directory
    while (current / "__init__.py").is_file():
        parts.insert(0, current.name)
        current = current.parent
    if not parts:
        return None
    dotted = ".".join(parts)
    try:
        spec = importlib.util.find_spec(dotted)
    except (ImportError, ValueError):
        return None
    except Exception as error:
        raise FeatureLoadError(
            f"feature directory {str(directory)!r} is package {dotted!r}, whose import failed: {type(error).__name__}: {error}"
        ) from error
    if spec is None or spec.origin is None or Path(spec.origin).resolve() != (directory / "__init__.py").resolve():
        return None
    return dotted


def _load_directory(directory: Path) -> list[ModuleType]:
    package = _package_name(directory)
    modules = []
    for path in _python_files(directory):
        if package is not None:
            relative = path.relative_to(directory).with_suffix("").parts
            if relative[-1] == "__init__":
                relative = relative[:-1]
            modules.append(_import(".".join((package, *relative)), path))
        else:
            modules.append(_load_file(path))
    return modules


def _import(name: str, path: Path) -> ModuleType:
    try:
        return importlib.import_module(name)
    except (Exception, SystemExit) as error:
        raise FeatureLoadError(f"feature file {str(path)!r} failed to import: {type(error).__name__}: {error}") from error


def _load_file(path: Path) -> ModuleType:
    """The module of feature file ``path``, executed on first use under its private name."""
    if path.name == "__init__.py":
        return _directory_package(path.parent)
    existing = sys.modules.get(path.stem)
    if existing is not None and _module_file(existing) == path.resolve():
        return existing  # imported by its user under its own name: executing it again would make new classes
    name = f"{_directory_package(path.parent).__name__}.{path.stem}"
    return sys.modules.get(name) or _execute(name, path)


def _directory_package(directory: Path) -> ModuleType:
    """The private package whose ``__path__`` is ``directory`` (so relative imports work): its ``__init__.py``
    when it has one, else an empty package."""
    readable = _NON_IDENTIFIER.sub("_", directory.name)
    name = f"{PRIVATE_PACKAGE}.{readable}_{hashlib.sha1(str(directory).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    if (directory / "__init__.py").is_file():
        return _execute(name, directory / "__init__.py")
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [str(directory)]
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    return module


def _execute(name: str, path: Path) -> ModuleType:
    """Run ``path`` as module ``name`` (a package for ``__init__.py``); a failure names the file and leaves
    nothing in ``sys.modules``."""
    package_path = [str(path.parent)] if path.name == "__init__.py" else None
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=package_path)
    if spec is None or spec.loader is None:
        raise FeatureLoadError(f"feature file {str(path)!r} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        with _SiblingImports(path.parent):
            spec.loader.exec_module(module)
    except (Exception, SystemExit) as error:
        sys.modules.pop(name, None)
        raise FeatureLoadError(f"feature file {str(path)!r} failed to import: {type(error).__name__}: {error}") from error
    return module


class _SiblingImports(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """While a feature file runs, ``import sibling`` (``sibling.py`` or ``sibling/__init__.py`` beside it,
    and their submodules) gives the sibling's private module, as when the directory was on ``sys.path``.
    ``load_feature_dirs`` removes the bare names from ``sys.modules`` at its end."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def __enter__(self) -> _SiblingImports:
        sys.meta_path.insert(0, self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        sys.meta_path.remove(self)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        parent, _, child = fullname.rpartition(".")
        if parent and parent not in _sibling_aliases:
            return None  # a submodule of a module that is no sibling
        base = Path(path[0]) / child if parent else self.directory / child  # path: the parent's __path__
        if (base / "__init__.py").is_file():
            return importlib.machinery.ModuleSpec(fullname, self, loader_state=base / "__init__.py", is_package=True)
        if base.with_name(base.name + ".py").is_file():
            return importlib.machinery.ModuleSpec(fullname, self, loader_state=base.with_name(base.name + ".py"))
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = _load_file(spec.loader_state)
        _sibling_aliases[spec.name] = module
        self.specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.specs[module.__name__]  # the import system set the alias's spec; the module ran already


def _module_file(module: ModuleType) -> Path | None:
    file = getattr(module, "__file__", None)
    return Path(file).resolve() if file else None
