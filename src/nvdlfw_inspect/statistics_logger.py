"""The interface of a statistics sink, apart from the loggers built on it, so that a logger's own module (W&B's)
can be imported by ``nvdlfw_inspect.logging`` without a circle. ``nvdlfw_inspect.logging.BaseLogger`` stays."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class BaseLogger(ABC):
    """A statistics sink. Implement ``log_scalar`` and pass an instance as ``statistics_logger``."""

    @abstractmethod
    def log_scalar(self, name: str, value: float | int, iteration: int, **kwargs: Any) -> None: ...
