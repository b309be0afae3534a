"""The search's secret draws: whether another trial runs, and each trial's settings.

The number of trials K is never drawn at once and never stored: before trial ``k`` the search
draws whether it runs, with probability ``P(K >= k) / P(K >= k-1)`` (:meth:`TrialCount.survival`);
the first ``no`` ends it. By the chain rule the number of trials run has exactly the law of K,
and a state saved between trials holds only the past (trials started, the best so far): a
resumed search draws its next decision afresh, which leaves the law unchanged (each decision
depends only on ``k``). The draws come from the CSPRNG in secure mode, else from a numpy
generator seeded from ``os.urandom``, or from ``seed`` (reproducible, and as secret as the
data: whoever knows it can recompute K; only then does a saved state keep the generator, so
that a resumed search continues its stream).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Dict, Optional

import numpy as np

from ..accounting.search import TrialCount
from ..sketch import entropy_seed


@lru_cache(maxsize=4096)
def continue_probability(count: TrialCount, k: int) -> float:
    """``P(K >= k | K >= k - 1)``: the probability that trial ``k`` (1-based) runs once ``k - 1`` have."""
    before = count.survival(k - 1)
    return 0.0 if before <= 0.0 else min(1.0, count.survival(k) / before)


class SecretDraws:
    """Uniforms in [0, 1) from the CSPRNG (``secure_mode``), ``seed``, or ``os.urandom``."""

    def __init__(self, secure_mode: bool = False, seed: Optional[int] = None, state: Optional[Dict[str, Any]] = None):
        if secure_mode and seed is not None:
            raise ValueError(f"seed={seed!r} with secure_mode=True; accepted values: seed=None in secure mode "
                             "(a known seed is no secret)")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed={seed!r}; accepted values: None or an integer >= 0")
        self.seeded = seed is not None
        self._csprng = None
        self._numpy: Optional[np.random.Generator] = None
        if secure_mode:
            from ..csprng import CSPRNG

            self._csprng = CSPRNG()
        else:
            self._numpy = np.random.Generator(np.random.PCG64(entropy_seed() if seed is None else seed))
            if state is not None and self.seeded:
                self._numpy.bit_generator.state = state

    def uniform(self) -> float:
        """One uniform in [0, 1) (53 bits)."""
        if self._csprng is not None:
            return float(self._csprng.uniform(1)[0])
        return float(self._numpy.random())

    def runs(self, count: TrialCount, k: int) -> bool:
        """Whether trial ``k`` runs (``k - 1`` have): one uniform below :func:`continue_probability`."""
        p = continue_probability(count, k)
        u = self.uniform()
        return u < p

    def state(self) -> Optional[Dict[str, Any]]:
        """What a saved search keeps of the generator: its state with ``seed``, else nothing."""
        return self._numpy.bit_generator.state if self.seeded else None


def draw_trial_count(count: TrialCount, draws: SecretDraws, limit: int = 1_000_000) -> int:
    """The number of trials a search would run (every decision drawn, no trial run): for tests."""
    k = 0
    while k < limit and draws.runs(count, k + 1):
        k += 1
    return k


__all__ = ["SecretDraws", "continue_probability", "draw_trial_count"]
