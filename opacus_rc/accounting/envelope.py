"""Envelope of the sensitivity multiplier Z of randomized clipping.

With an estimated squared norm ``n_hat = n * W``, ``W = sum_j w_j X_j / k``,
``X_j ~ chi2_k`` i.i.d. and ``w`` a convex combination chosen by the adversary, the
clipped contribution of one example has norm at most ``C * Z`` with ``Z = 1/sqrt(W)``.
Over-estimation (``Z < 1``) is credited nothing, so the envelope variable is

    Z* = max(1, sqrt(k / chi2_k)),   P(Z* > z) = sup_w P(W < 1/z^2)  for z >= 1.

The single-chi-square lower tail ``P(chi2_k / k < x)`` is the supremum for ``x <= 1``:
an adversarial search with an exact CDF (saddle-point contour inversion, Imhof and Monte
Carlo as second opinions; ``python -m tools.verify_envelope``, results in
``docs/envelope_verification.md``) found no weight vector exceeding it beyond rounding
(~1e-15 relative, attained next to the single-component vertex where both sides are the
same distribution) for every ``k`` in :data:`VERIFIED_K`. No safety margin is added: the
only numerical error on this side is that of ``scipy.stats.chi2.cdf`` (a few ulp), far
below the accountant's discretisation, which rounds every bin up.

For a ``k`` outside :data:`VERIFIED_K` the bound is the smaller of two rigorous ones
(given the claim for the verified ``d``): the Chernoff bound ``min_t e^{tx} (1 +
2t/k)^{-k/2}``, and the divisor rule: if ``d | k`` then ``chi2_k / k`` is the mean of
``k/d`` i.i.d. ``chi2_d / d``, so ``W = sum_j sum_i (w_j d/k) chi2_d^{(j,i)} / d`` is itself a
convex combination of ``chi2_d / d`` variables and ``sup_w P(W < x) <= P(chi2_d/d < x)`` for
the largest verified divisor ``d`` of ``k`` (``d = 1`` always qualifies).
For Hutch++ pass the residual's sketch count (``SketchConfig.sketch_size``: the head is
assumed known to the adversary).
"""

from __future__ import annotations

import logging

import numpy as np
from scipy import stats

logger = logging.getLogger(__name__)

__all__ = [
    "VERIFIED_K",
    "chernoff_lower_tail",
    "verified_divisor",
    "envelope_lower_tail",
    "envelope_sf",
    "envelope_cdf",
]

#: Sketch counts for which ``verify_envelope`` found no violation of the single-chi-square
#: claim on ``(0, 1]`` (all of 1..128, 192, 256, 512, 1024 and the large-k run 2048, 4096,
#: 10000, 16384, 32768, 65536, 100000; see ``docs/envelope_verification.md``). Kept equal to
#: ``K_MAIN + K_EXTRA + K_LARGE`` there (tested).
VERIFIED_K = (frozenset(range(1, 129)) | frozenset((192, 256, 512, 1024))
              | frozenset((2048, 4096, 10000, 16384, 32768, 65536, 100000)))

_warned_k: set = set()


def _check_k(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k <= 0:
        raise ValueError(f"k={k!r} is invalid; accepted values: a positive integer (sketch count)")
    return int(k)


def chernoff_lower_tail(x: np.ndarray, k: int) -> np.ndarray:
    """Chernoff bound on ``sup_w P(W < x)``: ``min_{t>=0} e^{t x} (1 + 2t/k)^{-k/2}``.

    The minimiser is ``t* = k/2 * (1/x - 1)`` for ``x < 1`` (bound 1 for ``x >= 1``),
    giving ``(x e^{1-x})^{k/2}``. Valid for every convex combination ``w``:
    ``E e^{-t W} = prod_j (1 + 2 t w_j / k)^{-k/2} <= (1 + 2t/k)^{-k/2}`` because
    ``log(1 + c w)`` is concave with value 0 at 0, hence subadditive over ``w``.
    """
    k = _check_k(k)
    x = np.asarray(x, dtype=float)
    out = np.ones_like(x)
    inside = (x > 0) & (x < 1)
    xi = x[inside]
    out[inside] = np.exp(0.5 * k * (np.log(xi) + 1.0 - xi))
    out[x <= 0] = 0.0
    return out


def verified_divisor(k: int) -> int:
    """Largest ``d`` in :data:`VERIFIED_K` dividing ``k`` (``k`` itself when verified)."""
    k = _check_k(k)
    return max(d for d in VERIFIED_K if d <= k and k % d == 0)


def _chi2_lower_tail(x: np.ndarray, d: int) -> np.ndarray:
    """``P(chi2_d/d < x)`` for ``x <= 1``, 1 above."""
    return np.where(x > 1.0, 1.0, stats.chi2.cdf(x * d, df=d))


def envelope_lower_tail(x: np.ndarray, k: int) -> np.ndarray:
    """Upper bound on ``sup_w P(W < x)``: ``P(chi2_k/k < x)`` for ``0 < x <= 1``.

    For ``k`` in :data:`VERIFIED_K` this is the single-chi-square tail (the supremum,
    verified numerically); otherwise ``min(Chernoff (x e^{1-x})^{k/2}, P(chi2_d/d < x))``
    with ``d`` = :func:`verified_divisor` (module docstring). For ``x <= 0`` it is 0; for
    ``x > 1`` it is 1 (the claim fails there and over-estimation is credited nothing).
    """
    k = _check_k(k)
    x = np.asarray(x, dtype=float)
    if k not in VERIFIED_K:
        d = verified_divisor(k)
        if k not in _warned_k:
            _warned_k.add(k)
            logger.warning("sketch count k=%d is outside the verified set; the randomized-clipping "
                           "envelope uses min(Chernoff bound, single chi2 tail of the verified "
                           "divisor d=%d), which is looser", k, d)
        return np.minimum(chernoff_lower_tail(x, k), _chi2_lower_tail(x, d))
    return _chi2_lower_tail(x, k)


def envelope_sf(z: np.ndarray, k: int) -> np.ndarray:
    """Survival function ``P(Z* > z)`` of the envelope variable ``Z*``.

    For ``z < 1`` it is 1 (``Z* >= 1`` always); for ``z >= 1`` it is
    ``P(chi2_k / k < 1/z^2)`` (see :func:`envelope_lower_tail`).
    """
    z = np.asarray(z, dtype=float)
    out = np.ones_like(z)
    big = z >= 1.0
    out[big] = envelope_lower_tail(1.0 / z[big] ** 2, k)
    return out


def envelope_cdf(z: np.ndarray, k: int) -> np.ndarray:
    """``P(Z* <= z) = 1 - envelope_sf(z, k)``: 0 below 1, an atom ``P(chi2_k/k >= 1)`` at 1."""
    z = np.asarray(z, dtype=float)
    out = np.zeros_like(z)
    big = z >= 1.0
    xb = 1.0 / z[big] ** 2
    k = _check_k(k)
    # the chi2 sf is accurate where it is close to 1
    out[big] = stats.chi2.sf(xb * k, df=k) if k in VERIFIED_K else 1.0 - envelope_lower_tail(xb, k)
    return out
