#!/usr/bin/env bash
# The GPU check of a short session on a bare GPU host (torch, triton, timm; no OpenMMLab stack), in ONE
# command of at most BUDGET seconds: the CUDA tests, a kernel profile, the benchmark in order of value, then
# the rest while time is left. Everything it measures is in $OUT the moment it is measured.
#
#   bash tools/gpu_session.sh wheels      # beforehand, here: the wheels the host lacks into .whl/ (carried)
#   bash tools/gpu_session.sh rehearse    # beforehand, here: the whole call on the CPU with the host's versions
#   BUDGET=480 bash tools/gpu_session.sh  # on the GPU host (carry .whl): the default stages below
#
# Stages (run in the order given; none given: setup tests profile sanitize decide graphs detector throughput bench
# compile tune, i.e. in order of value: the CUDA tests, the profile, the rows that decide the defaults table, the
# user's commands, the rest):
#   wheels    tools/device_wheels.sh: mmengine, mmdet, mmsegmentation and the packages their imports need, for
#             Python 3.12, and mmcv 2.1.0 built here with CUDA ops for the host's torch and sm_90, into .whl/
#   rehearsal-env  the throw-away Python 3.12 environment with the host's own versions (requirements/gpu_host.txt:
#             torch, triton, timm, numpy, ...) that rehearse and tools/device_wheels.sh use (REHEARSAL_VENV)
#   rehearse  on this machine: the carried wheels installed as the device call installs them, a check that the
#             carried mmcv's compiled ops import against the host's torch, the default stages with SMOKE=1
#             (results in $OUT/rehearsal/), then tools/analysis/triton_resources.py: every kernel compiled for
#             sm_90 by the host's Triton, and by ours against the kernel digests the call will report
#             (--digests check)
#   setup     install the carried wheels; the environment report: python, GPU, torch, CUDA, triton, timm, the
#             host's versions of requirements/gpu_host.txt against its pins, the attention paths
#   tests     the CUDA-marked tests that decide the defaults table (each Triton kernel and each backbone path
#             against the float64 reference), at most TESTS_BUDGET seconds (tests.xml)
#   profile   tools/analysis/profile_step.py: Swin-T and our four backbones at batch 8 then 2, 800x1333, bf16
#             fwd+bwd on 'auto', a few steps under torch.profiler: kernel time by class (ours kernel by kernel),
#             launches per step, wall time, the GPU's busy fraction (the floors: --floor-only, on the CPU); at most
#             PROFILE_BUDGET seconds. No file of its own: its tables and then its CSV (between '--- profile_step.csv'
#             and '--- end profile_step.csv') go into session.log
#   sanitize  SANITIZE_TESTS under compute-sanitizer's memcheck, one process, at most SANITIZE_BUDGET seconds: the
#             kernel and line of an out-of-bounds access (a CUDA error otherwise surfaces at a later call);
#             skipped, saying so, where compute-sanitizer is missing (the CPU)
#   decide    tools/analysis/benchmark.py over DECIDE_GRIDS: the rows that decide the defaults table (800x1333, bf16,
#             fwd+bwd, 'fast' and 'triton', batch 8 then 2) -> decide.csv, decide.md (the ratio table)
#   graphs    tools/analysis/benchmark.py --cuda-graphs over GRAPHS_GRIDS: each step captured as a CUDA graph and
#             replayed (batch 2, bf16, fwd+bwd, 'auto'), against Swin-T's graphed step -> graphs.csv, graphs.md;
#             skipped, saying so, on the CPU
#   detector  the user's commands at the configs' sizes on toy data (tools/make_toy_data.py --config): tools/train.py
#             --amp for DETECTOR_ITERS iterations, then tools/test.py on the checkpoint it wrote, for Mask R-CNN ViL-S
#             (1333x800, CocoMetric) and UperNet ViL-S (512x512, IoUMetric); each run at most DETECTOR_BUDGET s,
#             a later one runs when an earlier one fails (their output: session.log)
#   throughput  tools/analysis/train_throughput.py at batch 2 in bf16 and fp16 (THROUGHPUT_DTYPES): Mask R-CNN with
#             the four backbones against mmdet's Mask R-CNN Swin-T, then UperNet against mmseg's UperNet Swin-T
#             (throughput_maskrcnn.csv, throughput_upernet.csv), each set at most THROUGHPUT_BUDGET s
#   bench     tools/analysis/benchmark.py over BENCH_GRIDS: fp16 (mmdet's --amp), fp32, the other paths, forward
#             alone (benchmark.csv after every case; benchmark.md, the ratio table, at the end)
#   compile   the CUDA test of the Triton path under torch.compile's Inductor (compile.xml)
#   tune      tools/analysis/triton_tuning.py: each Triton kernel under candidate launch settings (triton_tuning.csv)
# Every stage's output goes to $OUT/session.log, headed by the stage's name; summary.txt says which passed. A failed
# stage does not stop the next; the exit status is that of the first failed stage. A device call brings back at
# most 8 files: session.log and summary.txt stay as they are, and where more than 7 files are left the others are
# packed at the end into results.tar.gz (pack_results).
#
# Variables: OUT (work_dirs/gpu_session), PYTHON (else .venv/bin/python, else python3),
#   SITE (/tmp/site), WHEEL_DIR (.whl), BUDGET (seconds for the whole invocation, 480: a stage still running
#   30 s before its end gets SIGINT, and pytest and benchmark.py report what they have), TESTS_BUDGET (180),
#   SANITIZE_TESTS (pytest targets, the cases that met an illegal address last), SANITIZE_BUDGET (120),
#   PROFILE_BUDGET (60; SMOKE=1: 180), PROFILE_MODELS (comma-separated), PROFILE_ARGS (more profile_step.py options),
#   TESTS (pytest targets), TESTS_MARKS (their -m expression, 'cuda'; empty: all), TEST_WORKERS (pytest-xdist
#   processes for the tests and compile stages where xdist is installed, 8; 0: one process),
#   BENCH_MODELS (comma-separated), DECIDE_GRIDS, GRAPHS_GRIDS and BENCH_GRIDS (newline-separated --grid values),
#   DETECTORS (the detector stage's configs, space-separated; upernet_* on toy ADE20K, the others on toy COCO),
#   DETECTOR_ITERS (2),
#   DETECTOR_BUDGET (seconds per train or test run, 90; 300 with SMOKE=1), THROUGHPUT_DTYPES (bf16,fp16),
#   THROUGHPUT_BUDGET (150 per set),
#   BENCH_ARGS (more benchmark.py options; later ones win, e.g. "--repeats 5"), TUNE_ARGS (more triton_tuning.py
#   options), SMOKE=1 (the same stages on the CPU at tiny settings; tests/test_tools/test_gpu_session.py runs it),
#   REHEARSAL_VENV (/tmp/visattn_gpu_rehearsal), REHEARSAL_PYTHON (a Python 3.12; else found on PATH or pyenv).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

