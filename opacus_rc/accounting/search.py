"""Accounting of a private hyperparameter search: a random number K of trials, only the best
one released (Papernot and Steinke, ICLR 2022, "Hyperparameter tuning with Rényi
differential privacy").

If each trial is ``(a, rdp(a))``-RDP at every order ``a`` and K is drawn independently of
the data, releasing the best of K trials is RDP with

* K truncated negative binomial (shape ``eta >= 0``, parameter ``gamma``; Thm 2):
  ``rdp(a) + (1 + eta) (1 - 1/b) rdp(b) + (1 + eta) log(1/gamma) / b + log E[K] / (a - 1)``,
  minimised over ``b`` (then made non-decreasing in ``a``). ``eta = 0``: logarithmic,
  ``eta = 1``: geometric;
* K Poisson with mean ``mu`` (Thm 6): ``rdp(a) + mu delta_hat + log(mu) / (a - 1)``, where each
  trial is ``(log(1 + 1/(a-1)), delta_hat)``-DP.

These are the forms of dp_accounting's ``RepeatAndSelectDpEvent(event, mean, shape)``
(``shape = inf``: Poisson), reproduced here on the curves of :mod:`.rdp`. When the trials'
privacy-relevant settings vary over the search space (sigma, sampling rate, steps, sketch),
``rdp`` is the pointwise maximum of their curves (a trial that draws its setting at random,
independently of the data, is a mixture of mechanisms and no worse than the worst of them).

Randomized clipping: each trial's curve caps the sensitivity multiplier Z at ``z_max``
(:func:`.rdp.mixture_rdp`). A search with Z uncapped differs from the capped one only on the
event that the differing example is drawn at a step where Z exceeds the cap, of probability
``tau <= E[K] * max(steps * q) * P(Z > z_max)`` (union bound over the trials run, whose number
is independent of it); so ``(eps, delta_rdp)`` for the capped search gives
``(eps, delta_rdp + e^eps tau)`` for the real one. The cap is chosen so that
``e^eps tau <= TAIL_DELTA_FRACTION * delta``.
"""

from __future__ import annotations

import dataclasses
import math
from functools import lru_cache
from typing import Callable, Optional, Sequence, Tuple

import numpy as np
from scipy import stats

from .accountant import MAX_SIGMA, TAIL_DELTA_FRACTION
from .prv import DEFAULT_BIN_RATIO, envelope_mixture
from .rdp import ORDERS, mixture_rdp, rdp_delta, rdp_epsilon, subsampled_gaussian_rdp
from ..values import PER_EXAMPLE_SKETCH
from .records import StepRecord
from .secant import _LogLogSecant

POISSON, LOGARITHMIC, GEOMETRIC, NEGATIVE_BINOMIAL = "poisson", "logarithmic", "geometric", "negative_binomial"
#: the distributions of the number of trials K (shape eta: inf, 0, 1, given)
DISTRIBUTIONS = (POISSON, LOGARITHMIC, GEOMETRIC, NEGATIVE_BINOMIAL)
_SHAPES = {POISSON: math.inf, LOGARITHMIC: 0.0, GEOMETRIC: 1.0}


def _expm1_over_x(x: float) -> float:
    """``(e^x - 1) / x``, stable near 0."""
    if abs(x) > 0.1:
        return math.expm1(x) / x
    return math.fsum(x ** (k - 1) / math.factorial(k) for k in range(1, 30))


def _log_over_xm1(x: float) -> float:
    """``log(x) / (x - 1)``, stable near 1."""
    if abs(x - 1.0) > 0.1:
        return math.log(x) / (x - 1.0)
    return math.fsum((1.0 - x) ** (k - 1) / k for k in range(1, 60))


def truncated_negative_binomial_mean(gamma: float, shape: float) -> float:
    """``E[K] = eta (1/gamma - 1) / (1 - gamma^eta)`` (``eta = 0``: ``(1/gamma - 1) / log(1/gamma)``)."""
    if shape == 1.0:
        return 1.0 / gamma
    if shape == 0.0:
        return 1.0 / (gamma * _log_over_xm1(gamma))
    return 1.0 / (gamma * _expm1_over_x(shape * math.log(gamma)) * _log_over_xm1(gamma))


