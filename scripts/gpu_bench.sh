#!/usr/bin/env bash
# One-shot GPU benchmark (benchmarks/gpu.py): a Llama-3.2-1B-shaped decoder at
# T in {4096, 16384, 65536}, batch 1, bf16 autocast: non-private, Opacus hooks, Opacus ghost,
# randomized two-pass and randomized book-keeping; with reentrant activation checkpointing at
# T in {16384, 65536, 131072}: the chunked LM head (opacus_rc.lm_head.ChunkedLMHeadLoss,
# block 1024, no T x vocab logits) non-private, randomized two-pass and the per-example form
# (one sequence per backward pass, exact clipping, the head a plain loss), then non-private,
# randomized (book-keeping), the per-example form and Opacus ghost (last: out of memory at
# 131072 by the model of docs/scaling.md); JSON with the median step time and
# torch.cuda.max_memory_allocated per mode (out-of-memory recorded as such). The bf16 case
# (issue 48): the per-example, randomized and non-private checkpointed modes also run on the model
# converted with .to(torch.bfloat16), in the same call (--bf16-params MODES, '' for none).
#   bash scripts/gpu_bench.sh [--out PATH]   # one large GPU (default docs/results/gpu_bench.json), about 10 minutes
#   bash scripts/gpu_bench.sh --device cpu --tiny         # CI: the same code paths on CPU (JSON in $TMPDIR)
# Without CUDA (and without --device cpu) it says so in one line and exits with status 2.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
exec "$PYTHON" -m benchmarks.gpu "$@"
