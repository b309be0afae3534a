"""Benchmarks (not tests).

* ``python -m benchmarks``: per-layer FLOPs and peak memory of the per-sample norm
  computation (Opacus ghost, FGC, Hutchinson, Hutch++) and per-step time and memory of
  a small decoder (non-private, Opacus hooks, Opacus ghost, randomized clipping), see
  :mod:`benchmarks.__main__` and ``docs/benchmarks.md``;
* ``python -m benchmarks.accounting``: the rc_prv accountant against ``prv``;
* ``python -m benchmarks.revisions --old REV [--new REV]``: the book-keeping step time (as a
  multiple of non-private training) of two revisions of opacus_rc, side by side in one run;
* ``PYTHONPATH=<checkout> python benchmarks/identity_paths.py --json PATH``: issue 52's paths
  (banded neighbours, a sorting collate, checkpoint secrets, loops as they run on a GPU) on any
  checkout (docs/results/identity_paths_*.json).

Nothing here is imported by the library.
"""
