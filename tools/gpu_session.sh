#!/usr/bin/env bash
# The GPU check of a short session on a bare GPU host (torch, triton, timm; no OpenMMLab stack):
# the CUDA tests and the backbone benchmark, with logs and results in $OUT.
#
#   bash tools/gpu_session.sh wheels          # beforehand, with network: pure-Python wheels into .whl/
#   bash tools/gpu_session.sh setup tests     # on the GPU host, one command (carry .whl)
#   bash tools/gpu_session.sh setup bench     # on the GPU host, a second command
#   bash tools/gpu_session.sh setup tune      # a third, where device time is left
#
# Stages (run in the order given; none given: setup tests bench):
#   wheels  download mmengine and the pure-Python packages its import needs, for Python 3.12, into .whl/
#   setup   the environment report (setup.log): python, GPU, torch, CUDA, triton, timm, mmcv/mmdet
#   tests   the CUDA-marked tests that need no mmdet (tests.log, tests.xml)
#   bench   tools/analysis/benchmark.py on CUDA (bench.log, benchmark.md, benchmark.csv, .png)
#   tune    tools/analysis/triton_tuning.py on CUDA: each Triton kernel's time under candidate launch
#           settings (tune.log, triton_tuning.md, triton_tuning.csv)
# Wheels in .whl/ are installed into $SITE by every invocation (seconds), so any stage runs on a
# fresh machine. A failed stage does not stop the next; summary.txt says which passed; the exit
# status is that of the first failed stage.
#
# Variables: OUT (work_dirs/gpu_session), PYTHON (else .venv/bin/python, else python3),
#   SITE (/tmp/site), WHEEL_DIR (.whl), BUDGET (seconds for the whole invocation, 570: a stage
#   still running near its end gets SIGINT, and pytest and benchmark.py report what they have),
#   TESTS (pytest targets), BENCH_MODELS (comma-separated), BENCH_ARGS (more benchmark.py
#   options; later ones win, e.g. "--repeats 5 --impls triton"), TUNE_ARGS (more triton_tuning.py options),
#   SMOKE=1 (the same stages on the CPU at tiny settings; tests/test_gpu_session.py runs it).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

OUT="${OUT:-work_dirs/gpu_session}"
SITE="${SITE:-/tmp/site}"
WHEEL_DIR="${WHEEL_DIR:-.whl}"
BUDGET="${BUDGET:-570}"
SMOKE="${SMOKE:-0}"
# What importing visattn_mm needs beyond torch, timm, numpy and opencv: mmengine, and what its import
# pulls in: addict, yapf (-> platformdirs), termcolor, rich (-> markdown-it-py, mdurl, pygments).
WHEELS=(mmengine==0.10.7 addict yapf termcolor platformdirs rich markdown-it-py mdurl pygments)
TESTS="${TESTS:-tests/test_triton_kernels.py tests/test_triton_long_short.py tests/test_triton_pale.py
    tests/test_triton_vicinity.py tests/test_benchmark_tools.py tests/test_cuda.py::test_backbone_matches_float64_reference
    tests/test_cuda.py::test_training_step_never_waits_for_the_gpu tests/test_compile.py}"
if [[ "$SMOKE" == 1 ]]; then
    DEVICE=cpu
    BENCH=(--models "${BENCH_MODELS:-vil-t,swin-t}" --sizes 64x64 --batches 1 --dtypes fp32
           --impls fast,triton --warmup 0 --repeats 1 --threads 1)
    # The interpreter runs the kernels (slowly): one candidate, one step.
    TUNE=(--models vil-s --dtypes fp32 --size 32x32 --batch 1 --warps 2 --stages 1 --bias-grad-copies 1 --repeats 1)
else
    DEVICE=cuda
    # The baselines first, so that an interrupted run still has the ratios' reference.
    BENCH=(--models "${BENCH_MODELS:-swin-t,r50,vil-s,vil-ls-s,pale-t,vvt-s,vvt-s-bf16}" --sizes 800x1333
           --batches 8,2 --dtypes bf16,fp32 --impls fast,math,triton --warmup 3 --repeats 10)
    TUNE=(--dtypes bf16 --size 800x1333 --batch 2 --warps 4,8,16 --stages 1,3 --repeats 3)
