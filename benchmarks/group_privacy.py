"""Group privacy of an example-level run: epsilon per person with up to k rows.

``python -m benchmarks.group_privacy`` prints, for exact clipping at ``--sigma``, ``--q``,
``--steps``, ``--delta`` and each k of ``--ks``: the example-level epsilon times k (not a
valid bound at the same delta), the group-privacy theorem's bound ((eps, delta)-DP gives
(k eps, k e^{(k-1) eps} delta); eps from Opacus's RDP accountant, the delta split chosen on a
log grid to minimise it) and ``group_epsilon`` (the exact mixture over J ~ Bin(k, q)).
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

from opacus_rc.accounting import RCPRVAccountant, group_epsilon

ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 1025))


def theorem_bound(sigma: float, q: float, steps: int, delta: float, k: int) -> float:
    """Smallest ``k eps_1(delta_1)`` with ``k e^{(k-1) eps_1} delta_1 <= delta`` (RDP eps_1)."""
    rdp = compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=ORDERS)
    best = math.inf
    for log_d1 in np.linspace(math.log(delta), -700.0, 2000):
        eps_1, _ = get_privacy_spent(orders=ORDERS, rdp=rdp, delta=math.exp(log_d1))
        if math.log(k) + (k - 1) * eps_1 + log_d1 <= math.log(delta):
            best = min(best, k * eps_1)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--q", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 5, 10, 50])
    args = parser.parse_args()
    acc = RCPRVAccountant()
    acc.history = [(args.sigma, args.q, args.steps, None)]
    eps_1 = acc.get_epsilon(args.delta)
    print(f"sigma={args.sigma} q={args.q} steps={args.steps} delta={args.delta} (exact clipping)")
    print(f"{'k':>4} {'k*eps_1':>10} {'theorem':>10} {'group_epsilon':>14} {'seconds':>8}")
    for k in args.ks:
        start = time.perf_counter()
        eps_k = group_epsilon(acc.history, args.delta, k, bin_ratio=acc.bin_ratio)
        seconds = time.perf_counter() - start
        bound = theorem_bound(args.sigma, args.q, args.steps, args.delta, k)
        print(f"{k:>4} {k * eps_1:>10.2f} {bound:>10.2f} {eps_k:>14.2f} {seconds:>8.1f}")


if __name__ == "__main__":
    main()
