"""Shared fixtures: every test starts and ends with the debug framework shut down."""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
# helpers imported by bare name (``from logreader import read_stats``): tests/support holds the spawn,
# log-reading and interpreter helpers, tests/references the float64 and bit-exact references
sys.path[:0] = [str(TESTS), str(TESTS / "support"), str(TESTS / "references")]

from cuda_marks import CUDA_SKIP_REASON  # noqa: E402
from tmpfs import mounted_tmpfs  # noqa: E402

import nvdlfw_inspect.api as debug_api  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks ``cuda`` every test whose skip condition is the device, so that the GPU check selects the
    tests that skip on a CPU-only machine; tests that skip at run time carry the marker themselves."""
    for item in items:
        if any(CUDA_SKIP_REASON.search(str(mark.kwargs.get("reason", ""))) for mark in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.cuda)


@pytest.fixture(autouse=True)
def _clean_debug_state():
    debug_api.end_debug()
    yield
    debug_api.end_debug()


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    return tmp_path / "logs"


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """``small_tmpfs(size)``: a fresh directory on a real tmpfs of ``size`` (``64k``) that fills up as a disk does;
    unmounted after the test, once the debug session whose logs are open on it has ended."""
    numbers = itertools.count()
    with contextlib.ExitStack() as mounts:
        yield lambda size: mounts.enter_context(mounted_tmpfs(tmp_path / f"tmpfs{next(numbers)}", size))
        debug_api.end_debug()
