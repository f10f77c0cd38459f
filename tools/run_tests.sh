#!/usr/bin/env bash
# The whole test suite: sets up .venv/ on first use (see tools/bootstrap.sh), then runs pytest.
# Extra arguments go to pytest, e.g. `bash tools/run_tests.sh -k vil -x`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/tools/bootstrap.sh"
cd "$ROOT"
exec .venv/bin/python -m pytest "$@"
