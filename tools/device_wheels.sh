#!/usr/bin/env bash
# The wheels a device call carries (tools/gpu_session.sh; `carry: [".whl"]`), made on this CPU machine ahead of
# the call, for the bare GPU host: Python 3.12, torch 2.11.0+cu130, an sm_90 GPU (requirements/gpu_host.txt), no
# network, no OpenMMLab stack.
#
#   bash tools/device_wheels.sh            # everything into .whl/ (first run: ~3 min of downloads + the mmcv build)
#   bash tools/device_wheels.sh backbones  # only what importing visattn_mm needs (mmengine and its pure-Python needs)
#
# What it puts in WHEEL_DIR (.whl, ignored by git), pinned in requirements/gpu_wheels.txt:
#   backbones  mmengine and what its import pulls in that the host lacks
#   detectors  mmdet, mmsegmentation and what their imports pull in that the host lacks (pycocotools, shapely, ...)
#   mmcv       mmcv 2.1.0 built from its source with CPU and CUDA ops for sm_90 against the host's torch: no wheel of
#              it exists for that torch, and building it on the host takes ~250 s of a 15-minute device budget.
#              The compiler comes from the package registry (nvcc, nvvm, crt, cccl of CUDA 13.0, pinned: an unpinned
#              nvcc 13.0 pulls an nvvm whose PTX its ptxas refuses); the CUDA headers and libraries are those of the
#              torch wheel's own CUDA packages. The wheel is kept in a cache keyed by torch, Python, CUDA and
#              architecture (VISATTN_WHEEL_CACHE, ~/.cache/visattn_mm/wheels), so a second run only copies it.
#
# Variables: WHEEL_DIR (.whl), HOST_PYTHON (a Python 3.12 with the host's torch; default: the rehearsal environment
#   that `tools/gpu_session.sh rehearse` builds, made here if missing), REHEARSAL_VENV (/tmp/visattn_gpu_rehearsal),
#   MAX_JOBS (compile jobs; default: the cores), TORCH_CUDA_ARCH_LIST (9.0: the H100 and H200).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WHEEL_DIR="${WHEEL_DIR:-.whl}"
PINS=requirements/gpu_wheels.txt
ARCH="${TORCH_CUDA_ARCH_LIST:-9.0}"
VENV="${REHEARSAL_VENV:-/tmp/visattn_gpu_rehearsal}"
parts=("$@")
((${#parts[@]})) || parts=(backbones detectors mmcv)

# The pinned names of one section ("# [name]" lines) of $PINS.
section() {
    awk -v want="[$1]" '/^# \[/ {on = ($2 == want); next} on && /^[^#[:space:]]/ {print $1}' "$PINS"
}

# A Python 3.12 with the host's torch: HOST_PYTHON, or the rehearsal environment (built from the host's pins if missing).
host_python() {
    if [[ -n "${HOST_PYTHON:-}" ]]; then echo "$HOST_PYTHON"; return; fi
    if [[ ! -x "$VENV/bin/python" ]]; then
        echo "[device_wheels] building $VENV with requirements/gpu_host.txt (the host's versions)" >&2
        bash tools/gpu_session.sh rehearsal-env >&2 || return
    fi
    echo "$VENV/bin/python"
}

download() {  # pure-Python or manylinux wheels for CPython 3.12 on x86-64, without their dependencies
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$1" "${@:2}"
}

build_mmcv() {
    local version torch_version cuda key cache tools cuda_home site started
    version="$(section mmcv | sed -n 's/^mmcv==//p')"
    read -r torch_version cuda site < <("$PY" -c 'import site, torch
print(torch.__version__, torch.version.cuda, site.getsitepackages()[0])')
    [[ "$cuda" != None ]] || { echo "[device_wheels] $PY has a CPU-only torch ($torch_version): mmcv's CUDA ops need" \
        "the host's CUDA build (requirements/gpu_host.txt)" >&2; return 2; }
    key="mmcv-$version-torch$torch_version-py$("$PY" -c 'import sys; print("%d%d" % sys.version_info[:2])')-sm${ARCH//./}"
    cache="${VISATTN_WHEEL_CACHE:-$HOME/.cache/visattn_mm/wheels}/$key"
    if ! ls "$cache"/mmcv-*.whl >/dev/null 2>&1; then
        # An unfinished build stays in $tools: a rerun resumes it where ninja left off (a session may end mid-build).
        tools="$cache.build"
        mkdir -p "$tools"
        # The build's own tools, beside (not in) the host's environment: mmcv's setup.py imports pkg_resources,
        # which setuptools 70 removed; nvcc and its parts of the CUDA 13.0 toolkit.
        [[ -f "$tools/py/.complete" ]] || { rm -rf "$tools/py" &&
            "$PY" -m pip install -q --disable-pip-version-check --target "$tools/py" $(section build) &&
            touch "$tools/py/.complete"; }
        [[ -f "$tools/cuda/.complete" ]] || { rm -rf "$tools/cuda" &&
            "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$tools/cuda" $(section cuda) &&
            touch "$tools/cuda/.complete"; }
        # CUDA_HOME: nvcc's bin/ and nvvm/, the headers and libraries of both the compiler's packages and torch's.
        cuda_home="$tools/cuda_home"
        rm -rf "$cuda_home" && mkdir -p "$cuda_home/include" "$cuda_home/lib64"
        ln -s "$tools/cuda/nvidia/cu13/bin" "$tools/cuda/nvidia/cu13/nvvm" "$cuda_home/"
        local from
        for from in "$site/nvidia/cu13" "$tools/cuda/nvidia/cu13"; do
            cp -rsf "$from/include/." "$cuda_home/include/"
            [[ ! -d "$from/lib" ]] || cp -rsf "$from/lib/." "$cuda_home/lib64/"
        done
        ln -sf libcudart.so.13 "$cuda_home/lib64/libcudart.so"
        # The source, unpacked once: pip builds a local folder in place, so ninja's objects outlive the build.
        if [[ ! -f "$tools/src/setup.py" ]]; then
            rm -rf "$tools/sdist" "$tools/src"
            PYTHONPATH="$tools/py" "$PY" -m pip download -q --disable-pip-version-check --no-deps \
                --no-binary :all: --no-build-isolation -d "$tools/sdist" "mmcv==$version"
            mkdir "$tools/src" && tar -xzf "$tools"/sdist/mmcv-*.tar.gz -C "$tools/src" --strip-components 1
        fi
        echo "[device_wheels] building mmcv $version with CUDA ops for sm_${ARCH//./} against torch $torch_version" \
             "(CUDA $cuda; on $(nproc) cores: about 4 min on 16, over an hour on 2)"
        started=$SECONDS
        # No build isolation: the build must see the host's torch, or the ops are silently left out.
        env PATH="$cuda_home/bin:$PATH" CUDA_HOME="$cuda_home" PYTHONPATH="$tools/py" MMCV_WITH_OPS=1 FORCE_CUDA=1 \
            TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
            "$PY" -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps --no-cache-dir \
            -w "$tools/wheel" "$tools/src" || { echo "$((SECONDS - started))" >> "$tools/seconds"; return 1; }
        echo "$((SECONDS - started))" >> "$tools/seconds"
        mkdir -p "$cache"
        mv "$tools"/wheel/mmcv-*.whl "$cache/"
        echo "built in $(awk '{s += $1} END {print s}' "$tools/seconds") s on $(nproc) cores ($(wc -l < "$tools/seconds") runs)" \
            > "$cache/BUILD"
        rm -rf "$tools"
    fi
    cp "$cache"/mmcv-*.whl "$WHEEL_DIR/"
    echo "[device_wheels] mmcv: $(cd "$cache" && ls mmcv-*.whl) ($(du -m "$cache"/mmcv-*.whl | cut -f1) MB;" \
         "$(cat "$cache/BUILD"))"
}

PY="$(host_python)"
mkdir -p "$WHEEL_DIR"
for part in "${parts[@]}"; do
    case "$part" in
        backbones|detectors) mapfile -t wanted < <(section "$part"); download "$WHEEL_DIR" "${wanted[@]}" ;;
        mmcv) build_mmcv ;;
        *) echo "unknown part '$part': use backbones, detectors, mmcv" >&2; exit 2 ;;
    esac
done
echo "[device_wheels] $WHEEL_DIR: $(ls "$WHEEL_DIR"/*.whl | wc -l) wheels, $(du -sm "$WHEEL_DIR" | cut -f1) MB" \
     "(a device call carries at most 64 MiB with the checkout)"