OUT="${OUT:-work_dirs/gpu_session}"
SITE="${SITE:-/tmp/site}"
WHEEL_DIR="${WHEEL_DIR:-.whl}"
BUDGET="${BUDGET:-480}"
TESTS_BUDGET="${TESTS_BUDGET:-180}"
TESTS_MARKS="${TESTS_MARKS-cuda}"
TEST_WORKERS="${TEST_WORKERS:-8}"
SMOKE="${SMOKE:-0}"
declare -A TOY_SIZES  # the toy images of each layout (HEIGHT WIDTH) for the detector stage
HOST_PINS=requirements/gpu_host.txt
# The tests the defaults table's rule needs (outputs and every gradient against float64), kernels first.
KERNEL_TESTS="tests/test_ops/test_triton/test_triton_sliding_chunk.py tests/test_ops/test_triton/test_triton_long_short.py
    tests/test_ops/test_triton/test_triton_pale.py tests/test_ops/test_triton/test_triton_vicinity.py
    tests/test_ops/test_triton/test_triton_conv_gelu.py"
BACKBONE_TESTS="tests/test_cuda.py::test_backbone_matches_float64_reference
    tests/test_cuda.py::test_training_step_never_waits_for_the_gpu
    tests/test_models/test_pale.py::test_qkv_projections_run_as_one_compute_what_each_computes"
