#!/usr/bin/env bash
# Distributed training: tools/dist_train.sh CONFIG GPUS [train.py args...]
# (multi-node and CPU-only use: see tools/_torchrun.sh)
set -euo pipefail
exec "$(dirname "$0")/_torchrun.sh" "$2" train.py "$1" "${@:3}"
