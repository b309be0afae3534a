#!/usr/bin/env bash
# The fast test suite (sets up .venv first): every privacy-critical and brute-force-equivalence
# test of one process. The slow rest (gloo ranks, notebooks, benchmarks, long sweeps):
# scripts/test_slow.sh. Extra arguments go to pytest. Ctrl-C stops the whole run at once.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# two test processes (pytest-xdist): on 2 cores shared with other jobs the suite gets two
# shares of the CPU instead of one (OMP_NUM_THREADS=1 each, scripts/run_pytest.sh)
exec bash scripts/run_pytest.sh -m "not slow" -n "${OPACUS_RC_TEST_WORKERS:-2}" "$@"
