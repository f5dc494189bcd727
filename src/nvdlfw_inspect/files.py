"""Writing the files the commands make (a report, a config of remedies, a comparison page) so that a full
disk or an unwritable directory costs only the new file: the text goes to a temporary file beside the
target and replaces it only once complete, so the previous file is never left cut short."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from nvdlfw_inspect.errors import NvdlfwInspectError


class WriteError(NvdlfwInspectError, OSError):
    """A file could not be written: the message names it and the cause; the previous file is intact."""


def write_text_atomic(path: str | Path, text: str, what: str = "the file") -> Path:
    """Write ``text`` to ``path`` (UTF-8) through a temporary file in the same directory and ``os.replace``.
    Any ``OSError`` becomes a ``WriteError`` naming ``what``, the path and the cause; the temporary file is
    removed."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(temporary, "x", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except OSError as error:
        with contextlib.suppress(OSError):
            temporary.unlink()
        failure = WriteError(f"cannot write {what} to '{path}': {error.strerror or error}")
        failure.errno = error.errno
        raise failure from None
    return path
