"""Exact epsilon of the audited pair, computed independently of the accountant.

On the canary's entry the step releases ``N(0, 1)`` without the canary and ``E_Z N(Z / sigma,
1)`` with it (units of ``sigma C``, Z hidden); the likelihood ratio increases in x, so
``delta(eps) = P(X > x_eps) - e^eps Q(X > x_eps)`` (and the mirror image), and epsilon at
delta is found by bisection. Z per variant and the side paths' mixtures: docs/audit.md,
"Exact reference".
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import numpy as np
from scipy.special import log_ndtr, logsumexp
from scipy.stats import binom, chi2

from ..values import HUTCHPP


def sensitivity_atoms(
    estimator: str, sketch_size: int, variant: str, canary_norm: float, m: int = 4000
) -> np.ndarray:
    """Equally likely values of the canary's contribution Z (units of C)."""
    if variant == "data_dependent_sketch":
        return np.array([float(canary_norm)])
    factor = 2.0 if variant == "biased_low" else 1.0
    if estimator == HUTCHPP:
        return np.array([factor])
    w = chi2.ppf((np.arange(m) + 0.5) / m, sketch_size) / sketch_size
    return np.minimum(factor / np.sqrt(w), canary_norm)


def bisect(up: Callable[[float], bool], lo: float, hi: float, halvings: int) -> Tuple[float, float]:
    """``[lo, hi]`` halved ``halvings`` times, keeping the upper half where ``up(mid)``."""
    for _ in range(halvings):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if up(mid) else (lo, mid)
    return lo, hi


def _log_ratio(x: np.ndarray, mu: np.ndarray, log_w: np.ndarray) -> np.ndarray:
    """``log L(x) = log sum_i w_i exp(x mu_i - mu_i^2 / 2)``, for each x."""
    return logsumexp(x[:, None] * mu[None, :] - 0.5 * mu[None, :] ** 2 + log_w[None, :], axis=1)


def _solve_x(level: float, mu: np.ndarray, log_w: np.ndarray) -> float:
    """``x`` with ``log L(x) = level`` (L increasing)."""
    lo, hi = bisect(lambda x: not _log_ratio(np.array([x]), mu, log_w)[0] > level, -60.0, 60.0 + float(mu.max()), 64)
    return 0.5 * (lo + hi)


def _delta(eps: float, mu: np.ndarray, log_w: np.ndarray) -> float:
    """``max`` over the two orders of the pair of the hockey-stick divergence."""
    # with the canary vs without: P(X > x) - e^eps Q(X > x)
    x = _solve_x(eps, mu, log_w)
    log_p_tail = float(logsumexp(log_ndtr(mu - x) + log_w))
    first = math.exp(log_p_tail) - float(np.exp(eps + float(log_ndtr(-x))))
    # without vs with: Q(X < y) - e^eps P(X < y), with log L(y) = -eps
    y = _solve_x(-eps, mu, log_w)
    log_p_low = float(logsumexp(log_ndtr(y - mu) + log_w))
    second = math.exp(float(log_ndtr(y))) - float(np.exp(eps + log_p_low))
    return max(first, second, 0.0)


def mixture_epsilon(mu: np.ndarray, delta: float, log_w: Optional[np.ndarray] = None) -> float:
    """Epsilon at ``delta`` of ``N(0, 1)`` against the mixture ``sum_i w_i N(mu_i, 1)``
    (``mu >= 0``; log-weights ``log_w``, None: equal weights), both orders of the pair."""
    mu = np.asarray(mu, dtype=float)
    log_w = np.full(mu.shape, -math.log(mu.size)) if log_w is None else np.asarray(log_w, dtype=float)
    if _delta(0.0, mu, log_w) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while _delta(hi, mu, log_w) > delta:
        lo, hi = hi, 2.0 * hi
        if hi > 600.0:
            return math.inf
    return bisect(lambda eps: _delta(eps, mu, log_w) > delta, lo, hi, 40)[1]


def exact_epsilon(
    estimator: str, sketch_size: int, sigma: float, variant: str, delta: float, canary_norm: float = 100.0
) -> float:
    """Epsilon at ``delta`` of the audited step for the canary pair (see module doc)."""
    return mixture_epsilon(sensitivity_atoms(estimator, sketch_size, variant, canary_norm) / sigma, delta)