@dataclasses.dataclass(frozen=True)
class TrialCount:
    """The distribution of the number of trials K: ``"poisson"`` (K >= 0), or a truncated
    negative binomial (K >= 1) of shape ``eta``: ``"logarithmic"`` (0), ``"geometric"`` (1),
    ``"negative_binomial"`` (``shape``, > 0). ``mean`` is E[K] (>= 1)."""

    distribution: str
    mean: float
    shape: Optional[float] = None

    def __post_init__(self) -> None:
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(
                f"distribution={self.distribution!r} is not supported; accepted values: "
                f"{', '.join(map(repr, DISTRIBUTIONS))} (the distribution of the number of trials)"
            )
        mean = self.mean
        if isinstance(mean, bool) or not isinstance(mean, (int, float)) or not (math.isfinite(mean) and mean >= 1):
            raise ValueError(f"n_trials={mean!r}; accepted values: a finite real >= 1 (the mean number of trials)")
        if self.distribution == NEGATIVE_BINOMIAL:
            s = self.shape
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not (math.isfinite(s) and s > 0):
                raise ValueError(f"shape={s!r}; accepted values: a finite real > 0 (negative_binomial's shape eta)")
        elif self.shape is not None:
            raise ValueError(
                f"shape={self.shape!r} is given with distribution={self.distribution!r}; accepted values: None "
                "(shape is only for 'negative_binomial'; 'logarithmic' is shape 0, 'geometric' shape 1)"
            )

    @property
    def eta(self) -> float:
        """The shape: inf (Poisson), 0, 1 or ``shape``."""
        return float(self.shape) if self.distribution == NEGATIVE_BINOMIAL else _SHAPES[self.distribution]

    @property
    def gamma(self) -> float:
        """The truncated negative binomial's parameter, ``E[K](gamma) = mean`` (bisection to
        rounding, the root from below: E[K] of the returned gamma is at least ``mean``)."""
        return _gamma(self.eta, float(self.mean))

    @property
    def expected(self) -> float:
        """E[K] of the distribution drawn from (``mean``, or the mean at :attr:`gamma`, which is
        at least ``mean``): what the accounting charges."""
        if self.distribution == POISSON or self.mean == 1.0:
            return float(self.mean)
        return max(float(self.mean), truncated_negative_binomial_mean(self.gamma, self.eta))

    def survival(self, k: int) -> float:
        """``P(K >= k)``."""
        if k <= 0:
            return 1.0
        if self.distribution == POISSON:
            return float(stats.poisson.sf(k - 1, self.mean))
        gamma = self.gamma
        if k == 1:
            return 1.0
        if gamma >= 1.0:
            return 0.0
        if self.eta == 0.0:
            return float(stats.logser.sf(k - 1, 1.0 - gamma))
        return float(stats.nbinom.sf(k - 1, self.eta, gamma) / stats.nbinom.sf(0, self.eta, gamma))

    def pmf(self, k: int) -> float:
        """``P(K = k)``."""
        return self.survival(k) - self.survival(k + 1)

    @property
    def spec(self) -> dict:
        """The public description: ``distribution``, ``mean_trials`` and (negative binomial) ``shape``."""
        out = {"distribution": self.distribution, "mean_trials": float(self.mean)}
        if self.distribution == NEGATIVE_BINOMIAL:
            out["shape"] = float(self.shape)
        return out


@lru_cache(maxsize=64)
def _gamma(eta: float, mean: float) -> float:
    if mean == 1.0:
        return 1.0
    if eta == 1.0:
        return 1.0 / mean
    lo, hi = 0.0, min(1.0, 2.0 * (eta + 1.0) / mean)  # E[K] <= 2 (eta + 1) / gamma
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        lo, hi = (mid, hi) if truncated_negative_binomial_mean(mid, eta) >= mean else (lo, mid)
    return lo


