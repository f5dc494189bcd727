"""The log-dir lock: one live run per ``log_dir`` and rank."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket

from nvdlfw_inspect.errors import LogDirInUseError
from nvdlfw_inspect.logging.files import _SPACE_ERRORS, WriteFaults, _open_inside, print_warning
from nvdlfw_inspect.logging.settings import MAIN_LOG_DIR, _global_rank, log_file_name


class LogDirLock:
    """Held from ``initialize`` to ``end_debug`` (the OS releases it if the process dies): a second live process on
    the same ``log_dir`` at the same rank would truncate this one's logs and then write as the same rank, so it is
    refused (``LogDirInUseError``, naming this process's pid and host from the lock file). A lock file that cannot
    be created for lack of space is a write fault like the logs'; a file system without locks is warned about."""

    def __init__(self, log_dir: str, faults: WriteFaults):
        self.path = os.path.join(log_dir, MAIN_LOG_DIR, os.path.splitext(log_file_name())[0] + ".lock")
        self._fd: int | None = None
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd = _open_inside(log_dir, self.path, os.O_RDWR | os.O_CREAT)
        except OSError as error:
            if error.errno not in _SPACE_ERRORS:
                raise
            faults.failed(self.path, 0, error)
            return
        # A POSIX record lock belongs to this process: a forked child (a DataLoader worker) does not hold it. Closing
        # any descriptor of the file releases it, so this class is the file's only opener.
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EACCES, errno.EAGAIN):
                print_warning(
                    f"cannot lock {self.path} ({error}): on this file system a second live run in this log_dir at "
                    "this rank is not refused, and would mix its logs with this run's"
                )
                self._keep(fd)
                return
            holder = os.pread(fd, 256, 0).decode("utf-8", "replace").strip() or "a process that has not named itself yet"
            os.close(fd)
            raise LogDirInUseError(
                f"log_dir {log_dir} is in use at rank {_global_rank()} by another live run ({holder}; lock file "
                f"{self.path}): a second run there would truncate its logs and both would write as one rank. Use "
                "another log_dir, or end that run first (its lock goes at end_debug() or when its process ends)."
            ) from None
        self._keep(fd)

    def _keep(self, fd: int) -> None:
        self._fd = fd
        with contextlib.suppress(OSError):  # the holder's name helps the refused run; a full disk may keep it out
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)

    def release(self) -> None:
        """Closing the file releases the lock; the file stays (removing it would race with a run taking it)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
