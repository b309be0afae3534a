"""Cell masses of Gaussian mixtures: the single-step discretisation kernel."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
from scipy.special import ndtr

_LOG2PI_HALF = 0.5 * math.log(2.0 * math.pi)

#: Series terms of ``Phi(c + h/2) - Phi(c - h/2) = phi(c) h sum_k He_2k(c) h^2k / ((2k+1)! 4^k)``
_SERIES_TERMS = 4
#: A cell uses the series when ``h (|c| + 3) <= _SERIES_MAX`` for every component; the
#: first omitted term is then below ``0.15^8 / (9! 4^4) < 3e-15`` relative (``|He_8(c)| <=
#: (|c| + 3)^8``), otherwise both ends are evaluated with ``ndtr``.
_SERIES_MAX = 0.15
#: Rows (cells) per chunk: the cells that share one selection of components.
_ROWS_PER_CHUNK = 8192
#: OpenBLAS multiplies on one thread when ``M N K <= 4 * 65536`` (its default threshold;
#: a BLAS that threads smaller products threads the blocks, as it did the whole product).
_ONE_THREAD_MNK = 4 * 65536
#: Rows of the products in a chunk: multiples of every BLAS kernel's row unroll (4-16).
_PRODUCT_ROWS = 64
#: ``phi(c) < exp(-800)`` beyond this: such components are skipped in a chunk.
_C_NEGLIGIBLE = 40.0


def _herme_even_coefficients(alpha: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """Power-series coefficients in ``t`` of ``He_2k(alpha t + beta)``, ``k < _SERIES_TERMS``.

    Returns an array ``(m, K, 2K - 1)`` indexed ``[component, k, power of t]``.
    """
    from numpy.polynomial import hermite_e as H

    n_k = _SERIES_TERMS
    out = np.zeros((alpha.size, n_k, 2 * n_k - 1))
    for k in range(n_k):
        pc = H.herme2poly([0.0] * (2 * k) + [1.0])  # He_2k in powers of c
        for j, (a, b) in enumerate(zip(alpha, beta)):
            # sum_p pc[p] (a t + b)^p, expanded binomially
            for p, coef in enumerate(pc):
                if coef == 0.0:
                    continue
                for r in range(p + 1):
                    out[j, k, r] += coef * math.comb(p, r) * a**r * b ** (p - r)
    return out


def _exact_gauss_diff(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``Phi(hi) - Phi(lo)`` from the tail that keeps relative precision."""
    upper = lo > 0
    return np.where(upper, ndtr(-lo) - ndtr(-hi), ndtr(hi) - ndtr(lo))


def _series_coefficients(alpha: np.ndarray, beta: np.ndarray):
    """Per-component coefficients of the monomials ``w^2k t^r`` of the midpoint series."""
    K = _SERIES_TERMS
    H = _herme_even_coefficients(alpha, beta)  # (m, K, 2K-1)
    fact = np.array([alpha ** (2 * k) / (math.factorial(2 * k + 1) * 4.0**k) for k in range(K)]).T
    k_idx = np.concatenate([np.full(2 * k + 1, k) for k in range(K)])  # nonzero powers only
    r_idx = np.concatenate([np.arange(2 * k + 1) for k in range(K)])
    return (H * fact[:, :, None])[:, k_idx, r_idx], k_idx, r_idx


