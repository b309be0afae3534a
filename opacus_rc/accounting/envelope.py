"""Envelope of the sensitivity multiplier Z of randomized clipping.

With an estimated squared norm ``n_hat = n * W``, ``W = sum_j w_j X_j / k``,
``X_j ~ chi2_k`` i.i.d. and ``w`` a convex combination chosen by the adversary, the
clipped contribution of one example has norm at most ``C * Z`` with ``Z = 1/sqrt(W)``.
Over-estimation (``Z < 1``) is credited nothing, so the envelope variable is

    Z* = max(1, sqrt(k / chi2_k)),   P(Z* > z) = sup_w P(W < 1/z^2)  for z >= 1.

The single-chi-square lower tail ``P(chi2_k / k < x)`` is the supremum for ``x <= 1``
(checked numerically, see ``docs/envelope_verification.md``); where that claim is not
established, the rigorous Chernoff bound ``min_t e^{tx} (1 + 2t/k)^{-k/2}`` is used.
"""

from __future__ import annotations

import numpy as np
from scipy import stats


def chernoff_lower_tail(x: np.ndarray, k: int) -> np.ndarray:
    """Chernoff bound on ``sup_w P(W < x)``: ``min_{t>=0} e^{t x} (1 + 2t/k)^{-k/2}``.

    The minimiser is ``t* = k/2 * (1/x - 1)`` for ``x < 1`` (bound 1 for ``x >= 1``),
    giving ``(x e^{1-x})^{k/2}``. Valid for every convex combination ``w``:
    ``E e^{-t W} = prod_j (1 + 2 t w_j / k)^{-k/2} <= (1 + 2t/k)^{-k/2}`` because
    ``log(1 + c w)`` is concave with value 0 at 0, hence subadditive over ``w``.
    """
    x = np.asarray(x, dtype=float)
    out = np.ones_like(x)
    inside = (x > 0) & (x < 1)
    xi = x[inside]
    out[inside] = np.exp(0.5 * k * (np.log(xi) + 1.0 - xi))
    out[x <= 0] = 0.0
    return out


def envelope_lower_tail(x: np.ndarray, k: int) -> np.ndarray:
    """``sup_w P(W < x)`` for ``0 < x <= 1``: the single chi-square lower tail."""
    return stats.chi2.cdf(np.asarray(x, dtype=float) * k, df=k)


def envelope_sf(z: np.ndarray, k: int) -> np.ndarray:
    """Survival function ``P(Z* > z)`` of the envelope variable ``Z*``.

    For ``z < 1`` it is 1 (``Z* >= 1`` always); for ``z >= 1`` it is
    ``P(chi2_k / k < 1/z^2)``.
    """
    z = np.asarray(z, dtype=float)
    out = np.ones_like(z)
    big = z >= 1.0
    out[big] = envelope_lower_tail(1.0 / z[big] ** 2, k)
    return out
