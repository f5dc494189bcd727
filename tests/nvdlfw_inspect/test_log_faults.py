"""Logs under faults: a process killed while writing, a full disk, an exit without end_debug, unsafe names."""

from __future__ import annotations

import errno
import logging
import os
import select
import signal
import subprocess
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from logreader import main_log_path, read_messages, stats_log_path, stats_records_path

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.cli import main
from nvdlfw_inspect.logging import STATISTICS_LOG_DIR, STATISTICS_RECORDS_DIR, BaseLogger, MetricLogger
from nvdlfw_inspect.logging import records as statistics_records
from nvdlfw_inspect.reading import SkippedRecordsWarning, TornLineWarning, iter_statistics

WORKER = str(Path(__file__).with_name("log_fault_worker.py"))
CHILD_TIMEOUT = 120
CONFIG = {
    "s": {
        "enabled": True,
        "layers": {"layer_name_regex_pattern": ".*"},
        "LogTensorStats": {"enabled": True, "stats": ["min", "max"], "tensors": ["activation"]},
    }
}


def log_step(step: int, layers: int = 2) -> None:
    """One training step: ``layers`` layers fed, two statistics each logged by ``step()``."""
    for layer in range(1, layers + 1):
        debug_api.log_tensor_stats(f"net.fc{layer}", tensor=torch.tensor([-1.0, float(step)]), tensor_name="activation")
    debug_api.step()


def run(log_dir: Path, steps: int) -> None:
    debug_api.initialize(CONFIG, log_dir=log_dir)
    for step in range(steps):
        log_step(step)
    debug_api.end_debug()


def steps_read(log_dir: Path) -> tuple[Counter, list[str]]:
    """Statistics per iteration, and the torn-line warnings reading gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        per_step = Counter(s.iteration for s in iter_statistics(log_dir))
    return per_step, [str(w.message) for w in caught if w.category is TornLineWarning]


# --- 2. a torn last line ----------------------------------------------------------------------


def read_lines_until(pipe: int, lines: int, child: subprocess.Popen) -> bytes:
    data = b""
    deadline = time.monotonic() + CHILD_TIMEOUT
    while data.count(b"\n") < lines:
        assert child.poll() is None, f"the child ended: {child.communicate()[1].decode()[-2000:]}"
        assert time.monotonic() < deadline, "the child did not write in time"
        if select.select([pipe], [], [], 1.0)[0]:
            data += os.read(pipe, 1 << 16)
    return data


def drain(pipe: int) -> bytes:
    data = b""
    while select.select([pipe], [], [], 0)[0]:
        data += os.read(pipe, 1 << 16)
    return data


def test_sigkill_while_writing_leaves_every_complete_step_readable(log_dir):
    """The records file is a pipe the test reads: once two and a half steps came through it stops reading, so
    the child is stuck inside the write of its third step (a step is more than a pipe holds) when it is killed."""
    records = 4000
    jsonl = stats_records_path(log_dir)
    jsonl.parent.mkdir(parents=True)
    os.mkfifo(jsonl)
    pipe = os.open(jsonl, os.O_RDWR | os.O_NONBLOCK)  # open before the child: its open does not wait
    command = [sys.executable, WORKER, "log_forever", str(log_dir), str(records)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        data = read_lines_until(pipe, records * 5 // 2, child)
        child.kill()
        finished = [int(line) for line in child.communicate(timeout=CHILD_TIMEOUT)[0].split()]
        data += drain(pipe)
    finally:
        child.kill()
        os.close(pipe)
    jsonl.unlink()
    jsonl.write_bytes(data)

    per_step, torn = steps_read(log_dir)
    assert finished == [0, 1]
    assert per_step[0] == per_step[1] == records  # every step that finished, whole
    assert 0 < per_step[2] < records and set(per_step) == {0, 1, 2}  # the one killed mid-write, in part
    if data.endswith(b"\n"):  # killed exactly at a line's end: nothing to skip
        assert torn == []
    else:
        assert len(torn) == 1 and str(jsonl) in torn[0]


def stats_file(log_dir: Path, suffix: str) -> Path:
    """Rank 0's structured records (``.jsonl``) or its text log (``.log``); for the text log, the records are
    removed, as in a run with text logs only."""
    if suffix == ".jsonl":
        return stats_records_path(log_dir)
    stats_records_path(log_dir).unlink()
    return stats_log_path(log_dir)


def tear(path: Path, keep: int) -> bytes:
    """Cut ``path`` inside its last line, ``keep`` bytes into it; returns the line's start that stays."""
    data = path.read_bytes()
    start = data.rindex(b"\n", 0, len(data) - 1) + 1
    path.write_bytes(data[: start + keep])
    return data[start : start + keep]


