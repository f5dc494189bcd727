#!/usr/bin/env bash
# Runs the main demo: a small GPT trained in emulated FP8 with statistics and an HTML report.
# Extra arguments go to `nvdlfw-inspect demo` (see --help).
EXTRAS=demo  # the package and what the demo uses; scripts/test.sh installs the development extras
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
"$VENV/bin/nvdlfw-inspect" demo "$@"
