"""Reading a run's statistics back: every rank's structured records (``.jsonl``), or, for runs that
only have text logs (the reference framework's), the text lines with names split as well as they can be.
Records are read from ``STATISTICS_RECORDS_DIR``, or, for runs of versions that wrote them there, from
``STATISTICS_LOG_DIR`` beside the text logs.

A file whose last line is torn (its writer was killed, or ran out of space, while writing it) is read
without that line, with a ``TornLineWarning``. Any other line that is no statistics record (it does not
parse, or a field has the wrong type) is skipped: one ``SkippedRecordsWarning`` per file says how many and
names the first by its line. A directory named like a statistics file is skipped with that warning too.
The routing records (``read_routing``: which GEMM read which tensor in which precision) are read the same way, and
``NonfiniteGuard``'s findings (``read_nonfinite``) from their lines of the debug log.

Records a run could not write (its records directory full, its text log not) are said once with a
``LostRecordsWarning``, and the statistics they lack are read from the text log (to its 4 decimals).
"""

from __future__ import annotations

import json
import re
import warnings
from array import array
from collections.abc import Callable, Iterable, Iterator
from itertools import groupby, islice
from operator import attrgetter
from pathlib import Path
from typing import Any, NamedTuple

from nvdlfw_inspect.errors import short_repr
from nvdlfw_inspect.logging import (
    MAIN_LOG_DIR,
    NONFINITE_RECORD,
    ROUTING_DECISIONS,
    ROUTING_GEMMS,
    ROUTING_RECORDS_DIR,
    STATISTICS_LOG_DIR,
    STATISTICS_RECORDS_DIR,
)
from nvdlfw_inspect.logging.records import loss_note_path, read_loss_note, text_name

TENSOR_NAMES = ("activation", "gradient", "weight", "output", "wgrad", "dgrad")
_TEXT_LINE = re.compile(r"^\S+ \S+ - \w+ - (\S+) \t\t\t\t iteration=(\d+) \t\t\t\t value=(\S+)$")
_NAME = re.compile(rf"^(.*)_({'|'.join(TENSOR_NAMES)})_(.+)$")
_RANK = re.compile(r"globalrank-(\d+)")
RECORDS_PER_PARSE = 2048
_VALUE_TYPES = (float, int, str)  # finite values are numbers, NaN and infinities the strings float() reads


class Statistic(NamedTuple):
    rank: int
    layer: str
    tensor: str
    stat: str
    iteration: int
    value: float


class RoutingRecord(NamedTuple):
    """From ``iteration`` on, ``gemm`` of ``layer`` read ``tensor`` as ``decision`` says (see ``debug_api.log_routing``)."""

    rank: int
    layer: str
    gemm: str
    tensor: str
    decision: str
    feature: str | None
    recipe: bool
    iteration: int
    reason: str | None = None  # why a GEMM no feature decided is in that precision (a module left unconverted)
    format: str | None = None  # the format the GEMM's recipe reads the tensor in (``mxfp8``, ``nvfp4``, ...), when said
    recipe_spec: dict[str, Any] | None = None  # that recipe with its options, as a precision plan writes it, when said
    plan_rule: str | None = None  # the precision plan rule that chose the GEMM's recipe, when one did


class NonfiniteRecord(NamedTuple):
    """``NonfiniteGuard``'s finding at ``iteration`` (a step) on ``rank``: the first tensor in execution order that held
    NaN or inf (``layer``, the ``gemm`` that reads it, ``tensor``, ``micro_batch``); all four None where only another
    rank of the reduction group saw one."""

    rank: int
    iteration: int
    layer: str | None
    gemm: str | None
    tensor: str | None
    micro_batch: int | None


class SkippedRecordsWarning(UserWarning):
    """Lines of a statistics file (or a whole path named like one) were skipped: they hold no statistics."""


class TornLineWarning(SkippedRecordsWarning):
    """A statistics file ends in an incomplete line, which was skipped."""


class LostRecordsWarning(UserWarning):
    """The run could not write some of its statistics (a full disk or quota, noted beside its debug log): the
    records it lacks are read from the text log where that has them."""


class AppendedRunsWarning(UserWarning):
    """A statistics file holds several runs one after another (``NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE=0``): their
    statistics at the same iterations are read as one run's."""


