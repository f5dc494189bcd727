"""A statistics logger that keeps every logged value, for tests that check the numbers a run logs."""

from __future__ import annotations

from nvdlfw_inspect.logging import BaseLogger


class Collect(BaseLogger):
    """``values[(name, iteration)]``: what ``log_scalar`` was given."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, int], float] = {}

    def log_scalar(self, name: str, value: float, iteration: int) -> None:
        self.values[(name, iteration)] = value
