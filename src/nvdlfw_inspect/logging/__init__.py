"""The logs of a debug run, one job a module: the debug log (``debug_log``), the statistics loggers
(``statistics``; the default statistics file's lines and records in ``records``), the log files and their safety
(``files``), the log-dir lock (``lock``), the names and settings of the logs (``settings``) and logging windows
(``windows``). Every name stays importable from ``nvdlfw_inspect.logging``, as in the reference framework."""

from __future__ import annotations

from typing import Any

from nvdlfw_inspect.logging import debug_log
from nvdlfw_inspect.logging.debug_log import (
    FileLogger,
    SingleMessageLogger,
    close_logger,
    custom_assert,
    get_logger,
    initialize_logger,
    make_default_statistics_logger,
    print_rank_0,
    say_once,
)
from nvdlfw_inspect.logging.files import (
    LOG_FORMAT,
    STDERR_FORMAT,
    LogFile,
    LogFileHandler,
    WriteFaults,
    link_out_of,
    print_warning,
)
from nvdlfw_inspect.logging.lock import LogDirLock
from nvdlfw_inspect.logging.records import (
    ROUTING_DECISIONS,
    ROUTING_GEMMS,
    Statistic,
    StatisticsFile,
    routing_record,
)
from nvdlfw_inspect.logging.settings import (
    ENV_LOG_LEVEL,
    ENV_OVERWRITE,
    ENV_TIMESTAMP,
    ENV_TIMESTAMP_VALUE,
    MAIN_LOG_DIR,
    NONFINITE_RECORD,
    ROUTING_RECORDS_DIR,
    STATISTICS_LOG_DIR,
    STATISTICS_RECORDS_DIR,
    log_file_name,
)
from nvdlfw_inspect.logging.statistics import (
    MetricLogger,
    TensorboardLogger,
    wrap_tensorboard_writer,
    wrap_wandb_logger,
)
from nvdlfw_inspect.logging.windows import enable_logging_at_current_step
from nvdlfw_inspect.statistics_logger import BaseLogger
from nvdlfw_inspect.wandb_logger import WandbLogger

__all__ = [
    "ENV_LOG_LEVEL",
    "ENV_OVERWRITE",
    "ENV_TIMESTAMP",
    "ENV_TIMESTAMP_VALUE",
    "LOG_FORMAT",
    "MAIN_LOG_DIR",
    "NONFINITE_RECORD",
    "ROUTING_DECISIONS",
    "ROUTING_GEMMS",
    "ROUTING_RECORDS_DIR",
    "STATISTICS_LOG_DIR",
    "STATISTICS_RECORDS_DIR",
    "STDERR_FORMAT",
    "BaseLogger",
    "FileLogger",
    "LogDirLock",
    "LogFile",
    "LogFileHandler",
    "MetricLogger",
    "SingleMessageLogger",
    "Statistic",
    "StatisticsFile",
    "TensorboardLogger",
    "WandbLogger",
    "WriteFaults",
    "close_logger",
    "custom_assert",
    "enable_logging_at_current_step",
    "get_logger",
    "initialize_logger",
    "link_out_of",
    "log_file_name",
    "make_default_statistics_logger",
    "print_rank_0",
    "print_warning",
    "routing_record",
    "say_once",
    "wrap_tensorboard_writer",
    "wrap_wandb_logger",
]


def __getattr__(name: str) -> Any:
    """``LOGGER``, the open debug log or None, read now: a copy bound at import would stay None forever."""
    if name == "LOGGER":
        return debug_log.LOGGER
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