TESTS="${TESTS:-$KERNEL_TESTS $BACKBONE_TESTS tests/test_tools/test_benchmark_tools.py tests/test_models/test_cuda_graphs.py}"
COMPILE_TESTS="tests/test_ops/test_compile.py tests/test_models/test_block_compile.py"
# Where the H100 and the H200 met an illegal address (2026-11-26: 16-bit kernels launched with 8 warps at head
# dim 64, now 4): the sliding-chunk kernels at a tiny backbone's third stage, and the backbone test that showed it.
SANITIZE_TESTS="${SANITIZE_TESTS:-tests/test_ops/test_triton/test_triton_sliding_chunk.py::test_cuda_kernels_match_float64_math_on_a_backbone_stage
    tests/test_cuda.py::test_backbone_matches_float64_reference[cuda-ViL-triton-bf16-45x71]}"
SANITIZE_BUDGET="${SANITIZE_BUDGET:-120}"
if [[ "$SMOKE" == 1 ]]; then
    DEVICE=cpu
    BENCH=(--models "${BENCH_MODELS:-swin-t,r50,vil-t}" --sizes 64x64 --warmup 0 --repeats 1 --threads 1)
    DECIDE_DEFAULT="batches=1 dtypes=fp32 impls=fast,triton modes=fwd+bwd"
    BENCH_DEFAULT="batches=1 dtypes=fp32 impls=math modes=fwd"
    # On the CPU: the demo's Mask R-CNN ViL-T at its own scale and UperNet ViL-T, on small images; no AMP (CPU
    # autocast is not what --amp runs on a GPU).
    DETECTORS_DEFAULT="configs/demo/maskrcnn_vil_t_toy.py configs/upernet_vil_t_160k_ade20k.py"
    TOY_SIZES=([coco]="128 160" [ade20k]="128 128")
    DETECTOR_BUDGET="${DETECTOR_BUDGET:-300}"
    AMP=()
    THROUGHPUT=(--image-size 64x96 --warmup 0 --iters 1 --workers 0 --dtypes fp32)
    THROUGHPUT_SETS=("configs/maskrcnn_vil_t_1x.py" "configs/upernet_vil_t_160k_ade20k.py")
    # The interpreter runs the kernels (slowly): one candidate, one step.
    TUNE=(--models vil-s --dtypes fp32 --size 32x32 --batch 1 --warps 2 --stages 1 --bias-grad-copies 1 --repeats 1)
    PROFILE=(--models "${PROFILE_MODELS:-swin-t,vil-t}" --batches 1 --size 64x64 --dtype fp32 --warmup 0 --steps 1
        --profiled-steps 1 --threads 1 --no-floor)
    : "${PROFILE_BUDGET:=180}"  # a 2-core CPU imports and steps slower than the GPU host
else
    DEVICE=cuda
    BENCH=(--models "${BENCH_MODELS:-swin-t,r50,vil-s,vil-ls-s,pale-t,vvt-s}" --sizes 800x1333 --warmup 3 --repeats 10)
    # The rows that decide the defaults table (docs/benchmarks.md), then the rest.
    DECIDE_DEFAULT="batches=8 dtypes=bf16 impls=fast,triton modes=fwd+bwd
batches=2 dtypes=bf16 impls=fast,triton modes=fwd+bwd"
    GRAPHS_DEFAULT="batches=2 dtypes=bf16 impls=auto modes=fwd+bwd"
    BENCH_DEFAULT="batches=8,2 dtypes=fp16 impls=fast,triton modes=fwd+bwd
