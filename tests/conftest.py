"""Shared fixtures: every test starts and ends with the debug framework shut down."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import nvdlfw_inspect.api as debug_api  # noqa: E402


@pytest.fixture(autouse=True)
def _clean_debug_state():
    debug_api.end_debug()
    yield
    debug_api.end_debug()


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    return tmp_path / "logs"