@pytest.mark.parametrize("suffix", [".jsonl", ".log"])
def test_torn_last_line_is_skipped_with_a_warning_and_the_report_is_written(log_dir, tmp_path, suffix, capsys):
    run(log_dir, steps=3)
    path = stats_file(log_dir, suffix)
    for keep in (1, 40, len(path.read_bytes().splitlines()[-1]) - 1):  # torn early, mid-line, at the line's end
        original = path.read_bytes()
        tear(path, keep)
        per_step, torn = steps_read(log_dir)
        assert per_step == {0: 4, 1: 4, 2: 3}
        assert len(torn) == 1 and f"{path}:12: skipped the torn last line" in torn[0]
        assert main(["report", str(log_dir), "-o", str(tmp_path / "r.html")]) == 0
        assert f"nvdlfw-inspect report: warning: {path}:12: skipped the torn last line" in capsys.readouterr().err
        path.write_bytes(original)


@pytest.mark.parametrize("suffix", [".jsonl", ".log"])
def test_torn_line_in_the_middle_is_skipped_and_named(log_dir, tmp_path, suffix, capsys):
    run(log_dir, steps=2)
    path = stats_file(log_dir, suffix)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:5] + [lines[5][:30]] + lines[6:]))
    with pytest.warns(SkippedRecordsWarning, match=rf"globalrank-0\{suffix}:6: skipped 1 line holding no statistics record"):
        assert len(list(iter_statistics(log_dir))) == len(lines) - 2  # the torn 6th ran into the 7th: one line
    assert main(["report", str(log_dir), "-o", str(tmp_path / "r.html")]) == 0
    assert f"nvdlfw-inspect report: warning: {path}:6: skipped 1 line" in capsys.readouterr().err


def test_each_step_reaches_each_file_in_one_write(log_dir, monkeypatch):
    writes: list[tuple[str, bytes]] = []
    real_write = os.write

    def spy(fd: int, data: bytes) -> int:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if Path(path).parent in (log_dir / STATISTICS_LOG_DIR, log_dir / STATISTICS_RECORDS_DIR):
            writes.append((Path(path).name, bytes(data)))
        return real_write(fd, data)

    debug_api.initialize(CONFIG, log_dir=log_dir)
    monkeypatch.setattr(os, "write", spy)
    log_step(0, layers=200)  # 400 lines, some 40 kB a file: more than a file object's buffer
    log_step(1, layers=200)
    assert [name for name, _ in writes] == ["nvdlfw_inspect_globalrank-0.log", "nvdlfw_inspect_globalrank-0.jsonl"] * 2
    assert all(data.count(b"\n") == 400 and data.endswith(b"\n") for _, data in writes)


def test_appending_run_cuts_off_the_torn_line_an_earlier_run_left(log_dir, monkeypatch):
    run(log_dir, steps=2)
    for path in (stats_log_path(log_dir), stats_records_path(log_dir)):
        tear(path, 20)
    monkeypatch.setenv("NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE", "0")
    run(log_dir, steps=1)
    assert steps_read(log_dir) == ({0: 8, 1: 3}, [])  # step 0 of both runs, run 1's step 1 less its torn line
    stats_records_path(log_dir).unlink()
    assert steps_read(log_dir) == ({0: 8, 1: 3}, [])


