#!/usr/bin/env bash
# The whole test suite: sets up .venv/ on first use (see tools/bootstrap.sh), then runs pytest.
# Extra arguments go to pytest, e.g. `bash tools/run_tests.sh -k vil -x`.
#
# The tests run in TEST_WORKERS processes (pytest-xdist; default: one per core, at most 4), each
# test file's tests in one process, so that a file's module fixtures are built once, the files handed
# out in collection order (tests/conftest.py puts the slowest first), not by test count. Each process
# gets its share of the cores for torch's threads (OMP_NUM_THREADS, unless set). Most of the
# suite's time is single-threaded (subprocess start-up, compiling, the Triton interpreter), which
# the processes overlap. TEST_WORKERS=0 runs everything in this process (e.g. for --pdb).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/tools/bootstrap.sh"
cd "$ROOT"
CORES="$(nproc)"
TEST_WORKERS="${TEST_WORKERS:-$((CORES < 4 ? CORES : 4))}"
if ((TEST_WORKERS > 1)); then
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$((CORES / TEST_WORKERS > 0 ? CORES / TEST_WORKERS : 1))}"
    exec .venv/bin/python -m pytest -n "$TEST_WORKERS" --dist loadfile --no-loadscope-reorder "$@"
fi
exec .venv/bin/python -m pytest "$@"