batches=8,2 dtypes=fp32 impls=fast,triton modes=fwd+bwd
models=swin-t,vil-s,vil-ls-s,pale-t batches=8,2 dtypes=bf16 impls=math modes=fwd+bwd
models=swin-t,vvt-s-bf16 batches=8,2 dtypes=bf16 impls=fast,triton modes=fwd+bwd
models=swin-t,vvt-s-fused batches=8,2 dtypes=bf16 impls=triton modes=fwd+bwd
batches=8,2 dtypes=bf16 impls=fast,triton modes=fwd"
    TUNE=(--dtypes bf16 --size 800x1333 --batch 2 --warps 4,8,16 --stages 1,3 --repeats 3)
    # The configs' own pipelines on toy data of their sizes, as users run them on a GPU (--amp: fp16).
    DETECTORS_DEFAULT="configs/maskrcnn_vil_s_1x.py configs/upernet_vil_s_160k_ade20k.py"
    TOY_SIZES=([coco]="800 1333" [ade20k]="512 512")
    AMP=(--amp)
    THROUGHPUT=(--batch 2 --warmup 2 --iters 5 --dtypes "${THROUGHPUT_DTYPES:-bf16,fp16}")
    # Each set: its configs, measured against the baseline of their library (mmdet's or mmseg's Swin-T).
    THROUGHPUT_SETS=("configs/maskrcnn_vil_s_1x.py configs/maskrcnn_vil_ls_s_1x.py configs/maskrcnn_pale_t_1x.py
        configs/maskrcnn_vvt_s_1x.py" "configs/upernet_vil_s_160k_ade20k.py configs/upernet_vil_ls_s_160k_ade20k.py
        configs/upernet_pale_t_160k_ade20k.py configs/upernet_vvt_s_160k_ade20k.py")
    # Few steps: about a minute for 10 cases and the first Triton compilations. No floors: they are counts of the
    # program, the same on any machine, and their traces take seconds each (profile_step.py --floor-only, here).
    PROFILE=(--models "${PROFILE_MODELS:-swin-t,vil-s,vil-ls-s,pale-t,vvt-s}" --batches 8,2 --size 800x1333 --warmup 2
        --steps 3 --profiled-steps 2 --no-floor)
fi
DECIDE_GRIDS="${DECIDE_GRIDS:-$DECIDE_DEFAULT}"
GRAPHS_GRIDS="${GRAPHS_GRIDS:-${GRAPHS_DEFAULT:-}}"
BENCH_GRIDS="${BENCH_GRIDS:-$BENCH_DEFAULT}"
DETECTORS="${DETECTORS:-$DETECTORS_DEFAULT}"
DETECTOR_ITERS="${DETECTOR_ITERS:-2}"
DETECTOR_BUDGET="${DETECTOR_BUDGET:-90}"
THROUGHPUT_BUDGET="${THROUGHPUT_BUDGET:-150}"
SCRATCH="${SCRATCH:-work_dirs/gpu_session_scratch}"
PROFILE_BUDGET="${PROFILE_BUDGET:-60}"
if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3
fi
mkdir -p "$OUT" "$SCRATCH"
LOG="$OUT/session.log"
deadline=$((SECONDS + BUDGET))

# Runs "$@" within what is left of BUDGET (30 s kept for reporting), or within $CAP seconds if that is
# sooner, then SIGINT, then SIGKILL.
limited() {
    local left=$((deadline - SECONDS - 30))
    if [[ -n "${CAP:-}" ]] && ((CAP < left)); then left=$CAP; fi
    if ((left < 10)); then
        echo "[gpu_session] BUDGET=$BUDGET s used up; not started: $*"
        return 124
    fi
    timeout -s INT -k 20 "$left" "$@"
}

stage_wheels() {
    WHEEL_DIR="$WHEEL_DIR" bash tools/device_wheels.sh
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

# A Python 3.12 interpreter (the host's minor version): REHEARSAL_PYTHON, python3.12, or pyenv's.
python312() {
    local candidate
    for candidate in ${REHEARSAL_PYTHON:-} python3.12 \
            $(command -v pyenv >/dev/null && ls -d "$(pyenv root)"/versions/3.12*/bin/python3.12 2>/dev/null); do
        if [[ "$("$candidate" -c 'import sys; print(sys.version_info[:2] == (3, 12))' 2>/dev/null)" == True ]]; then
            command -v "$candidate"
            return
        fi
    done
    echo "[gpu_session] rehearse: no Python 3.12 found; set REHEARSAL_PYTHON" >&2
    return 2
}

stage_rehearsal-env() {
    local venv="${REHEARSAL_VENV:-/tmp/visattn_gpu_rehearsal}" python want
    python="$(python312)" || return
    want="$(cat "$HOST_PINS" <("$python" --version) | sha256sum | cut -d' ' -f1)"
    if ! grep -qx "$want" "$venv/.gpu_host" 2>/dev/null; then
        echo "building $venv: $("$python" --version) with $HOST_PINS"
        rm -rf "$venv"
        "$python" -m venv "$venv" && "$venv/bin/python" -m pip install -q -r "$HOST_PINS" || return
        echo "$want" > "$venv/.gpu_host"
    fi
}

stage_rehearse() {
    local venv="${REHEARSAL_VENV:-/tmp/visattn_gpu_rehearsal}" status=0
    stage_rehearsal-env || return
    local wheels=("$WHEEL_DIR"/mmcv-*.whl)
    [[ -e "${wheels[0]}" ]] || HOST_PYTHON="$venv/bin/python" stage_wheels || return
    # The carried mmcv's compiled ops against the host's torch (their CUDA part loads without a GPU).
    ( SITE="$venv/site" PY="$venv/bin/python" install_wheels >/dev/null && "$venv/bin/python" -c 'import mmcv, torch
from mmcv.ops import get_compiling_cuda_version, nms
built = get_compiling_cuda_version()
assert built == torch.version.cuda, f"mmcv ops built with CUDA {built}, torch has {torch.version.cuda}"
boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 10, 10], [20, 20, 30, 30]], dtype=torch.float32)
kept = nms(boxes, torch.tensor([0.9, 0.8, 0.7]), 0.5)[1]
assert kept.tolist() == [0, 2], kept
print(f"rehearse: mmcv {mmcv.__version__} ops import against torch {torch.__version__} (CUDA ops built with {built})")'
    ) || return
    # The device call itself, on the CPU: the same wheels into a site of its own, every default stage.
    # Its tests stage runs every test of those files that needs no mmdet, the kernels' interpreter tests
    # included (TESTS_MARKS=''), under the host's Triton.
    env PYTHON="$venv/bin/python" SMOKE=1 OUT="$OUT/rehearsal" SITE="$venv/site" BUDGET=3000 TESTS_BUDGET=2400 \
        TESTS="$KERNEL_TESTS $BACKBONE_TESTS" TESTS_MARKS='' bash "$ROOT/tools/gpu_session.sh" || status=$?
    echo "rehearsal stages: $(cat "$OUT/rehearsal/summary.txt")"
    # Every kernel compiled for sm_90 by the host's Triton (no GPU needed).
    PYTHONPATH="$venv/site:$PYTHONPATH" "$venv/bin/python" tools/analysis/triton_resources.py \
        --capability 90 || { ((status)) || status=1; }
    # The kernel digests the call's environment report carries, and the defaults table's new rows record, are
    # those of this tree's kernels (compiled by our stack's Triton, as visattn_mm/ops/kernel_digests.py is).
    "$PY" tools/analysis/triton_resources.py --digests check | tail -1 || { ((status)) || status=1; }
    return "$status"
}