def accumulation_exact_epsilon(
    estimator: str, sketch_size: int, sigma: float, micro_batches: int, sample_rate: float, delta: float,
    canary_norm: float = 100.0, m: int = 1000,
) -> float:
    """Epsilon at ``delta`` of ``N(0, 1)`` against ``E_{J, Z} N(J Z / sigma, 1)``, J ~
    Bin(micro_batches, sample_rate) and Z as for the honest one-step pair (both hidden)."""
    z = sensitivity_atoms(estimator, sketch_size, "honest", canary_norm, m)
    j = np.arange(micro_batches + 1)
    log_pj = binom.logpmf(j, micro_batches, sample_rate)
    mu = (j[:, None] * z[None, :]).ravel() / sigma
    log_w = (log_pj[:, None] - math.log(z.size) + np.zeros((1, z.size))).ravel()
    keep = np.isfinite(log_w)
    return mixture_epsilon(mu[keep], delta, log_w[keep])


def composed_sum_epsilon(
    estimator: str, sketch_size: int, sigma: float, steps: int, delta: float, canary_norm: float = 100.0,
    draws: int = 20000, seed: int = 0,
) -> float:
    """Epsilon at ``delta`` of ``N(0, 1)`` against ``E N(sum_s Z_s / (sigma sqrt(steps)), 1)``,
    Z_s i.i.d. and hidden (fresh sketches): a Monte Carlo quadrature over ``draws`` sums."""
    rng = np.random.default_rng(seed)
    if estimator == HUTCHPP:
        total = np.full(draws, float(steps))
    else:
        w = rng.chisquare(sketch_size, size=(draws, steps)) / sketch_size
        total = np.minimum(1.0 / np.sqrt(w), canary_norm).sum(axis=1)
    return mixture_epsilon(total / (sigma * math.sqrt(steps)), delta)


def normaliser_exact_epsilon(
    output_dim: int, normaliser_in: float, normaliser_out: float, delta: float
) -> float:
    """Exact epsilon at ``delta`` of ``N(0, s_in^2 I_p)`` against ``N(0, s_out^2 I_p)``,
    ``s = sigma C / normaliser``, both orders (0 when the normalisers agree): thresholds on
    ``r = ||x||^2`` (scaled chi-square laws) are optimal, ``delta(eps) = P(r > r_eps) -
    e^eps Q(r > r_eps)`` for the wider law P (and the mirror image); eps by bisection."""
    if normaliser_in == normaliser_out:
        return 0.0
    wide, narrow = sorted((float(normaliser_in), float(normaliser_out)))  # smaller B: wider
    p = output_dim
    # variances (units of sigma C): v_w = 1 / wide^2 > v_n = 1 / narrow^2
    v_w, v_n = 1.0 / wide**2, 1.0 / narrow**2
    a = 0.5 * (1.0 / v_n - 1.0 / v_w)  # log L(r) = a r + p/2 log(v_n / v_w) (P=wide over Q=narrow)
    b = 0.5 * p * math.log(v_n / v_w)

    def delta_of(eps: float, wide_first: bool) -> float:
        if wide_first:  # the loss of "wide over narrow" exceeds eps iff r > r_eps
            r = (eps - b) / a
            return math.exp(chi2.logsf(r / v_w, p)) - math.exp(eps + chi2.logsf(r / v_n, p))
        r = (-eps - b) / a  # the loss of "narrow over wide" exceeds eps iff r < r_eps
        if r <= 0:
            return 0.0
        return math.exp(chi2.logcdf(r / v_n, p)) - math.exp(eps + chi2.logcdf(r / v_w, p))

    best = 0.0
    for wide_first in (True, False):
        hi = 1.0
        while delta_of(hi, wide_first) > delta and hi < 512.0:
            hi *= 2.0
        if delta_of(0.0, wide_first) > delta:
            best = max(best, bisect(lambda eps: delta_of(eps, wide_first) > delta, 0.0, hi, 100)[1])
    return best
