# Sourced by the other scripts: creates .venv on first use and installs the project into it
# whenever pyproject.toml or constraints.txt change. Needs only python3 (>= 3.10) on PATH.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
wanted="$(cat "$ROOT/pyproject.toml" "$ROOT/constraints.txt" | sha256sum | cut -c1-16)"
if [ ! -x "$PY" ]; then
  echo "Creating virtual environment in $VENV ..."
  "${PYTHON:-python3}" -m venv "$VENV"
fi
if [ "$(cat "$VENV/.installed" 2>/dev/null)" != "$wanted" ]; then
  echo "Installing lowprec-inspect and its dependencies into $VENV (first run takes a minute) ..."
  if ! "$PY" -m pip install --disable-pip-version-check -c "$ROOT/constraints.txt" -e "$ROOT[dev]" >"$VENV/install.log" 2>&1; then
    tail -n 30 "$VENV/install.log"
    echo "Installation failed; full log: $VENV/install.log" >&2
    exit 1
  fi
  echo "$wanted" >"$VENV/.installed"
fi
cd "$ROOT"
