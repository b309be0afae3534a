"""One step that sums ``m`` independently Poisson-sampled micro-batches (gradient
accumulation without BatchMemoryManager).

The differing example lands in ``J ~ Bin(m, q)`` of the step's micro-batches and each
copy is clipped on its own, so its contribution has norm at most ``C * sum_{i<=J} Z_i``
<= ``C * J * Z_max`` with ``Z_max`` the largest of the ``m`` sensitivity multipliers of
its sketch slots (one per micro-batch; they exist whether or not the example is
present). ``Z_max`` is binned from the union bound ``P(Z_max > z) <= m P(Z* > z)`` (any
dependence between the slots: shared sketches, dropout) and treated as *revealed*; ``J``
stays hidden (it is the membership itself). Per revealed bin ``z`` the step is

    ``P_z = sum_j Bin(j; m, q) N(j z / sigma, 1)``  vs  ``Q = N(0, 1)``,

i.e. a Poisson-subsampled Gaussian mixture with rate ``q_m = 1 - (1-q)^m`` and hidden
sensitivities ``j z`` (weights ``Bin(j; m, q) / q_m``, ``j >= 1``). Its privacy loss
distribution is the ``p_z``-mixture of those of :class:`StepPRV` with hidden mixtures;
the envelope's top mass ``p_inf`` is infinite loss with probability ``q_m`` and the atom
``log(1 - q_m)`` otherwise, as for a single micro-batch. ``m = 1`` is never routed here.
"""

from __future__ import annotations

import math
from typing import List, Tuple

import numpy as np
from scipy.stats import binom

from ..values import check_count
from .prv.cells import infinite_bin_atom, place_atom
from .prv.mixtures import SensitivityMixture
from .prv.prvs import StepPRV, _lse, mgf_exponent


def multiplicity_weights(micro_batches: int, sample_rate: float) -> Tuple[float, np.ndarray]:
    """``(q_m, w)``: the probability ``1 - (1-q)^m`` that the example is in some micro-batch
    and ``w[j-1] = P(J = j | J >= 1)`` for ``j = 1..m``."""
    j = np.arange(1, micro_batches + 1)
    q_m = -math.expm1(micro_batches * math.log1p(-sample_rate)) if sample_rate < 1 else 1.0
    w = binom.pmf(j, micro_batches, sample_rate) / q_m
    return q_m, w / w.sum()


class AccumulatedStepPRV:
    """PRV of one step summing ``micro_batches`` independent Poisson micro-batches.

    Args:
        noise_multiplier: sigma (noise std in units of the clipping bound C).
        sample_rate: q of each micro-batch.
        micro_batches: m >= 2.
        mixture: revealed bins of ``Z_max`` (``envelope_mixture(..., draws=m)``), or
            :data:`~opacus_rc.accounting.prv.DETERMINISTIC` for exact clipping.
    """

    hidden = False

    def __init__(
        self,
        noise_multiplier: float,
        sample_rate: float,
        micro_batches: int,
        mixture: SensitivityMixture,
    ) -> None:
        self.micro_batches = check_count(micro_batches, "micro_batches", minimum=2)
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate={sample_rate} must lie in (0, 1]")
        self.sigma = float(noise_multiplier)
        self.q, weights = multiplicity_weights(self.micro_batches, float(sample_rate))
        j = np.arange(1, self.micro_batches + 1)
        self.parts: List[Tuple[float, StepPRV]] = [
            (
                p_z,
                StepPRV(
                    self.sigma,
                    self.q,
                    SensitivityMixture(z=tuple(z * j), p=tuple(weights), hidden=True),
                ),
            )
            for z, p_z in zip(mixture.z, mixture.p)
            if p_z > 0
        ]
        self.p_inf = float(mixture.p_inf)
        self.log1mq = math.log1p(-self.q) if self.q < 1.0 else -math.inf

    def pm_inf(self, direction: str) -> float:
        """Mass at infinite loss: each bin's, plus ``q_m p_inf`` (remove only)."""
        parts = sum(p_z * part.pm_inf(direction) for p_z, part in self.parts)
        return parts + (self.q * self.p_inf if direction == "remove" else 0.0)

    def cell_masses(self, direction: str, edges: np.ndarray) -> Tuple[np.ndarray, float, float]:
        """Finite-loss masses in the cells between ``edges``, and below / above them."""
        masses, low, high = np.zeros(edges.size - 1), 0.0, 0.0
        for p_z, part in self.parts:
            m, lo, hi = part.cell_masses(direction, edges)
            masses += p_z * m
            low += p_z * lo
            high += p_z * hi
        loc, atom = infinite_bin_atom(direction, self.q, self.p_inf)
        if atom > 0:
            low, high = place_atom(masses, low, high, edges, loc, atom)
        return masses, low, high

    def partial_mean(self, direction: str, a: float, b: float) -> float:
        """Unnormalised ``E[Y ; a <= Y <= b]``."""
        total = sum(p_z * part.partial_mean(direction, a, b) for p_z, part in self.parts)
        loc, atom = infinite_bin_atom(direction, self.q, self.p_inf)
        if atom > 0 and a <= loc <= b:
            total += loc * atom
        return total

    def log_mgf(self, direction: str, lam: float, tail: str) -> float:
        """Upper bound on the log-MGF of the finite part (see :meth:`StepPRV.log_mgf`):
        the ``p_z``-mixture of the bins' moments ``E_Q[rho_z^beta]`` plus the top bin's
        ``p_inf (1 - q_m)^beta``."""
        beta = mgf_exponent(direction, lam, tail)
        terms = [math.log(p_z) + part._log_rho_moment(beta) for p_z, part in self.parts]
        if self.p_inf > 0 and self.q < 1.0:
            terms.append(math.log(self.p_inf) + beta * self.log1mq)
        return float(_lse(np.array(terms))) - math.log(1.0 - self.pm_inf(direction))
