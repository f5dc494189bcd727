"""The main debug log, the statistics loggers (file, TensorBoard, custom) and logging-window helpers.

Directory names, file names and line formats match the reference framework, since users parse them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from nvdlfw_inspect.utils import get_distributed_rank, is_distributed

MAIN_LOG_DIR = "nvdlfw_inspect_logs"
STATISTICS_LOG_DIR = "nvdlfw_inspect_statistics_logs"
LOG_FORMAT = "%(asctime)s - %(levelname)s - %(message)s"
STDERR_FORMAT = "NVDLFW INSPECT - %(asctime)s - %(levelname)s - %(message)s"

ENV_LOG_LEVEL = "NVDLFW_INSPECT_LOG_LEVEL"
ENV_OVERWRITE = "NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE"
ENV_TIMESTAMP = "NVDLFW_INSPECT_ENABLE_LOG_TIMESTAMP"
ENV_TIMESTAMP_VALUE = "NVDLFW_INSPECT_LOG_TIMESTAMP"
_LEVEL_NAMES = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "NOTSET")


class BaseLogger(ABC):
    """A statistics sink. Implement ``log_scalar`` and pass an instance as ``statistics_logger``."""

    @abstractmethod
    def log_scalar(self, name: str, value: float | int, iteration: int, **kwargs: Any) -> None: ...


class MetricLogger:
    """Fans each statistic out to every enabled statistics logger."""

    enabled_loggers: list[BaseLogger] = []

    @classmethod
    def log_scalar(cls, name: str, value: Any, iteration: int, **kwargs: Any) -> None:
        for logger in cls.enabled_loggers:
            logger.log_scalar(name, value, iteration, **kwargs)

    @classmethod
    def log_statistic(cls, layer: str, tensor: str, stat: str, value: float, iteration: int) -> None:
        """One statistic of a layer's tensor: loggers that keep structure (``log_statistic``) get its
        parts, the others ``log_scalar("{layer}_{tensor}_{stat}", ...)``."""
        for logger in cls.enabled_loggers:
            structured = getattr(logger, "log_statistic", None)
            if structured is not None:
                structured(layer, tensor, stat, value, iteration)
            else:
                logger.log_scalar(f"{layer}_{tensor}_{stat}", value, iteration)

    @classmethod
    def add_logger(cls, logger: BaseLogger) -> None:
        cls.enabled_loggers.append(logger)

    @classmethod
    def flush(cls) -> None:
        """Let loggers that batch (those with a ``flush`` method) send what they hold."""
        for logger in cls.enabled_loggers:
            flush = getattr(logger, "flush", None)
            if flush is not None:
                flush()

    @classmethod
    @contextlib.contextmanager
    def batch(cls) -> Iterator[None]:
        """Log many statistics at once: loggers that can (``hold_flushes``) stop flushing line by line,
        and every logger is flushed once at the end, also when logging fails half way."""
        for logger in cls.enabled_loggers:
            hold = getattr(logger, "hold_flushes", None)
            if hold is not None:
                hold()
        try:
            yield
        finally:
            cls.flush()

    @classmethod
    def reset(cls) -> None:
        cls.flush()
        cls.enabled_loggers.clear()


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
        stamp = os.environ.get(ENV_TIMESTAMP_VALUE)
        if not stamp:
            stamp = time.strftime("%Y%m%d_%H%M%S")
            os.environ[ENV_TIMESTAMP_VALUE] = stamp
        base += f"_{stamp}"
    return f"{base}_globalrank-{_global_rank()}.log"


def _file_mode() -> str:
    overwrite = _env_int_flag(ENV_OVERWRITE)
    return "w" if overwrite is None or overwrite else "a"


def _attach_file_handler(logger: logging.Logger, path: str) -> logging.FileHandler:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handler = logging.FileHandler(path, mode=_file_mode())
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logger.addHandler(handler)
    return handler


def _json_number(value: float) -> str:
    """A float as JSON: finite ones as numbers (``repr``, as ``json`` writes them); NaN and infinities
    as the strings ``float()`` reads back (strict JSON)."""
    return repr(value) if math.isfinite(value) else f'"{value}"'


class StatisticsFile:
    """The statistics log: text lines in the format of Python's logging (``LOG_FORMAT``), and next to
    them (``.jsonl``) one JSON record per statistic with its layer, tensor, stat, iteration, value and
    rank. Written directly (``step()`` writes hundreds of lines and a ``LogRecord`` each costs tens of
    microseconds) and flushed line by line, or once per batch while ``autoflush`` is off."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._file = open(path, _file_mode(), encoding="utf-8")  # closed by close()
        self._records = open(os.path.splitext(path)[0] + ".jsonl", _file_mode(), encoding="utf-8")
        self._rank = _global_rank()
        self._second = -1
        self._stamp = ""
        self._record_heads: dict[tuple[str, str, str], str] = {}
        self.autoflush = True

    def _asctime(self) -> str:
        """``YYYY-mm-dd HH:MM:SS,mmm`` in local time, like ``logging.Formatter``."""
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second, self._stamp = second, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
        return f"{self._stamp},{int((now - second) * 1000):03d}"

    def write(self, message: str, level: int = logging.INFO) -> None:
        self._file.write(f"{self._asctime()} - {logging.getLevelName(level)} - {message}\n")
        if self.autoflush:
            self._file.flush()

    def write_record(self, layer: str, tensor: str, stat: str, value: float, iteration: int) -> None:
        """``{"layer": ..., "tensor": ..., "stat": ..., "iteration": ..., "value": ..., "rank": ...}``
        as ``json.dumps`` writes it, the names' part encoded once per name."""
        head = self._record_heads.get((layer, tensor, stat))
        if head is None:
            names = ", ".join(
                f'"{key}": {json.dumps(name)}' for key, name in (("layer", layer), ("tensor", tensor), ("stat", stat))
            )
            head = self._record_heads[(layer, tensor, stat)] = "{" + names
        self._records.write(f'{head}, "iteration": {iteration}, "value": {_json_number(value)}, "rank": {self._rank}}}\n')
        if self.autoflush:
            self._records.flush()

    def flush(self) -> None:
        self._file.flush()
        self._records.flush()
        self.autoflush = True

    def close(self) -> None:
        self._file.close()
        self._records.close()


