"""The main debug log (``FileLogger``, which also owns the default statistics files), the process's one
``LOGGER``, and the ways the tools say things once (``say_once``, ``SingleMessageLogger``)."""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from collections.abc import Hashable
from typing import Any

from nvdlfw_inspect.distributed import get_distributed_rank, is_distributed
from nvdlfw_inspect.logging.files import STDERR_FORMAT, LogFile, LogFileHandler, WriteFaults, encodable, print_warning
from nvdlfw_inspect.logging.lock import LogDirLock
from nvdlfw_inspect.logging.records import Statistic, StatisticsFile, _as_float, _text_middle
from nvdlfw_inspect.logging.settings import (
    MAIN_LOG_DIR,
    NONFINITE_RECORD,
    ROUTING_RECORDS_DIR,
    STATISTICS_LOG_DIR,
    STATISTICS_RECORDS_DIR,
    _global_rank,
    _log_dir_path,
    _log_level_from_env,
    _overwrite,
    log_file_name,
)
from nvdlfw_inspect.statistics_logger import BaseLogger


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
        self.logger.log(level, encodable(message))  # the user's handlers too get text they can write

    def log_nonfinite(self, record: dict[str, Any]) -> None:
        """``NonfiniteGuard``'s finding of a step (its layer, GEMM, tensor, micro-batch and ``iteration``) as one line of
        the debug log, ``NONFINITE_RECORD`` and the record as JSON, which ``reading.read_nonfinite`` (and the report)
        read back. Written whatever the log level, and to the file alone: the guard's message says it on stderr."""
        line = NONFINITE_RECORD + json.dumps(record | {"rank": _global_rank()}, allow_nan=False)
        self._main_log.handle(logging.makeLogRecord({"msg": line, "levelno": logging.INFO, "levelname": "INFO"}))

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
            unnoted = self.stats_file.note_failure() if self.stats_file is not None else None
            lost += f"; {unnoted}" if unnoted else ""
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