def _single_thread_product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` as one batched product of row blocks, each small enough for one BLAS thread.

    BLAS worker threads spin after each product and, on a machine whose cores are busy,
    slow everything down more than they speed the product up (2x measured). Blocks start
    at multiples of ``_PRODUCT_ROWS``, so every row is computed by the same kernel
    instructions as in one single-threaded product of all rows: the same floats (a
    threaded product could split the rows at other places).
    """
    m, k = a.shape
    n = b.shape[1]
    rows = _PRODUCT_ROWS * max(1, _ONE_THREAD_MNK // (_PRODUCT_ROWS * k * n))
    full = m - m % rows
    out = np.empty((m, n))
    if full:
        np.matmul(a[:full].reshape(-1, rows, k), b, out=out[:full].reshape(-1, rows, n))
    if full < m:
        np.matmul(a[full:], b, out=out[full:])
    return out


def mixture_cell_masses(
    t_lo: np.ndarray,
    t_hi: np.ndarray,
    alpha: np.ndarray,
    beta: np.ndarray,
    log_w: np.ndarray,
    twin_log_w: Optional[np.ndarray] = None,
) -> np.ndarray:
    """``sum_j w_j (Phi(alpha_j t_hi + beta_j) - Phi(alpha_j t_lo + beta_j))`` per cell.

    ``alpha > 0``, ``t_lo <= t_hi`` (``-inf`` allowed), ``w_j = exp(log_w[j])``. With
    ``c = alpha t_mid + beta``, ``h = alpha (t_hi - t_lo)`` the difference is
    ``phi(c) h sum_k He_2k(c) h^2k / ((2k+1)! 4^k)`` (Taylor expansion of ``phi`` about the
    midpoint, odd terms cancel); ``phi(c_ij) = exp(t_i^2 P_j + t_i Q_j + R_j)``, so the sum
    over ``j`` of each monomial ``t^r h^2k`` is a matrix product: about one ``exp`` per (cell,
    component), relative accuracy ~1e-14 per cell (no cancellation between CDF values).
    ``twin_log_w`` adds the components ``beta_j - 1/alpha_j`` (weights ``exp(twin_log_w)``),
    whose density is that of ``j`` times ``exp(t) exp(beta/alpha - 1/(2 alpha^2))``: they
    reuse the same exponentials. Cells too wide for the series are evaluated with ``ndtr``.
    """
    alpha, beta, log_w = (np.asarray(v, dtype=float) for v in (alpha, beta, log_w))
    n = t_lo.size
    out = np.zeros(n)
    if n == 0 or alpha.size == 0:
        return out
    twin = twin_log_w is not None
    twin_beta = beta - 1.0 / alpha if twin else beta
    all_alpha, all_beta, all_w = alpha, beta, log_w
    if twin:
        twin_log_w = np.asarray(twin_log_w, dtype=float)
        pairs = ((alpha, alpha), (beta, twin_beta), (log_w, twin_log_w))
        all_alpha, all_beta, all_w = (np.concatenate(v) for v in pairs)
    with np.errstate(invalid="ignore"):
        mid = 0.5 * (t_lo + t_hi)
        width = t_hi - t_lo
    a_max = float(all_alpha.max())
    c_bound = np.minimum(np.abs(mid) * a_max + float(np.abs(all_beta).max()), 40.0) + 3.0
    with np.errstate(invalid="ignore"):
        series_ok = np.isfinite(mid) & np.isfinite(width)
        series_ok &= width * a_max * c_bound <= _SERIES_MAX
    # ---- cells too wide for the series: exact differences
    bad = np.nonzero(~series_ok & (t_hi > -np.inf))[0]  # cells below -inf: no mass
    # (chunked: a capped domain can have millions of wide cells times hundreds of bins)
    step = max(1, 2_000_000 // max(all_alpha.size, 1))
    for s0 in range(0, bad.size, step):
        rows = bad[s0 : s0 + step]
        with np.errstate(invalid="ignore"):
            lo = t_lo[rows, None] * all_alpha[None, :] + all_beta[None, :]
            hi = t_hi[rows, None] * all_alpha[None, :] + all_beta[None, :]
        lo = np.where(np.isnan(lo), -np.inf, lo)
        hi = np.where(np.isnan(hi), -np.inf, hi)
        out[rows] = _exact_gauss_diff(lo, hi) @ np.exp(all_w)
    good = np.nonzero(series_ok)[0]
    if not good.size:
        return out
    # ---- series cells
    P = -0.5 * alpha**2
    Q = -alpha * beta
    R = -0.5 * beta**2 + log_w + np.log(alpha) - _LOG2PI_HALF  # h = alpha * width
    coef, k_idx, r_idx = _series_coefficients(alpha, beta)
    if twin:
        shift = twin_log_w - log_w + beta / alpha - 0.5 / alpha**2
        c_twin, _, _ = _series_coefficients(alpha, twin_beta)
        coef = np.concatenate([coef, c_twin * np.exp(shift)[:, None]], axis=1)
    n_mono = k_idx.size
    # twins: balance the exponent with exp(t/2) so that neither family underflows while the
    # other matters (both are then exp(+-t/2) times the shared exponential)
    q_row = Q + (0.5 if twin else 0.0)
    # exponents laid out (components, cells): each element-wise pass runs along long rows
    buf = np.empty((alpha.size, min(_ROWS_PER_CHUNK, good.size)))
    for start in range(0, good.size, _ROWS_PER_CHUNK):
        rows = good[start : start + _ROWS_PER_CHUNK]
        t = mid[rows]  # increasing
        w = width[rows]
        # components whose |c| exceeds _C_NEGLIGIBLE on the whole chunk (and whose twin's
        # does too) contribute below exp(-800): skipped (any such mass is sent to
        # infinity by the caller's balance)
        lo_c, hi_c = alpha * t[0] + beta, alpha * t[-1] + beta
        lo_t, hi_t = alpha * t[0] + twin_beta, alpha * t[-1] + twin_beta
        cols = np.nonzero(
            ((hi_c >= -_C_NEGLIGIBLE) & (lo_c <= _C_NEGLIGIBLE))
            | ((hi_t >= -_C_NEGLIGIBLE) & (lo_t <= _C_NEGLIGIBLE))
        )[0]
        if cols.size == 0:
            continue
        x = buf[: cols.size, : rows.size]
        np.multiply(P[cols, None], t[None, :], out=x)
        x += q_row[cols, None]
        x *= t[None, :]
        x += R[cols, None]
        np.exp(x, out=x)
        s = _single_thread_product(x.T, coef[cols])
        mono = w[:, None] ** (2 * k_idx) * t[:, None] ** r_idx
        if not twin:
            val = np.einsum("ij,ij->i", s, mono)
        else:
            val = np.exp(-0.5 * t) * np.einsum("ij,ij->i", s[:, :n_mono], mono)
            val += np.exp(0.5 * t) * np.einsum("ij,ij->i", s[:, n_mono:], mono)
        out[rows] = w * val
    return np.maximum(out, 0.0)