class FileLogger(BaseLogger):
    """The main debug log, and (once enabled) the default statistics log file.

    Both files are flushed after every line, or after every batch of statistics (``step()``), so
    nothing logged is lost if the process dies.
    """

    def __init__(self, name: str, log_dir: str):
        self.log_dir = str(log_dir)
        self.logger = logging.getLogger(name)
        self.logger.setLevel(_log_level_from_env())
        self.logger.propagate = False
        self._handlers: list[tuple[logging.Logger, logging.Handler]] = []
        self.main_log_path = os.path.join(self.log_dir, MAIN_LOG_DIR, log_file_name())
        self._add(self.logger, _attach_file_handler(self.logger, self.main_log_path))
        stderr = logging.StreamHandler(sys.stderr)
        stderr.setLevel(logging.WARNING)
        stderr.setFormatter(logging.Formatter(STDERR_FORMAT))
        self._add(self.logger, stderr)
        self.stats_file: StatisticsFile | None = None
        self.stats_log_path: str | None = None
        self.logged_api_executed: set[str] = set()
        self.logged_api_encountered: set[str | None] = set()

    def _add(self, logger: logging.Logger, handler: logging.Handler) -> None:
        logger.addHandler(handler)
        self._handlers.append((logger, handler))

    def _initialize_stats_logger(self, dir_name: str = STATISTICS_LOG_DIR) -> FileLogger:
        if self.stats_file is None:
            self.stats_log_path = os.path.join(self.log_dir, dir_name, log_file_name())
            self.stats_file = StatisticsFile(self.stats_log_path)
        return self

    def log_message(self, message: str, level: int = logging.INFO) -> None:
        self.logger.log(level, message)

    def log_statistic(self, layer: str, tensor: str, stat: str, value: float, iteration: int) -> None:
        """A statistic of the run's own features: the text line, and its structured record."""
        self.log_scalar(f"{layer}_{tensor}_{stat}", value, iteration)
        self.stats_file.write_record(layer, tensor, stat, _as_float(value), int(iteration))

    def log_scalar(self, name: str, value: Any, iteration: int, **kwargs: Any) -> None:
        if self.stats_file is None:
            raise RuntimeError("[NVDLFW INSPECT ERROR] Default stats logger not initialized.")
        line = f"{name} \t\t\t\t iteration={int(iteration):06d} \t\t\t\t value={_as_float(value):.4f}"
        self.stats_file.write(line, kwargs.get("level", logging.INFO))

    def hold_flushes(self) -> None:
        """Until ``flush()``, statistics lines are written but not flushed (see ``MetricLogger.batch``)."""
        if self.stats_file is not None:
            self.stats_file.autoflush = False

    def flush(self) -> None:
        if self.stats_file is not None:
            self.stats_file.flush()

    def close(self) -> None:
        """Detach and close every handler this logger added, so a later initialize starts clean."""
        for logger, handler in self._handlers:
            logger.removeHandler(handler)
            handler.close()
        self._handlers.clear()
        if self.stats_file is not None:
            self.stats_file.close()
            self.stats_file = None


LOGGER: FileLogger | None = None


def initialize_logger(log_dir: str) -> FileLogger:
    global LOGGER
    close_logger()
    LOGGER = FileLogger("nvdlfw_inspect", log_dir)
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
