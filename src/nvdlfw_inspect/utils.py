"""Call-site identifiers, once-only messages and docstring helpers; the distributed helpers of the reference's
``utils`` live in ``distributed`` and are exported here too, as code written for the reference imports them."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from nvdlfw_inspect.distributed import (
    gather_along_first_dim,
    gather_tensor_on_last_rank,
    get_distributed_rank,
    get_distributed_world_size,
    is_distributed,
)
from nvdlfw_inspect.errors import FeatureLoadError
from nvdlfw_inspect.logging import SingleMessageLogger

__all__ = [
    "APICacheIdentifier",
    "SingleMessageLogger",
    "append_parent_docstring",
    "gather_along_first_dim",
    "gather_tensor_on_last_rank",
    "get_distributed_rank",
    "get_distributed_world_size",
    "import_and_exec_module",
    "is_distributed",
]


def import_and_exec_module(module_path: str | os.PathLike) -> ModuleType:
    """Run the Python file ``module_path`` as a new module named after the file, and return it.

    Every call runs the file again (as in the reference), so registration decorators in it register again
    after ``Registry.reset()``; the module is not added to ``sys.modules``. While it runs, its directory is
    first on ``sys.path``, so it can import the files beside it. A failure raises ``FeatureLoadError``.
    """
    path = Path(module_path)
    if not path.is_file():
        raise FeatureLoadError(f"module file not found: {str(path)!r} (current directory: {os.getcwd()})")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise FeatureLoadError(f"{str(path)!r} cannot be loaded as a Python module (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    directory = str(path.resolve().parent)
    sys.path.insert(0, directory)
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as error:
        raise FeatureLoadError(f"module file {str(path)!r} failed to run: {type(error).__name__}: {error}") from error
    finally:
        sys.path.remove(directory)
    return module


class APICacheIdentifier:
    """Remembers the user line that last touched the debug API, so routing results can be cached per call site.
    Per thread: a call of another thread in between must not lend its line to this thread's routing."""

    _local = threading.local()

    @classmethod
    def save_call_details(cls, depth: int = 2) -> None:
        """Record ``file.line`` of the frame ``depth`` levels above this method (default: the caller's caller)."""
        frame = sys._getframe(depth)
        cls._local.call_details = f"{frame.f_code.co_filename}.{frame.f_lineno}"
        del frame

    @classmethod
    def get_call_details(cls) -> str | None:
        return getattr(cls._local, "call_details", None)

    @classmethod
    def get_unique_identifier(
        cls,
        cacheable_apis: dict[str, list[str]],
        layer_name: str | None,
        api_name: str,
        **kwargs: Any,
    ) -> str | None:
        """Cache key ``{call site}.{layer}.{api}.{kwarg}...`` for cacheable APIs, None for the rest."""
        keys = cacheable_apis.get(api_name)
        if keys is None:
            return None
        uid = f"{cls.get_call_details()}.{layer_name}.{api_name}"
        for key in keys:
            uid += f".{kwargs.get(key, 0)}"
        return uid

    @classmethod
    def reset(cls) -> None:
        cls._local = threading.local()


def append_parent_docstring(parent: type) -> Callable[[type], type]:
    """Class decorator: append ``parent``'s docstring to the decorated class's own, separated by a blank line."""

    def decorate(cls: type) -> type:
        own = cls.__doc__ or ""
        cls.__doc__ = f"{own}\n\n{parent.__doc__ or ''}"
        return cls

    return decorate
