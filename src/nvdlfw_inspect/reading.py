"""Reading a run's statistics back: every rank's structured records (``.jsonl``), or, for runs that
only have text logs (the reference framework's), the text lines with names split as well as they can be.
Records are read from ``STATISTICS_RECORDS_DIR``, or, for runs of versions that wrote them there, from
``STATISTICS_LOG_DIR`` beside the text logs.

A file whose last line is torn (its writer was killed, or ran out of space, while writing it) is read
without that line, with a ``TornLineWarning``; any other line that does not parse is an error.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any, NamedTuple

from nvdlfw_inspect.logging import MAIN_LOG_DIR, STATISTICS_LOG_DIR, STATISTICS_RECORDS_DIR

TENSOR_NAMES = ("activation", "gradient", "weight", "output", "wgrad", "dgrad")
_TEXT_LINE = re.compile(r"^\S+ \S+ - \w+ - (\S+) \t\t\t\t iteration=(\d+) \t\t\t\t value=(\S+)$")
_NAME = re.compile(rf"^(.*)_({'|'.join(TENSOR_NAMES)})_(.+)$")
_RANK = re.compile(r"globalrank-(\d+)")
RECORDS_PER_PARSE = 65536


class Statistic(NamedTuple):
    rank: int
    layer: str
    tensor: str
    stat: str
    iteration: int
    value: float


class TornLineWarning(UserWarning):
    """A statistics file ends in an incomplete line, which was skipped."""


class AppendedRunsWarning(UserWarning):
    """A statistics file holds several runs one after another (``NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE=0``): their
    statistics at the same iterations are read as one run's."""


def run_directory(path: str | Path) -> Path:
    """The ``log_dir`` of a run, given it or one of the directories the run writes in it (the demo prints
    where the statistics are, and that path is the one people copy): a directory named as those, holding no
    statistics directory of its own, stands for its parent."""
    path = Path(path)
    if path.name in (STATISTICS_LOG_DIR, STATISTICS_RECORDS_DIR, MAIN_LOG_DIR) and not any(
        (path / name).is_dir() for name in (STATISTICS_LOG_DIR, STATISTICS_RECORDS_DIR)
    ):
        return path.parent
    return path


def statistics_files(log_dir: str | Path) -> list[Path]:
    """The statistics files of a run, one per rank: structured ones where they exist (the current layout
    first, then the old one), else text. ``log_dir`` may also be one of the run's own directories."""
    log_dir = run_directory(log_dir)
    text_dir, records_dir = Path(log_dir) / STATISTICS_LOG_DIR, Path(log_dir) / STATISTICS_RECORDS_DIR
    if not text_dir.is_dir() and not records_dir.is_dir():
        raise FileNotFoundError(f"no statistics in '{log_dir}': neither '{records_dir}' nor '{text_dir}' exists")
    return sorted(records_dir.glob("*.jsonl")) or sorted(text_dir.glob("*.jsonl")) or sorted(text_dir.glob("*.log"))


def split_name(name: str) -> tuple[str, str, str]:
    """``{layer}_{tensor}_{stat}`` into its parts, splitting at the last known tensor name."""
    match = _NAME.match(name)
    return (match.group(1), match.group(2), match.group(3)) if match else (name, "", "")


def _rank_of(path: Path) -> int:
    match = _RANK.search(path.name)
    return int(match.group(1)) if match else 0


def _statistic(record: dict[str, Any], default_rank: int) -> Statistic:
    return Statistic(
        int(record.get("rank", default_rank)),
        record["layer"],
        record["tensor"],
        record["stat"],
        int(record["iteration"]),
        float(record["value"]),
    )


