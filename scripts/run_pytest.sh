#!/usr/bin/env bash
# pytest in .venv, stopped as a whole by Ctrl-C. Without this, the notebook client turns a
# SIGINT into "shut the kernel down", which only fails the running test, and pytest carries on.
set -uo pipefail
cd "$(dirname "$0")/.."
descendants() {  # every process below $1 (notebook kernels run in sessions of their own)
  local child
  for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do
    echo "$child"
    descendants "$child"
  done
}
stop() {
  trap - INT TERM
  echo "interrupted: stopping the test run" >&2
  local all
  all="$pid $(descendants "$pid")"
  kill -TERM $all 2>/dev/null
  sleep 1
  kill -KILL $all 2>/dev/null
  wait "$pid" 2>/dev/null
  exit 130
}
# The golden epsilons (tests/blas.py) were recorded under OpenBLAS's SkylakeX kernels; OpenBLAS
# picks others on some AVX-512 CPUs (Haswell's on AMD Zen 4), which round differently. Any CPU
# with AVX-512 F/CD/BW/DQ/VL runs SkylakeX's, so there the goldens hold bit for bit.
if [ -z "${OPENBLAS_CORETYPE:-}" ] \
  && [ "$(grep -m1 -o -w -E 'avx512(f|cd|bw|dq|vl)' /proc/cpuinfo 2>/dev/null | sort -u | wc -l)" = 5 ]; then
  export OPENBLAS_CORETYPE=SkylakeX
fi
# One intra-op thread per test process (unless OMP_NUM_THREADS is set): the tests' tensors are
# tiny, and on a loaded machine two threads of one process wait for each other at every
# parallel region (tests/test_lm_head.py at load 8: 38 s with 2 threads, 15 s with 1). Child
# processes (the README's script, gloo ranks) inherit it.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
.venv/bin/python -m pytest -q "$@" &
pid=$!
trap stop INT TERM
wait "$pid"
rc=$?
trap - INT TERM
exit $rc
