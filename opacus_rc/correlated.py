"""The mathematics of banded matrix factorisation noise (``noise="banded"``; its mechanism:
:mod:`opacus_rc.noises.banded`).

DP-SGD releases ``x_t + z_t`` with fresh noise ``z_t`` at every step, and the model is the
running sum ``A x̂`` (A: the lower-triangular matrix of ones). A factorisation ``A = B C``
releases instead ``x̂ = x + C⁻¹ z``, so the model holds ``A x + B z``: with a good ``C`` much
of the noise cancels in the running sum. Here ``C`` is lower-triangular banded Toeplitz with
``b`` coefficients ``c_0 .. c_{b-1}``. The default coefficients are the banded square root of
``A`` (Kalinin and Lampert, 2024): those of ``(1 - x)^(-1/2)`` cut at ``b`` terms, divided by
their norm, so every column of ``C`` has norm at most 1.

Privacy (Choquette-Choo et al., 2023, amplified BandMF): when a unit can only be drawn at
steps ``b`` apart (cyclic Poisson sampling, :class:`~opacus_rc.units.CyclicPoissonSampler`),
the columns of ``C`` it touches are disjoint and the mechanism is accounted as DP-SGD with the
rate inside a part, over the rounds a unit can take part in (``ceil(steps / b)``), with
``sigma / max_column_norm(C)`` (:meth:`opacus_rc.accounting.records.StepRecord.reduced`).
"""

from __future__ import annotations

import math
import sys
from typing import List, Sequence, Tuple

import torch

from .values import check_count


def banded_sqrt_coefficients(bands: int) -> Tuple[float, ...]:
    """The banded square root's ``b`` coefficients: ``(1 - x)^(-1/2) = sum_j c_j x^j`` with
    ``c_0 = 1, c_j = c_{j-1} (2j - 1) / (2j)``, cut at ``b`` terms and divided by their
    Euclidean norm (every column of ``C`` then has norm <= 1, the first ones exactly 1)."""
    bands = check_count(bands, "bands")
    coefficients = [1.0]
    for j in range(1, bands):
        coefficients.append(coefficients[-1] * (2 * j - 1) / (2 * j))
    norm = math.sqrt(sum(c * c for c in coefficients))
    return tuple(c / norm for c in coefficients)


def max_column_norm(coefficients: Sequence[float]) -> float:
    """``max_t ||C[:, t]||_2`` of the banded Toeplitz ``C`` (the sensitivity of ``C x`` to one
    participation of norm 1): the norm of a full column, ``sqrt(sum_j c_j^2)`` (an upper bound
    for runs shorter than ``b`` steps), rounded up by a few ulps (never below the exact norm)."""
    return math.sqrt(math.fsum(float(c) ** 2 for c in coefficients)) * (1.0 + 4.0 * sys.float_info.epsilon)


def banded_matrix(coefficients: Sequence[float], steps: int) -> torch.Tensor:
    """The ``steps x steps`` lower-triangular banded Toeplitz ``C`` (float64), for tests and docs."""
    c = torch.zeros(steps, steps, dtype=torch.float64)
    for j, value in enumerate(coefficients):
        if j < steps:
            c += torch.diag(torch.full((steps - j,), float(value), dtype=torch.float64), -j)
    return c


def prefix_sum_error(coefficients: torch.Tensor, steps: int) -> torch.Tensor:
    """``||A C^-1||_F^2`` for the banded Toeplitz ``C`` of ``coefficients`` over ``steps`` steps
    (differentiable, O(steps x b)): ``C^-1`` is lower-triangular Toeplitz with the inverse series
    ``d`` (``d_0 = 1 / c_0``, ``d_k = -sum_{j>=1} c_j d_{k-j} / c_0``), ``A C^-1`` with its prefix
    sums ``e``, and the squared Frobenius norm is ``sum_k (steps - k) e_k^2``."""
    b = coefficients.shape[0]
    d = [1.0 / coefficients[0]]
    for k in range(1, steps):
        terms = [coefficients[j] * d[k - j] for j in range(1, min(k, b - 1) + 1)]
        d.append(-sum(terms) / coefficients[0] if terms else coefficients.new_zeros(()))
    e = torch.cumsum(torch.stack(d), 0)
    weights = torch.arange(steps, 0, -1, dtype=coefficients.dtype)
    return (weights * e**2).sum()


def optimized_banded_coefficients(bands: int, steps: int, iterations: int = 60) -> Tuple[float, ...]:
    """Banded Toeplitz coefficients that minimise the running sum's noise ``||A C^-1||_F^2`` over
    ``steps`` steps at column norm 1 (BandMF's objective restricted to Toeplitz ``C``), by L-BFGS
    from the banded square root (float64); never worse than it."""
    start = torch.tensor(banded_sqrt_coefficients(bands), dtype=torch.float64)
    if bands == 1:
        return tuple(start.tolist())
    theta = start.clone().requires_grad_(True)
    solver = torch.optim.LBFGS([theta], max_iter=iterations, line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        solver.zero_grad()
        value = prefix_sum_error(theta / theta.norm(), steps)
        value.backward()
        return value

    solver.step(loss)
    found = (theta / theta.norm()).detach()
    if not (found[0] > 0 and prefix_sum_error(found, steps) < prefix_sum_error(start, steps)):  # (NaN: diverged)
        return tuple(start.tolist())
    return tuple(found.tolist())


__all__: List[str] = [
    "banded_matrix", "banded_sqrt_coefficients", "max_column_norm", "optimized_banded_coefficients", "prefix_sum_error",
]
