#!/usr/bin/env bash
# Main demo: short DP training of a causal decoder (T=512, 40 steps; --full: T=1024, 60 steps)
# with randomized clipping.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# One intra-op thread unless OMP_NUM_THREADS is set, as scripts/run_pytest.sh: on a loaded 2-core
# machine a second thread mostly waits for the first (load 7.5 to 10: 99 s with one, 258 s with two).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python examples/demo.py "$@"
