"""Exact epsilon of the audited pair, computed independently of the accountant.

On the canary's gradient entry the step releases ``N(0, 1)`` without the canary and
``E_Z N(Z / sigma, 1)`` with it (units of ``sigma C``; Z hidden: the audit sees only the
released gradient, and no other entry depends on the canary). The likelihood ratio
``L(x) = E_Z exp(Z x / sigma - Z^2 / (2 sigma^2))`` increases in x, so

    delta(eps) = P(X > x_eps) - e^eps Q(X > x_eps),   L(x_eps) = e^eps

(and the mirror image for the other order of the pair); epsilon at delta is found by
bisection. Z per variant: honest Hutchinson ``min(sqrt(k / chi2_k), canary_norm)``;
honest Hutch++ 1 (a rank-1 gradient lies in its head); biased_low twice the honest Z;
data_dependent_sketch ``canary_norm`` (the estimate is 0: no clipping). The chi-square
law is discretised at ``m`` equal-probability midpoints (a quadrature, not a bound:
good to about 1e-3 in epsilon for m = 4000, enough to show where the accountant's and
the audit's numbers sit).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import log_ndtr, logsumexp
from scipy.stats import chi2


def sensitivity_atoms(
    estimator: str, sketch_size: int, variant: str, canary_norm: float, m: int = 4000
) -> np.ndarray:
    """Equally likely values of the canary's contribution Z (units of C)."""
    if variant == "data_dependent_sketch":
        return np.array([float(canary_norm)])
    factor = 2.0 if variant == "biased_low" else 1.0
    if estimator == "hutchpp":
        return np.array([factor])
    w = chi2.ppf((np.arange(m) + 0.5) / m, sketch_size) / sketch_size
    return np.minimum(factor / np.sqrt(w), canary_norm)


def _log_ratio(x: np.ndarray, mu: np.ndarray) -> np.ndarray:
    """``log L(x)`` for equally weighted means ``mu``."""
    a = x[:, None] * mu[None, :] - 0.5 * mu[None, :] ** 2
    return logsumexp(a, axis=1) - math.log(mu.size)


def _solve_x(level: float, mu: np.ndarray) -> float:
    """``x`` with ``log L(x) = level`` (bisection; L increasing)."""
    lo, hi = -60.0, 60.0 + float(mu.max())
    for _ in range(64):
        mid = 0.5 * (lo + hi)
        if _log_ratio(np.array([mid]), mu)[0] > level:
            hi = mid
        else:
            lo = mid
    return 0.5 * (lo + hi)


def _delta(eps: float, mu: np.ndarray) -> float:
    """``max`` over the two orders of the pair of the hockey-stick divergence."""
    # with the canary vs without: P(X > x) - e^eps Q(X > x)
    x = _solve_x(eps, mu)
    log_p_tail = float(logsumexp(log_ndtr(mu - x))) - math.log(mu.size)
    first = math.exp(log_p_tail) - float(np.exp(eps + float(log_ndtr(-x))))
    # without vs with: Q(X < y) - e^eps P(X < y), with log L(y) = -eps
    y = _solve_x(-eps, mu)
    log_p_low = float(logsumexp(log_ndtr(y - mu))) - math.log(mu.size)
    second = math.exp(float(log_ndtr(y))) - float(np.exp(eps + log_p_low))
    return max(first, second, 0.0)


def exact_epsilon(
    estimator: str,
    sketch_size: int,
    sigma: float,
    variant: str,
    delta: float,
    canary_norm: float = 100.0,
) -> float:
    """Epsilon at ``delta`` of the audited step for the canary pair (see module doc)."""
    mu = sensitivity_atoms(estimator, sketch_size, variant, canary_norm) / sigma
    if _delta(0.0, mu) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while _delta(hi, mu) > delta:
        lo, hi = hi, 2.0 * hi
        if hi > 600.0:
            return math.inf
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if _delta(mid, mu) > delta:
            lo = mid
        else:
            hi = mid
    return hi
