"""Distributions of the sensitivity multiplier Z: the envelope's bins (rounded up)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Tuple

import numpy as np

from ...values import check_count
from ..envelope import envelope_sf


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


DETERMINISTIC = SensitivityMixture(z=(1.0,), p=(1.0,))


def _quantile_z(k: int, level: float) -> float:
    """Smallest ``z >= 1`` with ``envelope_sf(z, k) <= level`` (bisection in ``log z``)."""
    above = lambda log_z: float(envelope_sf(np.array([math.exp(log_z)]), k)[0]) > level  # noqa: E731
    lo, hi = 0.0, 1.0
    while above(hi):
        lo, hi = hi, 2.0 * hi
        if hi > 200.0:  # z > e^200: treat as unbounded
            return math.inf
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if above(mid) else (lo, mid)
    return math.exp(hi)


#: Default relative width of the Z bins (z_i / z_{i-1} - 1). The rounding-up excess in
#: epsilon is about linear in it (k=32, eps~3.5: +0.05 per 0.01 of ratio).
DEFAULT_BIN_RATIO = 0.01
#: Bins whose survival mass is below ``COARSE_TAIL * tail_mass`` are merged ``COARSE_STRIDE``
#: at a time (rounded up to the merged bin's right edge).
COARSE_TAIL = 1e3
COARSE_STRIDE = 4


@lru_cache(maxsize=256)
def envelope_mixture(
    sketch_size: int,
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
    draws, k = check_count(draws, "draws"), check_count(sketch_size, "sketch_size")
    if not 0.0 < tail_mass < 1.0:
        raise ValueError(f"tail_mass={tail_mass} must lie in (0, 1)")
    if not 0.0 < bin_ratio <= 1.0:
        raise ValueError(f"bin_ratio={bin_ratio} must lie in (0, 1]")
    z_max = _quantile_z(k, tail_mass / draws)
    if not math.isfinite(z_max):
        z_max = math.exp(200.0)
    log_max = math.log(z_max)
    step = min(math.log1p(bin_ratio), log_max / min_bins) if log_max > 0 else 1.0
    n_bins = max(1, int(math.ceil(log_max / step - 1e-9)))
    edges = np.exp(np.linspace(0.0, log_max, n_bins + 1))
    sf_e = np.minimum(1.0, draws * envelope_sf(edges, k))
    # far tail (P(Z > z) below COARSE_TAIL x the cut-off mass): every COARSE_STRIDE-th edge
    # only; its bins round up further (still dominating) and cost fewer mixture components
    far = np.nonzero(sf_e < COARSE_TAIL * tail_mass)[0]
    if far.size > COARSE_STRIDE:
        kept = np.concatenate([np.arange(far[0]), far[::COARSE_STRIDE], [edges.size - 1]])
        kept = np.unique(kept)
        edges, sf_e = edges[kept], sf_e[kept]
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
