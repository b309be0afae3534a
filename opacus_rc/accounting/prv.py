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
from scipy.special import log_ndtr, logsumexp, ndtr

from .envelope import envelope_sf

logger = logging.getLogger(__name__)

#: Bins whose sensitivity ``z / sigma`` exceeds this are treated as infinite sensitivity
#: (their loss ~ mu^2 / 2 >= 800 lies far outside any useful domain).
MU_INFINITE = 40.0
#: Largest number of grid points of the discretised PRV; beyond it the mesh is widened.
MAX_DOMAIN_POINTS = 2**22
#: Normal-CDF terms below this are set to 0 (their total is added to delta, see ``_DROP``).
_PHI_NEGLIGIBLE_X = 11.5  # Phi(-11.5) < 1e-30
_DROP = 1e-30
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
) -> SensitivityMixture:
    """Bins of the envelope ``Z* = max(1, sqrt(k / chi2_k))``, every bin rounded up.

    Geometric edges ``1 = z_0 < ... < z_m = z_max`` (ratio ``1 + bin_ratio``, at least
    ``min_bins`` bins) with ``P(Z* > z_max) <= tail_mass``: that mass becomes ``p_inf``.
    Bin ``(z_{i-1}, z_i]`` gets value ``z_i`` and mass ``sf(z_{i-1}) - sf(z_i)``; the atom
    ``P(Z* = 1) = 1 - sf(1)`` stays at 1. Rounding up makes the bins stochastically
    larger than ``Z*``, hence a dominating mechanism (docs/accounting.md).
    """
    if isinstance(sketch_count, bool) or int(sketch_count) != sketch_count or sketch_count <= 0:
        raise ValueError(f"sketch_size={sketch_count!r} must be a positive integer")
    if not 0.0 < tail_mass < 1.0:
        raise ValueError(f"tail_mass={tail_mass} must lie in (0, 1)")
    if not 0.0 < bin_ratio <= 1.0:
        raise ValueError(f"bin_ratio={bin_ratio} must lie in (0, 1]")
    k = int(sketch_count)
    z_max = _quantile_z(k, tail_mass)
    if not math.isfinite(z_max):
        z_max = math.exp(200.0)
    log_max = math.log(z_max)
    step = min(math.log1p(bin_ratio), log_max / min_bins) if log_max > 0 else 1.0
    n_bins = max(1, int(math.ceil(log_max / step - 1e-9)))
    edges = np.exp(np.linspace(0.0, log_max, n_bins + 1))
    sf_e = envelope_sf(edges, k)
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
# One step: exact CDF / survival function / truncated mean / log-MGF of its PRV
# --------------------------------------------------------------------------------------


