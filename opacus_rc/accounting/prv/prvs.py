"""The privacy loss random variable of one Poisson-subsampled Gaussian step with a random
sensitivity (revealed or hidden Z): CDF pieces, truncated mean, log-MGF."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Dict, Optional, Protocol, Tuple, runtime_checkable

import numpy as np

from .cells import infinite_bin_atom, step_cell_masses
from .mixtures import SensitivityMixture

#: Nodes of the interpolated inverse of the hidden-Z loss, and its accepted error.
_INVERSE_NODES = 120_001
_INVERSE_TOL = 1e-12
#: Inversions of more points than this use the fine table (its cost pays off).
_FINE_INVERSION = 200_000
#: Points per block of :meth:`StepPRV._g`.
_G_BLOCK = 1024


def _hermite_inverse(u: np.ndarray, xs: np.ndarray, gs: np.ndarray, dgs: np.ndarray) -> np.ndarray:
    """Cubic Hermite interpolation of ``x(u)`` from nodes ``(xs, gs = g(xs), dgs = g'(xs))``
    of an increasing ``g`` (inverse slopes ``1/g'``), clipped to the bracketing nodes."""
    i = np.clip(np.searchsorted(gs, u) - 1, 0, gs.size - 2)
    du = gs[i + 1] - gs[i]
    t = np.where(du > 0, (u - gs[i]) / np.where(du > 0, du, 1.0), 0.0)
    h00, h10 = (1 + 2 * t) * (1 - t) ** 2, t * (1 - t) ** 2
    h01, h11 = t * t * (3 - 2 * t), t * t * (t - 1)
    x = h00 * xs[i] + h01 * xs[i + 1] + du * (h10 / dgs[i] + h11 / dgs[i + 1])
    return np.clip(x, xs[i], xs[i + 1])


#: Bins whose sensitivity ``z / sigma`` exceeds this are treated as infinite sensitivity
#: (their loss ~ mu^2 / 2 >= 800 lies far outside any useful domain).
MU_INFINITE = 40.0
_X_LO = -40.0  # Phi(-40) underflows to 0: the Gaussian mass beyond is nil in float64
_LOG2PI_HALF = 0.5 * math.log(2.0 * math.pi)


def _lse(a: np.ndarray, axis: Optional[int] = None) -> np.ndarray:
    """``log sum exp`` along ``axis`` (plain numpy; scipy's has a large per-call overhead)."""
    m = np.max(a, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    out = np.log(np.sum(np.exp(a - m), axis=axis, keepdims=True)) + m
    return out.squeeze(axis) if axis is not None else out.reshape(())


_leggauss = lru_cache(maxsize=8)(np.polynomial.legendre.leggauss)


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


@runtime_checkable
class PRVStep(Protocol):
    """What the composition needs of one step's privacy loss random variable (finite part
    conditioned on a finite loss; ``direction``: ``"remove"`` or ``"add"``):
    :class:`StepPRV` (one micro-batch) and
    :class:`~opacus_rc.accounting.multiplicity.AccumulatedStepPRV` implement it."""

    sigma: float
    q: float

    def pm_inf(self, direction: str) -> float:
        """Probability of an infinite loss in one step."""

    def cell_masses(self, direction: str, edges: np.ndarray) -> Tuple[np.ndarray, float, float]:
        """Finite-loss masses in the cells ``(edges[i], edges[i+1]]``, and below / above."""

    def partial_mean(self, direction: str, a: float, b: float) -> float:
        """Unnormalised ``E[Y ; a <= Y <= b]``."""

    def log_mgf(self, direction: str, lam: float, tail: str) -> float:
        """Upper bound on ``log E[exp(+-lam Y)]`` of the finite part."""


def mgf_exponent(direction: str, lam: float, tail: str) -> float:
    """``beta`` with ``E[exp(lam Y)]`` (``tail="upper"``) or ``E[exp(-lam Y)]`` (``"lower"``)
    equal to ``E_Q[rho^beta]``: remove ``1 + lam`` / ``1 - lam``; add ``-lam`` / ``lam``."""
    if direction == "remove":
        return 1.0 + lam if tail == "upper" else 1.0 - lam
    return -lam if tail == "upper" else lam


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
        self.sigma = self.sigma or 1e-300
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
        self._mgf_cache: Dict[float, float] = {}  # log E_Q[rho^beta] by beta
        self._inverse_tables: Dict[bool, Tuple[np.ndarray, np.ndarray, np.ndarray, bool]] = {}

    # ---- helpers -------------------------------------------------------------------
    def pm_inf(self, direction: str) -> float:
        """Probability of infinite loss in one step (only ``remove`` has any)."""
        return self.q * self.p_inf if direction == "remove" else 0.0

    def cell_masses(self, direction: str, edges: np.ndarray) -> Tuple[np.ndarray, float, float]:
        """Finite-loss masses in the cells between ``edges``, and below / above them
        (:func:`~opacus_rc.accounting.prv.cells.step_cell_masses`)."""
        return step_cell_masses(self, direction, edges)

    def _u(self, s: np.ndarray) -> np.ndarray:
        """``u(s) = log((e^s - (1-q)) / q)`` (``-inf`` where ``s <= log(1-q)``)."""
        a = np.expm1(s) + self.q
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(a > 0, np.log(np.where(a > 0, a, 1.0)) - math.log(self.q), -np.inf)

    def _g(self, x: np.ndarray, slope: bool = True) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        """``g(x) = log sum_j p_j exp(mu_j x - mu_j^2/2)`` and ``g'(x)`` (None unless ``slope``),
        row by row in blocks of ``_G_BLOCK`` points: the (points, bins) temporaries stay in
        the L2 cache, and each point's floats do not depend on the blocking."""
        g, dg = np.empty(x.shape), np.empty(x.shape) if slope else None
        offset = (self._logp - 0.5 * self.mu**2)[None, :]
        for i in range(0, x.size, _G_BLOCK):
            a = x[i : i + _G_BLOCK, None] * self.mu[None, :] + offset
            amax = a.max(axis=1, keepdims=True)
            w = np.exp(a - amax)
            sw = w.sum(axis=1)
            g[i : i + _G_BLOCK] = amax[:, 0] + np.log(sw)
            if slope:
                dg[i : i + _G_BLOCK] = (w * self.mu[None, :]).sum(axis=1) / sw
        return g, dg

    def _inverse_nodes(self, fine: bool) -> Tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        """Nodes ``(x, g(x), g'(x))`` of the inverse's interpolant and whether it needs no
        Newton step. Coarse: 16,001 nodes (error ~1e-10), Newton always. Fine (for large
        inversions): ``_INVERSE_NODES`` nodes, whose error is measured at every midpoint
        (where a cubic Hermite error peaks) against ``_INVERSE_TOL (1 + |x|)``."""
        table = self._inverse_tables.get(fine)
        if table is None:
            xs = np.linspace(_X_LO - 1.0, self._mu_max + 40.0, _INVERSE_NODES if fine else 16001)
            gs, dgs = self._g(xs)
            accurate = False
            if fine:
                mid = 0.5 * (xs[1:] + xs[:-1])
                err = np.abs(_hermite_inverse(self._g(mid, slope=False)[0], xs, gs, dgs) - mid)
                accurate = bool((err / (1.0 + np.abs(mid))).max() <= _INVERSE_TOL)
            table = self._inverse_tables[fine] = (xs, gs, dgs, accurate)
        return table

    def _x_hidden(self, u: np.ndarray, chunk: int = 16384) -> np.ndarray:
        """Solve ``g(x) = u`` (g convex, increasing) by cubic Hermite interpolation of the
        inverse (slopes ``1/g'``; error measured below ``1e-12 (1 + |x|)``), followed by
        Newton steps until the step is below ``1e-13 (1 + |x|)`` only where that
        measurement failed (at most 6)."""
        x_hi = self._mu_max + 40.0
        xs, gs, dgs, accurate = self._inverse_nodes(fine=u.size > _FINE_INVERSION)
        out = np.empty_like(u)
        for start in range(0, u.size, chunk):
            uc = u[start : start + chunk]
            finite = np.isfinite(uc)
            xc = np.full(uc.shape, _X_LO - 1.0)
            uf = np.clip(uc[finite], gs[0], gs[-1])
            x = _hermite_inverse(uf, xs, gs, dgs)
            for _ in range(0 if accurate else 6):
                g, dg = self._g(x)
                step = (g - uf) / dg
                x = x - step
                if np.all(np.abs(step) <= 1e-13 * (1.0 + np.abs(x))):
                    break
            xc[finite] = np.clip(x, _X_LO - 1.0, x_hi)
            out[start : start + chunk] = xc
        return out

    # ---- truncated first moment ------------------------------------------------------
    def _log_rho(self, log_q_term: np.ndarray) -> np.ndarray:
        """``log rho = log(1 - q + exp(log_q_term))`` for ``log_q_term = log q + (g or lin)``."""
        return np.logaddexp(self.log1mq, log_q_term) if self.q < 1 else log_q_term

    def _density(self, direction: str, x: np.ndarray, mu: np.ndarray, p: np.ndarray) -> np.ndarray:
        """Density of ``X`` at ``x``: ``P = (1-q) N(0,1) + q sum_j p_j N(mu_j, 1)`` (remove),
        ``Q = N(0, 1)`` (add)."""
        phi = np.exp(-0.5 * x**2 - _LOG2PI_HALF)
        if direction != "remove":
            return phi
        dens = (1 - self.q) * phi
        for mu_j, p_j in zip(mu, p):
            dens = dens + self.q * p_j * np.exp(-0.5 * (x - mu_j) ** 2 - _LOG2PI_HALF)
        return dens

    def partial_mean(self, direction: str, a: float, b: float) -> float:
        """Unnormalised ``E[Y ; a <= Y <= b]`` by Gauss-Legendre quadrature in ``x``."""
        q = self.q
        sign = 1.0 if direction == "remove" else -1.0
        # loss ``sign * log rho(x)`` lies in [a, b]  <=>  x in [x(lo), x(hi)]
        lo_s, hi_s = (a, b) if direction == "remove" else (-b, -a)
        u = self._u(np.array([lo_s, hi_s]))
        if self.hidden:
            xl, xh = self._x_hidden(u)
            xl = max(xl, _X_LO) if np.isfinite(u[0]) else _X_LO
            nodes, w = _gauss_legendre_panels(xl, min(xh, self._mu_max + 40.0), 0.05)
            if not nodes.size:
                return 0.0
            loss = self._log_rho(math.log(q) + self._g(nodes, slope=False)[0])
            return float(np.sum(w * sign * loss * self._density(direction, nodes, self.mu, self.p)))
        total = 0.0
        for mu_j, p_j in zip(self.mu, self.p):
            if p_j == 0:
                continue
            xl, xh = np.where(np.isfinite(u), (u + 0.5 * mu_j**2) / mu_j, _X_LO)
            nodes, w = _gauss_legendre_panels(max(xl, _X_LO), min(xh, mu_j + 40.0), 0.05)
            if not nodes.size:
                continue
            loss = self._log_rho(math.log(q) + mu_j * nodes - 0.5 * mu_j**2)
            total += p_j * float(np.sum(w * sign * loss * self._density(direction, nodes, [mu_j], [1.0])))
        atom, mass = infinite_bin_atom(direction, q, self.p_inf)
        if mass > 0 and a <= atom <= b:
            total += atom * mass
        return total

    # ---- log moment generating functions (for the domain size) -----------------------
    def _log_rho_moment(self, beta: float) -> float:
        """``log E_Q[rho(X)^beta]`` (:meth:`_moment`), once per exponent: both directions
        and tails share exponents (e.g. remove-lower ``1 - 2`` and add-upper ``-1``), and
        the domain of each direction asks for all of them."""
        beta = float(beta)
        if beta not in self._mgf_cache:
            self._mgf_cache[beta] = self._moment(beta)
        return self._mgf_cache[beta]

    def _moment(self, beta: float) -> float:
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
            return self._with_top_bin(per_bin, beta)
        reach = max(beta, 0.0) * self._mu_max
        # rho_j^beta is analytic in the strip |Im x| < pi / mu_j (zeros of rho_j); with
        # h <= 0.25 / mu_max the trapezoid error is ~exp(-pi^2 / (mu h)) <= e^-39 relative
        h = min(0.05, 0.25 / self._mu_max)
        x = np.arange(-14.0, reach + 14.0, h)
        logphi = -0.5 * x**2 - _LOG2PI_HALF + math.log(h)
        if direct_hidden:
            log_rho = self._log_rho(math.log(q) + self._g(x, slope=False)[0])
            return float(_lse(logphi + beta * log_rho))
        log_rho = self._log_rho(math.log(q) + x[None, :] * self.mu[:, None] - 0.5 * self.mu[:, None] ** 2)
        return self._with_top_bin(_lse(logphi[None, :] + beta * log_rho, axis=1), beta)

    def _with_top_bin(self, per_bin: np.ndarray, beta: float) -> float:
        """``log(sum_j p_j E_Q[rho_j^beta] + p_inf (1-q)^beta)`` from the bins' log-moments."""
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
        beta = mgf_exponent(direction, lam, tail)
        return self._log_rho_moment(beta) - math.log(1.0 - self.pm_inf(direction))
