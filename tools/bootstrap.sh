#!/usr/bin/env bash
# Create (or reuse) .venv/ at the repository root and install the pinned stack into it.
#
# Idempotent: a stamp file records a hash of everything that decides the install
# (this script, requirements/stack.txt, setup.cfg); when it matches, nothing is
# reinstalled. mmcv 2.1.0 is built from source once per torch version and kept in
# a wheel folder keyed by that version, so a torch change never picks up a stale
# build (pip's own cache keys by source only).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
TORCH_VERSION=2.12.1
TORCHVISION_VERSION=0.27.1
MMCV_VERSION=2.1.0
WHEEL_DIR="${VISATTN_WHEEL_CACHE:-$HOME/.cache/visattn_mm/wheels}/torch-$TORCH_VERSION"
STAMP="$VENV/.visattn_stack"

want="$(cat "$ROOT/tools/bootstrap.sh" "$ROOT/requirements/stack.txt" "$ROOT/setup.cfg" "$ROOT/setup.py" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    exit 0
fi

PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
    PYTHON="$(command -v python3.11 || command -v python3)"
fi
"$PYTHON" - <<'PY'
import sys
if sys.version_info[:2] != (3, 11):
    sys.exit(f"visattn_mm's stack is pinned for Python 3.11, found {sys.version.split()[0]}; "
             "set PYTHON=/path/to/python3.11")
PY

echo "[bootstrap] setting up $VENV (first run: ~15 min, mostly building mmcv's ops)"
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)

"${PIP[@]}" install -q "pip>=24" 
# Build tools for mmcv: its setup.py imports pkg_resources (gone in setuptools>=70).
"${PIP[@]}" install -q "setuptools<70" wheel ninja "numpy>=1.26,<2.3"
"${PIP[@]}" install -q "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"

if ! ls "$WHEEL_DIR"/mmcv-"$MMCV_VERSION"-*.whl >/dev/null 2>&1; then
    echo "[bootstrap] building mmcv $MMCV_VERSION with ops against torch $TORCH_VERSION (~10 min on 2 cores)"
    mkdir -p "$WHEEL_DIR"
    # No build isolation: the build must see the installed torch, or the ops are silently skipped.
    MMCV_WITH_OPS=1 MAX_JOBS="${MAX_JOBS:-2}" FORCE_CUDA=0 \
        "${PIP[@]}" wheel -q --no-build-isolation --no-deps --no-cache-dir \
        -w "$WHEEL_DIR" "mmcv==$MMCV_VERSION"
fi
"${PIP[@]}" install -q "$WHEEL_DIR"/mmcv-"$MMCV_VERSION"-*.whl
"${PIP[@]}" install -q -r "$ROOT/requirements/stack.txt"
"${PIP[@]}" install -q --no-deps --no-build-isolation -e "$ROOT"

# Fail here, not in the first test, if the compiled ops are missing.
"$PY" -c "import mmcv.ops, mmdet, mmseg, timm, visattn_mm; from mmcv.ops import RoIAlign, nms; print('[bootstrap] stack ok: torch', __import__('torch').__version__, 'mmcv', mmcv.__version__)"
echo "$want" > "$STAMP"
