#!/usr/bin/env bash
# Runs the lint check and the whole test suite, on every core (pytest-xdist; PYTEST_WORKERS=0 runs it in this
# process). Extra arguments go to pytest.
EXTRAS=dev
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# The report's browser tests need Chromium: install Debian's package when it is missing and we can.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  echo "Installing Chromium (Debian package) for the report's browser tests ..."
  if ! (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) >"$VENV/chromium.log" 2>&1; then
    echo "Chromium could not be installed (see $VENV/chromium.log): the browser tests will be skipped" >&2
  fi
fi
"$VENV/bin/ruff" check src tests examples benchmarks
"$VENV/bin/ruff" format --check src tests examples benchmarks
# Keep bytecode caches (ignored by git) even where the environment turns them off: otherwise every xdist worker
# and every test's subprocess compiles and assertion-rewrites each module again (7 s of each collection here).
unset PYTHONDONTWRITEBYTECODE
"$PY" -m pytest -q -n "${PYTEST_WORKERS:-auto}" "$@"
