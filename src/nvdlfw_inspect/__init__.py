"""nvdlfw_inspect: a debug framework that inspects and steers tensors of a training run from a YAML config.

Import the user-facing API as ``import nvdlfw_inspect.api as debug_api``.
"""

from __future__ import annotations

from os import PathLike
from typing import Any

__version__ = "0.3.0"


def read_stats(log_dir: str | PathLike) -> Any:
    """The statistics of the run in ``log_dir`` as a pandas DataFrame (see ``nvdlfw_inspect.reading``)."""
    from nvdlfw_inspect.reading import read_stats as read

    return read(log_dir)
