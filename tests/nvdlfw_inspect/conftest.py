"""Framework tests see only the framework: no feature directory that an imported library (lowprec)
registered for every initialize."""

from __future__ import annotations

import pytest

from nvdlfw_inspect import feature_loading


@pytest.fixture(autouse=True)
def _framework_only(monkeypatch):
    monkeypatch.setattr(feature_loading, "_default_feature_dirs", [])
