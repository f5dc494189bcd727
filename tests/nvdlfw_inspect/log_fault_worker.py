"""Child processes for test_log_faults: training loops that log statistics and end badly.

Run as ``python log_fault_worker.py FUNCTION LOG_DIR [ARG]``.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.logging import MetricLogger, close_logger

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


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
