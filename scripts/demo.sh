#!/usr/bin/env bash
# Main demo: short DP training of a causal decoder (T=512, 40 steps; --full: T=1024, 60 steps)
# with randomized clipping.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python examples/demo.py "$@"
