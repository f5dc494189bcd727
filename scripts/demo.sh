#!/usr/bin/env bash
# Runs the main demo: a small GPT trained in emulated FP8 with statistics and an HTML report.
# Extra arguments go to `nvdlfw-inspect demo` (see --help).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
"$PY" -m nvdlfw_inspect.cli demo "$@"