def run_directory(path: str | Path) -> Path:
    """The ``log_dir`` of a run, given it or one of the directories the run writes in it (the demo prints
    where the statistics are, and that path is the one people copy): a directory named as those, holding no
    statistics directory of its own, stands for its parent."""
    path = Path(path)
    run_dirs = (STATISTICS_LOG_DIR, STATISTICS_RECORDS_DIR, ROUTING_RECORDS_DIR)
    if path.name in (*run_dirs, MAIN_LOG_DIR) and not any((path / name).is_dir() for name in run_dirs):
        return path.parent
    return path


def statistics_files(log_dir: str | Path) -> list[Path]:
    """The statistics files of a run, one per rank: structured ones where they exist (the current layout
    first, then the old one), else text. ``log_dir`` may also be one of the run's own directories."""
    log_dir = run_directory(log_dir)
    text_dir, records_dir = Path(log_dir) / STATISTICS_LOG_DIR, Path(log_dir) / STATISTICS_RECORDS_DIR
    if not text_dir.is_dir() and not records_dir.is_dir():
        raise FileNotFoundError(f"no statistics in '{log_dir}': neither '{records_dir}' nor '{text_dir}' exists")
    return _files(records_dir, "*.jsonl") or _files(text_dir, "*.jsonl") or _files(text_dir, "*.log")


def _files(directory: Path, pattern: str) -> list[Path]:
    """The files in ``directory`` matching ``pattern``; anything else that matches is said and skipped."""
    paths = sorted(directory.glob(pattern))
    for path in paths:
        if not path.is_file():
            warnings.warn(f"{path}: skipped: not a file (a statistics file is a file)", SkippedRecordsWarning, stacklevel=3)
    return [path for path in paths if path.is_file()]


def split_name(name: str) -> tuple[str, str, str]:
    """``{layer}_{tensor}_{stat}`` into its parts, splitting at the last known tensor name."""
    match = _NAME.match(name)
    return (match.group(1), match.group(2), match.group(3)) if match else (name, "", "")


def _rank_of(path: Path) -> int:
    match = _RANK.search(path.name)
    return int(match.group(1)) if match else 0


def _statistic(record: dict[str, Any], default_rank: int) -> Statistic:
    """A record as a ``Statistic``; a field of the wrong type is a ``TypeError`` naming it (a name that is no
    string would break every sort of names later, far from its line). Exact type tests: ``json`` makes no
    subclasses, and ``isinstance`` against a union costs a third of the reading."""
    layer, tensor, stat, iteration, value = (
        record["layer"],
        record["tensor"],
        record["stat"],
        record["iteration"],
        record["value"],
    )
    rank = record.get("rank", default_rank)
    if (
        type(layer) is str
        and type(tensor) is str
        and type(stat) is str
        and type(iteration) is int
        and type(rank) is int
        and type(value) in _VALUE_TYPES
    ):
        return Statistic(rank, layer, tensor, stat, iteration, float(value))
    for key, field in {"layer": layer, "tensor": tensor, "stat": stat, "iteration": iteration, "rank": rank}.items():
        kind, wanted = (str, "a string") if key in ("layer", "tensor", "stat") else (int, "an integer")
        if type(field) is not kind:
            raise TypeError(f"{key} is {short_repr(field)}, not {wanted}")
    raise TypeError(f"value is {short_repr(value)}, not a number")


class _Skipped:
    """The lines of one file that hold no record (``what``): counted, the first kept, said once at the file's end."""

    def __init__(self, path: Path, what: str = "statistics record") -> None:
        self.path, self.count, self.first, self.what = path, 0, (0, ""), what

    def add(self, number: int, reason: str, line: bytes) -> None:
        if not self.count:
            self.first = (number, f"({reason}): {_shown(line)}")
        self.count += 1

    def say(self) -> None:
        if self.count:
            number, what = self.first
            lines = "1 line" if self.count == 1 else f"{self.count} lines, this the first,"
            message = f"{self.path}:{number}: skipped {lines} holding no {self.what} {what}"
            warnings.warn(message, SkippedRecordsWarning, stacklevel=4)


