#!/usr/bin/env bash
# Distributed testing: tools/dist_test.sh CONFIG CHECKPOINT GPUS [test.py args...]
# (multi-node, CPU-only use and the interpreter used: see tools/_torchrun.sh)
set -euo pipefail
if [[ $# -lt 3 ]]; then
    echo "usage: [PYTHON=.venv/bin/python] bash tools/dist_test.sh CONFIG CHECKPOINT GPUS" \
         "[test.py args...] (GPUS: processes on this node; CPU processes without GPUs)" >&2
    exit 2
fi
exec "$(dirname "$0")/_torchrun.sh" "$3" test.py "$1" "$2" "${@:4}"
