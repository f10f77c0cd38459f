#!/usr/bin/env bash
# Distributed testing: tools/dist_test.sh CONFIG CHECKPOINT GPUS [test.py args...]
# (multi-node and CPU-only use: see tools/_torchrun.sh)
set -euo pipefail
exec "$(dirname "$0")/_torchrun.sh" "$3" test.py "$1" "$2" "${@:4}"
