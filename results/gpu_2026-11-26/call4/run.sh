# The launch-settings matrix of 2026-11-26 (call 4), as it ran on the H200: MATRIX_CAP=170 SAN_CAP=100 bash results/gpu_2026-11-26/call4/run.sh
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
nvidia-smi --query-gpu=name --format=csv,noheader
for c in package 4w1s 4w2s 4w3s 8w1s 8w2s; do
  timeout -s INT -k 10 ${MATRIX_CAP:-170} python3 results/gpu_2026-11-26/call4/launch_matrix.py $c > $OUT/matrix_$c.log 2>&1 &
done
wait
grep -h "" $OUT/matrix_*.log | grep -v Warning | grep -v warn | cut -c1-400
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
timeout -s INT -k 10 ${SAN_CAP:-100} $SAN --tool memcheck --print-limit 8 python3 -m pytest -p no:cacheprovider -q -x \
  "tests/test_cuda.py::test_backbone_matches_float64_reference[cuda-ViL-triton-bf16-45x71]" > $OUT/sanitize.log 2>&1
grep -v "^\s*$" $OUT/sanitize.log | grep -i -B2 -A12 "invalid\|error\|at 0x" | head -80
