"""Log files, their names and formats, and the choice of statistics loggers."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch
from logreader import main_log_path, read_messages, read_stats, stats_log_path, stats_records_path

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.errors import LogDirInUseError, UnsafeLogPathError
from nvdlfw_inspect.logging import (
    BaseLogger,
    FileLogger,
    MetricLogger,
    TensorboardLogger,
    custom_assert,
    get_logger,
    log_file_name,
    print_rank_0,
    wrap_tensorboard_writer,
)
from nvdlfw_inspect.reading import AppendedRunsWarning, iter_statistics

CONFIG = {
    "s": {
        "enabled": True,
        "layers": {"layer_types": ["fc"]},
        "LogTensorStats": {"enabled": True, "stats": ["min", "max"], "tensors": ["activation"]},
    }
}


class ListLogger(BaseLogger):
    def __init__(self):
        self.records = []

    def log_scalar(self, name, value, iteration, **kwargs):
        self.records.append((name, float(value), iteration))


class FakeWriter:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))


def log_stats_once():
    """One call, then ``step()``: statistics reach the loggers when the step ends."""
    debug_api.log_tensor_stats("net.fc", tensor=torch.tensor([-2.0, 5.0]), tensor_name="activation")
    debug_api.step()


def test_default_file_logger_line_format(log_dir):
    debug_api.initialize(CONFIG, log_dir=log_dir, init_training_step=7)
    log_stats_once()
    lines = stats_log_path(log_dir).read_text().splitlines()
    assert len(lines) == 2
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} - INFO - net\.fc_activation_min \t\t\t\t iteration=000007 \t\t\t\t value=-2\.0000",
        lines[0],
    )
    assert read_stats(log_dir) == {("net.fc_activation_min", 7): -2.0, ("net.fc_activation_max", 7): 5.0}
    first_main = main_log_path(log_dir).read_text().splitlines()[0]
    assert re.fullmatch(r"\S+ \S+ - INFO - Default logging to file enabled at .*", first_main)


def test_custom_logger_replaces_the_file_logger(log_dir):
    sink = ListLogger()
    debug_api.initialize(CONFIG, log_dir=log_dir, statistics_logger=sink)
    log_stats_once()
    assert sink.records == [("net.fc_activation_min", -2.0, 0), ("net.fc_activation_max", 5.0, 0)]
    assert not (log_dir / "nvdlfw_inspect_statistics_logs").exists()
    assert ("INFO", "Using the provided logger for logging tensor statistics.") in read_messages(log_dir)


class BatchLogger(ListLogger):
    """A logger that takes a step's statistics at once."""

    def __init__(self):
        super().__init__()
        self.batches = []

    def log_statistics(self, records):
        self.batches.append(list(records))


def test_a_logger_with_log_statistics_gets_each_step_at_once(log_dir):
    sink, plain = BatchLogger(), ListLogger()
    debug_api.initialize(CONFIG, log_dir=log_dir, statistics_logger=sink, default_logging_enabled=True)
    MetricLogger.add_logger(plain)
    log_stats_once()
    log_stats_once()
    assert sink.batches == [
        [("net.fc", "activation", "min", -2.0, 0), ("net.fc", "activation", "max", 5.0, 0)],
        [("net.fc", "activation", "min", -2.0, 1), ("net.fc", "activation", "max", 5.0, 1)],
    ]
    assert sink.records == []  # the batch replaces log_scalar
    assert plain.records[:2] == [("net.fc_activation_min", -2.0, 0), ("net.fc_activation_max", 5.0, 0)]  # one call each
    assert read_stats(log_dir)[("net.fc_activation_max", 1)] == 5.0  # the file logger's batch


def test_default_logging_enabled_adds_the_file_logger(log_dir):
    sink = ListLogger()
    debug_api.initialize(CONFIG, log_dir=log_dir, statistics_logger=sink, default_logging_enabled=True)
    log_stats_once()
    assert len(sink.records) == 2
    assert read_stats(log_dir)[("net.fc_activation_max", 0)] == 5.0


def test_custom_logger_and_tb_writer_both_receive(log_dir):
    sink, writer = ListLogger(), FakeWriter()
    debug_api.initialize(CONFIG, log_dir=log_dir, statistics_logger=sink, tb_writer=writer)
    log_stats_once()
    assert len(sink.records) == 2
    assert writer.scalars == [("net.fc_activation_min", -2.0, 0), ("net.fc_activation_max", 5.0, 0)]


