"""The statistics log's lines and records (``StatisticsFile``: the text log and its JSONL records) and the routing
records' fields. The structured records, which the reference does not write, go to a directory of their own
(``STATISTICS_RECORDS_DIR``), so that scripts reading every file of ``STATISTICS_LOG_DIR`` find only text logs; so
do the routing records (``ROUTING_RECORDS_DIR``: which GEMM read which tensor in which precision)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from typing import Any

from nvdlfw_inspect.files import replace_whole
from nvdlfw_inspect.logging.files import LogFile, WriteFaults, _one_line
from nvdlfw_inspect.logging.settings import MAIN_LOG_DIR, _global_rank

ROUTING_GEMMS = ("fprop", "dgrad", "wgrad")
#: fp8: the recipe's quantized operand; high_precision: the GEMM reads the tensor unquantized; modified: a feature's
#: ``modify_tensor`` produced the operand
ROUTING_DECISIONS = ("fp8", "high_precision", "modified")

Statistic = tuple[str, str, str, float, int]  # (layer, tensor, stat, value, iteration)
LOSS_NOTE_SUFFIX = ".losses.json"


def loss_note_path(log_dir: str | os.PathLike[str], stem: str) -> str:
    """Where a rank's statistics files (``stem``: their name without suffix) note what write errors cost them:
    beside the debug log, since the statistics directory may be the full one (and scripts read all its files)."""
    return os.path.join(log_dir, MAIN_LOG_DIR, stem + LOSS_NOTE_SUFFIX)


def read_loss_note(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The note's fields (``StatisticsFile._note_losses``); ``{}`` when there is none: nothing was lost. An
    unreadable note raises (``OSError``, ``ValueError``)."""
    try:
        with open(path, "rb") as file:
            note = json.loads(file.read())
    except FileNotFoundError:
        return {}
    if not isinstance(note, dict):
        raise ValueError(f"not a JSON object: {note!r:.80}")
    return note


def _as_float(value: Any) -> float:
    return float(value.item()) if hasattr(value, "item") else float(value)


def text_name(layer: str, tensor: str, stat: str) -> str:
    """A statistic's name in the text log: ``{layer}_{tensor}_{stat}``, one line (see ``_one_line``)."""
    return _one_line(f"{layer}_{tensor}_{stat}")


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
        self._root, self._faults = root, faults
        self._note = loss_note_path(root, os.path.splitext(os.path.basename(records_path))[0])
        self._lost_before = (0, 0)  # (records, text lines) an earlier run appended to lost
        if overwrite:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._note)  # an earlier run's, about files now truncated
        else:
            with contextlib.suppress(OSError, ValueError, TypeError):
                note = read_loss_note(self._note)
                self._lost_before = (int(note.get("lost_records", 0)), int(note.get("lost_log_lines", 0)))
        self._noted = self._lost_before
        self.note_error: OSError | None = None  # why the losses could not be noted (said at end_debug)
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
        heads = self._heads[names] = (text_name(*names), "{" + record)
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
        self._note_losses()

    def _note_losses(self) -> None:
        """Write down how many records and text lines write errors cost, whenever that grew: ``read_stats`` then
        says so and reads the iterations the records lack from the text log (a full records directory would
        otherwise cost them without a word). The note may fail to be written too: kept for ``end_debug`` to say
        with the lost lines, never raised; every later step tries again."""
        if not self._faults.lost:
            return
        lost = (
            self._lost_before[0] + self._faults.lost.get(self._records.path, 0),
            self._lost_before[1] + self._faults.lost.get(self._file.path, 0),
        )
        if lost == self._noted:
            return
        error = self._faults.errors.get(self._records.path) or self._faults.errors.get(self._file.path)
        note = {
            "statistics_records": os.path.relpath(self._records.path, self._root),
            "lost_records": lost[0],
            "statistics_log": os.path.relpath(self._file.path, self._root),
            "lost_log_lines": lost[1],
            "error": str(error),
        }
        try:
            replace_whole(self._note, lambda file: file.write(json.dumps(note).encode("utf-8") + b"\n"))
        except OSError as failure:
            self.note_error = failure
            return
        self._noted, self.note_error = lost, None

    def note_failure(self) -> str | None:
        """What an unwritten loss note costs the readers, or None when the losses are noted."""
        if self.note_error is None:
            return None
        return (
            f"the count of the statistics lost could not be written to {self._note} ({self.note_error}): read_stats "
            "and the report will not say that statistics are missing"
        )

    def drop_held(self) -> None:
        """Forget the lines queued since ``autoflush`` went off (a batch cut short)."""
        self._file.drop_pending()
        self._records.drop_pending()

    def close(self) -> None:
        try:
            self._file.close()
        finally:
            self._records.close()
        self._note_losses()


def routing_record(
    layer: str,
    gemm: str,
    tensor: str,
    decision: str,
    feature: str | None,
    recipe: bool,
    iteration: int,
    reason: str | None = None,
    format: str | None = None,
    recipe_spec: dict[str, Any] | None = None,
    plan_rule: str | None = None,
) -> dict[str, Any]:
    """A routing record's fields, checked (``ValueError``/``TypeError`` naming the field), in the file's order;
    ``reason``, ``format``, ``recipe_spec`` and ``plan_rule`` only when given, so records without them keep their
    line format."""
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
    if format is not None and (not isinstance(format, str) or not format):
        raise TypeError(f"routing record: format must be a non-empty string or None, got {format!r}")
    if recipe_spec is not None and not (isinstance(recipe_spec, dict) and isinstance(recipe_spec.get("name"), str)):
        raise TypeError(f"routing record: recipe_spec must be a mapping with a 'name' or None, got {recipe_spec!r}")
    if plan_rule is not None and (not isinstance(plan_rule, str) or not plan_rule):
        raise TypeError(f"routing record: plan_rule must be a non-empty string or None, got {plan_rule!r}")
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
    if reason is not None:
        record["reason"] = reason
    if format is not None:
        record["format"] = format
    if recipe_spec is not None:
        record["recipe_spec"] = recipe_spec
    if plan_rule is not None:
        record["plan_rule"] = plan_rule
    return record
