#!/usr/bin/env bash
# Runs the main demo. Extra arguments go to the demo script (see --help).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
"$PY" examples/train_mlp_stats.py "$@"
