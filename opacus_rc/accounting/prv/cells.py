"""Cell masses of one step's PRV (revealed or hidden Z) between given loss edges, and
the revealed top bin's finite atom."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Tuple

import numpy as np
from scipy.special import ndtr

from .kernel import mixture_cell_masses

if TYPE_CHECKING:  # pragma: no cover
    from .prvs import StepPRV


def infinite_bin_atom(direction: str, q: float, p_inf: float) -> Tuple[float, float]:
    """``(loss, mass)`` of the finite atom of the top (infinite-sensitivity) bin when Z
    is revealed: ``log(1-q)`` w.p. ``(1-q) p_inf`` (remove: the example is absent) and
    ``-log(1-q)`` w.p. ``p_inf`` (add); no atom when ``q = 1`` or ``p_inf = 0``."""
    if p_inf <= 0.0 or q >= 1.0:
        return 0.0, 0.0
    log1mq = math.log1p(-q)
    return (log1mq, (1.0 - q) * p_inf) if direction == "remove" else (-log1mq, p_inf)


def _revealed_masses(step: "StepPRV", t_lo: np.ndarray, t_hi: np.ndarray, remove: bool) -> np.ndarray:
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


def _hidden_components(step: "StepPRV", remove: bool) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(alpha, beta, log_w)`` of ``P = (1-q) N(0,1) + q sum_j p_j N(mu_j,1)`` (remove)
    or ``Q = N(0,1)`` (add), as ``Phi(alpha x + beta)`` components."""
    if not remove:
        return np.ones(1), np.zeros(1), np.zeros(1)
    ones = np.ones(step.mu.size + 1)
    beta = np.concatenate([[0.0], -step.mu])
    log_w = np.concatenate([[step.log1mq], math.log(step.q) + step._logp])
    return ones, beta, log_w


def _tail_masses(lo: float, hi: float, alpha: np.ndarray, beta: np.ndarray, log_w: np.ndarray) -> Tuple[float, float]:
    """``sum_j w_j P(N(0,1) < alpha_j lo + beta_j)`` and ``sum_j w_j P(N(0,1) > alpha_j hi + beta_j)``."""
    w = np.exp(log_w)
    low = float(w.sum()) if lo == math.inf else float(w @ ndtr(alpha * lo + beta))
    high = float(w.sum()) if hi == -math.inf else float(w @ ndtr(-(alpha * hi + beta)))
    return low, high


def step_cell_masses(step: "StepPRV", direction: str, edges: np.ndarray) -> Tuple[np.ndarray, float, float]:
    """Masses of the finite loss in the cells ``(edges[i], edges[i+1]]`` and the masses
    below ``edges[0]`` and above ``edges[-1]``.

    Remove: ``Y = log rho(X), X ~ P``; add: ``Y = -log rho(X), X ~ Q``. A cell in ``Y`` is an
    interval in ``u = log((e^Y - (1-q))/q)`` (remove) or in ``u(-Y)`` (add), affine in
    ``x`` per bin (revealed) or through the root ``x(u)`` of the hidden mixture.
    """
    remove = direction == "remove"
    u = step._u(edges if remove else -edges[::-1])  # increasing
    if step.hidden:
        xe = np.where(np.isfinite(u), step._x_hidden(u), -np.inf)
        alpha, beta, log_w = _hidden_components(step, remove)
        masses = mixture_cell_masses(xe[:-1], xe[1:], alpha, beta, log_w)
        low, high = _tail_masses(float(xe[0]), float(xe[-1]), alpha, beta, log_w)
        loc, atom = 0.0, 0.0
    else:
        masses = _revealed_masses(step, u[:-1], u[1:], remove)
        alpha, beta = 1.0 / step.mu, 0.5 * step.mu
        low, high = _tail_masses(float(u[0]), float(u[-1]), alpha, beta, step._logp + (step.log1mq if remove else 0.0))
        if remove and step.q > 0:
            twin = _tail_masses(float(u[0]), float(u[-1]), alpha, beta - 1.0 / alpha, step._logp + math.log(step.q))
            low, high = low + twin[0], high + twin[1]
        loc, atom = infinite_bin_atom(direction, step.q, step.p_inf)
    if not remove:  # back to increasing Y: reverse cells, swap the two sides
        masses, low, high = masses[::-1].copy(), high, low
    if atom > 0:
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