def repeat_and_select_rdp(orders: Sequence[float], rdp: Sequence[float], count: TrialCount) -> np.ndarray:
    """The RDP of releasing the best of K trials, each with the curve ``rdp`` at ``orders``
    (module docstring; dp_accounting's ``_compute_rdp_repeat_and_select``)."""
    a, r = np.asarray(orders, dtype=float), np.asarray(rdp, dtype=float)
    if a.shape != r.shape:
        raise ValueError(f"orders and rdp must have the same length ({a.size} and {r.size})")
    mean = count.expected
    if count.distribution == POISSON:
        out = np.empty_like(r)
        for i, alpha in enumerate(a):
            delta_hat = rdp_delta(a, r, math.log1p(1.0 / (alpha - 1.0)))[0]
            out[i] = r[i] + mean * delta_hat + math.log(mean) / (alpha - 1.0)
        return out
    eta, gamma = count.eta, count.gamma
    c = (1.0 + eta) * float(np.min((1.0 - 1.0 / a) * r - math.log(gamma) / a))
    out = r + math.log(mean) / (a - 1.0) + c
    # Rényi DP is non-decreasing in the order: a lower order gets any higher order's bound
    by_order = np.argsort(a)
    out[by_order] = np.minimum.accumulate(out[by_order][::-1])[::-1]
    return out


@dataclasses.dataclass(frozen=True)
class TrialMechanism:
    """What one trial runs, as its accountant charges it: ``steps`` logical steps at
    ``noise_multiplier`` and ``sample_rate``, each recorded as ``record`` (deterministic or
    randomized clipping, one micro-batch, independent noise)."""

    noise_multiplier: float
    sample_rate: float
    steps: int
    record: StepRecord = StepRecord()

    def __post_init__(self) -> None:
        if self.record.micro_batches != 1 or not self.record.dp_sgd:
            raise ValueError(
                f"record={self.record!r}: a search accounts trials of single-draw steps with independent noise "
                "(micro_batches=1, noise='independent'); accepted values: a record without accumulation or bands"
            )
        if not (self.noise_multiplier > 0 and 0 < self.sample_rate <= 1 and self.steps >= 1):
            raise ValueError(
                f"noise_multiplier={self.noise_multiplier!r}, sample_rate={self.sample_rate!r}, steps={self.steps!r}; "
                "accepted values: sigma > 0, q in (0, 1], steps >= 1"
            )

    def rdp(self, orders: Sequence[float], tail_mass: float) -> np.ndarray:
        """The trial's curve: ``steps`` times one step's (Z capped where ``P(Z > z_max) <= tail_mass``)."""
        return self.steps * _step_rdp(self.noise_multiplier, self.sample_rate, self.record,
                                      tuple(float(a) for a in orders), float(tail_mass) if self.record.randomized else 0.0)

    def with_noise(self, sigma: float) -> "TrialMechanism":
        return dataclasses.replace(self, noise_multiplier=float(sigma))


@lru_cache(maxsize=512)
def _step_rdp(sigma: float, q: float, record: StepRecord, orders: Tuple[float, ...], tail_mass: float) -> np.ndarray:
    if not record.randomized:
        return subsampled_gaussian_rdp(q, sigma, orders)
    hidden = record.sketching == PER_EXAMPLE_SKETCH  # as rc_prv: a shared sketch reveals Z
    mixture = envelope_mixture(record.sketch_size, tail_mass, hidden=hidden, bin_ratio=DEFAULT_BIN_RATIO)
    return mixture_rdp(q, sigma, mixture, orders)


@dataclasses.dataclass(frozen=True)
class SearchEpsilon:
    """``epsilon`` of the search at ``delta`` (order ``order``); ``trial_epsilon``: one trial
    of the worst setting, by the same RDP accounting; ``tail_delta``: the part of ``delta``
    paid for capping randomized clipping's Z (0 for deterministic clipping)."""

    epsilon: float
    delta: float
    order: float
    trial_epsilon: float
    tail_delta: float


def trial_curve(mechanisms: Sequence[TrialMechanism], orders: Sequence[float], tail_mass: float = 0.0) -> np.ndarray:
    """The pointwise maximum of the trials' curves over the search space's settings."""
    if not mechanisms:
        raise ValueError("mechanisms is empty; accepted values: the settings a trial can run (at least one)")
    return np.max([m.rdp(orders, tail_mass) for m in mechanisms], axis=0)