def test_statistics_logger_must_be_a_base_logger(log_dir):
    class DuckLogger:
        def log_scalar(self, name, value, iteration, **kwargs):
            pass

    with pytest.raises(TypeError, match="statistics_logger must be an instance of nvdlfw_inspect.logging.BaseLogger"):
        debug_api.initialize(CONFIG, log_dir=log_dir, statistics_logger=DuckLogger())
    assert debug_api.DEBUG_MANAGER is None
    with pytest.raises(TypeError, match="tb_writer must have an add_scalar method"):
        debug_api.initialize(CONFIG, log_dir=log_dir, tb_writer=object())


def test_tensorboard_events_are_written_and_read_back(log_dir, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    debug_api.initialize(CONFIG, log_dir=log_dir, tb_writer=writer)
    log_stats_once()
    debug_api.log_tensor_stats("net.fc", tensor=torch.tensor([1.5, 3.25]), tensor_name="activation")
    debug_api.end_debug()  # logs the unfinished step
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"net.fc_activation_min", "net.fc_activation_max"}
    assert [(e.step, e.value) for e in events.Scalars("net.fc_activation_min")] == [(0, -2.0), (1, 1.5)]
    assert [(e.step, e.value) for e in events.Scalars("net.fc_activation_max")] == [(0, 5.0), (1, 3.25)]
    assert ("INFO", "TB Writer found. Logging to Tensorboard..") in read_messages(log_dir)
    assert not (log_dir / "nvdlfw_inspect_statistics_logs").exists()


def test_overwrite_is_default_and_append_on_request(log_dir, monkeypatch):
    for _ in range(2):
        debug_api.initialize(CONFIG, log_dir=log_dir)
        log_stats_once()
        debug_api.end_debug()
    assert len(stats_log_path(log_dir).read_text().splitlines()) == 2
    monkeypatch.setenv("NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE", "0")
    debug_api.initialize(CONFIG, log_dir=log_dir)
    log_stats_once()
    debug_api.end_debug()
    assert len(stats_log_path(log_dir).read_text().splitlines()) == 4
    monkeypatch.setenv("NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE", "yes")
    with pytest.raises(ValueError, match="NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE='yes' must be an integer"):
        debug_api.initialize(CONFIG, log_dir=log_dir)


@pytest.mark.parametrize("planted", [main_log_path, stats_log_path, stats_records_path])
@pytest.mark.parametrize("linked", ["file", "directory"])
def test_links_planted_in_log_dir_are_refused_and_their_targets_untouched(log_dir, tmp_path, planted, linked):
    victim_dir = tmp_path / "elsewhere"
    victim_dir.mkdir()
    path = planted(log_dir)
    victim = victim_dir / path.name
    victim.write_text("precious\n")
    link = path if linked == "file" else path.parent
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim if linked == "file" else victim_dir)
    with pytest.raises(UnsafeLogPathError, match=rf"symbolic link {re.escape(str(link))} -> {re.escape(str(link.readlink()))}"):
        debug_api.initialize(CONFIG, log_dir=log_dir)
    assert victim.read_text() == "precious\n"
    assert debug_api.DEBUG_MANAGER is None


def test_log_dir_that_is_itself_a_link_and_links_inside_it_are_followed(tmp_path):
    real = tmp_path / "real_logs"
    (real / "stats_here").mkdir(parents=True)
    (tmp_path / "logs").symlink_to(real)
    (real / "nvdlfw_inspect_statistics_logs").symlink_to(real / "stats_here")
    debug_api.initialize(CONFIG, log_dir=tmp_path / "logs")
    log_stats_once()
    debug_api.end_debug()
    assert len((real / "stats_here" / "nvdlfw_inspect_globalrank-0.log").read_text().splitlines()) == 2


