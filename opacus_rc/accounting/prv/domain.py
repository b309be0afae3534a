"""The PRV domain: Chernoff bounds on both tails and the mesh."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .prvs import PRVStep

logger = logging.getLogger(__name__)

#: Largest number of grid points of the discretised PRV; beyond it the mesh is widened.
MAX_DOMAIN_POINTS = 2**22
DIRECTIONS = ("remove", "add")

#: The Chernoff bounds' exponents (both tails).
_LAMBDAS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def _chernoff_level(log_mgfs: Sequence[np.ndarray], counts: Sequence[int], delta: float) -> float:
    """Smallest ``s`` with ``P(sum Y > s) <= delta`` by ``min_l (sum K(l) + log 1/delta) / l``
    (``l`` over :data:`_LAMBDAS`, ``K(l)`` in ``log_mgfs``)."""
    lams = np.asarray(_LAMBDAS, dtype=float)
    total = np.zeros_like(lams)
    for k_vals, n in zip(log_mgfs, counts):
        total = total + n * k_vals
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
    steps: Sequence[PRVStep], counts: Sequence[int], eps_error: float, delta_error: float
) -> _Domain:
    """Domain ``[-L, L]`` (Gopi et al. remark 5.6, with Chernoff tails) and its mesh."""
    total = int(sum(counts))
    levels = [eps_error]
    for direction in DIRECTIONS:
        for tail in ("upper", "lower"):
            kv = [np.array([st.log_mgf(direction, l, tail) for l in _LAMBDAS]) for st in steps]
            levels.append(_chernoff_level(kv, counts, delta_error / 4))
            levels += [_chernoff_level([kvi], [1], delta_error / (8 * total)) for kvi in kv]
    L = max(levels) + 3.0
    if not math.isfinite(L):
        L = 1e3
    spread = math.sqrt(total * math.log(12.0 / delta_error) / 2.0)
    dt = eps_error / spread
    if 2.0 * L / dt + 2 > MAX_DOMAIN_POINTS:
        dt = 2.0 * L / (MAX_DOMAIN_POINTS - 2)
        eps_error = dt * spread
        logger.warning(
            "PRV domain capped at %d points; epsilon error raised to %.3g",
            MAX_DOMAIN_POINTS,
            eps_error,
        )
    i0 = int(math.floor(-L / dt))
    n = int(math.ceil(L / dt)) - i0 + 1
    n += n % 2
    return _Domain(i0=i0, n=n, dt=dt, eps_error=eps_error)
