"""A statistics logger for Weights & Biases (``pip install wandb``).

Every statistic of one debug iteration goes into one history row, so the run's history stays one row
per iteration rather than one per statistic. Statistics are plotted against their own x-axis (the
debug iteration, ``step_metric``) so they never collide with the ``step`` of the user's own
``wandb.log`` calls, and each layer gets its own section of the workspace.
"""

from __future__ import annotations

from typing import Any

from nvdlfw_inspect.statistics_logger import BaseLogger


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError as error:
        raise ImportError("WandbLogger needs the wandb package: pip install wandb") from error
    return wandb


class WandbLogger(BaseLogger):
    """Pass as ``debug_api.initialize(..., statistics_logger=WandbLogger(run))``.

    ``run`` is a run from ``wandb.init``; without one, ``wandb.init(**init_kwargs)`` starts one that
    this logger owns and ``finish()`` ends. A statistic of layer L is logged as ``"L/{tensor}_{stat}"``.
    """

    def __init__(self, run: Any = None, *, step_metric: str = "debug_iteration", **init_kwargs: Any):
        if run is not None and init_kwargs:
            raise ValueError(f"WandbLogger: pass either a run or wandb.init arguments, not both: {sorted(init_kwargs)}")
        self.owns_run = run is None
        self.run = _import_wandb().init(**init_kwargs) if run is None else run
        self.step_metric = step_metric
        self.run.define_metric(step_metric)
        self._sections: set[str] = set()
        self._iteration: int | None = None
        self._row: dict[str, float] = {}

    def log_statistic(self, layer: str, tensor: str, stat: str, value: float, iteration: int) -> None:
        self.log_scalar(f"{layer}/{tensor}_{stat}", value, iteration)

    def log_scalar(self, name: str, value: Any, iteration: int, **kwargs: Any) -> None:
        if self._iteration is not None and iteration != self._iteration:
            self.flush()
        self._iteration = int(iteration)
        self._use_debug_axis(name)
        self._row[name] = float(value)

    def _use_debug_axis(self, name: str) -> None:
        """Plot the metric (its whole ``section/*`` when it has one) against the debug iteration."""
        section = f"{name.split('/', 1)[0]}/*" if "/" in name else name
        if section not in self._sections:
            self.run.define_metric(section, step_metric=self.step_metric)
            self._sections.add(section)

    def flush(self) -> None:
        """Send the pending iteration's row (``step()`` and ``end_debug()`` call this)."""
        if self._row:
            self.run.log({**self._row, self.step_metric: self._iteration})
            self._row = {}

    def finish(self) -> None:
        """Flush, and end the run if this logger started it."""
        self.flush()
        if self.owns_run:
            self.run.finish()