def test_relative_log_dir_is_fixed_at_initialize(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    debug_api.initialize(CONFIG, log_dir="logs")
    assert get_logger().root_log_dir == str(tmp_path / "a" / "logs")
    monkeypatch.chdir(tmp_path / "b")
    log_stats_once()
    debug_api.end_debug()
    assert len(stats_log_path(tmp_path / "a" / "logs").read_text().splitlines()) == 2
    assert list((tmp_path / "b").iterdir()) == []


def test_a_second_run_says_which_logs_it_overwrote_and_how_to_keep_them(log_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the first run overwrites nothing and says nothing
        debug_api.initialize(CONFIG, log_dir=log_dir)
    log_stats_once()
    debug_api.end_debug()
    with pytest.warns(UserWarning, match="overwrote the logs of an earlier run") as record:
        debug_api.initialize(CONFIG, log_dir=log_dir)
    message = str(record[0].message)
    assert str(log_dir) in message
    for path in (main_log_path(log_dir), stats_log_path(log_dir), stats_records_path(log_dir)):
        assert str(path.relative_to(log_dir)) in message
    assert "NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE=0" in message and "its own log_dir" in message
    assert sum("overwrote" in text for _, text in read_messages(log_dir)) == 1


def test_appended_runs_are_read_with_a_warning_that_they_are_mixed(log_dir, monkeypatch):
    monkeypatch.setenv("NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE", "0")
    for _ in range(2):
        debug_api.initialize(CONFIG, log_dir=log_dir)
        log_stats_once()
        log_stats_once()
        debug_api.end_debug()
    with pytest.warns(AppendedRunsWarning, match=r"go back from 1 to 0 at statistic 5: .* more than one run") as record:
        statistics = list(iter_statistics(log_dir))
    assert len(record) == 1 and len(statistics) == 8


HOLDER = """
import sys
import nvdlfw_inspect.api as debug_api
debug_api.initialize("", log_dir=sys.argv[1])
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_second_live_process_on_the_same_log_dir_is_refused_until_the_first_ends(log_dir):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(log_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    deadline = threading.Timer(60, holder.kill)  # a holder that hangs before it is ready ends the wait
    deadline.start()
    try:
        assert holder.stdout.readline() == "ready\n"
        before = main_log_path(log_dir).read_bytes()
        with pytest.raises(
            LogDirInUseError,
            match=rf"in use at rank 0 by another live run \(pid {holder.pid} on host "
            rf"{re.escape(socket.gethostname())}; lock file .*nvdlfw_inspect_globalrank-0\.lock\)",
        ):
            debug_api.initialize(CONFIG, log_dir=log_dir)
        assert main_log_path(log_dir).read_bytes() == before and debug_api.DEBUG_MANAGER is None
    finally:
        deadline.cancel()
        holder.kill()
        holder.communicate(timeout=60)
    debug_api.initialize(CONFIG, log_dir=log_dir)  # the OS released the killed holder's lock
    assert (main_log_path(log_dir).parent / "nvdlfw_inspect_globalrank-0.lock").read_text() == (
        f"pid {os.getpid()} on host {socket.gethostname()}\n"
    )
    debug_api.end_debug()
    debug_api.initialize(CONFIG, log_dir=log_dir)  # and end_debug released this one's


def test_a_forked_child_does_not_keep_the_lock_after_end_debug(log_dir):
    debug_api.initialize(CONFIG, log_dir=log_dir)
    child = os.fork()
    if child == 0:  # a DataLoader worker, say: outlives the session
        time.sleep(30)
        os._exit(0)
    try:
        debug_api.end_debug()
        debug_api.initialize(CONFIG, log_dir=log_dir)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_timestamped_file_names(log_dir, monkeypatch):
    monkeypatch.setenv("NVDLFW_INSPECT_ENABLE_LOG_TIMESTAMP", "1")
    monkeypatch.delenv("NVDLFW_INSPECT_LOG_TIMESTAMP", raising=False)
    name = log_file_name()
    assert re.fullmatch(r"nvdlfw_inspect_\d{8}_\d{6}_globalrank-0\.log", name)
    assert log_file_name() == name  # fixed once per process
    monkeypatch.setenv("NVDLFW_INSPECT_LOG_TIMESTAMP", "shared_stamp")
    debug_api.initialize(CONFIG, log_dir=log_dir)
    assert (log_dir / "nvdlfw_inspect_logs" / "nvdlfw_inspect_shared_stamp_globalrank-0.log").is_file()
    monkeypatch.setenv("NVDLFW_INSPECT_ENABLE_LOG_TIMESTAMP", "0")
    assert log_file_name() == "nvdlfw_inspect_globalrank-0.log"


def test_rank_from_launcher_environment_when_not_distributed(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    assert log_file_name() == "nvdlfw_inspect_globalrank-3.log"


def test_file_logger_without_statistics_file_refuses_scalars(tmp_path):
    logger = FileLogger("nvdlfw_inspect_test_logger", str(tmp_path))
    try:
        with pytest.raises(RuntimeError, match="Default stats logger not initialized"):
            logger.log_scalar("x", 1.0, 0)
        logger.log_message("kept", level=logging.INFO)
        assert "kept" in (tmp_path / "nvdlfw_inspect_logs" / "nvdlfw_inspect_globalrank-0.log").read_text()
    finally:
        logger.close()


def test_metric_logger_fans_out_and_tensorboard_wrapper():
    writer, sink = FakeWriter(), ListLogger()
    MetricLogger.add_logger(sink)
    MetricLogger.add_logger(wrap_tensorboard_writer(writer))
    try:
        MetricLogger.log_scalar("a", torch.tensor(2.5), 4)
    finally:
        MetricLogger.reset()
    assert sink.records == [("a", 2.5, 4)]
    assert writer.scalars == [("a", 2.5, 4)]
    TensorboardLogger(None).log_scalar("ignored", 1.0, 0)


def test_print_rank_0_and_custom_assert(capsys):
    print_rank_0("a", 1)
    assert capsys.readouterr().out == "a 1 \n"
    custom_assert(True, "fine")
    with pytest.raises(AssertionError, match="broken"):
        custom_assert(False, "broken")


def test_warnings_are_echoed_to_stderr(log_dir, capsys):
    debug_api.initialize(CONFIG, log_dir=log_dir)
    capsys.readouterr()
    debug_api.log_message("watch out", level=logging.WARNING)
    debug_api.log_message("quiet")
    err = capsys.readouterr().err
    assert re.search(r"NVDLFW INSPECT - \S+ \S+ - WARNING - watch out", err)
    assert "quiet" not in err


def test_say_once_writes_the_debug_log_and_one_warning_and_without_a_session_the_warning_alone(log_dir):
    import warnings

    from nvdlfw_inspect.logging import say_once

    debug_api.initialize(CONFIG, log_dir=log_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        said = [say_once("the GEMM of fc1 runs in high precision", "fc1", call_site="test") for _ in range(3)]
        say_once("a note only for the log", level=logging.INFO, warning=None, call_site="test")
        debug_api.end_debug()
        alone = say_once("no session is open", warning=RuntimeWarning, call_site="test")
    assert said == [True, False, False] and alone
    assert [(w.category, str(w.message)) for w in caught] == [
        (UserWarning, "the GEMM of fc1 runs in high precision"),
        (RuntimeWarning, "no session is open"),
    ]
    messages = read_messages(log_dir)
    assert messages.count(("WARNING", "LAYER=fc1: the GEMM of fc1 runs in high precision")) == 1
    assert ("INFO", "a note only for the log") in messages


EARLY = ["kurtosis", "rms", "outlier_channel_ratio", "max_channel"]


def early_warning_steps(steps: int = 3) -> list[torch.Tensor]:
    """``steps`` steps of two micro-batches of one (8, 6) activation logging the early-warning statistics, channel
    ``step + 1`` grown x10 more each step; each step's two micro-batches together (what its statistics describe)."""
    generator = torch.Generator().manual_seed(5)
    seen = []
    for step in range(steps):
        halves = [torch.randn(8, 6, generator=generator, dtype=torch.float64) for _ in range(2)]
        for half in halves:
            half[:, step + 1] *= 10.0 ** (step + 1)
            debug_api.log_tensor_stats("net.fc", tensor=half.float(), tensor_name="activation")
        seen.append(torch.cat(halves).float().double())
        debug_api.step()
    return seen


def early_warning_reference(x: torch.Tensor) -> dict[str, float]:
    """The early-warning statistics of ``x`` in float64, from their definitions (``docs/statistics.md``)."""
    deviation = x - x.mean()
    amax = x.abs().amax(dim=0)
    middle = amax.sort().values[[2, 3]]  # six columns: the median is the mean of the two middle ones
    return {
        "kurtosis": (x.numel() * deviation.pow(4).sum() / deviation.pow(2).sum() ** 2).item(),
        "rms": x.pow(2).mean().sqrt().item(),
        "outlier_channel_ratio": (amax.max() / middle.mean()).item(),
        "max_channel": float(amax.argmax().item()),
    }


def test_early_warning_statistics_reach_tensorboard(log_dir, tmp_path):
    """kurtosis, rms, outlier_channel_ratio and max_channel (issue 38) reach a real SummaryWriter as the other
    statistics do: one tag each, one event per step, the values of float64 torch on the step's tensors (in float32)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    config = {"s": CONFIG["s"] | {"LogTensorStats": {"enabled": True, "stats": EARLY, "tensors": ["activation"]}}}
    writer = SummaryWriter(str(tmp_path / "tb"))
    debug_api.initialize(config, log_dir=log_dir, tb_writer=writer)
    seen = early_warning_steps()
    debug_api.end_debug()
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {f"net.fc_activation_{stat}" for stat in EARLY}
    expected = [early_warning_reference(x) for x in seen]
    assert [e["max_channel"] for e in expected] == [1.0, 2.0, 3.0]  # the grown channel, as planted
    for stat in EARLY:
        scalars = events.Scalars(f"net.fc_activation_{stat}")
        assert [e.step for e in scalars] == [0, 1, 2]
        assert [e.value for e in scalars] == [pytest.approx(ref[stat], rel=1e-6) for ref in expected], stat
