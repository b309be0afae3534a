"""Choosing ``bands``: the noise in the model (the running sum of updates) at equal epsilon.

For each ``b``, sigma is calibrated by ``rc_prv`` for ``steps`` steps at the rate inside a part
(``b * q``, exact clipping), and the noise of the running sum after the banded factorisation is

    error(b) = sigma_b * sqrt(mean_t ||(A C_b^-1)[t, :]||^2)      (per coordinate, in units of C),

A the prefix-sum matrix; ``b = 1`` is DP-SGD (``C = I``). The table gives each ``b``'s error
relative to ``b = 1``: below 1, banded noise leaves less noise in the model at the same epsilon.
The second figure of each cell uses coefficients optimised for the run's steps
(:func:`~opacus_rc.correlated.optimized_banded_coefficients`) instead of the banded square root.
It is the mechanism's side only (what the optimiser does with the noise is the utility study's,
docs/correlated_noise.md).

    python -m benchmarks.banded_error                    # 4 settings, a few minutes
    python -m benchmarks.banded_error --out docs/results/banded_error.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from typing import Dict, List, Sequence

import torch
from tqdm import tqdm

from opacus_rc.accounting.accountant import get_noise_multiplier_rc
from opacus_rc.correlated import (
    banded_matrix, banded_sqrt_coefficients, max_column_norm, optimized_banded_coefficients,
)

logger = logging.getLogger(__name__)

#: (epsilon, epochs, steps per epoch): delta 1e-5
SETTINGS = ((3.0, 1, 100), (3.0, 5, 100), (8.0, 1, 100), (8.0, 5, 100))
BANDS = (1, 2, 4, 8, 16, 32)


def prefix_sum_rms(coefficients: Sequence[float], steps: int) -> float:
    """``sqrt(mean_t ||(A C^-1)[t, :]||^2)``: the per-coordinate noise std of the running sum,
    averaged over the steps, for unit ``z`` (float64)."""
    c = banded_matrix(coefficients, steps)
    a = torch.tril(torch.ones(steps, steps, dtype=torch.float64))
    b = torch.linalg.solve_triangular(c, a, upper=False, left=False)  # B = A C^-1
    return math.sqrt(b.pow(2).sum().item() / steps)


def banded_errors(epsilon: float, epochs: int, per_epoch: int, bands: Sequence[int] = BANDS,
                  delta: float = 1e-5) -> List[Dict[str, float]]:
    """One row per ``b`` (at most the draws of an epoch): sigma, rounds and the running sum's noise."""
    steps, q = epochs * per_epoch, 1.0 / per_epoch
    rows = []
    for b in [b for b in bands if b <= per_epoch]:
        coefficients = banded_sqrt_coefficients(b)
        zeta = max_column_norm(coefficients)
        sigma = get_noise_multiplier_rc(
            target_epsilon=epsilon, target_delta=delta, sample_rate=b * q, steps=steps, bands=b, column_norm=zeta,
        )
        optimized = optimized_banded_coefficients(b, steps)  # sigma: both have column norm 1
        rows.append({"bands": b, "sigma": sigma, "rounds": math.ceil(steps / b),
                     "error": sigma * prefix_sum_rms(coefficients, steps),
                     "optimized_error": sigma * prefix_sum_rms(optimized, steps)})
    for row in rows:
        row["relative"] = row["error"] / rows[0]["error"]
        row["optimized_relative"] = row["optimized_error"] / rows[0]["error"]
    return rows


def main(argv: Sequence[str] = ()) -> Dict[str, list]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(list(argv))
    results = {}
    for epsilon, epochs, per_epoch in tqdm(SETTINGS, desc="settings"):
        results[f"eps={epsilon:g}, {epochs} epochs of {per_epoch} steps"] = banded_errors(epsilon, epochs, per_epoch)
    lines = ["| setting (δ = 1e-5) | " + " | ".join(f"b = {b}" for b in BANDS) + " |",
             "|---|" + "---|" * len(BANDS)]
    for name, rows in results.items():
        cells = {r["bands"]: f"{r['relative']:.3f} / {r['optimized_relative']:.3f} (σ {r['sigma']:.2f})" for r in rows}
        lines.append(f"| {name} | " + " | ".join(cells.get(b, "–") for b in BANDS) + " |")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    import sys

    logging.basicConfig(level=logging.INFO)
    main(sys.argv[1:])
