#!/usr/bin/env bash
# Create (or reuse) .venv/ at the repository root and install the pinned stack into it.
#
# Python: $PYTHON if set, else the venv's own, else the first of python3.11, python3.12,
# python3 that is 3.11 or 3.12; any other version is refused.
# Idempotent: the stamp file .venv/.visattn_stack records a hash of everything that decides
# the install (these scripts, the lock files, the packaging files, the Python version,
# VISATTN_CPU_ONLY) and what was installed; when the hash matches, nothing is reinstalled.
# mmcv 2.1.0 is built from source once per torch version, Python version and flavour
# (CPU ops, or CUDA ops where torch sees a GPU; see tools/mmcv_build_plan.py) and kept in
# a wheel folder keyed by all of them.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.visattn_stack"
LOCK="$ROOT/requirements/stack.txt"
SUPPORTED_PYTHONS="3.11 3.12"

python_version() {  # major.minor of interpreter $1, empty if it does not run
    "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true
}
pyenv_interpreter() {  # a pyenv-installed interpreter named $1 that its shim does not select
    command -v pyenv >/dev/null || return 0
    local version
    for version in $(pyenv whence "$1" 2>/dev/null); do
        if [[ -x "$(pyenv root)/versions/$version/bin/$1" ]]; then
            echo "$(pyenv root)/versions/$version/bin/$1"
            return 0
        fi
    done
}
is_supported() { [[ -n "$1" && " $SUPPORTED_PYTHONS " == *" $1 "* ]]; }
pin() {  # the version the lock file pins for package $1
    sed -n "s/^$1==\([^ ;#]*\).*/\1/p" "$LOCK"
}

if [[ -n "${PYTHON:-}" ]]; then
    PY_VERSION="$(python_version "$PYTHON")"
    if [[ -z "$PY_VERSION" && -n "$(pyenv_interpreter "$PYTHON")" ]]; then
        # e.g. PYTHON=python3.12 where pyenv's shim selects another global version
        PYTHON="$(pyenv_interpreter "$PYTHON")"
        PY_VERSION="$(python_version "$PYTHON")"
    fi
    if ! is_supported "$PY_VERSION"; then
        echo "[bootstrap] error: PYTHON=$PYTHON is Python ${PY_VERSION:-(does not run)}; the stack" \
             "supports Python ${SUPPORTED_PYTHONS// / and }: set PYTHON to one of those" \
             "(e.g. PYTHON=python3.12)" >&2
        exit 2
    fi
elif is_supported "$(python_version "$VENV/bin/python")"; then
    PYTHON="$VENV/bin/python"
    PY_VERSION="$(python_version "$PYTHON")"
else
    seen=""
    for candidate in python3.11 python3.12 python3; do
        command -v "$candidate" >/dev/null || continue
        version="$(python_version "$candidate")"
        if [[ -z "$version" && -n "$(pyenv_interpreter "$candidate")" ]]; then
            candidate="$(pyenv_interpreter "$candidate")"
            version="$(python_version "$candidate")"
        fi
        seen+=" $candidate=${version:-?}"
        if is_supported "$version"; then
            PYTHON="$(command -v "$candidate")"
            PY_VERSION="$version"
            break
        fi
    done
    if [[ -z "${PYTHON:-}" ]]; then
        echo "[bootstrap] error: no Python ${SUPPORTED_PYTHONS// / or } found (seen:${seen:- none});" \
             "install one, or set PYTHON=/path/to/python3.11" >&2
        exit 2
    fi
fi

want="$( { cat "$ROOT/tools/bootstrap.sh" "$ROOT/tools/mmcv_build_plan.py" "$ROOT"/requirements/*.txt \
               "$ROOT/setup.cfg" "$ROOT/setup.py" "$ROOT/pyproject.toml"
           echo "python=$PY_VERSION cpu_only=${VISATTN_CPU_ONLY:-}"; } | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" ]] && grep -qx "hash=$want" "$STAMP"; then
    exit 0
fi

if [[ -x "$VENV/bin/python" && "$(python_version "$VENV/bin/python")" != "$PY_VERSION" ]]; then
    echo "[bootstrap] $VENV is Python $(python_version "$VENV/bin/python"), Python $PY_VERSION" \
         "was asked for: recreating it"
    rm -rf "$VENV"