def search_epsilon(
    mechanisms: Sequence[TrialMechanism], count: TrialCount, delta: float, orders: Sequence[float] = ORDERS
) -> SearchEpsilon:
    """Epsilon at ``delta`` of releasing the best of K trials (module docstring), each running
    one of ``mechanisms``; randomized clipping's cap on Z is paid with at most
    ``TAIL_DELTA_FRACTION * delta``."""
    return _search_epsilon(tuple(mechanisms), count, float(delta), tuple(float(a) for a in orders))


@lru_cache(maxsize=256)
def _search_epsilon(mechanisms: Tuple[TrialMechanism, ...], count: TrialCount, delta: float, orders: Tuple[float, ...]
                    ) -> SearchEpsilon:
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta={delta!r}; accepted values: a real in (0, 1)")
    if not any(m.record.randomized for m in mechanisms):
        curve = trial_curve(mechanisms, orders)
        eps, order = rdp_epsilon(orders, repeat_and_select_rdp(orders, curve, count), delta)
        return SearchEpsilon(float(eps), delta, order, float(rdp_epsilon(orders, curve, delta)[0]), 0.0)
    exposure = count.expected * max(m.steps * m.sample_rate for m in mechanisms if m.record.randomized)
    paid = TAIL_DELTA_FRACTION * delta
    guess = 10.0
    for _ in range(20):
        tail_mass = min(0.5, paid * math.exp(-guess) / exposure)
        if tail_mass < 1e-300:  # epsilon in the hundreds: no cap is small enough; report inf
            break
        curve = trial_curve(mechanisms, orders, tail_mass)
        eps, order = rdp_epsilon(orders, repeat_and_select_rdp(orders, curve, count), delta - paid)
        trial = rdp_epsilon(orders, curve, delta - paid)[0]
        if eps <= guess:  # e^eps * tau <= paid: the cap's mass fits in its share of delta
            return SearchEpsilon(float(eps), delta, order, float(trial), math.exp(eps) * tail_mass * exposure)
        guess = eps + 1.0
    return SearchEpsilon(math.inf, delta, math.inf, math.inf, paid)


def search_noise_multiplier(
    target_epsilon: float,
    delta: float,
    count: TrialCount,
    mechanisms: Sequence[TrialMechanism],
    *,
    epsilon_tolerance: float = 0.01,
    orders: Sequence[float] = ORDERS,
) -> float:
    """The noise multiplier, shared by every setting of ``mechanisms`` (their own sigma is
    replaced), whose search epsilon at ``delta`` lies in ``[target - tolerance, target]``
    (a safeguarded secant search in ``(log sigma, log eps)``, as ``get_noise_multiplier_rc``)."""
    if not (isinstance(target_epsilon, (int, float)) and math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target_epsilon={target_epsilon!r}; accepted values: a finite real > 0 (the search's total)")
    eps_at: Callable[[float], float] = lambda s: search_epsilon(  # noqa: E731
        [m.with_noise(s) for m in mechanisms], count, delta, orders).epsilon
    solver = _LogLogSecant(float(target_epsilon), float(epsilon_tolerance))
    sigma = 1.0
    for _ in range(200):
        if sigma > MAX_SIGMA:
            raise ValueError(f"target_epsilon={target_epsilon!r}: the privacy budget is too low for this search")
        solver.update(sigma, eps_at(sigma))
        if solver.done():
            return float(solver.hi)
        sigma = solver.propose()
    raise RuntimeError("noise calibration of the search did not converge")  # pragma: no cover


__all__ = [
    "DISTRIBUTIONS", "GEOMETRIC", "LOGARITHMIC", "NEGATIVE_BINOMIAL", "POISSON", "SearchEpsilon", "TrialCount",
    "TrialMechanism", "repeat_and_select_rdp", "search_epsilon", "search_noise_multiplier", "trial_curve",
    "truncated_negative_binomial_mean",
]
