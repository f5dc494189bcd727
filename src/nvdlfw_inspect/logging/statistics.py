"""The statistics loggers: ``MetricLogger`` fans each statistic out to every enabled logger (the default file
logger, TensorBoard, W&B, a custom ``BaseLogger``), a failing one costing its own records only."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from nvdlfw_inspect.logging import debug_log
from nvdlfw_inspect.logging.debug_log import say_once
from nvdlfw_inspect.logging.records import Statistic, _as_float
from nvdlfw_inspect.statistics_logger import BaseLogger
from nvdlfw_inspect.wandb_logger import WandbLogger


class MetricLogger:
    """Fans each statistic out to every enabled statistics logger. A logger that raises costs its own records
    only: they are dropped and counted, the first failure is said once, ``end_debug`` says how many were lost,
    and the other loggers and the training go on (``strict_logging`` raises the logger's error instead)."""

    enabled_loggers: list[BaseLogger] = []
    failures: dict[int, tuple[str, str, int]] = {}  # id(logger) -> (its class, its first error, records dropped)

    @classmethod
    def _failed(cls, logger: BaseLogger, records: int, error: Exception) -> None:
        """Count a logger's lost records and say its first failure; under ``strict_logging`` raise instead."""
        if debug_log.LOGGER is not None and debug_log.LOGGER.faults.strict:
            raise error
        key = id(logger)
        if key not in cls.failures:
            cls.failures[key] = (type(logger).__name__, f"{type(error).__name__}: {error}", 0)
            say_once(
                f"statistics logger {cls.failures[key][0]} failed ({cls.failures[key][1]}): its records are dropped "
                "and counted, the other loggers and the training go on (initialize(..., strict_logging=True) raises "
                "instead).",
                call_site=__name__,
            )
        name, first, dropped = cls.failures[key]
        cls.failures[key] = (name, first, dropped + records)

    @classmethod
    def log_scalar(cls, name: str, value: Any, iteration: int, **kwargs: Any) -> None:
        for logger in cls.enabled_loggers:
            try:
                logger.log_scalar(name, value, iteration, **kwargs)
            except Exception as error:
                cls._failed(logger, 1, error)

    @classmethod
    def log_statistic(cls, layer: str, tensor: str, stat: str, value: float, iteration: int) -> None:
        """One statistic of a layer's tensor (see ``_log_one``)."""
        for logger in cls.enabled_loggers:
            try:
                _log_one(logger, (layer, tensor, stat, value, iteration))
            except Exception as error:
                cls._failed(logger, 1, error)

    @classmethod
    def log_statistics(cls, records: list[Statistic]) -> None:
        """Many statistics at once (a step's): loggers that take a whole batch (``log_statistics``) get the list,
        the others each record as ``_log_one`` hands it to them."""
        for logger in cls.enabled_loggers:
            batch = getattr(logger, "log_statistics", None)
            if batch is not None:
                try:
                    batch(records)
                except Exception as error:
                    cls._failed(logger, len(records), error)
                continue
            for record in records:
                try:
                    _log_one(logger, record)
                except Exception as error:
                    cls._failed(logger, 1, error)

    @classmethod
    def add_logger(cls, logger: BaseLogger) -> None:
        cls.enabled_loggers.append(logger)

    @classmethod
    def _each(cls, method: str) -> None:
        """Call ``method`` of every logger that has it; a failure costs what that logger held."""
        for logger in cls.enabled_loggers:
            call = getattr(logger, method, None)
            if call is not None:
                try:
                    call()
                except Exception as error:
                    cls._failed(logger, 0, error)

    @classmethod
    def flush(cls) -> None:
        """Let loggers that batch (those with a ``flush`` method) send what they hold."""
        cls._each("flush")

    @classmethod
    @contextlib.contextmanager
    def batch(cls) -> Iterator[None]:
        """Log many statistics at once (a step): loggers that can (``hold_flushes``) stop flushing line by line,
        and every logger is flushed once at the end. A batch cut short (Ctrl-C, an error of the caller) is written
        whole or not at all: loggers that hold lines (``drop_held``) drop them."""
        cls._each("hold_flushes")
        try:
            yield
        except BaseException:
            cls._each("drop_held")
            raise
        finally:
            cls.flush()

    @classmethod
    def reset(cls) -> None:
        """Flush, say how many records each failing logger dropped, and forget every logger, even when a flush
        raises (``strict_logging``), so that the next ``initialize`` starts clean."""
        try:
            cls.flush()
            for name, first, dropped in cls.failures.values():
                if dropped:
                    say_once(f"statistics logger {name} dropped {dropped} statistics records (the first error: {first}).")
        finally:
            cls.enabled_loggers.clear()
            cls.failures.clear()


def _log_one(logger: BaseLogger, record: Statistic) -> None:
    """Loggers that keep structure (``log_statistic``) get a statistic's parts, the others
    ``log_scalar("{layer}_{tensor}_{stat}", ...)``."""
    layer, tensor, stat, value, iteration = record
    structured = getattr(logger, "log_statistic", None)
    if structured is not None:
        structured(layer, tensor, stat, value, iteration)
    else:
        logger.log_scalar(f"{layer}_{tensor}_{stat}", value, iteration)


class TensorboardLogger(BaseLogger):
    """Writes statistics as TensorBoard scalars through a ``SummaryWriter``-like object."""

    def __init__(self, writer: Any):
        self.writer = writer

    def log_scalar(self, name: str, value: Any, iteration: int, **kwargs: Any) -> None:
        if self.writer is not None:
            self.writer.add_scalar(name, _as_float(value), iteration)

    def flush(self) -> None:
        if self.writer is not None and hasattr(self.writer, "flush"):
            self.writer.flush()


def wrap_tensorboard_writer(writer: Any) -> TensorboardLogger:
    return TensorboardLogger(writer)


def wrap_wandb_logger(logger: Any) -> WandbLogger:
    """A statistics logger writing to Weights & Biases: ``logger`` is a run from ``wandb.init`` or Lightning's
    ``WandbLogger``, whose ``experiment`` is its run (NeMo's tensor-inspection callback passes that one, then
    ``MetricLogger.add_logger``). The run stays the caller's: finishing the debug session does not finish it."""
    run = getattr(logger, "experiment", logger)
    if not all(callable(getattr(run, method, None)) for method in ("log", "define_metric")):
        raise TypeError(
            "wrap_wandb_logger needs a W&B run (wandb.init's result) or a Lightning WandbLogger (its .experiment is "
            f"the run), got {type(logger).__name__}"
        )
    return WandbLogger(run)