# --- 3. a full disk ---------------------------------------------------------------------------


class FullDisk:
    """The disk under ``root``, full or not: while full, directories and files cannot be created there, and
    writes to its files take ``room`` more bytes at most (a short write), then fail with ENOSPC."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch):
        self.root, self.full, self.room = str(root), False, 0
        self._write, self._mkdir, self._open = os.write, os.mkdir, os.open
        monkeypatch.setattr(os, "write", self.write)
        monkeypatch.setattr(os, "mkdir", self.mkdir)
        monkeypatch.setattr(os, "open", self.open)

    def _no_space(self, path: str) -> bool:
        return self.full and os.fspath(path).startswith(self.root)

    def write(self, fd: int, data: bytes) -> int:
        if self._no_space(os.readlink(f"/proc/self/fd/{fd}")):
            if not self.room:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            data, self.room = data[: self.room], max(0, self.room - len(data))
        return self._write(fd, data)

    def mkdir(self, path, mode=0o777, *, dir_fd=None):
        if self._no_space(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return self._mkdir(path, mode, dir_fd=dir_fd)

    def open(self, path, flags, mode=0o777, *, dir_fd=None):
        if self._no_space(path) and flags & os.O_CREAT and not os.path.exists(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return self._open(path, flags, mode, dir_fd=dir_fd)


def test_disk_full_mid_run_costs_no_step_and_later_steps_are_logged(log_dir, monkeypatch, capsys):
    disk = FullDisk(log_dir, monkeypatch)
    debug_api.initialize(CONFIG, log_dir=log_dir)
    for step in range(6):
        disk.full, disk.room = step in (2, 3), 100 if step == 2 else 0  # step 2's first write goes in part
        log_step(step)
    debug_api.end_debug()
    err = capsys.readouterr().err
    assert err.count("cannot write") == 1 and "No space left on device" in err and "Logging error" not in err
    jsonl = stats_records_path(log_dir)
    assert "16 log lines were lost to write errors (the first: [Errno 28] No space left on device): 8 in" in err
    assert f"8 in {jsonl}" in err
    assert steps_read(log_dir) == ({0: 4, 1: 4, 4: 4, 5: 4}, [])  # the partial write was cut back
    jsonl.unlink()
    assert steps_read(log_dir) == ({0: 4, 1: 4, 4: 4, 5: 4}, [])
    assert any(level == "WARNING" and "16 log lines were lost" in text for level, text in read_messages(log_dir))


def test_disk_full_at_initialize_costs_nothing_and_logging_starts_when_space_is_back(log_dir, monkeypatch, capsys):
    disk = FullDisk(log_dir, monkeypatch)
    disk.full = True
    debug_api.initialize(CONFIG, log_dir=log_dir)
    log_step(0)
    log_step(1)
    disk.full = False
    log_step(2)
    log_step(3)
    debug_api.end_debug()
    err = capsys.readouterr().err
    assert err.count("cannot write") == 1 and "Logging error" not in err
    assert steps_read(log_dir) == ({2: 4, 3: 4}, [])
    lost = [text for level, text in read_messages(log_dir) if "log lines were lost" in text]
    assert len(lost) == 1 and f"8 in {stats_log_path(log_dir)}," in lost[0] and str(main_log_path(log_dir)) in lost[0]


def test_strict_logging_raises_the_write_error(log_dir, monkeypatch):
    disk = FullDisk(log_dir, monkeypatch)
    disk.full = True
    with pytest.raises(OSError) as info:
        debug_api.initialize(CONFIG, log_dir=log_dir, strict_logging=True)
    assert info.value.errno == errno.ENOSPC and debug_api.DEBUG_MANAGER is None
    disk.full = False
    debug_api.initialize(CONFIG, log_dir=log_dir, strict_logging=True)
    log_step(0)
    disk.full = True
    with pytest.raises(OSError) as info:
        log_step(1)
    assert info.value.errno == errno.ENOSPC
    disk.full = False
    debug_api.end_debug()
    with pytest.raises(TypeError, match="strict_logging must be True or False, got 'yes'"):
        debug_api.initialize(CONFIG, log_dir=log_dir, strict_logging="yes")


# --- 5. an exit without end_debug -------------------------------------------------------------


@pytest.mark.parametrize(("how", "code"), [("sys.exit", 3), ("exception", 1), ("end_debug", 3), ("torn_down", 3)])
def test_exit_without_end_debug_logs_the_unfinished_step_once(log_dir, how, code):
    child = subprocess.run(
        [sys.executable, WORKER, "exit_mid_step", str(log_dir), how], capture_output=True, text=True, timeout=CHILD_TIMEOUT
    )
    assert child.returncode == code, child.stderr
    assert "Exception ignored" not in child.stderr
    logged = sorted((s.layer, s.iteration, s.value) for s in iter_statistics(log_dir))
    if how == "torn_down":  # nothing could be logged, and exit says so in one line
        assert logged == [("net.fc", 0, 0.5)] and "Traceback" not in child.stderr
        assert child.stderr.count("statistics logger FileLogger failed (RuntimeError") == 1  # a failing logger
    else:
        assert logged == [("net.fc", 0, 0.5), ("net.fc", 1, 1.5)]


def test_a_rank_failing_alone_exits_without_waiting_for_the_others(log_dir, tmp_path):
    """Logging the unfinished step would reduce over ranks that never join: rank 0 must exit, not hang."""
    ranks = [
        subprocess.Popen(
            [sys.executable, WORKER, "fail_on_one_rank", str(log_dir), str(rank), str(tmp_path / "rendezvous")],
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        stderr = ranks[0].communicate(timeout=CHILD_TIMEOUT)[1]
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    assert ranks[0].returncode == 1 and "RuntimeError: rank 0 failed" in stderr and "Exception ignored" not in stderr
    assert "the unfinished step is not logged in a multi-rank run (call end_debug() on every rank to log it)" in stderr


# --- 10a. file names and log_dir --------------------------------------------------------------


@pytest.mark.parametrize("stamp", ["x/../../../../p", "a..b", "x" * 65, "ok stamp"])
def test_unsafe_timestamp_is_an_error_naming_the_variable(log_dir, tmp_path, monkeypatch, stamp):
    monkeypatch.setenv("NVDLFW_INSPECT_ENABLE_LOG_TIMESTAMP", "1")
    monkeypatch.setenv("NVDLFW_INSPECT_LOG_TIMESTAMP", stamp)
    with pytest.raises(ValueError, match="NVDLFW_INSPECT_LOG_TIMESTAMP=.* use 1 to 64 of the characters A-Z a-z 0-9") as info:
        debug_api.initialize(CONFIG, log_dir=log_dir)
    assert repr(stamp) in str(info.value)
    assert debug_api.DEBUG_MANAGER is None and list(tmp_path.iterdir()) == []


def test_safe_timestamp_names_the_files(log_dir, monkeypatch):
    monkeypatch.setenv("NVDLFW_INSPECT_ENABLE_LOG_TIMESTAMP", "1")
    monkeypatch.setenv("NVDLFW_INSPECT_LOG_TIMESTAMP", "run-7.a_B")
    run(log_dir, steps=1)
    assert [p.name for p in (log_dir / STATISTICS_LOG_DIR).iterdir() if p.suffix == ".log"] == [
        "nvdlfw_inspect_run-7.a_B_globalrank-0.log"
    ]


def test_log_dir_none_is_an_error_not_a_directory_named_none(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TypeError, match=r"log_dir must be a directory path \(str or os.PathLike\), got None"):
        debug_api.initialize(CONFIG, log_dir=None)
    assert debug_api.DEBUG_MANAGER is None and list(tmp_path.iterdir()) == []


# --- 6. end_debug from a signal handler, fork children ----------------------------------------


def test_end_debug_from_a_signal_handler_during_step_exits(log_dir):
    """A preemption handler calling end_debug interrupts step() in the same thread: it must not wait for the
    step's own lock (a deadlock), and the steps logged before stay whole."""
    command = [sys.executable, WORKER, "end_debug_from_signal_handler", str(log_dir)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        read_lines_until(child.stdout.fileno(), 3, child)  # inside the slow logger of step 2
        child.send_signal(signal.SIGUSR1)
        out, err = child.communicate(timeout=15)
    finally:
        child.kill()
    assert child.returncode == 7, err.decode()[-3000:]
    assert b"ended True" in out
    per_step, torn = steps_read(log_dir)
    assert torn == [] and per_step == {0: 20, 1: 20}


@pytest.mark.parametrize("how", ["exit", "end_debug"])
def test_a_forked_child_does_not_log_the_parents_step(log_dir, how):
    child = subprocess.run(
        [sys.executable, WORKER, "fork_mid_step", str(log_dir), how], capture_output=True, text=True, timeout=CHILD_TIMEOUT
    )
    assert child.returncode == 0, child.stderr
    logged = sorted((s.layer, s.iteration, s.value) for s in iter_statistics(log_dir))
    assert logged == [("net.fc", 0, 0.5), ("net.fc", 1, 1.5)]
    if how == "exit":  # nor, exiting, touch the parent's loggers (a TensorBoard writer's flush may hang there)
        pid = child.stdout.split("child ")[1].split()[0]
        assert f"flushed in {pid}" not in child.stdout


# --- 7. a failing statistics logger -----------------------------------------------------------


class BrokenLogger(BaseLogger):
    """A custom statistics logger that fails (a remote service down): on every statistic, or on its flush."""

    def __init__(self, fail_log: bool = True, fail_flush: bool = False):
        self.fail_log, self.fail_flush, self.flushes = fail_log, fail_flush, 0

    def log_scalar(self, name: str, value: float, iteration: int, **kwargs: object) -> None:
        if self.fail_log:
            raise ConnectionError("metrics service unreachable")

    def flush(self) -> None:
        self.flushes += 1
        if self.fail_flush:
            raise ConnectionError("metrics service unreachable")


class ScalarWriter:
    """A SummaryWriter stand-in that keeps what it is given."""

    def __init__(self):
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, name: str, value: float, step: int) -> None:
        self.scalars.append((name, value, step))


