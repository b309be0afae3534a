"""Benchmark of the rc_prv accountant against Opacus's ``prv`` on the same input.

``python -m benchmarks.accounting`` prints the time of get_epsilon for 10,000 steps
and of a full calibration (eps=2, delta=1e-5, q=0.01, 300 steps), deterministic and
randomized clipping (k=32, shared and per-example sketches), and the ratios to ``prv``.
get_epsilon is timed ``--reps`` times, the alternatives interleaved; each figure is the
median (the ratio: the median of the per-repetition ratios), robust to a loaded machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Tuple

from opacus.accountants import PRVAccountant
from opacus.accountants.utils import get_noise_multiplier

from opacus_rc.accounting.accountant import RCPRVAccountant, get_noise_multiplier_rc
from opacus_rc.config import SketchConfig


def _timed(fn: Callable[[], float]) -> Tuple[float, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--q", type=float, default=0.01)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    def prv_eps() -> float:
        acc = PRVAccountant()
        acc.history = [(args.sigma, args.q, args.steps)]
        return acc.get_epsilon(1e-5)

    def rc_eps(sketch) -> Callable[[], float]:
        def run() -> float:
            acc = RCPRVAccountant()
            acc.history = [(args.sigma, args.q, args.steps, sketch)]
            return acc.get_epsilon(1e-5)

        return run

    runs = {
        "prv": prv_eps,
        "deterministic": rc_eps(None),
        "shared k": rc_eps({"sketch_size": args.k, "sketching": "shared"}),
        "per_example k": rc_eps({"sketch_size": args.k, "sketching": "per_example"}),
    }
    times = {name: [] for name in runs}
    eps = {}
    for _ in range(args.reps):
        for name, fn in runs.items():
            eps[name], t = _timed(fn)
            times[name].append(t)
    t_ref = statistics.median(times["prv"])
    print(f"get_epsilon {args.steps} steps (median of {args.reps}): prv eps={eps['prv']:.4f} {t_ref:.2f}s")
    for name in list(runs)[1:]:
        ratio = statistics.median(t / r for t, r in zip(times[name], times["prv"]))
        print(f"  rc_prv {name:14s} eps={eps[name]:.4f} {statistics.median(times[name]):.2f}s  ratio {ratio:.1f}x")

    sig, t_ref = _timed(
        lambda: get_noise_multiplier(
            target_epsilon=2.0, target_delta=1e-5, sample_rate=0.01, steps=300, accountant="prv"
        )
    )
    print(f"calibration eps=2 q=0.01 300 steps: prv sigma={sig:.4f} {t_ref:.2f}s")
    for name, cfg in (
        ("deterministic", None),
        ("shared k", SketchConfig(sketch_size=args.k)),
        ("per_example k", SketchConfig(sketch_size=args.k, sketching="per_example")),
    ):
        sig, t = _timed(
            lambda: get_noise_multiplier_rc(2.0, 1e-5, 0.01, steps=300, sketch_config=cfg)
        )
        print(f"  rc_prv {name:14s} sigma={sig:.4f} {t:.2f}s  ratio {t / t_ref:.1f}x")


if __name__ == "__main__":
    main()
