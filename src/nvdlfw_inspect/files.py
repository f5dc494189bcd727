"""Writing the files the commands make (a report, a config of remedies, a comparison page) so that a full
disk or an unwritable directory costs only the new file: the text goes to a temporary file beside the
target and replaces it only once complete, so the previous file is never left cut short."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from nvdlfw_inspect.errors import NvdlfwInspectError


class WriteError(NvdlfwInspectError, OSError):
    """A file could not be written: the message names it and the cause; the previous file is intact."""


def replace_whole(path: str | Path, write: Callable[[BinaryIO], object]) -> None:
    """``write`` the new content into a temporary file beside ``path`` (created exclusively, so no link planted
    there is followed), then ``os.replace`` it: ``path`` holds the previous file or the whole new one, never a part.
    On any failure (a full disk, Ctrl-C) the temporary file is removed and the error goes on."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(temporary, "xb") as file:
            write(file)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise


def write_text_atomic(path: str | Path, text: str, what: str = "the file") -> Path:
    """Write ``text`` to ``path`` (UTF-8, synced to the disk) with ``replace_whole``. Any ``OSError`` becomes a
    ``WriteError`` naming ``what``, the path and the cause."""

    def write(file: BinaryIO) -> None:
        file.write(text.encode("utf-8"))
        file.flush()
        os.fsync(file.fileno())

    path = Path(path)
    try:
        replace_whole(path, write)
    except OSError as error:
        failure = WriteError(f"cannot write {what} to '{path}': {error.strerror or error}")
        failure.errno = error.errno
        raise failure from None
    return path


def file_system(path: str | Path) -> str:
    """The file system ``path`` is on, by its mount point, and its free space now (``the file system at /data
    (0 bytes free)``): a message about a full disk names the disk to clear, not only the file that failed."""
    place = os.path.abspath(path)
    while not os.path.exists(place) and place != os.path.dirname(place):
        place = os.path.dirname(place)
    mount = place
    while not os.path.ismount(mount) and mount != os.path.dirname(mount):
        mount = os.path.dirname(mount)
    try:
        free = f"{shutil.disk_usage(place).free} bytes free"
    except OSError as error:
        free = f"free space unknown: {error.strerror or error}"
    return f"the file system at {mount} ({free})"