fi
echo "[bootstrap] setting up $VENV with Python $PY_VERSION (first run: ~15 min on 2 cores, mostly building mmcv's ops)"
# torch's CUDA build from PyPI fills about 5 GB of .venv/ and passes through pip's temporary folder
# on the way: fail now, saying so, rather than with pip's "No space left on device" minutes later.
NEED_GB=10
for place in "$ROOT" "${TMPDIR:-/tmp}"; do
    free_gb="$(df -Pk "$place" | awk 'NR == 2 { print int($4 / 1048576) }')"
    if ((free_gb < NEED_GB)); then
        echo "[bootstrap] error: $free_gb GB free on the disk of $place; installing the stack needs about" \
             "$NEED_GB GB there: free some space (an old .venv/ or a clone's) or set TMPDIR to a larger disk" >&2
        exit 2
    fi
done
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)

"${PIP[@]}" install -q "pip>=24"
# Build tools for mmcv: its setup.py imports pkg_resources (gone in setuptools>=70).
"${PIP[@]}" install -q "setuptools<70" wheel packaging ninja "numpy>=1.26,<2.3"
TORCH_VERSION="$(pin torch)"
MMCV_VERSION="$(pin mmcv)"
"${PIP[@]}" install -q "torch==$TORCH_VERSION" "torchvision==$(pin torchvision)"

# CPU or CUDA ops, and the cache folder for this torch/Python/flavour (exits with the
# reason and the ways forward where it cannot decide, e.g. a GPU without nvcc).
plan="$("$PY" "$ROOT/tools/mmcv_build_plan.py")"
plan_value() { sed -n "s/^$1=//p" <<<"$plan"; }
mapfile -t BUILD_ENV < <(grep -E '^[A-Z_]+=' <<<"$plan")
FLAVOUR="$(plan_value flavour)"
WHEEL_DIR="${VISATTN_WHEEL_CACHE:-$HOME/.cache/visattn_mm/wheels}/$(plan_value cache_key)"
echo "[bootstrap] mmcv flavour: $(plan_value note)"

if ! ls "$WHEEL_DIR"/mmcv-"$MMCV_VERSION"-*.whl >/dev/null 2>&1; then
    echo "[bootstrap] building mmcv $MMCV_VERSION into $WHEEL_DIR (${BUILD_ENV[*]};" \
         "~10 min on 2 CPU cores, ~4 min with CUDA ops on 16)"
    mkdir -p "$WHEEL_DIR"
    # No build isolation: the build must see the installed torch, or the ops are silently skipped.
    env "${BUILD_ENV[@]}" "${PIP[@]}" wheel -q --no-build-isolation --no-deps --no-cache-dir \
        -w "$WHEEL_DIR" "mmcv==$MMCV_VERSION"
fi
"${PIP[@]}" install -q "$WHEEL_DIR"/mmcv-"$MMCV_VERSION"-*.whl
"${PIP[@]}" install -q -r "$LOCK"
# openmim without its dependency opendatalab (see requirements/mim.txt).
"${PIP[@]}" install -q --no-deps -r "$ROOT/requirements/mim.txt"
# Editable install as a develop egg-link: mim (`mim search/train visattn_mm`) finds a
# package through its distribution's location, which for pip's editable wheels is
# site-packages, not this checkout. setup.py links configs/ and tools/ into
# visattn_mm/.mim/ for it. --no-deps: the lock above already satisfies setup.cfg's ranges.
"${PIP[@]}" uninstall -q -y visattn_mm >/dev/null 2>&1 || true
(cd "$ROOT" && "$PY" setup.py -q develop --no-deps >"$VENV/.develop.log" 2>&1) \
    || { cat "$VENV/.develop.log" >&2; exit 1; }

# Fail here, not in the first test, if the compiled ops are missing.
"$PY" - "$FLAVOUR" <<'PY'
import sys

import mmcv
import mmcv.ops
import mmdet, mmseg, timm, torch, visattn_mm  # noqa: F401, E401
from mmcv.ops import RoIAlign, nms  # noqa: F401

flavour = sys.argv[1]
cuda_ops = mmcv.ops.get_compiling_cuda_version()
if flavour == 'cuda' and cuda_ops == 'not available':
    sys.exit('[bootstrap] error: mmcv was built without its CUDA ops although they were asked for')
print(f'[bootstrap] stack ok: torch {torch.__version__}, mmcv {mmcv.__version__} '
      f'({flavour} ops, CUDA ops compiled for: {cuda_ops})')
PY
{
    echo "hash=$want"
    echo "python=$PY_VERSION"
    echo "torch=$TORCH_VERSION"
    echo "mmcv=$MMCV_VERSION"
    echo "flavour=$FLAVOUR"
    echo "wheel=$(ls "$WHEEL_DIR"/mmcv-"$MMCV_VERSION"-*.whl | head -1)"
} > "$STAMP"
