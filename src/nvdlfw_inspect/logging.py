"""The main debug log, the statistics loggers (file, TensorBoard, custom) and logging-window helpers.

Directory names, file names and line formats match the reference framework, since users parse them. The
structured statistics records, which the reference does not write, go to a directory of their own
(``STATISTICS_RECORDS_DIR``), so that scripts reading every file of ``STATISTICS_LOG_DIR`` find only text logs;
so do the routing records (``ROUTING_RECORDS_DIR``: which GEMM read which tensor in which precision).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import re
import socket
import sys
import time
import warnings
from collections.abc import Hashable, Iterator
from typing import Any

from nvdlfw_inspect.distributed import get_distributed_rank, is_distributed
from nvdlfw_inspect.errors import LogDirInUseError, UnsafeLogPathError
from nvdlfw_inspect.statistics_logger import BaseLogger
from nvdlfw_inspect.wandb_logger import WandbLogger

MAIN_LOG_DIR = "nvdlfw_inspect_logs"
STATISTICS_LOG_DIR = "nvdlfw_inspect_statistics_logs"
STATISTICS_RECORDS_DIR = "nvdlfw_inspect_statistics_jsonl"
ROUTING_RECORDS_DIR = "nvdlfw_inspect_routing_jsonl"
ROUTING_GEMMS = ("fprop", "dgrad", "wgrad")
#: fp8: the recipe's quantized operand; high_precision: the GEMM reads the tensor unquantized; modified: a feature's
#: ``modify_tensor`` produced the operand
ROUTING_DECISIONS = ("fp8", "high_precision", "modified")
LOG_FORMAT = "%(asctime)s - %(levelname)s - %(message)s"
STDERR_FORMAT = "NVDLFW INSPECT - %(asctime)s - %(levelname)s - %(message)s"

ENV_LOG_LEVEL = "NVDLFW_INSPECT_LOG_LEVEL"
ENV_OVERWRITE = "NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE"
ENV_TIMESTAMP = "NVDLFW_INSPECT_ENABLE_LOG_TIMESTAMP"
ENV_TIMESTAMP_VALUE = "NVDLFW_INSPECT_LOG_TIMESTAMP"
_LEVEL_NAMES = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "NOTSET")
_SAFE_STAMP = re.compile(r"[A-Za-z0-9._-]{1,64}")
_SPACE_ERRORS = (errno.ENOSPC, errno.EDQUOT)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # where the platform has it; link_out_of checks the path everywhere


Statistic = tuple[str, str, str, float, int]  # (layer, tensor, stat, value, iteration)


class MetricLogger:
    """Fans each statistic out to every enabled statistics logger. A logger that raises costs its own records
    only: they are dropped and counted, the first failure is said once, ``end_debug`` says how many were lost,
    and the other loggers and the training go on (``strict_logging`` raises the logger's error instead)."""

    enabled_loggers: list[BaseLogger] = []
    failures: dict[int, tuple[str, str, int]] = {}  # id(logger) -> (its class, its first error, records dropped)

    @classmethod
    def _failed(cls, logger: BaseLogger, records: int, error: Exception) -> None:
        """Count a logger's lost records and say its first failure; under ``strict_logging`` raise instead."""
        if LOGGER is not None and LOGGER.faults.strict:
            raise error
        key = id(logger)
        if key not in cls.failures:
            cls.failures[key] = (type(logger).__name__, f"{type(error).__name__}: {error}", 0)
            say_once(
                f"statistics logger {cls.failures[key][0]} failed ({cls.failures[key][1]}): its records are dropped "
                "and counted, the other loggers and the training go on (initialize(..., strict_logging=True) raises "
                "instead).",
                call_site=__name__,
            )
        name, first, dropped = cls.failures[key]
        cls.failures[key] = (name, first, dropped + records)

    @classmethod
    def log_scalar(cls, name: str, value: Any, iteration: int, **kwargs: Any) -> None:
        for logger in cls.enabled_loggers:
            try:
                logger.log_scalar(name, value, iteration, **kwargs)
            except Exception as error:
                cls._failed(logger, 1, error)

    @classmethod
    def log_statistic(cls, layer: str, tensor: str, stat: str, value: float, iteration: int) -> None:
        """One statistic of a layer's tensor (see ``_log_one``)."""
        for logger in cls.enabled_loggers:
            try:
                _log_one(logger, (layer, tensor, stat, value, iteration))
            except Exception as error:
                cls._failed(logger, 1, error)

    @classmethod
    def log_statistics(cls, records: list[Statistic]) -> None:
        """Many statistics at once (a step's): loggers that take a whole batch (``log_statistics``) get the list,
        the others each record as ``_log_one`` hands it to them."""
        for logger in cls.enabled_loggers:
            batch = getattr(logger, "log_statistics", None)
            if batch is not None:
                try:
                    batch(records)
                except Exception as error:
                    cls._failed(logger, len(records), error)
                continue
            for record in records:
                try:
                    _log_one(logger, record)
                except Exception as error:
                    cls._failed(logger, 1, error)

    @classmethod
    def add_logger(cls, logger: BaseLogger) -> None:
        cls.enabled_loggers.append(logger)

    @classmethod
    def _each(cls, method: str) -> None:
        """Call ``method`` of every logger that has it; a failure costs what that logger held."""
        for logger in cls.enabled_loggers:
            call = getattr(logger, method, None)
            if call is not None:
                try:
                    call()
                except Exception as error:
                    cls._failed(logger, 0, error)

    @classmethod
    def flush(cls) -> None:
        """Let loggers that batch (those with a ``flush`` method) send what they hold."""
        cls._each("flush")

    @classmethod
    @contextlib.contextmanager
    def batch(cls) -> Iterator[None]:
        """Log many statistics at once (a step): loggers that can (``hold_flushes``) stop flushing line by line,
        and every logger is flushed once at the end. A batch cut short (Ctrl-C, an error of the caller) is written
        whole or not at all: loggers that hold lines (``drop_held``) drop them."""
        cls._each("hold_flushes")
        try:
            yield
        except BaseException:
            cls._each("drop_held")
            raise
        finally:
            cls.flush()

    @classmethod
    def reset(cls) -> None:
        """Flush, say how many records each failing logger dropped, and forget every logger, even when a flush
        raises (``strict_logging``), so that the next ``initialize`` starts clean."""
        try:
            cls.flush()
            for name, first, dropped in cls.failures.values():
                if dropped:
                    say_once(f"statistics logger {name} dropped {dropped} statistics records (the first error: {first}).")
        finally:
            cls.enabled_loggers.clear()
            cls.failures.clear()


def _log_one(logger: BaseLogger, record: Statistic) -> None:
    """Loggers that keep structure (``log_statistic``) get a statistic's parts, the others
    ``log_scalar("{layer}_{tensor}_{stat}", ...)``."""
    layer, tensor, stat, value, iteration = record
    structured = getattr(logger, "log_statistic", None)
    if structured is not None:
        structured(layer, tensor, stat, value, iteration)
    else:
        logger.log_scalar(f"{layer}_{tensor}_{stat}", value, iteration)


class TensorboardLogger(BaseLogger):
    """Writes statistics as TensorBoard scalars through a ``SummaryWriter``-like object."""

    def __init__(self, writer: Any):
        self.writer = writer

    def log_scalar(self, name: str, value: Any, iteration: int, **kwargs: Any) -> None:
        if self.writer is not None:
            self.writer.add_scalar(name, _as_float(value), iteration)

    def flush(self) -> None:
        if self.writer is not None and hasattr(self.writer, "flush"):
            self.writer.flush()


def wrap_tensorboard_writer(writer: Any) -> TensorboardLogger:
    return TensorboardLogger(writer)


def wrap_wandb_logger(logger: Any) -> WandbLogger:
    """A statistics logger writing to Weights & Biases: ``logger`` is a run from ``wandb.init`` or Lightning's
    ``WandbLogger``, whose ``experiment`` is its run (NeMo's tensor-inspection callback passes that one, then
    ``MetricLogger.add_logger``). The run stays the caller's: finishing the debug session does not finish it."""
    run = getattr(logger, "experiment", logger)
    if not all(callable(getattr(run, method, None)) for method in ("log", "define_metric")):
        raise TypeError(
            "wrap_wandb_logger needs a W&B run (wandb.init's result) or a Lightning WandbLogger (its .experiment is "
            f"the run), got {type(logger).__name__}"
        )
    return WandbLogger(run)


def _as_float(value: Any) -> float:
    return float(value.item()) if hasattr(value, "item") else float(value)


def _env_int_flag(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer (0 or 1)") from None


def _log_level_from_env() -> int:
    raw = os.environ.get(ENV_LOG_LEVEL, "INFO")
    name = raw.strip().upper()
    if name not in _LEVEL_NAMES:
        raise ValueError(f"environment variable {ENV_LOG_LEVEL}={raw!r} is not a log level; allowed: {', '.join(_LEVEL_NAMES)}")
    return getattr(logging, name)


def _global_rank() -> int:
    """The rank used in log file names: the process group's if it exists, else the launcher's RANK variable."""
    if is_distributed():
        return get_distributed_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def log_file_name() -> str:
    """``nvdlfw_inspect[_YYYYmmdd_HHMMSS]_globalrank-{R}.log``; the timestamp is fixed once per process."""
    base = "nvdlfw_inspect"
    if _env_int_flag(ENV_TIMESTAMP):
        base += f"_{_timestamp()}"
    return f"{base}_globalrank-{_global_rank()}.log"


def _timestamp() -> str:
    """The preset stamp, or now's (kept in the environment for the ranks this process starts). A preset one becomes
    part of a file name, so it may not name a directory (``x/../../p`` would write outside ``log_dir``)."""
    stamp = os.environ.get(ENV_TIMESTAMP_VALUE)
    if not stamp:
        stamp = os.environ[ENV_TIMESTAMP_VALUE] = time.strftime("%Y%m%d_%H%M%S")
    if not _SAFE_STAMP.fullmatch(stamp) or ".." in stamp:
        raise ValueError(
            f"environment variable {ENV_TIMESTAMP_VALUE}={stamp!r} cannot be part of a log file name: "
            "use 1 to 64 of the characters A-Z a-z 0-9 . _ - and no '..'"
        )
    return stamp


def _overwrite() -> bool:
    overwrite = _env_int_flag(ENV_OVERWRITE)
    return overwrite is None or bool(overwrite)


def _log_dir_path(log_dir: Any) -> str:
    """``log_dir`` as an absolute path, fixed at ``initialize`` so that an ``os.chdir`` later moves no log or dump.
    None is an error, as in the reference framework (where ``os.path.join`` fails): neither a directory named "None"
    nor a silent fallback to the current directory, which would hide an unset setting."""
    path = os.fspath(log_dir) if isinstance(log_dir, str | os.PathLike) else None
    if not isinstance(path, str):
        raise TypeError(f"log_dir must be a directory path (str or os.PathLike), got {log_dir!r}; the default is '.'")
    return os.path.abspath(path)


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

    def failed(self, path: str, lines: int, error: OSError) -> None:
        if self.strict:
            raise error
        if lines:
            self.lost[path] = self.lost.get(path, 0) + lines
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
    holding a newline cannot forge a line of its own."""
    return text.replace("\n", "\\n").replace("\r", "\\r")


def _text_middle(iteration: int) -> str:
    """What follows a statistic's name in a text line of the statistics log, up to its value."""
    return f" \t\t\t\t iteration={iteration:06d} \t\t\t\t value="


def _record_middle(iteration: int) -> str:
    """What follows the names in a statistics record, up to its value."""
    return f', "iteration": {iteration}, "value": '


def _json_number(value: float) -> str:
    """A float as JSON: finite ones as numbers (``repr``, as ``json`` writes them); NaN and infinities
    as the strings ``float()`` reads back (strict JSON)."""
    return repr(value) if math.isfinite(value) else f'"{value}"'


class StatisticsFile:
    """The statistics log: text lines in the format of Python's logging (``LOG_FORMAT``), and in a file of
    ``STATISTICS_RECORDS_DIR`` (``.jsonl``) one JSON record per statistic with its layer, tensor, stat,
    iteration, value and rank. Written directly (``step()`` writes hundreds of lines and a ``LogRecord``
    each costs tens of microseconds), line by line, or while ``autoflush`` is off one write per file per
    batch (a step), so a crash leaves whole steps (see ``LogFile``)."""

    def __init__(self, path: str, records_path: str, root: str, overwrite: bool, faults: WriteFaults):
        self._file = LogFile(path, root, overwrite, faults)
        self._records = LogFile(records_path, root, overwrite, faults)
        self._rank = _global_rank()
        self._second = -1
        self._stamp = ""
        self._heads: dict[tuple[str, str, str], tuple[str, str]] = {}  # names -> (text line's, record's start)
        self.autoflush = True

    def _asctime(self) -> str:
        """``YYYY-mm-dd HH:MM:SS,mmm`` in local time, like ``logging.Formatter``."""
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second, self._stamp = second, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
        return f"{self._stamp},{int((now - second) * 1000):03d}"

    def write(self, message: str, level: int = logging.INFO) -> None:
        self._file.add(f"{self._asctime()} - {logging.getLevelName(level)} - {_one_line(message)}\n")
        if self.autoflush:
            self._file.commit()

    def _new_heads(self, names: tuple[str, str, str]) -> tuple[str, str]:
        """The text line's and the record's start for these names, encoded once per run."""
        record = ", ".join(f'"{key}": {json.dumps(name)}' for key, name in zip(("layer", "tensor", "stat"), names, strict=True))
        heads = self._heads[names] = (_one_line("_".join(names)), "{" + record)
        return heads

    def write_record(self, layer: str, tensor: str, stat: str, value: float, iteration: int) -> None:
        """``{"layer": ..., "tensor": ..., "stat": ..., "iteration": ..., "value": ..., "rank": ...}``
        as ``json.dumps`` writes it."""
        names = (layer, tensor, stat)
        record_head = (self._heads.get(names) or self._new_heads(names))[1]
        self._records.add(f'{record_head}{_record_middle(iteration)}{_json_number(value)}, "rank": {self._rank}}}\n')
        if self.autoflush:
            self._records.commit()

    def write_statistics(self, records: list[Statistic]) -> None:
        """A batch of statistics: their text lines (stamped with one time) and their records, each file in
        one write, formatted as ``FileLogger.log_scalar`` and ``write_record`` format one, with the parts
        that repeat (names, the iteration) formatted once."""
        prefix, tail = f"{self._asctime()} - INFO - ", f', "rank": {self._rank}}}\n'
        middles: dict[int, tuple[str, str]] = {}
        text, structured = [], []
        for layer, tensor, stat, value, iteration in records:
            names = (layer, tensor, stat)
            text_head, record_head = self._heads.get(names) or self._new_heads(names)
            middle = middles.get(iteration) or middles.setdefault(iteration, (_text_middle(iteration), _record_middle(iteration)))
            text.append(f"{prefix}{text_head}{middle[0]}{value:.4f}\n")
            structured.append(f"{record_head}{middle[1]}{_json_number(value)}{tail}")
        self._file.add("".join(text))
        self._records.add("".join(structured))
        if self.autoflush:
            self.flush()

    def flush(self) -> None:
        self.autoflush = True
        try:
            self._file.commit()
        finally:
            self._records.commit()

    def drop_held(self) -> None:
        """Forget the lines queued since ``autoflush`` went off (a batch cut short)."""
        self._file.drop_pending()
        self._records.drop_pending()

    def close(self) -> None:
        try:
            self._file.close()
        finally:
            self._records.close()


def routing_record(
    layer: str,
    gemm: str,
    tensor: str,
    decision: str,
    feature: str | None,
    recipe: bool,
    iteration: int,
    reason: str | None = None,
) -> dict[str, Any]:
    """A routing record's fields, checked (``ValueError``/``TypeError`` naming the field), in the file's order;
    ``reason`` only when given, so records without one keep their line format."""
    for name, value in (("layer", layer), ("tensor", tensor)):
        if not isinstance(value, str) or not value:
            raise TypeError(f"routing record: {name} must be a non-empty string, got {value!r}")
    if gemm not in ROUTING_GEMMS:
        raise ValueError(f"routing record: gemm must be one of {ROUTING_GEMMS}, got {gemm!r}")
    if decision not in ROUTING_DECISIONS:
        raise ValueError(f"routing record: decision must be one of {ROUTING_DECISIONS}, got {decision!r}")
    if feature is not None and (not isinstance(feature, str) or not feature):
        raise TypeError(f"routing record: feature must be a feature's name or None, got {feature!r}")
    if reason is not None and (not isinstance(reason, str) or not reason):
        raise TypeError(f"routing record: reason must be a non-empty string or None, got {reason!r}")
    if not isinstance(recipe, bool):
        raise TypeError(f"routing record: recipe must be True or False (whether a recipe is active), got {recipe!r}")
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"routing record: iteration must be a non-negative integer, got {iteration!r}")
    record = {
        "layer": layer,
        "gemm": gemm,
        "tensor": tensor,
        "decision": decision,
        "feature": feature,
        "recipe": recipe,
        "iteration": iteration,
    }
    return record if reason is None else record | {"reason": reason}


class FileLogger(BaseLogger):
    """The main debug log, and (once enabled) the default statistics log file.

    Both files are written after every line, or after every batch of statistics (``step()``), so
    nothing logged is lost if the process dies. Write errors (a full disk) never stop training
    unless ``strict``: see ``WriteFaults``.
    """

    def __init__(self, name: str, log_dir: Any, strict: bool = False):
        self.log_dir = _log_dir_path(log_dir)
        self.faults = WriteFaults(strict)
        self._lock = LogDirLock(self.log_dir, self.faults)
        try:
            self._open_main_log(name)
        except BaseException:
            self._lock.release()
            raise
        self.stats_file: StatisticsFile | None = None
        self.stats_log_path: str | None = None
        self.stats_records_path: str | None = None
        self.routing_file: LogFile | None = None  # opened with the statistics records, on the ranks that write them
        self.logged_api_executed: set[str] = set()
        self.logged_api_encountered: set[str | None] = set()

    def _open_main_log(self, name: str) -> None:
        self.logger = logging.getLogger(name)
        self.logger.setLevel(_log_level_from_env())
        self.logger.propagate = False
        self._handlers: list[tuple[logging.Logger, logging.Handler]] = []
        self.main_log_path = os.path.join(self.log_dir, MAIN_LOG_DIR, log_file_name())
        self._main_log = LogFileHandler(LogFile(self.main_log_path, self.log_dir, _overwrite(), self.faults))
        self._add(self.logger, self._main_log)
        stderr = logging.StreamHandler(sys.stderr)
        stderr.setLevel(logging.WARNING)
        stderr.setFormatter(logging.Formatter(STDERR_FORMAT))
        self._add(self.logger, stderr)

    @property
    def root_log_dir(self) -> str:
        """The reference's name for ``log_dir`` (the ``log_dir`` given to ``initialize``, which holds every log
        directory); Transformer Engine's ``DumpTensors`` writes its dumps below it."""
        return self.log_dir

    def _add(self, logger: logging.Logger, handler: logging.Handler) -> None:
        logger.addHandler(handler)
        self._handlers.append((logger, handler))

    def _initialize_stats_logger(self, dir_name: str = STATISTICS_LOG_DIR) -> FileLogger:
        if self.stats_file is None:
            name = log_file_name()
            self.stats_log_path = os.path.join(self.log_dir, dir_name, name)
            self.stats_records_path = os.path.join(self.log_dir, STATISTICS_RECORDS_DIR, os.path.splitext(name)[0] + ".jsonl")
            self.stats_file = StatisticsFile(
                self.stats_log_path, self.stats_records_path, self.log_dir, _overwrite(), self.faults
            )
            routing_path = os.path.join(self.log_dir, ROUTING_RECORDS_DIR, f"routing_globalrank-{_global_rank()}.jsonl")
            self.routing_file = LogFile(routing_path, self.log_dir, _overwrite(), self.faults)
        return self

    def overwritten_logs(self) -> list[str]:
        """The log files of this run that held an earlier run's lines, truncated at ``initialize``."""
        files = [self._main_log.file] + ([self.stats_file._file, self.stats_file._records] if self.stats_file else [])
        files += [self.routing_file] if self.routing_file else []
        return [file.path for file in files if file.overwritten]

    def log_message(self, message: str, level: int = logging.INFO) -> None:
        self.logger.log(level, message)

    def log_routing(self, record: dict[str, Any]) -> None:
        """One routing record (``routing_record``'s fields and the rank) as a JSON line, written at once; a write
        error costs this record only (see ``WriteFaults``). Without the default statistics files it is said once
        in the debug log that no routing record is written (they are written where statistics records are)."""
        if self.routing_file is None:
            say_once(
                "routing records (which GEMM read which tensor in which precision) are written beside the default "
                f"statistics records ({ROUTING_RECORDS_DIR}/), which this run does not write: pass "
                "default_logging_enabled=True to initialize() to write both; the debug log lists the routing.",
                level=logging.INFO,
                warning=None,
                call_site=__name__,
            )
            return
        self.routing_file.add(json.dumps(record | {"rank": _global_rank()}) + "\n")
        self.routing_file.commit()

    def log_statistic(self, layer: str, tensor: str, stat: str, value: float, iteration: int) -> None:
        """A statistic of the run's own features: the text line, and its structured record."""
        self.log_scalar(f"{layer}_{tensor}_{stat}", value, iteration)
        self.stats_file.write_record(layer, tensor, stat, _as_float(value), int(iteration))

    def log_statistics(self, records: list[Statistic]) -> None:
        """A step's statistics of the run's own features (``log_statistic`` of each, in two writes)."""
        if self.stats_file is None:
            raise RuntimeError("[NVDLFW INSPECT ERROR] Default stats logger not initialized.")
        self.stats_file.write_statistics(records)

    def log_scalar(self, name: str, value: Any, iteration: int, **kwargs: Any) -> None:
        if self.stats_file is None:
            raise RuntimeError("[NVDLFW INSPECT ERROR] Default stats logger not initialized.")
        line = f"{name}{_text_middle(int(iteration))}{_as_float(value):.4f}"
        self.stats_file.write(line, kwargs.get("level", logging.INFO))

    def hold_flushes(self) -> None:
        """Until ``flush()``, statistics lines are queued, then written at once (see ``MetricLogger.batch``)."""
        if self.stats_file is not None:
            self.stats_file.autoflush = False

    def flush(self) -> None:
        if self.stats_file is not None:
            self.stats_file.flush()

    def drop_held(self) -> None:
        if self.stats_file is not None:
            self.stats_file.drop_held()

    def _report_lost_lines(self) -> None:
        """Whatever the log level: on stderr, and in the debug log (if it can be written now)."""
        lost = self.faults.summary()
        if lost is not None:
            print_warning(lost)
            self._main_log.handle(logging.makeLogRecord({"msg": lost, "levelno": logging.WARNING, "levelname": "WARNING"}))

    def close(self) -> None:
        """Write what is queued and say how many lines write errors cost (on stderr and, space permitting, in the
        debug log); then detach and close every handler this logger added, so a later initialize starts clean."""
        try:
            self.flush()
            self._report_lost_lines()
        finally:
            for logger, handler in self._handlers:
                logger.removeHandler(handler)
                handler.close()
            self._handlers.clear()
            try:
                if self.stats_file is not None:
                    stats_file, self.stats_file = self.stats_file, None
                    stats_file.close()
            finally:
                try:
                    if self.routing_file is not None:
                        routing_file, self.routing_file = self.routing_file, None
                        routing_file.close()
                finally:
                    self._lock.release()


LOGGER: FileLogger | None = None


def initialize_logger(log_dir: Any, strict: bool = False) -> FileLogger:
    """Open the logs in ``log_dir``; ``strict`` (``initialize(strict_logging=...)``) makes write errors raise."""
    global LOGGER
    if not isinstance(strict, bool):
        raise TypeError(f"strict_logging must be True or False, got {strict!r}")
    close_logger()
    LOGGER = FileLogger("nvdlfw_inspect", log_dir, strict)
    return LOGGER


def get_logger() -> FileLogger:
    if LOGGER is None:
        raise RuntimeError("[NVDLFW INSPECT ERROR] Debug manager not initialized. Call initialize first.")
    return LOGGER


def close_logger() -> None:
    global LOGGER
    if LOGGER is not None:
        LOGGER.close()
        LOGGER = None


def make_default_statistics_logger() -> FileLogger:
    return get_logger()._initialize_stats_logger(STATISTICS_LOG_DIR)


def print_rank_0(*msgs: Any) -> None:
    """Print on rank 0 only (every process prints when not distributed)."""
    if is_distributed() and get_distributed_rank() != 0:
        return
    print("".join(f"{m} " for m in msgs))


def enable_logging_at_current_step(
    cur_step: int,
    freq: int = 1,
    start_step: int = 0,
    end_step: int = -1,
    start_end_list: list[list[int]] | None = None,
) -> bool:
    """Whether a statistic scheduled by these keys is logged at ``cur_step``.

    ``start_end_list`` windows are half-open ``[start, end)`` (end -1: no end) and override
    ``start_step``/``end_step``, whose window is closed ``[start_step, end_step]``. ``freq`` counts
    absolute steps, not steps since the start.
    """
    if freq <= 0:
        raise ValueError(f"freq must be a positive integer, got {freq!r}")
    if cur_step % freq != 0:
        return False
    if start_end_list:
        return any(cur_step >= start and (end == -1 or cur_step < end) for start, end in start_end_list)
    return cur_step >= start_step and (end_step == -1 or cur_step <= end_step)


def custom_assert(condition: Any, message: str, level: int = logging.ERROR) -> None:
    """Log ``message`` and raise AssertionError when ``condition`` is false (kept for downstream code)."""
    if not condition:
        if LOGGER is not None:
            LOGGER.log_message(message, level=level)
        raise AssertionError(message)


class SingleMessageLogger:
    """Writes each distinct message once per call site, layer and extra key until ``reset``."""

    logged_messages: set[tuple[Hashable, ...]] = set()

    @classmethod
    def log_message_once(
        cls,
        message: str,
        layer_name: str | None = None,
        level: int = logging.INFO,
        extra_cachable_args: Hashable = None,
        call_site: str | None = None,
    ) -> bool:
        """Log ``message`` unless this exact message was logged from the same place before; True if written."""
        if call_site is None:
            frame = sys._getframe(1)
            call_site = f"{frame.f_code.co_filename}.{frame.f_lineno}"
            del frame
        key = (call_site, layer_name, extra_cachable_args, message)
        if key in cls.logged_messages:
            return False
        logger = get_logger()  # raises before initialize; the message must not count as written then
        cls.logged_messages.add(key)
        text = f"LAYER={layer_name}: {message}" if layer_name else message
        logger.log_message(text, level=level)
        return True

    @classmethod
    def reset(cls) -> None:
        cls.logged_messages.clear()


def say_once(
    message: str,
    layer_name: str | None = None,
    level: int = logging.WARNING,
    warning: type[Warning] | None = UserWarning,
    call_site: str | None = None,
) -> bool:
    """The one way the tools say what they skip, ignore or cannot do: once per ``call_site``, layer and
    message, in the debug log when a session is open, and as a Python ``warning`` (None: none) so the console
    shows it too; without a session the warning alone. True when said now."""
    site = call_site or "say_once"
    try:
        first = SingleMessageLogger.log_message_once(message, layer_name, level, call_site=site)
    except RuntimeError:  # no debug session to log to: the warning alone, still once (until the next session)
        key = ("no session", site, layer_name, message)
        first = key not in SingleMessageLogger.logged_messages
        SingleMessageLogger.logged_messages.add(key)
    if first and warning is not None:
        warnings.warn(message, warning, stacklevel=3)
    return first
