"""Child processes for test_log_faults: training loops that log statistics and end badly.

Run as ``python log_fault_worker.py FUNCTION LOG_DIR [ARG]``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.logging import BaseLogger, MetricLogger, close_logger

CONFIG = {
    "s": {
        "enabled": True,
        "layers": {"layer_name_regex_pattern": ".*"},
        "LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation"]},
    }
}


def log_forever(log_dir: str, records: str) -> None:
    """Steps of ``records`` statistics each, logged as ``step()`` logs them (one batch), each finished step printed."""
    debug_api.initialize(config_file="", log_dir=log_dir)
    step = 0
    while True:
        with MetricLogger.batch():
            for layer in range(int(records)):
                MetricLogger.log_statistic(f"model.layers.{layer}", "activation", "max", float(step), step)
        print(step, flush=True)
        step += 1


def exit_mid_step(log_dir: str, how: str) -> None:
    """Log step 0, feed step 1, then end without ``end_debug`` (or with it, for ``how="end_debug"``)."""
    debug_api.initialize(CONFIG, log_dir=log_dir)
    debug_api.log_tensor_stats("net.fc", tensor=torch.tensor([0.5]), tensor_name="activation")
    debug_api.step()
    debug_api.log_tensor_stats("net.fc", tensor=torch.tensor([1.5]), tensor_name="activation")
    if how == "exception":
        raise RuntimeError("training failed")
    if how == "end_debug":
        debug_api.end_debug()
    if how == "torn_down":
        close_logger()  # the logs closed under the run: exit must stay quiet
    sys.exit(3)


def fail_on_one_rank(log_dir: str, rank: str, init_file: str) -> None:
    """Rank 0 of two fails mid-step while rank 1 trains on (here: sleeps until killed)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=int(rank), world_size=2)
    if rank == "1":
        time.sleep(600)
    debug_api.initialize(CONFIG, log_dir=log_dir)
    debug_api.log_tensor_stats("net.fc", tensor=torch.tensor([0.5]), tensor_name="activation")
    raise RuntimeError("rank 0 failed")


class SlowLogger(BaseLogger):
    """A statistics logger that from iteration 2 on takes its time (a remote one), saying when a step reached it."""

    def log_scalar(self, name: str, value: float, iteration: int, **kwargs: object) -> None:
        if iteration >= 2:
            print(f"logging {iteration}", flush=True)
            time.sleep(0.2)


def end_debug_from_signal_handler(log_dir: str) -> None:
    """The usual preemption handler (``end_debug``, then exit) run while ``step()`` hands a step to a slow logger."""

    def preempted(signum: int, frame: object) -> None:
        debug_api.end_debug()
        print(f"ended {debug_api.DEBUG_MANAGER is None and MetricLogger.enabled_loggers == []}", flush=True)
        sys.exit(7)

    signal.signal(signal.SIGUSR1, preempted)
    debug_api.initialize(CONFIG, log_dir=log_dir, statistics_logger=SlowLogger(), default_logging_enabled=True)
    for step in range(1000):
        for layer in range(20):
            debug_api.log_tensor_stats(f"net.fc{layer}", tensor=torch.tensor([float(step)]), tensor_name="activation")
        debug_api.step()


class FlushReporter(BaseLogger):
    """A batching logger (TensorBoard's writer, W&B) that says which process flushes it."""

    def log_scalar(self, name: str, value: float, iteration: int, **kwargs: object) -> None:
        pass

    def flush(self) -> None:
        print(f"flushed in {os.getpid()}", flush=True)


def fork_mid_step(log_dir: str, how: str) -> None:
    """Log step 0, feed step 1, then fork a child that exits normally (after ``end_debug`` for ``how="end_debug"``);
    the parent ends the run after it."""
    debug_api.initialize(CONFIG, log_dir=log_dir, statistics_logger=FlushReporter(), default_logging_enabled=True)
    debug_api.log_tensor_stats("net.fc", tensor=torch.tensor([0.5]), tensor_name="activation")
    debug_api.step()
    debug_api.log_tensor_stats("net.fc", tensor=torch.tensor([1.5]), tensor_name="activation")
    child = os.fork()
    if child == 0:
        print(f"child {os.getpid()}", flush=True)
        if how == "end_debug":
            debug_api.end_debug()
        sys.exit(0)  # a normal exit: the atexit handlers run
    assert os.waitpid(child, 0)[1] == 0
    debug_api.end_debug()


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