stage_setup() {
    echo "python: $PY; PYTHONPATH: $PYTHONPATH; OUT: $OUT; device: $DEVICE; commit: $(git rev-parse --short HEAD \
        2>/dev/null || echo '(no git here)')"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
        || echo "(no nvidia-smi)"
    "$PY" - "$HOST_PINS" <<'EOF'
import importlib.metadata as metadata, re, sys
pins = [line.split('==') for line in open(sys.argv[1]) if re.match(r'^[\w.-]+==', line)]
for name, pin in pins:
    try:
        here = metadata.version(name)
    except metadata.PackageNotFoundError:
        here = 'not installed'
    print(f'{name}: {here}' + ('' if here == pin.strip() else f' (the rehearsal pins {pin.strip()})'))
EOF
    "$PY" tools/collect_env.py || return
    DEVICE="$DEVICE" "$PY" -c 'import os, torch, triton, timm, visattn_mm.models
assert os.environ["DEVICE"] == "cpu" or torch.cuda.is_available(), "CUDA is not available"
print("setup: the backbones import; triton", triton.__version__, "timm", timm.__version__)'
}

# pytest-xdist's options when the interpreter has it (the GPU host does): most of a CUDA test's time is
# Triton's and Inductor's compiling, which the host's 16 cores do side by side.
parallel() {
    if [[ "$TEST_WORKERS" != 0 ]] && "$PY" -c 'import xdist' 2>/dev/null; then echo "-n $TEST_WORKERS"; fi
}

# With xdist, each worker's share of the cores for torch's CPU threads (unless OMP_NUM_THREADS is set):
# with a full pool each, 8 workers on the host's 16 cores took 100 s over one float64 reference.
worker_threads() {
    [[ -n "$(parallel)" && -z "${OMP_NUM_THREADS:-}" ]] || return 0
    local share=$(($(nproc) / TEST_WORKERS))
    echo "OMP_NUM_THREADS=$((share > 0 ? share : 1))"
}

