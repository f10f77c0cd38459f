#!/usr/bin/env bash
# Distributed training: tools/dist_train.sh CONFIG GPUS [train.py args...]
# Multi-node: set NNODES, NODE_RANK, MASTER_ADDR (and PORT) on every node.
# On a machine without GPUs, GPUS is the number of CPU processes (gloo backend).
# PYTHON selects the interpreter (default: python on PATH).
set -euo pipefail

CONFIG=$1
GPUS=$2
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
PORT=${PORT:-29500}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
TOOLS_DIR="$(cd "$(dirname "$0")" && pwd)"

# `python -m torch.distributed.run` is torchrun, run by the chosen interpreter.
PYTHONPATH="$TOOLS_DIR/..${PYTHONPATH:+:$PYTHONPATH}" \
exec "${PYTHON:-python}" -m torch.distributed.run \
    --nnodes="$NNODES" \
    --node_rank="$NODE_RANK" \
    --master_addr="$MASTER_ADDR" \
    --master_port="$PORT" \
    --nproc_per_node="$GPUS" \
    "$TOOLS_DIR/train.py" "$CONFIG" --launcher pytorch "${@:3}"
