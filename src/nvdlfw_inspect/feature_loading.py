"""Load feature directories and collect the namespace APIs and features they register.

A directory that is an importable package is imported by its dotted name, so its classes are the same
objects that a normal ``import`` gives. Any other directory is loaded file by file, with the directory
on ``sys.path`` meanwhile so that files can import their siblings. Modules are kept in ``sys.modules``
and never executed twice; registration tags let the registry be rebuilt after ``end_debug``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from nvdlfw_inspect.errors import FeatureLoadError
from nvdlfw_inspect.registry import registrations_of

BUILTIN_FEATURE_DIR = Path(__file__).parent / "debug_features"
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


def load_feature_dirs(dirs: list[Path]) -> list[type]:
    """Import every ``*.py`` file under the built-in and the given directories; return tagged classes in order."""
    classes: list[type] = []
    for directory in dict.fromkeys([BUILTIN_FEATURE_DIR, *_default_feature_dirs, *dirs]):
        for module in _load_directory(directory):
            for value in list(vars(module).values()):
                if isinstance(value, type) and registrations_of(value) and value not in classes:
                    classes.append(value)
    return classes


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
    name = path.parent.name if path.stem == "__init__" else path.stem
    existing = sys.modules.get(name)
    if existing is not None:
        if _module_file(existing) == path.resolve():
            return existing
        digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
        name = f"_nvdlfw_features_{digest}.{name}"
        if name in sys.modules:
            return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise FeatureLoadError(f"feature file {str(path)!r} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as error:
        sys.modules.pop(name, None)
        raise FeatureLoadError(f"feature file {str(path)!r} failed to import: {type(error).__name__}: {error}") from error
    finally:
        if str(path.parent) in sys.path:
            sys.path.remove(str(path.parent))
    return module


def _module_file(module: ModuleType) -> Path | None:
    file = getattr(module, "__file__", None)
    return Path(file).resolve() if file else None