def _from_records(path: Path) -> Iterator[Statistic]:
    """Parsed ``RECORDS_PER_PARSE`` lines at a time as one JSON array (several times faster than a
    parse per line); a chunk that fails is parsed again line by line to skip and count its bad lines."""
    rank, skipped = _rank_of(path), _Skipped(path)
    with path.open("rb") as file:
        first_line = 1
        while lines := list(islice(file, RECORDS_PER_PARSE)):
            try:
                chunk = json.loads(b"[" + b",".join(line for line in lines if line.strip()) + b"]")
                statistics = [_statistic(record, rank) for record in chunk]
            except (ValueError, KeyError, TypeError, AttributeError):
                statistics = list(_line_by_line(path, lines, first_line, rank, skipped))
            first_line += len(lines)
            del lines  # not held while the consumer works
            yield from statistics
    skipped.say()


def _line_by_line(
    path: Path,
    lines: list[bytes],
    first_line: int,
    rank: int,
    skipped: _Skipped,
    parse: Callable[[dict[str, Any], int], Any] = _statistic,
) -> Iterator[Any]:
    """Each line's record (``parse``: a ``Statistic``, or a ``RoutingRecord``). A record that does not parse is
    skipped, unless it is the file's last line and lacks its newline: then it is torn (a complete record shows its
    end, the closing brace, even without a newline)."""
    for number, line in enumerate(lines, first_line):
        if not line.strip():
            continue
        try:
            statistic = parse(json.loads(line), rank)
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            if not line.endswith(b"\n"):  # only the last line of a file can lack it
                _warn_torn(path, number, line)
                return
            skipped.add(number, f"no field {error}" if isinstance(error, KeyError) else str(error), line)
            continue
        yield statistic


def _routing(record: dict[str, Any], default_rank: int) -> RoutingRecord:
    """A routing record as a ``RoutingRecord``; a field of the wrong type or value is a ``TypeError`` naming it."""
    fields = {key: record[key] for key in ("layer", "gemm", "tensor", "decision", "feature", "recipe", "iteration")}
    fields["reason"] = record.get("reason")
    fields["format"] = record.get("format")
    fields["recipe_spec"] = record.get("recipe_spec")
    fields["plan_rule"] = record.get("plan_rule")
    rank = record.get("rank", default_rank)
    problems = [
        ("layer", type(fields["layer"]) is str, "a string"),
        ("tensor", type(fields["tensor"]) is str, "a string"),
        ("gemm", fields["gemm"] in ROUTING_GEMMS, f"one of {', '.join(ROUTING_GEMMS)}"),
        ("decision", fields["decision"] in ROUTING_DECISIONS, f"one of {', '.join(ROUTING_DECISIONS)}"),
        ("feature", fields["feature"] is None or type(fields["feature"]) is str, "a string or null"),
        ("reason", fields["reason"] is None or type(fields["reason"]) is str, "a string or null"),
        ("format", fields["format"] is None or type(fields["format"]) is str, "a string or null"),
        ("recipe_spec", fields["recipe_spec"] is None or type(fields["recipe_spec"]) is dict, "a mapping or null"),
        ("plan_rule", fields["plan_rule"] is None or type(fields["plan_rule"]) is str, "a string or null"),
        ("recipe", type(fields["recipe"]) is bool, "true or false"),
        ("iteration", type(fields["iteration"]) is int, "an integer"),
        ("rank", type(rank) is int, "an integer"),
    ]
    for key, good, wanted in problems:
        if not good:
            raise TypeError(f"{key} is {short_repr(fields.get(key, rank))}, not {wanted}")
    return RoutingRecord(rank, **fields)


def read_routing(log_dir: str | Path) -> list[RoutingRecord]:
    """Every rank's routing records of the run in ``log_dir`` (or one of its directories, see ``run_directory``),
    rank by rank in the order written; a run without them (older versions, other frameworks) has none. Bad and
    torn lines are skipped as in the statistics files."""
    records: list[RoutingRecord] = []
    for path in sorted(_files(run_directory(log_dir) / ROUTING_RECORDS_DIR, "routing_globalrank-*.jsonl"), key=_rank_of):
        skipped = _Skipped(path, "routing record")
        with path.open("rb") as file:
            records += _line_by_line(path, file.readlines(), 1, _rank_of(path), skipped, _routing)
        skipped.say()
    return records


def _nonfinite(record: dict[str, Any], default_rank: int) -> NonfiniteRecord:
    fields = {key: record[key] for key in ("iteration", "layer", "gemm", "tensor", "micro_batch")}
    fields["rank"] = record.get("rank", default_rank)
    for key, kind in [("iteration", int), ("rank", int), ("layer", str), ("gemm", str), ("tensor", str), ("micro_batch", int)]:
        if type(fields[key]) is not kind and (fields[key] is not None or key in ("iteration", "rank")):
            raise TypeError(f"{key} is {short_repr(fields[key])}, not {'an integer' if kind is int else 'a string'}")
    return NonfiniteRecord(**fields)


