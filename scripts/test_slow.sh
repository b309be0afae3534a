#!/usr/bin/env bash
# The slow rest of the test suite (gloo ranks, notebook kernels, Hugging Face stacks,
# benchmarks, long sweeps); scripts/test.sh runs the fast suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec bash scripts/run_pytest.sh -m slow "$@"
