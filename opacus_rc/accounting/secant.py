"""The root search of :func:`opacus_rc.accounting.accountant.get_noise_multiplier_rc`."""

from __future__ import annotations

import math
from typing import List, Optional, Tuple


class _LogLogSecant:
    """Root search of a decreasing ``eps(sigma)`` in ``(log sigma, log eps)`` coordinates.

    Keeps a bracket (``lo``: eps above the target, ``hi``: at or below it) and proposes the
    secant through the last two finite points (slope ``-1`` until there are two: ``eps`` is
    about ``1/sigma`` for a Gaussian), aimed at the middle of the acceptance window; the
    proposal is clamped to a factor 4 per step and replaced by the geometric midpoint of the
    bracket when it falls outside it or the same end moved twice in a row (Illinois-type
    safeguard), so it never needs more steps than bisection plus a few.
    """

    def __init__(self, target: float, tol: float, slope: float = -1.0) -> None:
        self.target, self.tol = target, tol
        self.aim = math.log(max(target - 0.5 * tol, 0.5 * target))
        self.lo: Optional[float] = None
        self.hi: Optional[float] = None
        self.eps_hi = math.inf
        self.points: List[Tuple[float, float]] = []
        self.slope = slope
        self._last_side = ""
        self._same_side = 0

    def update(self, sigma: float, eps: float) -> None:
        side = "hi" if eps <= self.target else "lo"
        if side == "hi" and (self.hi is None or sigma < self.hi):
            self.hi, self.eps_hi = sigma, eps
        if side == "lo" and (self.lo is None or sigma > self.lo):
            self.lo = sigma
        self._same_side = self._same_side + 1 if side == self._last_side else 0
        self._last_side = side
        if math.isfinite(eps) and eps > 0:
            self.points.append((math.log(sigma), math.log(eps)))
            if len(self.points) >= 2:
                (a0, b0), (a1, b1) = self.points[-2], self.points[-1]
                if a1 != a0 and (b1 - b0) / (a1 - a0) < 0:
                    self.slope = (b1 - b0) / (a1 - a0)

    def done(self) -> bool:
        if self.hi is None:
            return False
        if self.target - self.eps_hi <= self.tol:
            return True
        return self.lo is not None and self.hi - self.lo <= 1e-6 * self.hi

    def propose(self) -> float:
        if not self.points:  # only infinite epsilons so far: grow
            return 2.0 * (self.lo if self.lo is not None else 1.0)
        a, b = self.points[-1]
        step = min(max((self.aim - b) / self.slope, -math.log(4.0)), math.log(4.0))
        guess = math.exp(a + step)
        if self.lo is not None and self.hi is not None:
            inside = self.lo < guess < self.hi
            margin = 1e-3 * (self.hi - self.lo)
            if not inside or self._same_side >= 2:
                return math.sqrt(self.lo * self.hi) if self.lo > 0 else 0.5 * self.hi
            return min(max(guess, self.lo + margin), self.hi - margin)
        # one end at most: the bracket's side of the guess
        if self.lo is not None:
            return max(guess, 1.05 * self.lo)
        return guess if self.hi is None else min(guess, 0.95 * self.hi)