fi
if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3
fi
mkdir -p "$OUT"
deadline=$((SECONDS + BUDGET))

# Runs "$@" within what is left of BUDGET (30 s kept for reporting), then SIGINT, then SIGKILL.
limited() {
    local left=$((deadline - SECONDS - 30))
    if ((left < 10)); then
        echo "[gpu_session] BUDGET=$BUDGET s used up; not started: $*"
        return 124
    fi
    timeout -s INT -k 20 "$left" "$@"
}

stage_wheels() {
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d "$WHEEL_DIR" "${WHEELS[@]}"
}

install_wheels() {
    local wheels=("$WHEEL_DIR"/*.whl)
    if [[ ! -e "${wheels[0]}" ]]; then
        echo "no wheels in $WHEEL_DIR/: using $PY's packages"
        return
    fi
    echo "installing ${#wheels[@]} wheels from $WHEEL_DIR/ into $SITE"
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" \
            "${wheels[@]}"; then
        echo "pip failed; unpacking the wheels instead (pure Python)"
        for wheel in "${wheels[@]}"; do "$PY" -m zipfile -e "$wheel" "$SITE" || return; done
    fi
    export PYTHONPATH="$SITE:$PYTHONPATH"
}

stage_setup() {
    echo "python: $PY; PYTHONPATH: $PYTHONPATH; OUT: $OUT; device: $DEVICE"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
        || echo "(no nvidia-smi)"
    "$PY" tools/collect_env.py || return
    DEVICE="$DEVICE" "$PY" -c 'import os, torch, triton, timm, visattn_mm.models
assert os.environ["DEVICE"] == "cpu" or torch.cuda.is_available(), "CUDA is not available"
print("setup: the backbones import; triton", triton.__version__, "timm", timm.__version__)'
}

stage_tests() {
    # shellcheck disable=SC2086  # TESTS is a list of targets
    limited "$PY" -m pytest -p no:cacheprovider -m cuda -q --durations=20 \
        --junitxml="$OUT/tests.xml" $TESTS
}

stage_bench() {
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
    limited "$PY" tools/analysis/benchmark.py --device "$DEVICE" "${BENCH[@]}" \
        --out-dir "$OUT" ${BENCH_ARGS:-}
}

stage_tune() {
    # shellcheck disable=SC2086  # TUNE_ARGS is a list of options
    ( [[ "$DEVICE" == cpu ]] && export TRITON_INTERPRET=1
      limited "$PY" tools/analysis/triton_tuning.py --device "$DEVICE" "${TUNE[@]}" --out-dir "$OUT" ${TUNE_ARGS:-} )
}

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
stages=("$@")
((${#stages[@]})) || stages=(setup tests bench)
for stage in "${stages[@]}"; do
    if [[ ! "$stage" =~ ^(wheels|setup|tests|bench|tune)$ ]]; then
        echo "unknown stage '$stage': use wheels, setup, tests, bench, tune" >&2
        exit 2
    fi
done
# setup.log starts with the installation, which every invocation does (a bare machine needs it).
[[ " ${stages[*]} " == *" wheels "* ]] || install_wheels > "$OUT/setup.log" 2>&1
summary=""
first_failure=0
for stage in "${stages[@]}"; do
    echo "=== $stage (at $SECONDS s)"
    log="$OUT/$stage.log"
    [[ "$stage" == setup ]] || : > "$log"
    "stage_$stage" 2>&1 | tee -a "$log"
    status=${PIPESTATUS[0]}
    # The ratio table benchmark.py prints (interrupted runs print one too).
    [[ "$stage" == bench ]] && grep '^|' "$log" > "$OUT/benchmark.md"
    [[ "$stage" == tune ]] && grep '^|' "$log" > "$OUT/triton_tuning.md"
    if ((status == 0)); then summary+="$stage ok, "
    elif ((status == 124)); then summary+="$stage STOPPED: BUDGET=$BUDGET s reached ($log), "
    else summary+="$stage FAILED (exit $status, $log), "
    fi
    ((status == 0 || first_failure)) || first_failure=$status
done
echo "gpu_session: ${summary%, } in $SECONDS s" | tee "$OUT/summary.txt"
exit "$first_failure"
