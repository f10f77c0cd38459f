#!/usr/bin/env bash
# Distributed training: tools/dist_train.sh CONFIG GPUS [train.py args...]
# (multi-node, CPU-only use and the interpreter used: see tools/_torchrun.sh)
set -euo pipefail
if [[ $# -lt 2 ]]; then
    echo "usage: [PYTHON=.venv/bin/python] bash tools/dist_train.sh CONFIG GPUS [train.py args...]" \
         "(GPUS: processes on this node; CPU processes without GPUs)" >&2
    exit 2
fi
exec "$(dirname "$0")/_torchrun.sh" "$2" train.py "$1" "${@:3}"
