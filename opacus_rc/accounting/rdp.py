"""Rényi DP curves of one run, for the accounting of a private hyperparameter search.

``rdp(alpha) = log E_Q[(P/Q)^alpha] / (alpha - 1)`` at the orders :data:`ORDERS`
(dp_accounting's default grid).

* **Deterministic clipping**: the Poisson-subsampled Gaussian, as dp_accounting computes it
  (Mironov, Talwar and Zhang 2019): exact at integer orders,
  ``A_a = sum_i C(a,i) q^i (1-q)^(a-i) e^((i^2-i)/(2 sigma^2))``; at fractional orders the
  series of their Sec. 3.3 with every term taken in absolute value (an upper bound on the
  exact divergence: 7% above it at order 1.1 for sigma 1, q 0.01), cut where dp_accounting
  cuts it. Equal to dp_accounting's ``_compute_rdp_poisson_subsampled_gaussian`` to rounding.
* **Randomized clipping**: the contribution of the differing example has norm ``Z C`` with
  ``Z`` the envelope variable (docs/accounting.md), binned with every bin rounded up (a
  dominating mechanism: Rényi divergences are f-divergences, ordered as the tradeoff curves).
  With ``Z`` revealed (a shared sketch): ``exp((a-1) rdp) = sum_j p_j A_a(q, sigma/z_j)``, exact
  per bin (each bin's reverse divergence is the smaller, Mironov, Talwar and Zhang 2019, as for
  deterministic clipping, so the mixture's is too). With ``Z`` hidden (per-example sketches): ``P = (1-q) N(0,1) + q sum_j p_j
  N(z_j/sigma, 1)`` against ``N(0,1)``, integrated numerically, the larger of the two orders of
  the pair. Hiding is post-processing, so hidden <= revealed. Z's envelope is heavy-tailed
  (``P(Z > z) ~ z^-k``), and the high orders of the curve see the largest bins: randomized
  clipping's RDP is far looser than its PRV (docs/tuning.md). The mass of ``Z`` beyond the
  cut-off ``z_max`` is not in the curve: ``Z`` is capped at ``z_max`` (that mass sits on the
  last bin) and the runs where the cap binds are paid in delta (:mod:`.search`).
  Fractional orders take the curve's value at the next integer (Rényi divergences grow with
  the order): conservative.
* The conversion to ``(epsilon, delta)`` is dp_accounting's (Canonne, Kamath and Steinke 2020,
  Prop. 12; the KL bound ``delta <= sqrt(1 - e^-rdp)`` where it is better).
"""

from __future__ import annotations

import math
from typing import Dict, Sequence, Tuple

import numpy as np
from scipy import special

from .prv.mixtures import SensitivityMixture

#: dp_accounting's default Rényi orders: 1.1 to 10.9 by 0.1, 11 to 63, 128, 256, 512, 1024.
ORDERS: Tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024])
#: terms of the fractional-order series before dp_accounting gives up on an order (inf)
_MAX_TERMS = 1000
#: hidden Z: orders ``a`` with ``a * z_max / sigma`` above this get an infinite bound (not integrated)
HIDDEN_MAX_SPAN = 2000.0
#: hidden Z: added to every log-moment (the quadrature's error is far below it)
HIDDEN_SLACK = 1e-9


def _orders(orders: Sequence[float]) -> np.ndarray:
    out = np.asarray(orders, dtype=float)
    if out.ndim != 1 or out.size == 0 or not np.all(out > 1.0):
        raise ValueError(f"orders={orders!r}; accepted values: a non-empty sequence of Rényi orders > 1")
    return out


