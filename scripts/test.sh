#!/usr/bin/env bash
# Runs the lint check and the whole test suite. Extra arguments go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
"$VENV/bin/ruff" check src tests examples benchmarks
"$VENV/bin/ruff" format --check src tests examples benchmarks
"$PY" -m pytest -q "$@"