def _from_records(path: Path) -> Iterator[Statistic]:
    """Parsed ``RECORDS_PER_PARSE`` lines at a time as one JSON array (several times faster than a
    parse per line); a chunk that fails is parsed again line by line to name the bad line."""
    rank = _rank_of(path)
    with path.open("rb") as file:
        first_line = 1
        while lines := list(islice(file, RECORDS_PER_PARSE)):
            try:
                chunk = json.loads(b"[" + b",".join(line for line in lines if line.strip()) + b"]")
                statistics = [_statistic(record, rank) for record in chunk]
            except (ValueError, KeyError, TypeError, AttributeError):
                statistics = list(_line_by_line(path, lines, first_line, rank))
            yield from statistics
            first_line += len(lines)


def _line_by_line(path: Path, lines: list[bytes], first_line: int, rank: int) -> Iterator[Statistic]:
    """A record that does not parse is an error, unless it is the file's last line and lacks its newline:
    then it is torn (a complete record shows its end, the closing brace, even without a newline)."""
    for number, line in enumerate(lines, first_line):
        if not line.strip():
            continue
        try:
            statistic = _statistic(json.loads(line), rank)
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            if not line.endswith(b"\n"):  # only the last line of a file can lack it
                _warn_torn(path, number, line)
                return
            raise ValueError(f"{path}:{number}: not a statistics record ({error}): {_shown(line)}") from None
        yield statistic


def _from_text(path: Path) -> Iterator[Statistic]:
    """Text lines; the last one without its newline is torn even when it parses (its value may be cut short)."""
    rank = _rank_of(path)
    with path.open("rb") as file:
        for number, raw in enumerate(file, 1):
            if not raw.endswith(b"\n"):
                _warn_torn(path, number, raw)
                return
            try:
                match = _TEXT_LINE.match(raw.decode("utf-8").rstrip("\r\n"))
            except UnicodeDecodeError:
                match = None
            if match is None:
                raise ValueError(f"{path}:{number}: not a statistics line: {_shown(raw)}")
            yield Statistic(rank, *split_name(match.group(1)), int(match.group(2)), float(match.group(3)))


def _warn_torn(path: Path, number: int, line: bytes) -> None:
    warnings.warn(
        f"{path}:{number}: skipped the torn last line (the run stopped while writing it; the last step in this file "
        f"may lack some statistics): {_shown(line)}",
        TornLineWarning,
        stacklevel=2,
    )


def _shown(line: bytes) -> str:
    """A line for an error message: its start, decoded as far as it goes."""
    return repr(line[:200].decode("utf-8", errors="replace").rstrip("\n"))


def iter_statistics(log_dir: str | Path) -> Iterator[Statistic]:
    """Every statistic of every rank of the run in ``log_dir``."""
    for path in statistics_files(log_dir):
        yield from _warn_appended_runs(path, _from_records(path) if path.suffix == ".jsonl" else _from_text(path))


def _warn_appended_runs(path: Path, statistics: Iterator[Statistic]) -> Iterator[Statistic]:
    """One run writes its iterations in order; iterations going back mean that another run was appended, whose
    statistics the report and ``read_stats`` would mix with the first's (an ``AppendedRunsWarning``, once a file)."""
    last = -1
    for number, statistic in enumerate(statistics, 1):
        if statistic.iteration < last:
            warnings.warn(
                f"{path}: the iterations go back from {last} to {statistic.iteration} at statistic {number}: the file "
                "holds more than one run, appended with NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE=0, and their statistics at "
                "the same iterations are read as one run's. Give each run its own log_dir to keep them apart.",
                AppendedRunsWarning,
                stacklevel=3,
            )
            yield statistic
            yield from statistics
            return
        last = statistic.iteration
        yield statistic


def read_stats(log_dir: str | Path) -> Any:
    """A pandas DataFrame with columns rank, layer, tensor, stat, iteration, value (needs pandas:
    ``pip install lowprec-inspect[pandas]``)."""
    try:
        import pandas
    except ImportError:
        raise ImportError("read_stats needs pandas: pip install 'lowprec-inspect[pandas]'") from None
    return pandas.DataFrame(list(iter_statistics(log_dir)), columns=list(Statistic._fields))
