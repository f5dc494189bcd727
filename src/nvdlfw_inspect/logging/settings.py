"""Where the logs go and the environment settings that shape them: the directory and file names (users parse
them, so they match the reference framework), the rank in the names, the log level, overwrite and timestamps."""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any

from nvdlfw_inspect.distributed import get_distributed_rank, is_distributed

MAIN_LOG_DIR = "nvdlfw_inspect_logs"
STATISTICS_LOG_DIR = "nvdlfw_inspect_statistics_logs"
STATISTICS_RECORDS_DIR = "nvdlfw_inspect_statistics_jsonl"
ROUTING_RECORDS_DIR = "nvdlfw_inspect_routing_jsonl"
#: how a line of the debug log that holds ``NonfiniteGuard``'s finding as JSON begins (its message part)
NONFINITE_RECORD = "NonfiniteGuard record: "

ENV_LOG_LEVEL = "NVDLFW_INSPECT_LOG_LEVEL"
ENV_OVERWRITE = "NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE"
ENV_TIMESTAMP = "NVDLFW_INSPECT_ENABLE_LOG_TIMESTAMP"
ENV_TIMESTAMP_VALUE = "NVDLFW_INSPECT_LOG_TIMESTAMP"
_LEVEL_NAMES = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "NOTSET")
_SAFE_STAMP = re.compile(r"[A-Za-z0-9._-]{1,64}")


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
