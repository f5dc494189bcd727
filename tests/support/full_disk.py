"""A full disk without a tmpfs: ``nvdlfw_inspect.files`` opens its files through a fault-injecting file
object whose writes put part of the text down and then raise ``OSError(ENOSPC)``, as a disk that fills up
mid-write does."""

from __future__ import annotations

import builtins
import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nvdlfw_inspect import files

NO_SPACE = os.strerror(errno.ENOSPC)


class FullFile:
    """A file whose ``write`` writes its first half and then raises ENOSPC."""

    def __init__(self, file: Any) -> None:
        self._file = file

    def write(self, text: str) -> int:
        self._file.write(text[: len(text) // 2])
        raise OSError(errno.ENOSPC, NO_SPACE)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def __enter__(self) -> FullFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


def fill_disk(monkeypatch: pytest.MonkeyPatch, where: Callable[[Path], bool] = lambda path: True) -> None:
    """From now on, files that ``nvdlfw_inspect.files`` writes at a path ``where`` accepts hit a full disk."""

    def opened(path: Any, *args: Any, **kwargs: Any) -> Any:
        file = builtins.open(path, *args, **kwargs)
        return FullFile(file) if where(Path(path)) else file

    monkeypatch.setattr(files, "open", opened, raising=False)