def test_a_failing_logger_costs_its_own_records_only(log_dir, recwarn):
    writer = ScalarWriter()
    debug_api.initialize(
        CONFIG, log_dir=log_dir, statistics_logger=BrokenLogger(), tb_writer=writer, default_logging_enabled=True
    )
    for step in range(3):
        log_step(step)  # never raises
    debug_api.end_debug()
    assert len(writer.scalars) == 3 * 4  # the logger after the broken one lost nothing
    assert steps_read(log_dir) == ({0: 4, 1: 4, 2: 4}, [])
    said = [str(w.message) for w in recwarn if "BrokenLogger" in str(w.message)]
    assert len(said) == 2, said  # the first failure, and at end_debug the count
    assert "ConnectionError: metrics service unreachable" in said[0] and "strict_logging=True" in said[0]
    assert "12 statistics records" in said[1]
    assert sum("BrokenLogger" in text for _, text in read_messages(log_dir)) == 2


def test_a_failing_logger_costs_its_own_records_one_by_one_too(log_dir):
    """The per-record entries (``MetricLogger.log_statistic`` and ``log_scalar``) isolate loggers as a step does."""
    writer = ScalarWriter()
    debug_api.initialize(CONFIG, log_dir=log_dir, statistics_logger=BrokenLogger(), tb_writer=writer)
    with pytest.warns(UserWarning, match="statistics logger BrokenLogger failed"):
        MetricLogger.log_statistic("net.fc", "activation", "max", 1.0, 0)
    MetricLogger.log_scalar("net.fc_activation_min", -1.0, 0)
    with pytest.warns(UserWarning, match="BrokenLogger dropped 2 statistics records"):
        debug_api.end_debug()
    assert writer.scalars == [("net.fc_activation_max", 1.0, 0), ("net.fc_activation_min", -1.0, 0)]