def read_nonfinite(log_dir: str | Path) -> list[NonfiniteRecord]:
    """``NonfiniteGuard``'s findings in the run in ``log_dir`` (or one of its directories), every rank's, in the
    order written: the lines of each rank's debug log that ``FileLogger.log_nonfinite`` wrote. None without the guard
    (or before it found anything); a line whose record does not parse is skipped with a ``SkippedRecordsWarning``."""
    marker = f" - {NONFINITE_RECORD}".encode()
    records: list[NonfiniteRecord] = []
    for path in sorted(_files(run_directory(log_dir) / MAIN_LOG_DIR, "*.log"), key=_rank_of):
        skipped, last, warned = _Skipped(path, "NonfiniteGuard record"), -1, False
        with path.open("rb") as file:
            for number, line in enumerate(file, 1):
                if marker not in line:
                    continue
                try:
                    record = _nonfinite(json.loads(line.split(marker, 1)[1]), _rank_of(path))
                except (ValueError, KeyError, TypeError, AttributeError) as error:
                    skipped.add(number, f"no field {error}" if isinstance(error, KeyError) else str(error), line)
                    continue
                if record.iteration < last and not warned:  # one run logs its steps in order
                    _warn_appended(
                        f"{path}: NonfiniteGuard's steps go back from {last} to {record.iteration} at line {number}",
                        "the first non-finite value may be an earlier run's",
                        stacklevel=3,
                    )
                    warned = True
                records.append(record)
                last = record.iteration
        skipped.say()
    return records


def first_nonfinite_record(records: Iterable[NonfiniteRecord]) -> NonfiniteRecord | None:
    """The run's first: the earliest step, and in it a rank that saw the NaN itself before one told of another's."""
    return min(records, key=lambda r: (r.iteration, r.layer is None, r.rank), default=None)


def _from_text(path: Path) -> Iterator[Statistic]:
    """Text lines; the last one without its newline is torn even when it parses (its value may be cut short)."""
    rank, skipped = _rank_of(path), _Skipped(path)
    with path.open("rb") as file:
        for number, raw in enumerate(file, 1):
            if not raw.endswith(b"\n"):
                _warn_torn(path, number, raw)
                break
            try:
                match = _TEXT_LINE.match(raw.decode("utf-8").rstrip("\r\n"))
            except UnicodeDecodeError:
                match = None
            if match is None:
                skipped.add(number, "not a statistics line", raw)
                continue
            yield Statistic(rank, *split_name(match.group(1)), int(match.group(2)), float(match.group(3)))
    skipped.say()


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
        statistics = _from_records(path) if path.suffix == ".jsonl" else _from_text(path)
        yield from _warn_appended_runs(path, _with_lost_lines(path, statistics))


def _with_lost_lines(path: Path, statistics: Iterator[Statistic]) -> Iterator[Statistic]:
    """``statistics`` of ``path``, said (once) to lack what the run's loss note counts; the records' missing
    statistics filled in from the text log of the same rank."""
    run = path.parent.parent
    note_path = loss_note_path(run, path.stem)
    try:
        note = read_loss_note(note_path)
    except (OSError, ValueError) as error:
        warnings.warn(
            f"{note_path}: unreadable ({error}): whether {path} lacks statistics is unknown", LostRecordsWarning, stacklevel=3
        )
        return statistics
    lost, cause = note.get(f"lost_{'records' if path.suffix == '.jsonl' else 'log_lines'}"), note.get("error")
    if type(lost) is not int or lost <= 0:
        return statistics
    what = "statistics records" if path.suffix == ".jsonl" else "lines of this statistics log"
    text = run / STATISTICS_LOG_DIR / f"{path.stem}.log"
    fill = path.suffix == ".jsonl" and text.is_file()
    warnings.warn(
        f"{path}: {lost} {what} were lost to write errors while the run wrote them ({cause}); "
        + (f"the statistics they lack are read from the text log {text}, to its 4 decimals. " if fill else "")
        + f"Free space in {path.parent} (or raise its quota) for the next run to keep them all.",
        LostRecordsWarning,
        stacklevel=3,
    )
    return _filled(statistics, _from_text(text)) if fill else statistics


