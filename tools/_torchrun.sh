#!/usr/bin/env bash
# Shared launcher of tools/dist_train.sh and tools/dist_test.sh:
#   tools/_torchrun.sh NPROC SCRIPT [script args...]
# Multi-node: set NNODES, NODE_RANK, MASTER_ADDR (and PORT) on every node.
# Without GPUs, NPROC is the number of CPU processes (the tools switch to gloo).
# PYTHON selects the interpreter (default: python on PATH).
set -euo pipefail
NPROC=$1
SCRIPT=$2
TOOLS_DIR="$(cd "$(dirname "$0")" && pwd)"

# `python -m torch.distributed.run` is torchrun, run by the chosen interpreter.
PYTHONPATH="$TOOLS_DIR/..${PYTHONPATH:+:$PYTHONPATH}" \
exec "${PYTHON:-python}" -m torch.distributed.run \
    --nnodes="${NNODES:-1}" \
    --node_rank="${NODE_RANK:-0}" \
    --master_addr="${MASTER_ADDR:-127.0.0.1}" \
    --master_port="${PORT:-29500}" \
    --nproc_per_node="$NPROC" \
    "$TOOLS_DIR/$SCRIPT" --launcher pytorch "${@:3}"