def test_strict_logging_raises_a_loggers_error(log_dir):
    debug_api.initialize(CONFIG, log_dir=log_dir, statistics_logger=BrokenLogger(), strict_logging=True)
    with pytest.raises(ConnectionError, match="metrics service unreachable"):
        log_step(0)
    debug_api.end_debug()


@pytest.mark.parametrize("strict", [False, True])
def test_a_logger_failing_to_flush_at_end_debug_leaves_a_clean_state(log_dir, strict):
    broken = BrokenLogger(fail_log=False, fail_flush=True)
    debug_api.initialize(CONFIG, log_dir=log_dir, statistics_logger=broken, strict_logging=strict)
    with pytest.raises(ConnectionError) if strict else pytest.warns(UserWarning, match="BrokenLogger"):
        debug_api.end_debug()  # strict or not: end_debug completes (strict then raises the logger's error)
    flushes = broken.flushes
    debug_api.initialize(CONFIG, log_dir=log_dir)  # the broken logger is gone
    log_step(0)
    debug_api.end_debug()
    assert broken.flushes == flushes and steps_read(log_dir)[0] == {0: 4}


# --- 8. Ctrl-C in step(), and names that would forge lines ------------------------------------


def test_ctrl_c_during_step_writes_the_step_whole_or_not_at_all(log_dir, monkeypatch):
    """A KeyboardInterrupt while step() formats its 120 records (here at the 40th) writes none of them."""
    debug_api.initialize(CONFIG, log_dir=log_dir)
    log_step(0, layers=60)
    calls, json_number = [0], statistics_records._json_number

    def interrupted(value: float) -> str:
        calls[0] += 1
        if calls[0] == 40:
            raise KeyboardInterrupt
        return json_number(value)

    monkeypatch.setattr(statistics_records, "_json_number", interrupted)
    with pytest.raises(KeyboardInterrupt):
        log_step(1, layers=60)
    monkeypatch.setattr(statistics_records, "_json_number", json_number)
    log_step(2, layers=60)
    debug_api.end_debug()
    assert steps_read(log_dir) == ({0: 120, 2: 120}, [])
    stats_records_path(log_dir).unlink()  # the text log alone
    assert steps_read(log_dir) == ({0: 120, 2: 120}, [])