stage_tests() {
    # shellcheck disable=SC2086,SC2046  # TESTS is a list of targets; the options split into words
    CAP=$TESTS_BUDGET limited env $(worker_threads) "$PY" -m pytest -p no:cacheprovider $(parallel) \
        ${TESTS_MARKS:+-m "$TESTS_MARKS"} -q -rfE --durations=20 --junitxml="$OUT/tests.xml" $TESTS
}

stage_profile() {
    # Its files stay out of $OUT (at most 7 files come back): the tables are printed, the CSV follows them.
    local dir status
    dir="$(mktemp -d)"
    # shellcheck disable=SC2086  # PROFILE_ARGS is a list of options
    CAP=$PROFILE_BUDGET limited "$PY" tools/analysis/profile_step.py --device "$DEVICE" "${PROFILE[@]}" \
        --out-dir "$dir" ${PROFILE_ARGS:-}
    status=$?
    if [[ -f "$dir/profile_step.csv" ]]; then
        echo "--- profile_step.csv"
        cat "$dir/profile_step.csv"
        echo "--- end profile_step.csv"
    fi
    rm -rf "$dir"
    return "$status"
}

stage_sanitize() {
    # On PATH, or in the CUDA toolkit's bin/ (the GPU host's image has it there, not always on PATH).
    local sanitizer
    sanitizer="$(command -v compute-sanitizer || ls "${CUDA_HOME:-/usr/local/cuda}"/bin/compute-sanitizer 2>/dev/null)"
    if [[ -z "$sanitizer" ]]; then
        echo "no compute-sanitizer here: sanitize skipped"
        return 0
    fi
    # shellcheck disable=SC2086  # SANITIZE_TESTS is a list of targets
    CAP=$SANITIZE_BUDGET limited "$sanitizer" --tool memcheck --print-limit 5 "$PY" -m pytest \
        -p no:cacheprovider -p no:xdist -q -x -rfE $SANITIZE_TESTS
}

# benchmark.py over the grids $1 (newline-separated), with the options after $2; its CSV and ratio table as
# $OUT/$2.csv and $OUT/$2.md.
run_benchmark() {
    local grids=() grid status name="$2"
    while IFS= read -r grid; do [[ -n "$grid" ]] && grids+=(--grid "$grid"); done <<< "$1"
    shift 2
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
    limited "$PY" tools/analysis/benchmark.py --device "$DEVICE" "${BENCH[@]}" "${grids[@]}" "$@" \
        --out-dir "$SCRATCH/$name" --no-plot ${BENCH_ARGS:-} | tee "$SCRATCH/$name.log"
    status=${PIPESTATUS[0]}
    cp "$SCRATCH/$name/benchmark.csv" "$OUT/$name.csv" 2>/dev/null
    grep '^|' "$SCRATCH/$name.log" > "$OUT/$name.md"
    return "$status"
}

stage_decide() { run_benchmark "$DECIDE_GRIDS" decide; }

stage_graphs() {
    if [[ "$DEVICE" == cpu ]]; then
        echo "CUDA graphs need a GPU: graphs skipped"
        return 0
    fi
    run_benchmark "$GRAPHS_GRIDS" graphs --cuda-graphs
}

stage_bench() { run_benchmark "$BENCH_GRIDS" benchmark; }

# tools/make_toy_data.py writes each config pointed at toy data of its size as a short run; tools/train.py
# trains it (--amp on the GPU), tools/test.py evaluates the checkpoint it wrote. Each run within DETECTOR_BUDGET.
stage_detector() {
    local config name layout data toy work status=0
    for config in $DETECTORS; do
        name="$(basename "$config" .py)"
        layout=coco
        [[ "$name" != upernet* ]] || layout=ade20k
        data="$SCRATCH/toy_${layout}_${TOY_SIZES[$layout]// /x}"
        work="$SCRATCH/$name"
        echo "--- $name: tools/train.py ${AMP[*]} for $DETECTOR_ITERS iterations, then tools/test.py"
        # shellcheck disable=SC2086  # the size is two words
        "$PY" tools/make_toy_data.py "$layout" "$data" --num-train 4 --num-val 2 --image-size ${TOY_SIZES[$layout]} \
            --config "$config" --iters "$DETECTOR_ITERS" || { status=1; continue; }
        toy="$data/${name}_toy.py"
        rm -rf "$work"
        CAP=$DETECTOR_BUDGET limited "$PY" tools/train.py "$toy" --work-dir "$work/train" "${AMP[@]}" \
            || { status=1; continue; }
        CAP=$DETECTOR_BUDGET limited "$PY" tools/test.py "$toy" "$work/train/iter_$DETECTOR_ITERS.pth" \
            --work-dir "$work/test" || status=1
    done
    return "$status"
}

