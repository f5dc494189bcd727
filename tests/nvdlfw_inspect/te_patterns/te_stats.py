"""Statistics the features of this directory record at a call and log at ``debug_api.step()``, as
Transformer Engine's features do with their own buffers; and their schedule (closed windows)."""

from __future__ import annotations

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.logging import MetricLogger

#: (metric name, value, iteration) waiting for the next step
RECORDED: list[tuple[str, float, int]] = []


def record(layer_name: str, tensor_name: str, stat: str, value: float, iteration: int | None = None) -> None:
    """Keep one value; without ``iteration`` the trainer's counter is used (TE's ``TEDebugState`` reads it so)."""
    if iteration is None:
        iteration = debug_api.DEBUG_MANAGER._trainer_iteration_count
    RECORDED.append((f"{layer_name}_{tensor_name}_{stat}", float(value), iteration))


def log_recorded() -> None:
    for name, value, iteration in RECORDED:
        MetricLogger.log_scalar(name, value, iteration)
    RECORDED.clear()


def scheduled(config: dict, iteration: int) -> tuple[bool, int | None]:
    """Whether ``iteration`` is due under ``freq``/``start_step``/``end_step``, and the next due one."""
    freq, start, end = config.get("freq", 1), config.get("start_step", 0), config.get("end_step")
    due = iteration >= start and iteration % freq == 0 and (end is None or iteration <= end)
    upcoming = max(iteration + 1, start)
    upcoming += -upcoming % freq
    return due, (upcoming if end is None or upcoming <= end else None)