def test_ctrl_c_in_the_middle_of_a_steps_write_leaves_the_file_at_the_step_before(log_dir, monkeypatch):
    """The kernel took part of the step's write when Ctrl-C came (a slow disk, a pipe): that part is cut back."""
    jsonl, write, state = str(stats_records_path(log_dir)), os.write, {"armed": False, "writes": 0}

    def interrupted_write(fd: int, data: bytes) -> int:
        if state["armed"] and os.readlink(f"/proc/self/fd/{fd}") == jsonl:
            state["writes"] += 1
            if state["writes"] > 1:
                raise KeyboardInterrupt  # while the write goes on
            return write(fd, data[:1000])  # the kernel took a part
        return write(fd, data)

    debug_api.initialize(CONFIG, log_dir=log_dir)
    monkeypatch.setattr(os, "write", interrupted_write)
    log_step(0, layers=60)
    state["armed"] = True
    with pytest.raises(KeyboardInterrupt):
        log_step(1, layers=60)
    state["armed"] = False
    log_step(2, layers=60)
    debug_api.end_debug()
    assert steps_read(log_dir) == ({0: 120, 2: 120}, [])


FORGED = "net.fc\n2026-01-01 00:00:00,000 - INFO - net.forged_activation_max \t\t\t\t iteration=000007 \t\t\t\t value=9.0\r"


