# Sourced by the other scripts after they set EXTRAS (demo or dev): creates .venv on first use and
# installs the project with those extras whenever pyproject.toml or constraints.txt change or the
# environment lacks them. `dev` holds everything `demo` does, so after test.sh the demo installs nothing.
# Needs only python3 (>= 3.10) on PATH.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
hash="$(cat "$ROOT/pyproject.toml" "$ROOT/constraints.txt" | sha256sum | cut -c1-16)"
if [ ! -x "$PY" ]; then
  echo "Creating virtual environment in $VENV ..."
  "${PYTHON:-python3}" -m venv "$VENV"
fi
# The stamp is "<hash> <extras>" of the last installation.
read -r stamp_hash stamp_extras 2>/dev/null <"$VENV/.installed" || true
if [ "${stamp_hash:-}" != "$hash" ] || { [ "${stamp_extras:-}" != "$EXTRAS" ] && [ "${stamp_extras:-}" != dev ]; }; then
  echo "Installing lowprec-inspect[$EXTRAS] and its dependencies into $VENV (first run takes a minute) ..."
  if ! "$PY" -m pip install --disable-pip-version-check -c "$ROOT/constraints.txt" -e "$ROOT[$EXTRAS]" >"$VENV/install.log" 2>&1; then
    tail -n 30 "$VENV/install.log"
    echo "Installation failed; full log: $VENV/install.log" >&2
    exit 1
  fi
  echo "$hash $EXTRAS" >"$VENV/.installed"
fi
cd "$ROOT"
