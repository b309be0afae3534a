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

The side-path audits (:mod:`opacus_rc.audit.paths`) use the same computation with weighted
atoms (:func:`mixture_epsilon`): ``J Z / sigma`` with ``J ~ Bin(m, q)`` for a canary in
several micro-batches of one step (:func:`accumulation_exact_epsilon`), and the sum over S
fresh steps (:func:`composed_sum_epsilon`, Monte Carlo).
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
from scipy.special import log_ndtr, logsumexp
from scipy.stats import binom, chi2


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


def _log_weights(mu: np.ndarray, log_w: Optional[np.ndarray]) -> np.ndarray:
    """Log-weights of the atoms ``mu`` (None: equal weights)."""
    if log_w is None:
        return np.full(mu.shape, -math.log(mu.size))
    return np.asarray(log_w, dtype=float)


def _log_ratio(x: np.ndarray, mu: np.ndarray, log_w: Optional[np.ndarray] = None) -> np.ndarray:
    """``log L(x)`` for means ``mu`` with log-weights ``log_w`` (None: equal weights)."""
    a = x[:, None] * mu[None, :] - 0.5 * mu[None, :] ** 2 + _log_weights(mu, log_w)[None, :]
    return logsumexp(a, axis=1)


def _solve_x(level: float, mu: np.ndarray, log_w: Optional[np.ndarray] = None) -> float:
    """``x`` with ``log L(x) = level`` (bisection; L increasing)."""
    lo, hi = -60.0, 60.0 + float(mu.max())
    for _ in range(64):
        mid = 0.5 * (lo + hi)
        if _log_ratio(np.array([mid]), mu, log_w)[0] > level:
            hi = mid
        else:
            lo = mid
    return 0.5 * (lo + hi)


def _delta(eps: float, mu: np.ndarray, log_w: Optional[np.ndarray] = None) -> float:
    """``max`` over the two orders of the pair of the hockey-stick divergence."""
    lw = _log_weights(mu, log_w)
    # with the canary vs without: P(X > x) - e^eps Q(X > x)
    x = _solve_x(eps, mu, lw)
    log_p_tail = float(logsumexp(log_ndtr(mu - x) + lw))
    first = math.exp(log_p_tail) - float(np.exp(eps + float(log_ndtr(-x))))
    # without vs with: Q(X < y) - e^eps P(X < y), with log L(y) = -eps
    y = _solve_x(-eps, mu, lw)
    log_p_low = float(logsumexp(log_ndtr(y - mu) + lw))
    second = math.exp(float(log_ndtr(y))) - float(np.exp(eps + log_p_low))
    return max(first, second, 0.0)


def mixture_epsilon(mu: np.ndarray, delta: float, log_w: Optional[np.ndarray] = None) -> float:
    """Epsilon at ``delta`` of ``N(0, 1)`` against the mixture ``sum_i w_i N(mu_i, 1)``
    (``mu >= 0``; log-weights ``log_w``, None: equal weights), both orders of the pair."""
    mu = np.asarray(mu, dtype=float)
    if _delta(0.0, mu, log_w) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while _delta(hi, mu, log_w) > delta:
        lo, hi = hi, 2.0 * hi
        if hi > 600.0:
            return math.inf
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if _delta(mid, mu, log_w) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def exact_epsilon(
    estimator: str,
    sketch_size: int,
    sigma: float,
    variant: str,
    delta: float,
    canary_norm: float = 100.0,
) -> float:
    """Epsilon at ``delta`` of the audited step for the canary pair (see module doc)."""
    return mixture_epsilon(sensitivity_atoms(estimator, sketch_size, variant, canary_norm) / sigma, delta)


def accumulation_exact_epsilon(
    estimator: str,
    sketch_size: int,
    sigma: float,
    micro_batches: int,
    sample_rate: float,
    delta: float,
    canary_norm: float = 100.0,
    m: int = 1000,
) -> float:
    """Epsilon at ``delta`` of the accumulation audit's pair: ``N(0, 1)`` against
    ``E_{J, Z} N(J Z / sigma, 1)``, ``J ~ Bin(micro_batches, sample_rate)`` copies of the
    canary (hidden), Z as for the honest one-step pair (hidden; one value for all copies:
    the micro-batches of a step share its sketch)."""
    z = sensitivity_atoms(estimator, sketch_size, "honest", canary_norm, m)
    j = np.arange(micro_batches + 1)
    log_pj = binom.logpmf(j, micro_batches, sample_rate)
    mu = (j[:, None] * z[None, :]).ravel() / sigma
    log_w = (log_pj[:, None] - math.log(z.size) + np.zeros((1, z.size))).ravel()
    keep = np.isfinite(log_w)
    return mixture_epsilon(mu[keep], delta, log_w[keep])


def composed_sum_epsilon(
    estimator: str,
    sketch_size: int,
    sigma: float,
    steps: int,
    delta: float,
    canary_norm: float = 100.0,
    draws: int = 20000,
    seed: int = 0,
) -> float:
    """Epsilon at ``delta`` of the sum test over ``steps`` steps with fresh sketches:
    ``N(0, 1)`` against ``E N(sum_s Z_s / (sigma sqrt(steps)), 1)``, Z_s i.i.d. (honest
    law, hidden). A Monte Carlo quadrature (``draws`` fixed-seed draws of the sum; good
    to ~1e-2). It is the epsilon of the statistic the audit uses, a lower bound on the
    epsilon of the whole ``steps``-step release."""
    rng = np.random.default_rng(seed)
    if estimator == "hutchpp":
        total = np.full(draws, float(steps))
    else:
        w = rng.chisquare(sketch_size, size=(draws, steps)) / sketch_size
        total = np.minimum(1.0 / np.sqrt(w), canary_norm).sum(axis=1)
    return mixture_epsilon(total / (sigma * math.sqrt(steps)), delta)
