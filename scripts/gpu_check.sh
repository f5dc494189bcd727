#!/usr/bin/env bash
# Checks everything on a GPU in one command (about 9 minutes on an H100): the CUDA tests, every
# benchmark, and one table of the measures against their targets, all written to OUT_DIR.
# Without CUDA it runs the same plan on the CPU at tiny sizes. Needs no installation and no network:
# it runs from a copy of the tree with ${PYTHON:-python3} (torch, pytest and transformers installed);
# wheels in .whl/ (nvdlfw_inspect-0.2.2-*.whl, torchao-*.whl) are used when present.
# Usage: scripts/gpu_check.sh OUT_DIR [--tiny] [--budget-seconds N]
set -euo pipefail
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
  echo "usage: scripts/gpu_check.sh OUT_DIR [--tiny] [--budget-seconds N]" >&2
  exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="$1"
shift
export PYTHONPATH="$ROOT/src:$ROOT/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" "$ROOT/benchmarks/gpu_check.py" --out "$OUT_DIR" "$@"
