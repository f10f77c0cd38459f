#!/usr/bin/env bash
# The main job on the embedded default: generate the toy COCO dataset, train Mask R-CNN ViL-T on
# it, evaluate (bbox + segm AP) and draw ground truth, predictions and the loss curve.
# Sets up .venv/ on first use. Extra arguments go to tools/run_demo.py (e.g. --work-dir,
# --max-iters 20 for a quick look, --score-thr, --num-images; --help lists them).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/tools/bootstrap.sh"
cd "$ROOT"
exec .venv/bin/python tools/run_demo.py "$@"
