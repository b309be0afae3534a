"""Statistics of the audit: Clopper-Pearson bounds and a held-out threshold test.

An (eps, delta)-DP step has ``TPR <= e^eps FPR + delta`` and ``1 - FPR <= e^eps FNR + delta``
for every test, so upper bounds ``FPR_ub``, ``FNR_ub`` (alpha / 2 each) give ``eps >=
max(log((1 - delta - FNR_ub) / FPR_ub), log((1 - delta - FPR_ub) / FNR_ub))``. The threshold
of the test "canary present iff score > t" is chosen on half of the trials, the bound is
computed on the other half. See docs/audit.md, "Test and bound".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple

import numpy as np
from scipy.stats import beta

#: Number of candidate thresholds (quantiles of the pooled selection scores).
N_CANDIDATES = 512


def _check_alpha(alpha: float) -> float:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha={alpha!r} is invalid; accepted values: a float in (0, 1)")
    return float(alpha)


def clopper_pearson_upper(errors: np.ndarray, trials: np.ndarray, alpha: float) -> np.ndarray:
    """One-sided ``1 - alpha`` Clopper-Pearson upper bound on a binomial proportion:
    ``Beta^{-1}(1 - alpha; x + 1, n - x)`` for ``x < n``, 1 for ``x = n``."""
    alpha = _check_alpha(alpha)
    x = np.asarray(errors, dtype=float)
    n = np.broadcast_to(np.asarray(trials, dtype=float), x.shape)
    if np.any(n <= 0) or np.any(x < 0) or np.any(x > n):
        raise ValueError("clopper_pearson_upper needs 0 <= errors <= trials and trials > 0")
    out = np.ones_like(x)
    live = x < n
    out[live] = beta.ppf(1.0 - alpha, x[live] + 1.0, n[live] - x[live])
    return out


def epsilon_from_rates(fpr_ub: np.ndarray, fnr_ub: np.ndarray, delta: float) -> np.ndarray:
    """``max(log((1-delta-FNR)/FPR), log((1-delta-FPR)/FNR), 0)`` elementwise."""
    fpr_ub = np.asarray(fpr_ub, dtype=float)
    fnr_ub = np.asarray(fnr_ub, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.log(np.maximum(1.0 - delta - fnr_ub, 0.0) / fpr_ub)
        b = np.log(np.maximum(1.0 - delta - fpr_ub, 0.0) / fnr_ub)
    out = np.maximum(np.nan_to_num(a, nan=-np.inf), np.nan_to_num(b, nan=-np.inf))
    return np.maximum(out, 0.0)


def _errors(scores_in: np.ndarray, scores_out: np.ndarray, t: np.ndarray, alpha: float) -> Tuple[np.ndarray, ...]:
    """Per threshold: false positives (out-scores > t), false negatives (in-scores <= t) and
    their Clopper-Pearson upper rates ``FPR_ub``, ``FNR_ub`` at ``alpha / 2`` each."""
    fp = len(scores_out) - np.searchsorted(np.sort(scores_out), t, side="right")
    fn = np.searchsorted(np.sort(scores_in), t, side="right")
    ub = lambda errors, n: clopper_pearson_upper(errors, n, alpha / 2)  # noqa: E731
    return fp, fn, ub(fp, len(scores_out)), ub(fn, len(scores_in))


def choose_threshold(scores_in: np.ndarray, scores_out: np.ndarray, delta: float, alpha: float) -> float:
    """The threshold maximising the Clopper-Pearson epsilon bound on these scores."""
    pooled = np.concatenate([scores_in, scores_out])
    candidates = np.unique(np.quantile(pooled, np.linspace(0.0, 1.0, N_CANDIDATES)))
    # midpoints between order statistics separate perfectly separable samples cleanly
    candidates = np.unique(np.concatenate([candidates, 0.5 * (candidates[1:] + candidates[:-1])]))
    _, _, fpr_ub, fnr_ub = _errors(scores_in, scores_out, candidates, alpha)
    eps = epsilon_from_rates(fpr_ub, fnr_ub, delta)
    return float(candidates[int(np.argmax(eps))])


@dataclass(frozen=True)
class ThresholdAudit:
    """Outcome of the held-out threshold test (counts are on the evaluation part)."""

    eps_lower: float
    threshold: float
    false_positives: int
    negatives: int
    false_negatives: int
    positives: int
    fpr_ub: float
    fnr_ub: float


def threshold_audit(
    select_in: np.ndarray,
    select_out: np.ndarray,
    eval_in: np.ndarray,
    eval_out: np.ndarray,
    delta: float,
    alpha: float = 0.05,
) -> ThresholdAudit:
    """Lower bound on epsilon, valid with probability ``>= 1 - alpha``: ``select_*`` (scores with
    / without the canary) choose the threshold, ``eval_*`` give the counts and the bounds."""
    alpha = _check_alpha(alpha)
    if not 0.0 <= delta < 1.0:
        raise ValueError(f"delta={delta!r} is invalid; accepted values: a float in [0, 1)")
    arrays = [np.asarray(a, dtype=float).ravel() for a in (select_in, select_out, eval_in, eval_out)]
    if any(a.size == 0 for a in arrays):
        raise ValueError("threshold_audit needs non-empty score arrays")
    select_in, select_out, eval_in, eval_out = arrays
    t = choose_threshold(select_in, select_out, delta, alpha)
    fp, fn, fpr, fnr = _errors(eval_in, eval_out, np.array([t]), alpha)
    fpr_ub, fnr_ub = float(fpr[0]), float(fnr[0])
    eps = float(epsilon_from_rates(fpr_ub, fnr_ub, delta))
    return ThresholdAudit(
        eps_lower=eps if math.isfinite(eps) else 0.0,
        threshold=t,
        false_positives=int(fp[0]),
        negatives=len(eval_out),
        false_negatives=int(fn[0]),
        positives=len(eval_in),
        fpr_ub=fpr_ub,
        fnr_ub=fnr_ub,
    )