def _gauss_legendre_panels(lo: float, hi: float, panel: float, order: int = 12):
    """Nodes and weights of composite Gauss-Legendre on ``[lo, hi]``."""
    if hi <= lo:
        return np.zeros(0), np.zeros(0)
    n_panels = max(1, int(math.ceil((hi - lo) / panel)))
    xg, wg = np.polynomial.legendre.leggauss(order)
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
        """Solve ``g(x) = u`` (g convex, increasing) by interpolation plus Newton steps."""
        x_hi = self._mu_max + 40.0
        xs = np.linspace(_X_LO - 1.0, x_hi, 4001)
        gs, _ = self._g(xs)
        out = np.empty_like(u)
        for start in range(0, u.size, chunk):
            uc = u[start : start + chunk]
            finite = np.isfinite(uc)
            xc = np.full(uc.shape, _X_LO - 1.0)
            uf = np.clip(uc[finite], gs[0], gs[-1])
            x = np.interp(uf, gs, xs)
            for _ in range(4):
                g, dg = self._g(x)
                x = x - (g - uf) / dg
            xc[finite] = np.clip(x, _X_LO - 1.0, x_hi)
            out[start : start + chunk] = xc
        return out

    @staticmethod
    def _phi(x: np.ndarray) -> np.ndarray:
        """``Phi(x)``, set to 0 where it is below 1e-30 (``x < -11.5``)."""
        out = np.zeros_like(x)
        live = x > -_PHI_NEGLIGIBLE_X
        out[live] = ndtr(x[live])
        return out

    # ---- CDF (lower half) and survival function (upper half) ------------------------
    def lower_cdf(self, direction: str, s: np.ndarray) -> np.ndarray:
        """Unnormalised ``P(Y <= s, Y finite)`` for ``s < 0`` (accurate in the lower tail)."""
        q = self.q
        if direction == "remove":
            u = self._u(s)
            if self.hidden:
                x = self._x_hidden(u)
                out = (1 - q) * self._phi(x)
                for mu_j, p_j in zip(self.mu, self.p):
                    out += q * p_j * self._phi(x - mu_j)
            else:
                xj = self._x_revealed(u)
                comp = (1 - q) * self._phi(xj) + q * self._phi(xj - self.mu[None, :])
                out = comp @ self.p
                out += np.where(s >= self.log1mq, (1 - q) * self.p_inf, 0.0)
            return out
        # add: P(-log rho(X) <= s) = P(X >= x(-s)), X ~ N(0,1)
        u = self._u(-s)
        if self.hidden:
            return self._phi(-self._x_hidden(u))
        xj = self._x_revealed(u)
        return self._phi(-xj) @ self.p

    def upper_sf(self, direction: str, s: np.ndarray) -> np.ndarray:
        """Unnormalised ``P(s < Y < inf)`` for ``s >= 0`` (accurate in the upper tail)."""
        q = self.q
        if direction == "remove":
            u = self._u(s)
            if self.hidden:
                x = self._x_hidden(u)
                out = (1 - q) * self._phi(-x)
                for mu_j, p_j in zip(self.mu, self.p):
                    out += q * p_j * self._phi(mu_j - x)
                return out
            xj = self._x_revealed(u)
            comp = (1 - q) * self._phi(-xj) + q * self._phi(self.mu[None, :] - xj)
            return comp @ self.p
        below = -s > self.log1mq  # s < -log(1-q): loss can still exceed s
        u = self._u(-s)
        if self.hidden:
            out = self._phi(self._x_hidden(u))
        else:
            out = self._phi(self._x_revealed(u)) @ self.p + self.p_inf
        return np.where(below, out, 0.0)

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
            return float(logsumexp(terms))
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
            per_bin = logsumexp(
                base[None, :] + 0.5 * (i * i - i)[None, :] * self.mu[:, None] ** 2, axis=1
            )
            log_terms = self._logp + per_bin
            if self.p_inf > 0:
                log_terms = np.append(log_terms, math.log(self.p_inf) + beta * self.log1mq)
            return float(logsumexp(log_terms))
        reach = max(beta, 0.0) * self._mu_max
        x = np.arange(-14.0, reach + 14.0, 0.01)
        logphi = -0.5 * x**2 - _LOG2PI_HALF + math.log(0.01)
        if direct_hidden:
            g, _ = self._g(x)
            log_rho = np.logaddexp(self.log1mq, math.log(q) + g)
            return float(logsumexp(logphi + beta * log_rho))
        lin = math.log(q) + x[None, :] * self.mu[:, None] - 0.5 * self.mu[:, None] ** 2
        log_rho = np.logaddexp(self.log1mq, lin)
        per_bin = logsumexp(logphi[None, :] + beta * log_rho, axis=1)
        log_terms = self._logp + per_bin
        if self.p_inf > 0:
            log_terms = np.append(log_terms, math.log(self.p_inf) + beta * self.log1mq)
        return float(logsumexp(log_terms))

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


def _discretise(step: StepPRV, direction: str, dom: _Domain) -> Tuple[np.ndarray, float, float]:
    """Cell-centred pmf on the domain, mean shift, and the step's mass at infinity.

    Mass below the first edge is dropped and the rest renormalised (moves mass up);
    mass above the last edge goes to infinity. The grid is shifted so that the discrete
    mean equals the continuous (truncated, renormalised) mean, as in Gopi et al.
    """
    dt = dom.dt
    e_idx = dom.i0 + np.arange(dom.n + 1) - 0.5  # edge positions / dt
    edges = e_idx * dt
    neg = edges < 0
    cdf_lo = np.zeros(neg.sum())
    if cdf_lo.size:
        cdf_lo = step.lower_cdf(direction, edges[neg])
    sf_hi = step.upper_sf(direction, edges[~neg])
    # pmf: cells fully below 0 from the CDF, above 0 from the survival function
    finite = step._finite_mass(direction)
    n_lo = cdf_lo.size  # edges[0..n_lo-1] < 0 ; edges[n_lo..] >= 0
    pmf = np.empty(dom.n)
    pmf[: n_lo - 1] = np.diff(cdf_lo)
    pmf[n_lo - 1] = finite - cdf_lo[-1] - sf_hi[0]
    pmf[n_lo:] = -np.diff(sf_hi)
    pmf = np.maximum(pmf, 0.0)
    # mass beyond the last edge, plus a bound on the dropped Phi terms, to infinity
    dropped = 2.0 * _DROP * (step.p.size + 1) * dom.n
    upper_mass = float(sf_hi[-1]) + dropped
    inside = float(pmf.sum())
    pm_inf_total = step.pm_inf(direction) + upper_mass
    # truncated, renormalised distribution on [e_0, e_n]
    mean_c = step.partial_mean(direction, float(edges[0]), float(edges[-1])) / max(inside, 1e-300)
    pmf /= inside
    mean_d = float(np.dot(dom.centres, pmf))
    shift = mean_c - mean_d
    if abs(shift) >= dt / 2:
        logger.warning("mean shift %.3g exceeds half the mesh %.3g; clipped", shift, dt / 2)
        shift = math.copysign(dt / 2 * (1 - 1e-9), shift)
    # finite probability after renormalisation: 1 - pm_inf_total (counts mass below e_0)
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