stage_throughput() {
    local set detector status=0
    for set in "${THROUGHPUT_SETS[@]}"; do
        detector="$(basename "${set%% *}" | cut -d_ -f1)"  # maskrcnn, upernet: throughput_<detector>.csv
        # shellcheck disable=SC2086  # a set is a list of configs
        CAP=$THROUGHPUT_BUDGET limited "$PY" tools/analysis/train_throughput.py $set "${THROUGHPUT[@]}" \
            --out-dir "$SCRATCH/throughput_$detector" || status=$?
        cp "$SCRATCH/throughput_$detector/train_throughput.csv" "$OUT/throughput_$detector.csv" 2>/dev/null
    done
    return "$status"
}

stage_compile() {
    # shellcheck disable=SC2046,SC2086  # the options and COMPILE_TESTS (a list of files) split into words
    limited env $(worker_threads) "$PY" -m pytest -p no:cacheprovider $(parallel) -m cuda -q -rfE \
        --junitxml="$OUT/compile.xml" $COMPILE_TESTS
}

stage_tune() {
    # shellcheck disable=SC2086  # TUNE_ARGS is a list of options
    ( [[ "$DEVICE" == cpu ]] && export TRITON_INTERPRET=1
      limited "$PY" tools/analysis/triton_tuning.py --device "$DEVICE" "${TUNE[@]}" --out-dir "$OUT" ${TUNE_ARGS:-} )
}

# A device call brings back at most 8 files: past 7 in $OUT, all but session.log and summary.txt go into one archive.
pack_results() {
    local files
    mapfile -t files < <(cd "$OUT" && find . -type f ! -name session.log ! -name summary.txt ! -name results.tar.gz)
    ((${#files[@]} + 2 > 7)) || return 0
    (cd "$OUT" && tar -czf results.tar.gz "${files[@]}" && rm -f "${files[@]}" && find . -mindepth 1 -type d -empty -delete)
    echo "packed ${#files[@]} files into $OUT/results.tar.gz (a device call brings back at most 8)" | tee -a "$LOG"
}

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
stages=("$@")
((${#stages[@]})) || stages=(setup tests profile sanitize decide graphs detector throughput bench compile tune)
known=(wheels rehearsal-env rehearse setup tests profile sanitize decide graphs detector throughput bench compile tune)
for stage in "${stages[@]}"; do
    if [[ ! " ${known[*]} " =~ \ $stage\  ]]; then
        echo "unknown stage '$stage': use ${known[*]}" >&2
        exit 2
    fi
done
: > "$LOG"
# Every invocation that runs on the host installs the wheels first (a bare machine needs them).
if [[ ! " ${stages[*]} " =~ \ (wheels|rehearsal-env|rehearse)\  ]]; then
    echo "=== install (at $SECONDS s)" | tee -a "$LOG"
    install_wheels > >(tee -a "$LOG") 2>&1  # not in a pipe: its PYTHONPATH must stay
fi
summary=""
first_failure=0
for stage in "${stages[@]}"; do
    echo "=== $stage (at $SECONDS s)" | tee -a "$LOG"
    "stage_$stage" 2>&1 | tee -a "$LOG"
    status=${PIPESTATUS[0]}
    if ((status == 0)); then summary+="$stage ok, "
    elif ((status == 124)); then summary+="$stage STOPPED: BUDGET=$BUDGET s reached, "
    else summary+="$stage FAILED (exit $status), "
    fi
    ((status == 0 || first_failure)) || first_failure=$status
done
pack_results
echo "gpu_session: ${summary%, } in $SECONDS s (log: $LOG)" | tee "$OUT/summary.txt"
exit "$first_failure"
