"""The log files and their safety: whole lines only (a crash or Ctrl-C never leaves a torn line), no symbolic link
followed out of ``log_dir``, and write errors (a full disk) counted and said once instead of stopping training."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys

from nvdlfw_inspect.errors import UnsafeLogPathError

LOG_FORMAT = "%(asctime)s - %(levelname)s - %(message)s"
STDERR_FORMAT = "NVDLFW INSPECT - %(asctime)s - %(levelname)s - %(message)s"
_SPACE_ERRORS = (errno.ENOSPC, errno.EDQUOT)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # where the platform has it; link_out_of checks the path everywhere


def link_out_of(root: str, path: str) -> str | None:
    """``"LINK -> TARGET"`` for the first symbolic link on the way from ``root`` down to ``path`` (``path`` included)
    that leads out of ``root``, else None. A link planted in ``log_dir`` must not make the logs or dumps truncate and
    overwrite a file elsewhere; links inside ``root`` (and ``root`` itself being one) are fine."""
    real_root = os.path.realpath(root)
    current = root
    for part in os.path.relpath(path, root).split(os.sep):
        current = os.path.join(current, part)
        if os.path.islink(current):
            target = os.path.realpath(current)
            if os.path.commonpath([real_root, target]) != real_root:
                return f"{current} -> {os.readlink(current)}"
    return None


def print_warning(message: str) -> None:
    """A warning on stderr, formatted as the debug log's stderr lines, that never raises: it reports failures of the
    logs themselves, and training must go on (a ``warnings.warn`` could be turned into an exception by ``-W error``)."""
    record = logging.makeLogRecord({"msg": message, "levelno": logging.WARNING, "levelname": "WARNING"})
    with contextlib.suppress(Exception):
        sys.stderr.write(logging.Formatter(STDERR_FORMAT).format(record) + "\n")
        sys.stderr.flush()


class WriteFaults:
    """The write errors of one run's log files. Training goes on without the lines that could not be written: the
    first error is warned about once, the lost lines are counted and summed up at ``end_debug``; ``strict`` raises."""

    def __init__(self, strict: bool = False):
        self.strict = strict
        self.first: OSError | None = None
        self.lost: dict[str, int] = {}
        self.errors: dict[str, OSError] = {}  # each file's first error: the cause its loss note names

    def failed(self, path: str, lines: int, error: OSError) -> None:
        if self.strict:
            raise error
        if lines:
            self.lost[path] = self.lost.get(path, 0) + lines
        self.errors.setdefault(path, error)
        if self.first is None:
            self.first = error
            print_warning(
                f"cannot write {path}: {error}. Training goes on; log lines that cannot be written are dropped and "
                "counted, and every later write tries again (initialize(..., strict_logging=True) raises instead)."
            )

    def summary(self) -> str | None:
        """How many lines were lost where, or None when every line was written."""
        if not self.lost:
            return None
        where = ", ".join(f"{count} in {path}" for path, count in self.lost.items())
        return f"{sum(self.lost.values())} log lines were lost to write errors (the first: {self.first}): {where}"


def _complete_lines_end(fd: int, size: int) -> int:
    """Where the last complete line of an open file ends: a torn last line that an earlier run left (killed while
    writing) is cut off there before appending, since the first new line would run into it, and a torn line in the
    middle of a file is corruption to the readers."""
    end = size
    while end > 0:
        start = max(0, end - 65536)
        newline = os.pread(fd, end - start, start).rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        end = start
    return 0


def _open_inside(root: str, path: str, flags: int) -> int:
    """``os.open`` of a file of the logs, never through a symbolic link out of ``root`` nor a link in place of the
    file itself: a link planted there would have its target truncated and overwritten (``UnsafeLogPathError``)."""
    link = link_out_of(root, path)
    if link is None:
        try:
            return os.open(path, flags | _NOFOLLOW, 0o666)
        except OSError as error:
            if error.errno != errno.ELOOP or not os.path.islink(path):
                raise
            link = f"{path} -> {os.readlink(path)}"
    raise UnsafeLogPathError(
        f"refusing to write the log {path} through the symbolic link {link}: log files are written only inside "
        f"log_dir ({root}) and never through a link, which would overwrite its target. Remove the link or choose "
        "another log_dir."
    )


class LogFile:
    """An append-only log file written whole lines at a time: ``add`` queues lines, ``commit`` writes them in one
    ``write`` on an unbuffered descriptor, so a process killed between commits leaves complete lines only (the
    kernel keeps what was written; nothing waits in a user-space buffer to be written in pieces). A failed commit (a
    full disk) is cut back to the previous one and its lines are counted in ``faults``; every later commit tries
    again, also creating the file if a full disk kept it from being created. A commit interrupted part way
    (``KeyboardInterrupt``) is cut back too, so a step is in the file whole or not at all."""

    def __init__(self, path: str, root: str, overwrite: bool, faults: WriteFaults):
        self.path = path
        self._root = root
        self._faults = faults
        self._overwrite = overwrite
        self.overwritten = False  # an earlier run's lines were truncated
        self._pending: list[str] = []
        self._fd: int | None = None
        self._size = 0
        self._closed = False
        try:
            self._open()
        except OSError as error:
            if error.errno not in _SPACE_ERRORS:
                raise  # a wrong path or permission: a mistake to report at initialize
            faults.failed(path, 0, error)

    def _open(self) -> None:
        """Open (and create) the file inside ``root``, never through a symbolic link (``UnsafeLogPathError``)."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = _open_inside(self._root, self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND)
        try:
            size = os.fstat(fd).st_size
            self._size = 0 if self._overwrite else _complete_lines_end(fd, size)
            self.overwritten = self._overwrite and size > 0
            if self._size < size:
                os.ftruncate(fd, self._size)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def add(self, lines: str) -> None:
        """Queue whole lines (each ending in a newline) for the next ``commit``."""
        self._pending.append(lines)

    def drop_pending(self) -> None:
        self._pending = []

    def commit(self) -> None:
        if self._closed:
            raise ValueError(f"{self.path} is closed")
        if not self._pending:
            return
        lines, self._pending = self._pending, []
        try:
            if self._fd is None:
                self._open()
            self._write("".join(lines).encode("utf-8"))
        except OSError as error:
            self._cut_back()
            self._faults.failed(self.path, sum(text.count("\n") for text in lines), error)
        except BaseException:
            self._cut_back()  # interrupted mid-write (Ctrl-C): the file keeps whole commits, this one goes
            raise

    def _write(self, data: bytes) -> None:
        """One ``write`` unless the kernel takes less (then the rest, which on a full disk fails)."""
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]
        self._size += len(data)

    def _cut_back(self) -> None:
        """Truncate a partly written commit, so the file ends with the last complete one."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.commit()
        finally:
            self._closed = True
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class LogFileHandler(logging.Handler):
    """Python logging into a ``LogFile``, one write per message. A failed write is the file's to count and report
    once, not logging's "--- Logging error ---" and traceback for every message."""

    def __init__(self, file: LogFile):
        super().__init__()
        self.file = file
        self.setFormatter(logging.Formatter(LOG_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)  # a message that does not format: logging's usual report
            return
        self.file.add(_one_line(line) + "\n")
        self.file.commit()

    def close(self) -> None:
        try:
            self.file.close()
        finally:
            super().close()


def _one_line(text: str) -> str:
    """``text`` with its line breaks escaped (``\\n``, ``\\r``): in a text log a record is a line, so that a name
    holding a newline cannot forge a line of its own; and ``encodable``."""
    return encodable(text.replace("\n", "\\n").replace("\r", "\\r"))


def encodable(text: str) -> str:
    """``text`` with its lone surrogates (``\\udcff``: what undecodable bytes of a file name give) escaped: UTF-8
    cannot hold them, so a file's write, or any handler or process that a message goes on to, would fail."""
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")