def _filled(records: Iterator[Statistic], text: Iterator[Statistic]) -> Iterator[Statistic]:
    """The records, and in their place the text log's statistics they lack: both files hold the iterations in
    order, so they are merged a step at a time (a step's records are compared by name as the text log splits it)."""
    steps = groupby(text, attrgetter("iteration"))
    pending = next(steps, None)
    for iteration, group in groupby(records, attrgetter("iteration")):
        while pending is not None and pending[0] < iteration:
            yield from pending[1]  # a step whose every record was lost
            pending = next(steps, None)
        step = list(group)
        if pending is not None and pending[0] == iteration:
            names = {split_name(text_name(s.layer, s.tensor, s.stat)) for s in step}
            step += [s for s in pending[1] if (s.layer, s.tensor, s.stat) not in names]
            pending = next(steps, None)
        yield from step
    if pending is not None:
        yield from pending[1]
    for _, group in steps:
        yield from group


def _warn_appended(where: str, consequence: str, stacklevel: int) -> None:
    """An ``AppendedRunsWarning``: ``where`` a file's iterations went back, and what that mixes up."""
    warnings.warn(
        f"{where}: the file holds more than one run, appended with NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE=0, and "
        f"{consequence}. Give each run its own log_dir to keep them apart.",
        AppendedRunsWarning,
        stacklevel=stacklevel,
    )


def _warn_appended_runs(path: Path, statistics: Iterator[Statistic]) -> Iterator[Statistic]:
    """One run writes its iterations in order; iterations going back mean that another run was appended, whose
    statistics the report and ``read_stats`` would mix with the first's (an ``AppendedRunsWarning``, once a file)."""
    last = -1
    for number, statistic in enumerate(statistics, 1):
        if statistic.iteration < last:
            _warn_appended(
                f"{path}: the iterations go back from {last} to {statistic.iteration} at statistic {number}",
                "their statistics at the same iterations are read as one run's",
                stacklevel=4,
            )
            yield statistic
            yield from statistics
            return
        last = statistic.iteration
        yield statistic


def read_stats(log_dir: str | Path) -> Any:
    """A pandas DataFrame with columns rank, layer, tensor, stat, iteration, value (needs pandas:
    ``pip install lowprec-inspect[pandas]``).

    Read as a stream into compact columns (numbers in arrays, each name stored once and referred to by
    its index) and made a DataFrame once at the end: a list of records would take several times the
    log's size in memory."""
    try:
        import numpy
        import pandas
    except ImportError:
        raise ImportError("read_stats needs pandas: pip install 'lowprec-inspect[pandas]'") from None
    names: dict[str, int] = {}
    code = names.setdefault
    ranks, iterations, values = array("q"), array("q"), array("d")
    codes = {field: array("i") for field in ("layer", "tensor", "stat")}
    add_rank, add_iteration, add_value = ranks.append, iterations.append, values.append
    add_layer, add_tensor, add_stat = (column.append for column in codes.values())
    for rank, layer, tensor, stat, iteration, value in iter_statistics(log_dir):  # bound appends: the loop is hot
        add_rank(rank)
        add_layer(code(layer, len(names)))
        add_tensor(code(tensor, len(names)))
        add_stat(code(stat, len(names)))
        add_iteration(iteration)
        add_value(value)
    table = numpy.empty(len(names), dtype=object)
    table[:] = list(names)
    columns = {
        "rank": numpy.frombuffer(ranks, dtype=numpy.int64),
        **{field: table[numpy.frombuffer(column, dtype=numpy.int32)] for field, column in codes.items()},
        "iteration": numpy.frombuffer(iterations, dtype=numpy.int64),
        "value": numpy.frombuffer(values, dtype=numpy.float64),
    }
    return pandas.DataFrame(columns, columns=list(Statistic._fields), copy=False)


def run_layers(log_dir: str | Path) -> list[str]:
    """The names of the layers a run logged, sorted: those of its statistics and of its routing records
    (``read_routing``); a run with neither raises ``FileNotFoundError``."""
    log_dir = run_directory(log_dir)
    names = {record.layer for record in read_routing(log_dir)}
    try:
        names.update(statistic.layer for statistic in iter_statistics(log_dir))
    except FileNotFoundError:
        if not names:
            raise
    return sorted(names)
