"""``python -m benchmarks.secure_noise``: cost of secure-mode noise.

Times, on one thread and the same float32 reference of ``--params`` entries (default 10M):

* ``torch``: non-secure noise, ``torch.normal(0, std, reference.shape)`` in float32 from
  torch's default pseudo-random generator (Opacus's ``_generate_noise`` outside secure
  mode, without its extra zero buffer: the stricter baseline);
* ``secure``: :func:`opacus_rc.csprng.secure_noise` (AES-256-CTR keystream, 53-bit
  uniforms, Box-Muller in float64, halved sum of four normals);
* ``opacus_secure_formula`` (context only): Opacus's secure-mode formula (four
  ``torch.normal`` draws) fed by torch's default pseudo-random generator, i.e. what the
  floating-point guard alone costs with a non-cryptographic source.

Repetitions are interleaved after one warm-up of each; the report gives the median and
minimum of each and the ratio ``secure / torch`` (target: at most 5). Times are the
calling thread's CPU time (``time.thread_time``; with one torch thread every kernel runs
in it), which other processes on a shared machine do not inflate; wall times are
reported next to them. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

METHODS = ("torch", "secure", "opacus_secure_formula")


def _methods(reference: torch.Tensor, std: float) -> Dict[str, Callable[[], torch.Tensor]]:
    from opacus.optimizers.optimizer import _generate_noise

    from opacus_rc.csprng import secure_noise

    return {
        "torch": lambda: torch.normal(
            0.0, std, size=reference.shape, dtype=reference.dtype, device=reference.device
        ),
        "secure": lambda: secure_noise(std, reference),
        "opacus_secure_formula": lambda: _generate_noise(
            std=std, reference=reference, secure_mode=True
        ),
    }


def measure(
    params: int = 10_000_000,
    reps: int = 5,
    threads: int = 1,
    std: float = 1.0,
    methods: Sequence[str] = METHODS,
) -> Dict[str, object]:
    """Median and minimum CPU seconds per call of each method (and the wall-clock
    median), and the secure/torch ratios of the CPU times."""
    torch.set_num_threads(threads)
    reference = torch.zeros(params, dtype=torch.float32)
    calls = _methods(reference, std)
    times: Dict[str, List[float]] = {m: [] for m in methods}
    walls: Dict[str, List[float]] = {m: [] for m in methods}
    for m in methods:  # warm-up
        calls[m]()
    for rep in range(reps):
        order = list(methods[rep % len(methods):]) + list(methods[: rep % len(methods)])
        for m in order:
            start, wall = time.thread_time(), time.perf_counter()
            calls[m]()
            times[m].append(time.thread_time() - start)
            walls[m].append(time.perf_counter() - wall)
    result: Dict[str, object] = {
        "params": params,
        "threads": threads,
        "reps": reps,
        "clock": "thread CPU time",
        "median_s": {m: statistics.median(t) for m, t in times.items()},
        "min_s": {m: min(t) for m, t in times.items()},
        "wall_median_s": {m: statistics.median(t) for m, t in walls.items()},
    }
    if "torch" in times and "secure" in times:
        result["ratio_median"] = result["median_s"]["secure"] / result["median_s"]["torch"]
        result["ratio_min"] = result["min_s"]["secure"] / result["min_s"]["torch"]
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=10_000_000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--json", default=None, help="write the result to this file")
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"--methods: unknown {unknown}; accepted values: {', '.join(METHODS)}")
    result = measure(args.params, args.reps, args.threads, methods=methods)
    print(f"noise for {args.params:,} float32 parameters, {args.threads} thread(s), "
          f"{args.reps} interleaved repetitions")
    for m in methods:
        print(f"  {m:22s} CPU median {result['median_s'][m] * 1e3:7.1f} ms   "
              f"min {result['min_s'][m] * 1e3:7.1f} ms   "
              f"(wall median {result['wall_median_s'][m] * 1e3:7.1f} ms)")
    if "ratio_median" in result:
        print(f"  secure / torch: {result['ratio_median']:.2f}x (median), "
              f"{result['ratio_min']:.2f}x (min); target <= 5x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
