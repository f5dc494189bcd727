"""Read back the framework's log files in tests."""

from __future__ import annotations

import re
from pathlib import Path

_STAT_LINE = re.compile(r"^\S+ \S+ - (\w+) - (\S+) \t\t\t\t iteration=(\d{6}) \t\t\t\t value=(\S+)$")
_MAIN_LINE = re.compile(r"^\S+ \S+ - (\w+) - (.*)$")


def stats_log_path(log_dir: Path, rank: int = 0) -> Path:
    return Path(log_dir) / "nvdlfw_inspect_statistics_logs" / f"nvdlfw_inspect_globalrank-{rank}.log"


def stats_records_path(log_dir: Path, rank: int = 0) -> Path:
    return Path(log_dir) / "nvdlfw_inspect_statistics_jsonl" / f"nvdlfw_inspect_globalrank-{rank}.jsonl"


def main_log_path(log_dir: Path, rank: int = 0) -> Path:
    return Path(log_dir) / "nvdlfw_inspect_logs" / f"nvdlfw_inspect_globalrank-{rank}.log"


def read_stats(log_dir: Path, rank: int = 0) -> dict[tuple[str, int], float]:
    """``{(stat name, iteration): value}`` from the statistics log; every line must parse."""
    out: dict[tuple[str, int], float] = {}
    for line in stats_log_path(log_dir, rank).read_text().splitlines():
        match = _STAT_LINE.match(line)
        assert match, f"unparseable statistics line: {line!r}"
        out[(match.group(2), int(match.group(3)))] = float(match.group(4))
    return out


def read_messages(log_dir: Path, rank: int = 0) -> list[tuple[str, str]]:
    """``[(level, message)]`` from the main debug log."""
    out = []
    for line in main_log_path(log_dir, rank).read_text().splitlines():
        match = _MAIN_LINE.match(line)
        assert match, f"unparseable log line: {line!r}"
        out.append((match.group(1), match.group(2)))
    return out
