#!/usr/bin/env bash
# Shared launcher of tools/dist_train.sh and tools/dist_test.sh:
#   tools/_torchrun.sh NPROC SCRIPT [script args...]
# Multi-node: set NNODES, NODE_RANK, MASTER_ADDR (and PORT) on every node.
# Without GPUs, NPROC is the number of CPU processes (the tools switch to gloo).
# PYTHON selects the interpreter; unset, the repository's .venv/bin/python
# (tools/bootstrap.sh makes it) is used if it exists, else the first python3 or
# python on PATH that has torch installed.
set -euo pipefail
NPROC=$1
SCRIPT=$2
TOOLS_DIR="$(cd "$(dirname "$0")" && pwd)"
REPO_PYTHON="$(dirname "$TOOLS_DIR")/.venv/bin/python"

has_torch() {
    "$1" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)' \
        2>/dev/null
}

if [[ -z "${PYTHON:-}" ]]; then
    for candidate in "$REPO_PYTHON" python3 python; do
        if command -v "$candidate" >/dev/null && has_torch "$candidate"; then
            PYTHON=$candidate
            break
        fi
    done
    if [[ -z "${PYTHON:-}" ]]; then
        echo "error: found no Python with torch (looked at $REPO_PYTHON," \
             "python3 and python on PATH). Set PYTHON to the interpreter of your" \
             "torch/mmcv/mmdet environment, e.g. PYTHON=.venv/bin/python after" \
             "'bash tools/bootstrap.sh'." >&2
        exit 2
    fi
fi

# `python -m torch.distributed.run` is torchrun, run by the chosen interpreter.
PYTHONPATH="$TOOLS_DIR/..${PYTHONPATH:+:$PYTHONPATH}" \
exec "$PYTHON" -m torch.distributed.run \
    --nnodes="${NNODES:-1}" \
    --node_rank="${NODE_RANK:-0}" \
    --master_addr="${MASTER_ADDR:-127.0.0.1}" \
    --master_port="${PORT:-29500}" \
    --nproc_per_node="$NPROC" \
    "$TOOLS_DIR/$SCRIPT" --launcher pytorch "${@:3}"