def test_a_newline_in_a_layer_name_forges_no_line(log_dir):
    """Text logs hold one record a line: a layer name's newline (or carriage return) is written escaped."""
    debug_api.initialize(CONFIG, log_dir=log_dir)
    debug_api.log_tensor_stats(FORGED, tensor=torch.tensor([0.5]), tensor_name="activation")
    debug_api.log_message("seen", layer_name=FORGED)
    debug_api.step()
    debug_api.end_debug()
    escaped = FORGED.replace("\n", "\\n").replace("\r", "\\r")
    lines = stats_log_path(log_dir).read_text().splitlines()
    assert [line.split(" - INFO - ", 1)[1] for line in lines] == [
        f"{escaped}_activation_{stat} \t\t\t\t iteration=000000 \t\t\t\t value=0.5000" for stat in ("min", "max")
    ]
    assert ("INFO", f"LAYER={escaped}: seen") in read_messages(log_dir)
    assert {s.layer for s in iter_statistics(log_dir)} == {FORGED}  # the records keep the name as it is


class _Utf8Handler(logging.Handler):
    """Encodes each message as UTF-8, as a handler writing to a file or a pipe does, and lets a failure through."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""

    def emit(self, record: logging.LogRecord) -> None:
        self.written += record.getMessage().encode("utf-8") + b"\n"

    def handleError(self, record: logging.LogRecord) -> None:
        raise


def test_a_lone_surrogate_in_a_layer_name_costs_no_line(log_dir):
    """A name holding a lone surrogate (``\\udcff``, as undecodable bytes give), which UTF-8 cannot hold: nothing
    is raised into the training, the text logs write it escaped (``\\udcff``) and keep every layer's lines, and
    the records keep the name as it is."""
    odd = "net.fc\udcff"
    layers = ["net.fc1", odd, "net.fc3"]
    config = {"s": CONFIG["s"] | {"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation"]}}}
    debug_api.initialize(config, log_dir=log_dir)
    handler = _Utf8Handler()  # a user's handler on the debug log (a JSON log shipper, pytest-xdist) writes UTF-8
    logging.getLogger("nvdlfw_inspect").addHandler(handler)
    try:
        for step in range(12):
            for layer in layers:
                debug_api.log_tensor_stats(layer, tensor=torch.tensor([-1.0, float(step)]), tensor_name="activation")
            debug_api.log_message("seen", layer_name=odd)
            debug_api.step()
        debug_api.end_debug()
    finally:
        logging.getLogger("nvdlfw_inspect").removeHandler(handler)
    assert b"LAYER=net.fc\\udcff: seen" in handler.written
    names = Counter(line.split(" - INFO - ", 1)[1].split(" ", 1)[0] for line in stats_log_path(log_dir).read_text().splitlines())
    assert names == {"net.fc1_activation_max": 12, "net.fc\\udcff_activation_max": 12, "net.fc3_activation_max": 12}
    assert ("INFO", "LAYER=net.fc\\udcff: seen") in read_messages(log_dir)
    assert Counter(s.layer for s in iter_statistics(log_dir)) == dict.fromkeys(layers, 12)
    stats_records_path(log_dir).unlink()  # the text log alone: the name as it is written there
    assert Counter(s.layer for s in iter_statistics(log_dir)) == dict.fromkeys(["net.fc1", "net.fc\\udcff", "net.fc3"], 12)


@pytest.mark.parametrize("suffix", [".jsonl", ".log"])
def test_a_real_ctrl_c_leaves_every_step_whole_or_absent(log_dir, suffix):
    """SIGINT to a real process logging steps of 3,000 records: whatever it interrupts (formatting, a write, the
    exit), each step is in the file whole or not at all."""
    records = 3000
    command = [sys.executable, WORKER, "log_forever", str(log_dir), str(records)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in child.stdout:  # steps 0-2 finished: interrupt the ones after
            if int(line) == 2:
                break
        child.send_signal(signal.SIGINT)
        _, stderr = child.communicate(timeout=CHILD_TIMEOUT)
    finally:
        child.kill()
    assert "KeyboardInterrupt" in stderr
    stats_file(log_dir, suffix)  # for .log: the records file removed, the text log read
    per_step, torn = steps_read(log_dir)
    assert per_step[0] == per_step[1] == per_step[2] == records and torn == []
    assert set(per_step.values()) == {records}, {step: n for step, n in per_step.items() if n != records}