def _lse(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """``log sum exp`` along ``axis`` (rows of -inf give -inf)."""
    top = np.max(x, axis=axis, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return np.squeeze(top, axis=axis) + np.log(np.sum(np.exp(x - top), axis=axis))


def _log_a_int(q: float, sigmas: np.ndarray, alpha: int) -> np.ndarray:
    """``log A_alpha`` at integer ``alpha`` for each noise multiplier of ``sigmas`` (exact)."""
    i = np.arange(alpha + 1, dtype=float)
    log_coef = special.gammaln(alpha + 1) - special.gammaln(i + 1) - special.gammaln(alpha - i + 1)
    base = log_coef + i * math.log(q) + (alpha - i) * math.log1p(-q)
    terms = base[None, :] + (i * i - i)[None, :] / (2.0 * sigmas[:, None] ** 2)
    return _lse(terms, axis=1)


def _log_a_frac(q: float, sigma: float, alpha: float) -> float:
    """``log A_alpha`` at fractional ``alpha``: dp_accounting's two series (terms in absolute
    value), summed until both decrease and are ``e^-30`` below the total; inf if that takes
    more than :data:`_MAX_TERMS` terms (dp_accounting then excludes the order the same way)."""
    i = np.arange(_MAX_TERMS, dtype=float)
    j = alpha - i
    z0 = sigma**2 * math.log(1.0 / q - 1.0) + 0.5
    log_coef = special.gammaln(alpha + 1) - special.gammaln(i + 1) - special.gammaln(j + 1)
    log_q, log_1mq = math.log(q), math.log1p(-q)
    log_e0 = special.log_ndtr((z0 - i) / sigma)  # log(erfc((i - z0) / (sqrt(2) sigma)) / 2)
    log_e1 = special.log_ndtr((j - z0) / sigma)
    s0 = log_coef + i * log_q + j * log_1mq + (i * i - i) / (2.0 * sigma**2) + log_e0
    s1 = log_coef + j * log_q + i * log_1mq + (j * j - j) / (2.0 * sigma**2) + log_e1
    total = np.logaddexp(np.logaddexp.accumulate(s0), np.logaddexp.accumulate(s1))
    falling = np.zeros(_MAX_TERMS, dtype=bool)
    falling[1:] = (s0[1:] < s0[:-1]) & (s1[1:] < s1[:-1])
    done = np.nonzero(falling & (np.maximum(s0, s1) < total - 30.0))[0]
    return float(total[done[0]]) if done.size else math.inf


def subsampled_gaussian_rdp(q: float, sigma: float, orders: Sequence[float] = ORDERS) -> np.ndarray:
    """RDP of one step of the Poisson-subsampled Gaussian (rate ``q``, noise ``sigma``
    in units of the sensitivity) at ``orders``: ``log A_a / (a - 1)`` (module docstring)."""
    a = _orders(orders)
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"sample_rate={q!r}; accepted values: a real in [0, 1]")
    if not sigma >= 0.0:
        raise ValueError(f"noise_multiplier={sigma!r}; accepted values: a real >= 0")
    if q == 0.0:
        return np.zeros_like(a)
    if sigma == 0.0:
        return np.full_like(a, math.inf)
    if q == 1.0:
        return a / (2.0 * sigma**2)
    out = np.empty_like(a)
    for n, alpha in enumerate(a):
        if float(alpha).is_integer():
            out[n] = _log_a_int(q, np.array([sigma]), int(alpha))[0] / (alpha - 1.0)
        else:
            out[n] = _log_a_frac(q, sigma, float(alpha)) / (alpha - 1.0)
    return out


def _capped(mixture: SensitivityMixture) -> Tuple[np.ndarray, np.ndarray]:
    """The bins' values and log masses with Z capped at the last bin (``p_inf`` added to it)."""
    z = np.asarray(mixture.z, dtype=float)
    p = np.asarray(mixture.p, dtype=float).copy()
    p[-1] += mixture.p_inf
    with np.errstate(divide="ignore"):
        return z, np.log(p)


def _revealed_log_moments(q: float, sigma: float, mixture: SensitivityMixture, alphas: Sequence[int]) -> Dict[int, float]:
    """``log E[(P/Q)^a]`` with Z revealed: ``log sum_j p_j A_a(q, sigma / z_j)`` (exact per bin)."""
    z, log_p = _capped(mixture)
    sigmas = sigma / z
    out = {}
    for alpha in alphas:
        log_a = (alpha - 1.0) * alpha / (2.0 * sigmas**2) if q == 1.0 else _log_a_int(q, sigmas, alpha)
        out[alpha] = float(_lse(log_p + log_a))
    return out


def _hidden_log_moments(q: float, sigma: float, mixture: SensitivityMixture, alphas: Sequence[int]) -> Dict[int, float]:
    """With Z hidden, ``P = (1-q) N(0,1) + q sum_j p_j N(mu_j, 1)`` (``mu_j = z_j / sigma``) and
    ``Q = N(0,1)``: ``log max(E_Q[(P/Q)^a], E_Q[(P/Q)^(1-a)])`` (both orders of the pair), by the
    trapezoid rule on ``[-40, a mu_max + 40]``. At integer ``a`` the first integrand is entire and
    the second analytic in a strip of half-width about ``pi / mu_max``, so with the step
    ``h = min(0.05, 0.3 / mu_max)`` the rule's error is below ``e^-100`` relative; outside the
    interval the integrands hold less than ``e^-700`` of their mass. ``HIDDEN_SLACK`` is added.
    Orders with ``a mu_max > HIDDEN_MAX_SPAN`` get inf (a valid, useless bound)."""
    z, log_p = _capped(mixture)
    mu = z / sigma
    span = [a for a in alphas if a * mu.max() <= HIDDEN_MAX_SPAN]
    out = {a: math.inf for a in alphas}
    if not span:
        return out
    h = min(0.05, 0.3 / float(mu.max()))
    x = np.arange(-40.0, max(span) * float(mu.max()) + 40.0 + h, h)
    log_g = np.empty_like(x)
    for start in range(0, x.size, 4096):  # blocks of the (points x bins) exponent
        xs = x[start:start + 4096]
        log_g[start:start + 4096] = _lse(log_p[None, :] + xs[:, None] * mu[None, :] - 0.5 * mu**2, axis=1)
    log_ratio = log_g if q == 1.0 else np.logaddexp(math.log1p(-q), math.log(q) + log_g)  # log P/Q
    log_w = -0.5 * x**2 - 0.5 * math.log(2.0 * math.pi) + math.log(h)
    for a in span:
        forward = _lse(log_w + a * log_ratio)
        backward = _lse(log_w + (1.0 - a) * log_ratio)
        out[a] = float(max(forward, backward)) + HIDDEN_SLACK
    return out


def mixture_rdp(q: float, sigma: float, mixture: SensitivityMixture, orders: Sequence[float] = ORDERS) -> np.ndarray:
    """RDP of one randomized-clipping step, Z capped at the mixture's last bin (``mixture.p_inf``
    added to it): ``log E[(P/Q)^a] / (a - 1)`` with Z revealed (closed form per bin) or, when
    ``mixture.hidden``, hidden (per-example sketches; numerical integration, both orders of the
    pair), at integer orders; a fractional order takes the value at ``ceil(a)`` (module
    docstring). A deterministic mixture (``Z = 1``) is :func:`subsampled_gaussian_rdp`."""
    a = _orders(orders)
    if mixture.z == (1.0,) and mixture.p_inf == 0.0:
        return subsampled_gaussian_rdp(q, sigma, a)
    if not (0.0 <= q <= 1.0 and sigma > 0.0):
        raise ValueError(f"sample_rate={q!r}, noise_multiplier={sigma!r}; accepted values: q in [0, 1], sigma > 0")
    if q == 0.0:
        return np.zeros_like(a)
    integers = sorted({int(math.ceil(x)) for x in a})
    moments = (_hidden_log_moments if mixture.hidden else _revealed_log_moments)(q, sigma, mixture, integers)
    return np.array([moments[int(math.ceil(x))] / (math.ceil(x) - 1.0) for x in a])


def rdp_epsilon(orders: Sequence[float], rdp: Sequence[float], delta: float) -> Tuple[float, float]:
    """``(epsilon, order)``: the smallest epsilon at ``delta`` over the orders,
    ``rdp + log(1 - 1/a) - log(delta a) / (a - 1)`` (0 where the KL bound
    ``delta^2 >= 1 - e^-rdp`` holds), as dp_accounting's ``compute_epsilon``."""
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta={delta!r}; accepted values: a real in (0, 1)")
    best, best_order = math.inf, float(orders[0])
    for a, r in zip(orders, rdp):
        if r < 0 or delta**2 + math.expm1(-r) > 0:
            eps = 0.0
        elif a > 1.01:
            eps = r + math.log1p(-1.0 / a) - math.log(delta * a) / (a - 1.0)
        else:
            eps = math.inf
        if eps < best:
            best, best_order = eps, float(a)
    return max(0.0, best), best_order


def rdp_delta(orders: Sequence[float], rdp: Sequence[float], epsilon: float) -> Tuple[float, float]:
    """``(delta, order)``: the smallest delta at ``epsilon`` over the orders, the minimum of
    ``sqrt(1 - e^-rdp)`` and ``e^((a-1)(rdp - eps + log(1 - 1/a))) / a``, as dp_accounting's
    ``compute_delta``."""
    if not epsilon >= 0.0:
        raise ValueError(f"epsilon={epsilon!r}; accepted values: a real >= 0")
    best, best_order = math.inf, float(orders[0])
    for a, r in zip(orders, rdp):
        if r <= 0:
            log_delta = -math.inf
        else:
            log_delta = 0.5 * math.log1p(-math.exp(-r))
        if a > 1.01:
            log_delta = min(log_delta, (a - 1.0) * (r - epsilon + math.log1p(-1.0 / a)) - math.log(a))
        if log_delta < best:
            best, best_order = log_delta, float(a)
    return min(math.exp(best), 1.0), best_order


__all__ = ["ORDERS", "mixture_rdp", "rdp_delta", "rdp_epsilon", "subsampled_gaussian_rdp"]
