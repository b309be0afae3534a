"""PRV accounting of Poisson-subsampled Gaussian mechanisms with a random sensitivity.

One DP-SGD step with randomized clipping adds ``N(0, sigma^2 C^2)`` to a sum in which the
differing example (present with probability ``q``) contributes a vector of norm at most
``C * Z``. With the envelope ``Z*`` of ``opacus_rc.accounting.envelope`` the step is
dominated (in units of ``C``, projected on the example's direction) by

* revealed Z (shared sketch):  ``(Z, (1-q) N(0, s^2) + q N(Z, s^2))`` vs ``(Z, N(0, s^2))``;
  its privacy loss random variable (PRV) is the mixture over Z of the PRVs of Poisson
  subsampled Gaussians with noise ``sigma / Z``;
* hidden Z (independent sketch per example):
  ``(1-q) N(0, s^2) + q E_Z N(Z, s^2)`` vs ``N(0, s^2)``; the PRV of one mixture.

``Z*`` is discretised into bins, each rounded **up** to its right edge; the top mass (above
``z_max``) is given infinite sensitivity, which puts ``q * p_inf`` at infinite privacy loss
(into delta) and, when Z is revealed, ``(1-q) p_inf`` at ``log(1-q)``.

The composition over (heterogeneous) steps follows Gopi, Lee, Wutschitz (2021),
"Numerical composition of differential privacy" (the method of ``prv_accountant`` and of
Opacus's ``prv`` accountant), with these conservative changes:

* both directions of the add/remove relation are composed and the larger epsilon wins
  (Opacus's ``prv`` composes only ``P||Q`` with ``P`` the subsampled mixture);
* single-step mass above the domain and composed mass that leaves the domain are counted
  as infinite loss (added to delta) instead of being dropped and renormalised;
* the domain bound uses Chernoff bounds with the exact log-moment generating functions of
  the mixture (both tails, both directions), not the RDP of a plain subsampled Gaussian;
* the FFT runs on a padded fast length; the domain size is capped (the mesh then grows and
  the reported epsilon error grows with it), so large epsilons and 100k steps do not fail.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional, Sequence, Tuple

import numpy as np
from scipy import fft as sp_fft
from scipy.signal import lfilter
import torch
from scipy.special import ndtr

from .envelope import envelope_sf

logger = logging.getLogger(__name__)

#: Bins whose sensitivity ``z / sigma`` exceeds this are treated as infinite sensitivity
#: (their loss ~ mu^2 / 2 >= 800 lies far outside any useful domain).
MU_INFINITE = 40.0
#: Largest number of grid points of the discretised PRV; beyond it the mesh is widened.
MAX_DOMAIN_POINTS = 2**22
_X_LO = -40.0  # Phi(-40) underflows to 0: the Gaussian mass beyond is nil in float64
_DIRECTIONS = ("remove", "add")
_LOG2PI_HALF = 0.5 * math.log(2.0 * math.pi)


# --------------------------------------------------------------------------------------
# Sensitivity mixtures (the Z bins)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SensitivityMixture:
    """Distribution of the sensitivity multiplier ``Z`` of one step.

    ``P(Z = z[j]) = p[j]`` for the finite bins (``z >= 1`` sorted, values already rounded
    up) and ``P(Z = inf) = p_inf``; ``sum(p) + p_inf = 1``. ``hidden`` selects the hidden-Z
    (per-example sketch) analysis instead of the revealed-Z one.
    """

    z: Tuple[float, ...]
    p: Tuple[float, ...]
    p_inf: float = 0.0
    hidden: bool = False

    def __post_init__(self) -> None:
        if len(self.z) != len(self.p) or len(self.z) == 0:
            raise ValueError("z and p must be non-empty and of equal length")
        if min(self.z) < 1.0 - 1e-12:
            raise ValueError("sensitivity multipliers z must be >= 1")
        total = float(np.sum(self.p)) + self.p_inf
        if abs(total - 1.0) > 1e-9 or min(self.p) < 0 or self.p_inf < 0:
            raise ValueError(f"bin probabilities must be >= 0 and sum to 1 (got {total})")

    @property
    def is_deterministic(self) -> bool:
        return len(self.z) == 1 and self.z[0] == 1.0 and self.p_inf == 0.0


DETERMINISTIC = SensitivityMixture(z=(1.0,), p=(1.0,))


def _quantile_z(k: int, level: float) -> float:
    """Smallest ``z >= 1`` with ``envelope_sf(z, k) <= level`` (bisection in ``log z``)."""
    lo, hi = 0.0, 1.0
    while float(envelope_sf(np.array([math.exp(hi)]), k)[0]) > level:
        lo, hi = hi, 2.0 * hi
        if hi > 200.0:  # z > e^200: treat as unbounded
            return math.inf
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if float(envelope_sf(np.array([math.exp(mid)]), k)[0]) > level:
            lo = mid
        else:
            hi = mid
    return math.exp(hi)


#: Default relative width of the Z bins (z_i / z_{i-1} - 1). The rounding-up excess in
#: epsilon is about linear in it (k=32, eps~3.5: +0.05 per 0.01 of ratio).
DEFAULT_BIN_RATIO = 0.01


@lru_cache(maxsize=256)
def envelope_mixture(
    sketch_count: int,
    tail_mass: float,
    hidden: bool = False,
    bin_ratio: float = DEFAULT_BIN_RATIO,
    min_bins: int = 16,
    draws: int = 1,
) -> SensitivityMixture:
    """Bins of the envelope ``Z* = max(1, sqrt(k / chi2_k))``, every bin rounded up.

    Geometric edges ``1 = z_0 < ... < z_m = z_max`` (ratio ``1 + bin_ratio``, at least
    ``min_bins`` bins) with ``P(Z* > z_max) <= tail_mass``: that mass becomes ``p_inf``.
    Bin ``(z_{i-1}, z_i]`` gets value ``z_i`` and mass ``sf(z_{i-1}) - sf(z_i)``; the atom
    ``P(Z* = 1) = 1 - sf(1)`` stays at 1. Rounding up makes the bins stochastically
    larger than ``Z*``, hence a dominating mechanism (docs/accounting.md).

    ``draws = m > 1`` bins the largest of ``m`` envelope draws, whatever their dependence,
    through the union bound ``P(max_i Z_i > z) <= min(1, m P(Z* > z))`` (the sketch slots
    of an example in ``m`` accumulated micro-batches).
    """
    if isinstance(draws, bool) or int(draws) != draws or draws < 1:
        raise ValueError(f"draws={draws!r} must be a positive integer")
    if isinstance(sketch_count, bool) or int(sketch_count) != sketch_count or sketch_count <= 0:
        raise ValueError(f"sketch_size={sketch_count!r} must be a positive integer")
    if not 0.0 < tail_mass < 1.0:
        raise ValueError(f"tail_mass={tail_mass} must lie in (0, 1)")
    if not 0.0 < bin_ratio <= 1.0:
        raise ValueError(f"bin_ratio={bin_ratio} must lie in (0, 1]")
    k, draws = int(sketch_count), int(draws)
    z_max = _quantile_z(k, tail_mass / draws)
    if not math.isfinite(z_max):
        z_max = math.exp(200.0)
    log_max = math.log(z_max)
    step = min(math.log1p(bin_ratio), log_max / min_bins) if log_max > 0 else 1.0
    n_bins = max(1, int(math.ceil(log_max / step - 1e-9)))
    edges = np.exp(np.linspace(0.0, log_max, n_bins + 1))
    sf_e = np.minimum(1.0, draws * envelope_sf(edges, k))
    p = np.concatenate([[1.0 - sf_e[0]], np.maximum(sf_e[:-1] - sf_e[1:], 0.0)])
    p_inf = float(sf_e[-1])
    p *= (1.0 - p_inf) / p.sum()  # absorb float rounding of the sf differences
    keep = p > 0
    return SensitivityMixture(
        z=tuple(float(v) for v in edges[keep]),
        p=tuple(float(v) for v in p[keep]),
        p_inf=p_inf,
        hidden=hidden,
    )


# --------------------------------------------------------------------------------------
# Cell masses of Gaussian mixtures (the single-step discretisation kernel)
# --------------------------------------------------------------------------------------

#: Series terms of ``Phi(c + h/2) - Phi(c - h/2) = phi(c) h sum_k He_2k(c) h^2k / ((2k+1)! 4^k)``
_SERIES_TERMS = 4
#: A cell uses the series when ``h (|c| + 3) <= _SERIES_MAX`` for every component; the
#: first omitted term is then below ``0.15^8 / (9! 4^4) < 3e-15`` relative (``|He_8(c)| <=
#: (|c| + 3)^8``), otherwise both ends are evaluated with ``ndtr``.
_SERIES_MAX = 0.15
_ROWS_PER_CHUNK = 1024
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


def _matmul_1thread(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` on one thread: multi-threaded BLAS on small blocks is many times slower
    on a shared machine (threads spin)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return (torch.from_numpy(a) @ torch.from_numpy(b)).numpy()
    finally:
        torch.set_num_threads(old)


def _series_coefficients(alpha: np.ndarray, beta: np.ndarray, log_w: np.ndarray):
    """Per-component coefficients of the monomials ``w^2k t^r`` of the midpoint series."""
    K = _SERIES_TERMS
    H = _herme_even_coefficients(alpha, beta)  # (m, K, 2K-1)
    fact = np.array([alpha ** (2 * k) / (math.factorial(2 * k + 1) * 4.0**k) for k in range(K)]).T
    k_idx = np.concatenate([np.full(2 * k + 1, k) for k in range(K)])  # nonzero powers only
    r_idx = np.concatenate([np.arange(2 * k + 1) for k in range(K)])
    return (H * fact[:, :, None])[:, k_idx, r_idx], k_idx, r_idx


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
    alpha = np.asarray(alpha, dtype=float)
    beta = np.asarray(beta, dtype=float)
    log_w = np.asarray(log_w, dtype=float)
    n = t_lo.size
    out = np.zeros(n)
    if n == 0 or alpha.size == 0:
        return out
    all_alpha, all_beta, all_w = alpha, beta, log_w
    if twin_log_w is not None:
        all_alpha = np.concatenate([alpha, alpha])
        all_beta = np.concatenate([beta, beta - 1.0 / alpha])
        all_w = np.concatenate([log_w, np.asarray(twin_log_w, dtype=float)])
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
    coef, k_idx, r_idx = _series_coefficients(alpha, beta, log_w)
    if twin_log_w is not None:
        shift = np.asarray(twin_log_w, dtype=float) - log_w + beta / alpha - 0.5 / alpha**2
        c_twin, _, _ = _series_coefficients(alpha, beta - 1.0 / alpha, log_w)
        coef = np.concatenate([coef, c_twin * np.exp(shift)[:, None]], axis=1)
    n_mono = k_idx.size
    # twins: balance the exponent with exp(t/2) so that neither family underflows while the
    # other matters (both are then exp(+-t/2) times the shared exponential)
    q_row = Q + (0.5 if twin_log_w is not None else 0.0)
    twin_beta = beta - 1.0 / alpha if twin_log_w is not None else beta
    buf = np.empty((min(_ROWS_PER_CHUNK, good.size), alpha.size))
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
        x = buf[: rows.size, : cols.size]
        np.multiply(t[:, None], P[None, cols], out=x)
        x += q_row[cols]
        x *= t[:, None]
        x += R[cols]
        np.exp(x, out=x)
        s = _matmul_1thread(x, coef[cols])
        mono = w[:, None] ** (2 * k_idx) * t[:, None] ** r_idx
        if twin_log_w is None:
            val = np.einsum("ij,ij->i", s, mono)
        else:
            val = np.exp(-0.5 * t) * np.einsum("ij,ij->i", s[:, :n_mono], mono)
            val += np.exp(0.5 * t) * np.einsum("ij,ij->i", s[:, n_mono:], mono)
        out[rows] = w * val
    return np.maximum(out, 0.0)


# --------------------------------------------------------------------------------------
# One step: exact CDF / survival function / truncated mean / log-MGF of its PRV
# --------------------------------------------------------------------------------------


def _lse(a: np.ndarray, axis: Optional[int] = None) -> np.ndarray:
    """``log sum exp`` along ``axis`` (plain numpy; scipy's has a large per-call overhead)."""
    m = np.max(a, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    out = np.log(np.sum(np.exp(a - m), axis=axis, keepdims=True)) + m
    return out.squeeze(axis) if axis is not None else out.reshape(())


@lru_cache(maxsize=8)
def _leggauss(order: int) -> Tuple[np.ndarray, np.ndarray]:
    return np.polynomial.legendre.leggauss(order)


def _gauss_legendre_panels(lo: float, hi: float, panel: float, order: int = 12):
    """Nodes and weights of composite Gauss-Legendre on ``[lo, hi]``."""
    if hi <= lo:
        return np.zeros(0), np.zeros(0)
    n_panels = max(1, int(math.ceil((hi - lo) / panel)))
    xg, wg = _leggauss(order)
    edges = np.linspace(lo, hi, n_panels + 1)
    half = 0.5 * np.diff(edges)
    mid = 0.5 * (edges[1:] + edges[:-1])
    nodes = (mid[:, None] + half[:, None] * xg[None, :]).ravel()
    weights = (half[:, None] * wg[None, :]).ravel()
    return nodes, weights


class StepPRV:
    """PRV of one Poisson-subsampled Gaussian step with random sensitivity ``Z``.

    In units of the noise std: ``mu_j = z_j / sigma``; ``rho(x) = P(x) / Q(x)`` with
    ``Q = N(0, 1)``. Revealed: ``rho_j(x) = 1 - q + q exp(mu_j x - mu_j^2 / 2)`` per bin;
    hidden: ``rho(x) = 1 - q + q sum_j p_j exp(mu_j x - mu_j^2 / 2)``. Direction
    ``"remove"``: ``Y = log rho(X)``, ``X ~ P``; ``"add"``: ``Y = -log rho(X)``, ``X ~ Q``.
    All distributions are conditioned on a finite loss; ``pm_inf(direction)`` is the mass
    at infinity.
    """

    def __init__(
        self, noise_multiplier: float, sample_rate: float, mixture: SensitivityMixture
    ) -> None:
        self.sigma = float(noise_multiplier)
        self.q = float(sample_rate)
        if not 0.0 <= self.q <= 1.0:
            raise ValueError(f"sample_rate={sample_rate} must lie in [0, 1]")
        if not self.sigma >= 0.0:
            raise ValueError(f"noise_multiplier={noise_multiplier} must be >= 0")
        if self.sigma == 0.0 or not math.isfinite(self.sigma):
            self.sigma = max(self.sigma, 1e-300) if self.sigma == 0.0 else self.sigma
        self.mixture = mixture
        z = np.asarray(mixture.z, dtype=float)
        p = np.asarray(mixture.p, dtype=float)
        mu = z / self.sigma
        big = mu > MU_INFINITE
        self.p_inf = float(mixture.p_inf + p[big].sum())
        self.mu = mu[~big]
        self.p = p[~big]
        self.hidden = mixture.hidden
        self.log1mq = math.log1p(-self.q) if self.q < 1.0 else -math.inf
        if self.mu.size == 0:
            self.mu = np.array([1.0])
            self.p = np.array([0.0])
        self._logp = np.log(np.where(self.p > 0, self.p, 1e-320))
        self._mu_max = float(self.mu.max())
        self._mgf_cache: dict = {}
        self._inverse_table: Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]] = None

    # ---- helpers -------------------------------------------------------------------
    def pm_inf(self, direction: str) -> float:
        """Probability of infinite loss in one step (only ``remove`` has any)."""
        return self.q * self.p_inf if direction == "remove" else 0.0

    def _finite_mass(self, direction: str) -> float:
        return 1.0 - self.pm_inf(direction)

    def _u(self, s: np.ndarray) -> np.ndarray:
        """``u(s) = log((e^s - (1-q)) / q)`` (``-inf`` where ``s <= log(1-q)``)."""
        a = np.expm1(s) + self.q
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(a > 0, np.log(np.where(a > 0, a, 1.0)) - math.log(self.q), -np.inf)

    def _x_revealed(self, u: np.ndarray) -> np.ndarray:
        """Per-bin inverse of the loss: ``x_j = (u + mu_j^2/2) / mu_j``, shape (n, m)."""
        return (u[:, None] + 0.5 * self.mu[None, :] ** 2) / self.mu[None, :]

    def _g(self, x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """``g(x) = log sum_j p_j exp(mu_j x - mu_j^2/2)`` and ``g'(x)``."""
        a = x[:, None] * self.mu[None, :] + (self._logp - 0.5 * self.mu**2)[None, :]
        amax = a.max(axis=1, keepdims=True)
        w = np.exp(a - amax)
        sw = w.sum(axis=1)
        g = amax[:, 0] + np.log(sw)
        dg = (w * self.mu[None, :]).sum(axis=1) / sw
        return g, dg

    def _x_hidden(self, u: np.ndarray, chunk: int = 65536) -> np.ndarray:
        """Solve ``g(x) = u`` (g convex, increasing) by cubic Hermite interpolation of the
        inverse (nodes every ~0.005 in x, slopes ``1/g'``; error ~1e-10) plus Newton steps
        until the step is below ``1e-13 (1 + |x|)`` (usually one or two; at most 6)."""
        x_hi = self._mu_max + 40.0
        if self._inverse_table is None:
            xs = np.linspace(_X_LO - 1.0, x_hi, 16001)
            self._inverse_table = (xs, *self._g(xs))
        xs, gs, dgs = self._inverse_table
        out = np.empty_like(u)
        for start in range(0, u.size, chunk):
            uc = u[start : start + chunk]
            finite = np.isfinite(uc)
            xc = np.full(uc.shape, _X_LO - 1.0)
            uf = np.clip(uc[finite], gs[0], gs[-1])
            i = np.clip(np.searchsorted(gs, uf) - 1, 0, gs.size - 2)
            du = gs[i + 1] - gs[i]
            t = np.where(du > 0, (uf - gs[i]) / np.where(du > 0, du, 1.0), 0.0)
            h00, h10 = (1 + 2 * t) * (1 - t) ** 2, t * (1 - t) ** 2
            h01, h11 = t * t * (3 - 2 * t), t * t * (t - 1)
            x = h00 * xs[i] + h01 * xs[i + 1] + du * (h10 / dgs[i] + h11 / dgs[i + 1])
            x = np.clip(x, xs[i], xs[i + 1])
            for _ in range(6):
                g, dg = self._g(x)
                step = (g - uf) / dg
                x = x - step
                if np.all(np.abs(step) <= 1e-13 * (1.0 + np.abs(x))):
                    break
            xc[finite] = np.clip(x, _X_LO - 1.0, x_hi)
            out[start : start + chunk] = xc
        return out

    # ---- truncated first moment ------------------------------------------------------
    def partial_mean(self, direction: str, a: float, b: float) -> float:
        """Unnormalised ``E[Y ; a <= Y <= b]`` by Gauss-Legendre quadrature in ``x``."""
        q = self.q
        sign = 1.0 if direction == "remove" else -1.0
        # loss ``sign * log rho(x)`` lies in [a, b]  <=>  x in [x(lo), x(hi)]
        lo_s, hi_s = (a, b) if direction == "remove" else (-b, -a)
        x_hi_cap = self._mu_max + 40.0
        total = 0.0
        if self.hidden:
            u = self._u(np.array([lo_s, hi_s]))
            xl, xh = self._x_hidden(u)
            xl = max(xl, _X_LO) if np.isfinite(u[0]) else _X_LO
            xh = min(xh, x_hi_cap)
            nodes, w = _gauss_legendre_panels(xl, xh, 0.05)
            if nodes.size:
                g, _ = self._g(nodes)
                loss = np.logaddexp(self.log1mq, math.log(q) + g) if q < 1 else g
                dens = (1 - q) * np.exp(-0.5 * nodes**2 - _LOG2PI_HALF) if q < 1 else 0.0
                if direction == "remove":
                    for mu_j, p_j in zip(self.mu, self.p):
                        dens = dens + q * p_j * np.exp(-0.5 * (nodes - mu_j) ** 2 - _LOG2PI_HALF)
                else:
                    dens = np.exp(-0.5 * nodes**2 - _LOG2PI_HALF)
                total += float(np.sum(w * sign * loss * dens))
            return total
        u = self._u(np.array([lo_s, hi_s]))
        for mu_j, p_j in zip(self.mu, self.p):
            if p_j == 0:
                continue
            xl = (u[0] + 0.5 * mu_j**2) / mu_j if np.isfinite(u[0]) else _X_LO
            xh = (u[1] + 0.5 * mu_j**2) / mu_j if np.isfinite(u[1]) else _X_LO
            xl, xh = max(xl, _X_LO), min(xh, mu_j + 40.0)
            nodes, w = _gauss_legendre_panels(xl, xh, 0.05)
            if not nodes.size:
                continue
            lin = math.log(q) + mu_j * nodes - 0.5 * mu_j**2
            loss = np.logaddexp(self.log1mq, lin) if q < 1 else lin
            if direction == "remove":
                dens = (1 - q) * np.exp(-0.5 * nodes**2 - _LOG2PI_HALF) + q * np.exp(
                    -0.5 * (nodes - mu_j) ** 2 - _LOG2PI_HALF
                )
            else:
                dens = np.exp(-0.5 * nodes**2 - _LOG2PI_HALF)
            total += p_j * float(np.sum(w * sign * loss * dens))
        # the atom of the revealed infinite bin: log(1-q) (remove, mass (1-q) p_inf)
        # or -log(1-q) (add, mass p_inf)
        if self.p_inf > 0 and q < 1:
            atom, mass = (
                (self.log1mq, (1 - q) * self.p_inf)
                if direction == "remove"
                else (-self.log1mq, self.p_inf)
            )
            if a <= atom <= b:
                total += atom * mass
        return total

    # ---- log moment generating functions (for the domain size) -----------------------
    def _log_rho_moment(self, beta: float) -> float:
        """``log E_Q[rho(X)^beta]`` (revealed: the p-weighted per-bin moments).

        Hidden Z with ``beta`` outside ``(0, 1)``: the revealed moment, an upper bound by
        Jensen (``rho = sum_j p_j rho_j + p_inf (1-q)`` and ``x^beta`` convex).
        Integer ``beta >= 1`` per bin in closed form (binomial expansion); otherwise by
        the trapezoidal rule in log space on a grid of step 0.01 covering every peak
        (exponentially accurate for these smooth, Gaussian-tailed integrands).
        """
        q = self.q
        if q >= 1.0:
            # rho_j = exp(mu x - mu^2/2): E_Q rho^b = exp(b(b-1) mu^2 / 2)
            terms = self._logp + 0.5 * beta * (beta - 1) * self.mu**2
            return float(_lse(terms))
        direct_hidden = self.hidden and 0.0 < beta < 1.0
        if float(beta).is_integer() and beta >= 1:
            n = int(beta)
            i = np.arange(n + 1)
            logc = (
                math.lgamma(n + 1)
                - np.array([math.lgamma(v + 1) for v in i])
                - np.array([math.lgamma(n - v + 1) for v in i])
            )
            base = logc + i * math.log(q) + (n - i) * self.log1mq
            per_bin = _lse(
                base[None, :] + 0.5 * (i * i - i)[None, :] * self.mu[:, None] ** 2, axis=1
            )
            log_terms = self._logp + per_bin
            if self.p_inf > 0:
                log_terms = np.append(log_terms, math.log(self.p_inf) + beta * self.log1mq)
            return float(_lse(log_terms))
        reach = max(beta, 0.0) * self._mu_max
        # rho_j^beta is analytic in the strip |Im x| < pi / mu_j (zeros of rho_j); with
        # h <= 0.25 / mu_max the trapezoid error is ~exp(-pi^2 / (mu h)) <= e^-39 relative
        h = min(0.05, 0.25 / self._mu_max)
        x = np.arange(-14.0, reach + 14.0, h)
        logphi = -0.5 * x**2 - _LOG2PI_HALF + math.log(h)
        if direct_hidden:
            g, _ = self._g(x)
            log_rho = np.logaddexp(self.log1mq, math.log(q) + g)
            return float(_lse(logphi + beta * log_rho))
        lin = math.log(q) + x[None, :] * self.mu[:, None] - 0.5 * self.mu[:, None] ** 2
        log_rho = np.logaddexp(self.log1mq, lin)
        per_bin = _lse(logphi[None, :] + beta * log_rho, axis=1)
        log_terms = self._logp + per_bin
        if self.p_inf > 0:
            log_terms = np.append(log_terms, math.log(self.p_inf) + beta * self.log1mq)
        return float(_lse(log_terms))

    def log_mgf(self, direction: str, lam: float, tail: str) -> float:
        """Upper bound on ``log E[exp(lam Y)]`` (``tail="upper"``) or
        ``log E[exp(-lam Y)]`` (``"lower"``) of the finite part of the PRV.

        remove: ``E_P[rho^l] = E_Q[rho^(1+l)]``, ``E_P[rho^-l] = E_Q[rho^(1-l)]``;
        add: ``E_Q[rho^-l]``, ``E_Q[rho^l]``. Hidden-Z moments with exponent ``>= 1`` or
        ``<= 0`` are bounded by the revealed ones (Jensen, ``x^b`` convex); the
        hidden-Z mixture is integrated directly otherwise.
        """
        if direction == "remove":
            beta = 1.0 + lam if tail == "upper" else 1.0 - lam
        else:
            beta = -lam if tail == "upper" else lam
        key = (direction, lam, tail)
        if key not in self._mgf_cache:
            self._mgf_cache[key] = self._log_rho_moment(beta)
        val = self._mgf_cache[key]
        return val - math.log(self._finite_mass(direction))


# --------------------------------------------------------------------------------------
# Domain, discretisation, composition
# --------------------------------------------------------------------------------------

_LAMBDAS_UPPER = (0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
_LAMBDAS_LOWER = _LAMBDAS_UPPER


def _chernoff_level(log_mgfs: Sequence[np.ndarray], counts: Sequence[int], lams, delta: float) -> float:
    """Smallest ``s`` with ``P(sum Y > s) <= delta`` by ``min_l (sum K(l) + log 1/delta) / l``."""
    lams = np.asarray(lams, dtype=float)
    total = np.zeros_like(lams)
    for k_vals, n in zip(log_mgfs, counts):
        total = total + n * np.asarray(k_vals)
    with np.errstate(invalid="ignore"):
        levels = (total + math.log(1.0 / delta)) / lams
    levels = levels[np.isfinite(levels)]
    return float(levels.min()) if levels.size else math.inf


@dataclass
class _Domain:
    i0: int  # index of the first centre: t_i = (i0 + i) * dt
    n: int
    dt: float
    eps_error: float

    @property
    def centres(self) -> np.ndarray:
        return (self.i0 + np.arange(self.n)) * self.dt


def _make_domain(
    steps: Sequence[StepPRV], counts: Sequence[int], eps_error: float, delta_error: float
) -> _Domain:
    """Domain ``[-L, L]`` (Gopi et al. remark 5.6, with Chernoff tails) and its mesh."""
    total = int(sum(counts))
    levels = [eps_error]
    for direction in _DIRECTIONS:
        for tail, lams in (("upper", _LAMBDAS_UPPER), ("lower", _LAMBDAS_LOWER)):
            kv = [np.array([st.log_mgf(direction, l, tail) for l in lams]) for st in steps]
            levels.append(_chernoff_level(kv, counts, lams, delta_error / 4))
            for kvi in kv:
                levels.append(_chernoff_level([kvi], [1], lams, delta_error / (8 * total)))
    L = max(levels) + 3.0
    if not math.isfinite(L):
        L = 1e3
    dt = eps_error / math.sqrt(total * math.log(12.0 / delta_error) / 2.0)
    if 2.0 * L / dt + 2 > MAX_DOMAIN_POINTS:
        dt = 2.0 * L / (MAX_DOMAIN_POINTS - 2)
        eps_error = dt * math.sqrt(total * math.log(12.0 / delta_error) / 2.0)
        logger.warning(
            "PRV domain capped at %d points; epsilon error raised to %.3g",
            MAX_DOMAIN_POINTS,
            eps_error,
        )
    i0 = int(math.floor(-L / dt))
    i1 = int(math.ceil(L / dt))
    n = i1 - i0 + 1
    n += n % 2
    return _Domain(i0=i0, n=n, dt=dt, eps_error=eps_error)


def _revealed_masses(step: StepPRV, t_lo: np.ndarray, t_hi: np.ndarray, remove: bool) -> np.ndarray:
    """Cell masses of the revealed-Z loss for cells ``u in [t_lo, t_hi]``: per bin
    ``x = u/mu + mu/2``; remove: ``(1-q) N(0,1) + q N(mu,1)`` (the second is the twin),
    add: ``N(0,1)``."""
    mu, logp = step.mu, step._logp
    if remove:
        if step.q >= 1.0:  # no (1-q) N(0,1) part: only the twin N(mu, 1)
            return mixture_cell_masses(t_lo, t_hi, 1.0 / mu, -0.5 * mu, logp)
        twin = logp + math.log(step.q) if step.q > 0 else None
        return mixture_cell_masses(t_lo, t_hi, 1.0 / mu, 0.5 * mu, logp + step.log1mq, twin)
    return mixture_cell_masses(t_lo, t_hi, 1.0 / mu, 0.5 * mu, logp)


def _hidden_components(step: StepPRV, remove: bool) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(alpha, beta, log_w)`` of ``P = (1-q) N(0,1) + q sum_j p_j N(mu_j,1)`` (remove)
    or ``Q = N(0,1)`` (add), as ``Phi(alpha x + beta)`` components."""
    if not remove:
        return np.ones(1), np.zeros(1), np.zeros(1)
    ones = np.ones(step.mu.size + 1)
    beta = np.concatenate([[0.0], -step.mu])
    log_w = np.concatenate([[step.log1mq], math.log(step.q) + step._logp])
    return ones, beta, log_w


def _gauss_mass_beyond(x: float, alpha: np.ndarray, beta: np.ndarray, log_w: np.ndarray,
                       upper: bool) -> float:
    """``sum_j w_j P(N(0,1) > alpha_j x + beta_j)`` (``upper``) or ``< ...``."""
    if math.isinf(x) and (x < 0) == upper:
        return float(np.exp(log_w).sum())
    arg = alpha * x + beta
    return float(np.exp(log_w) @ (ndtr(-arg) if upper else ndtr(arg)))


def _cell_masses(step: StepPRV, direction: str, edges: np.ndarray) -> Tuple[np.ndarray, float, float]:
    """Masses of the finite loss in the cells ``(edges[i], edges[i+1]]`` and the masses
    below ``edges[0]`` and above ``edges[-1]``.

    Remove: ``Y = log rho(X), X ~ P``; add: ``Y = -log rho(X), X ~ Q``. A cell in ``Y`` is an
    interval in ``u = log((e^Y - (1-q))/q)`` (remove) or in ``u(-Y)`` (add), affine in
    ``x`` per bin (revealed) or through the root ``x(u)`` of the hidden mixture.
    """
    custom = getattr(step, "cell_masses", None)
    if custom is not None:  # composite steps (e.g. accumulated micro-batches)
        return custom(direction, edges)
    remove = direction == "remove"
    u = step._u(edges if remove else -edges[::-1])  # increasing
    if step.hidden:
        xe = step._x_hidden(u)
        xe = np.where(np.isfinite(u), xe, -np.inf)
        alpha, beta, log_w = _hidden_components(step, remove)
        masses = mixture_cell_masses(xe[:-1], xe[1:], alpha, beta, log_w)
        low = _gauss_mass_beyond(float(xe[0]), alpha, beta, log_w, upper=False)
        high = _gauss_mass_beyond(float(xe[-1]), alpha, beta, log_w, upper=True)
        atom = 0.0
    else:
        masses = _revealed_masses(step, u[:-1], u[1:], remove)
        alpha, beta = 1.0 / step.mu, 0.5 * step.mu
        lw = step._logp + (step.log1mq if remove else 0.0)
        low = _gauss_mass_beyond(float(u[0]), alpha, beta, lw, upper=False)
        high = _gauss_mass_beyond(float(u[-1]), alpha, beta, lw, upper=True)
        if remove and step.q > 0:
            lt = step._logp + math.log(step.q)
            low += _gauss_mass_beyond(float(u[0]), alpha, beta - 1.0 / alpha, lt, upper=False)
            high += _gauss_mass_beyond(float(u[-1]), alpha, beta - 1.0 / alpha, lt, upper=True)
        # the infinite bin's finite atom: log(1-q) w.p. (1-q) p_inf (remove), -log(1-q)
        # w.p. p_inf (add)
        atom = (1.0 - step.q) * step.p_inf if remove else step.p_inf
    if not remove:  # back to increasing Y: reverse cells, swap the two sides
        masses, low, high = masses[::-1].copy(), high, low
    if atom > 0 and step.q < 1.0:
        loc = step.log1mq if remove else -step.log1mq
        low, high = place_atom(masses, low, high, edges, loc, atom)
    return masses, low, high


def place_atom(
    masses: np.ndarray, low: float, high: float, edges: np.ndarray, loc: float, atom: float
) -> Tuple[float, float]:
    """Add ``atom`` at loss ``loc`` to the cell ``(edges[i], edges[i+1]]`` holding it (in
    place), or to the mass below / above the edges; returns the new ``(low, high)``."""
    i = int(np.searchsorted(edges, loc, side="left")) - 1  # edges[i] < loc <= edges[i+1]
    if i < 0:
        return low + atom, high
    if i >= masses.size:
        return low, high + atom
    masses[i] += atom
    return low, high


def _discretise(step: StepPRV, direction: str, dom: _Domain) -> Tuple[np.ndarray, float, float]:
    """Cell-centred pmf on the domain, mean shift, and the step's mass at infinity.

    Mass below the first edge is dropped and the rest renormalised (moves mass up);
    mass above the last edge, and any finite mass the cells do not account for (float
    rounding, underflow), goes to infinity. The grid is shifted so that the discrete
    mean equals the continuous (truncated, renormalised) mean, as in Gopi et al.
    """
    dt = dom.dt
    edges = (dom.i0 + np.arange(dom.n + 1) - 0.5) * dt
    pmf, below, _ = _cell_masses(step, direction, edges)
    inside = float(pmf.sum())
    # finite weight of the renormalised pmf: inside + below (below is moved up); all
    # the rest of the unit mass is infinite loss (never less than the exact pm_inf)
    pm_inf_total = max(1.0 - (inside + below), step.pm_inf(direction))
    mean_c = step.partial_mean(direction, float(edges[0]), float(edges[-1])) / max(inside, 1e-300)
    pmf /= inside
    mean_d = float(np.dot(dom.centres, pmf))
    shift = mean_c - mean_d
    if abs(shift) >= dt / 2:
        logger.warning("mean shift %.3g exceeds half the mesh %.3g; clipped", shift, dt / 2)
        shift = math.copysign(dt / 2 * (1 - 1e-9), shift)
    return pmf, shift, min(pm_inf_total, 1.0)


def _epsilon_from_pmf(
    pmf: np.ndarray, ts: np.ndarray, beyond: float, delta_target: float
) -> float:
    """Smallest eps with ``sum_t pmf (1 - e^{eps - t})_+ + beyond <= delta_target``."""
    target = delta_target - beyond
    if target <= 0:
        return math.inf
    dt = ts[1] - ts[0]
    rev = pmf[::-1]
    d1 = np.cumsum(rev)[::-1]
    # D2_i = sum_{j>=i} pmf_j e^{-(t_j - t_i)} = pmf_i + e^{-dt} D2_{i+1}
    d2 = lfilter([1.0], [1.0, -math.exp(-dt)], rev)[::-1]
    delta_at = d1 - d2  # delta(t_i), non-increasing in i
    i = int(np.searchsorted(-delta_at, -target, side="left"))
    if i >= len(ts):
        return math.inf
    if i == 0:
        return max(float(ts[0]), 0.0)
    if d1[i] <= target or d2[i] <= 0:
        return float(ts[i])
    return float(ts[i] + math.log((d1[i] - target) / d2[i]))


def _compose_direction(
    steps: Sequence[StepPRV],
    counts: Sequence[int],
    direction: str,
    delta: float,
    eps_error: float,
    delta_error: float,
) -> float:
    """Epsilon upper bound of one direction of the composition (see ``compose_epsilon``)."""
    dom = _make_domain(steps, counts, eps_error, delta_error)
    total = sum(counts)
    n_fft = sp_fft.next_fast_len(dom.n + dom.n // 8, real=True)
    log_finite = 0.0
    spectrum = None
    shift_total = 0.0
    for step, count in zip(steps, counts):
        pmf, shift, pm_inf = _discretise(step, direction, dom)
        log_finite += count * math.log1p(-pm_inf) if pm_inf < 1 else -math.inf
        f = sp_fft.rfft(pmf, n_fft) ** count
        spectrum = f if spectrum is None else spectrum * f
        shift_total += count * shift
    delta_inf = -math.expm1(log_finite)
    if delta_inf >= delta - delta_error:
        return math.inf
    composed = sp_fft.irfft(spectrum, n_fft)
    offset = (total - 1) * (-dom.i0)  # sum of indices of the window's first point
    composed = np.maximum(np.roll(composed, -(offset % n_fft)), 0.0)
    window = composed[: dom.n]
    beyond = float(composed[dom.n :].sum())  # left the window: counted as infinite
    ts = dom.centres + shift_total
    delta_fin = (delta - delta_inf) / (1.0 - delta_inf)
    if np.finfo(np.longdouble).eps * dom.n > delta_fin - delta_error:
        raise ValueError(
            f"delta={delta} is too small for the floating point accuracy of the PRV "
            "composition; increase delta"
        )
    return _epsilon_from_pmf(window, ts, beyond, delta_fin - delta_error) + dom.eps_error


def compose_epsilon(
    steps: Sequence[StepPRV],
    counts: Sequence[int],
    delta: float,
    eps_error: float = 0.01,
    delta_error: Optional[float] = None,
) -> float:
    """Upper bound on epsilon of the composition of ``counts[g]`` copies of ``steps[g]``.

    ``eps = max over directions of eps_hat(delta_fin - delta_error) + eps_error`` with
    ``delta_fin = (delta - delta_inf) / (1 - delta_inf)`` (Gopi et al. Thm 5.5).
    """
    if delta_error is None:
        delta_error = delta / 1000.0
    pairs = [
        (s, int(c)) for s, c in zip(steps, counts) if c > 0 and s.q > 0 and math.isfinite(s.sigma)
    ]
    if not pairs:
        return 0.0
    steps, counts = [p[0] for p in pairs], [p[1] for p in pairs]
    if any(s.sigma <= 0 for s in steps):
        return math.inf
    eps = _compose_direction(steps, counts, "remove", delta, eps_error, delta_error)
    # The add direction is usually far below: bound it on a 10x coarser mesh first (a
    # valid upper bound, with its own eps error) and refine only when it could matter.
    coarse = _compose_direction(steps, counts, "add", delta, 10 * eps_error, delta_error)
    if coarse > eps:
        eps = max(eps, _compose_direction(steps, counts, "add", delta, eps_error, delta_error))
    return eps
