"""The number of trials K (opacus_rc.tuning.draws): drawn one decision at a time, its law is the
stated distribution.

Statistical checks with fixed seeds: for each law, 10,000 searches' K against the pmf by
Pearson's chi-square (cells with expected count >= 5, the tail merged); under the law the
p-value is uniform, so a threshold of 1e-3 fails a correct sampler with probability 1e-3 (the
seeds are fixed: the outcome is deterministic). The sample mean must lie within 4.5 standard
errors of the law's mean (two-sided, probability 7e-6 under the law).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from opacus_rc.accounting.search import TrialCount
from opacus_rc.tuning.draws import SecretDraws, continue_probability, draw_trial_count

LAWS = [
    TrialCount("poisson", 5), TrialCount("logarithmic", 5), TrialCount("geometric", 5),
    TrialCount("negative_binomial", 5, 0.5), TrialCount("poisson", 20), TrialCount("geometric", 1),
]


@pytest.mark.parametrize("count", LAWS, ids=lambda c: f"{c.distribution}-{c.mean}")
def test_the_number_of_trials_has_the_stated_law(count):
    n = 10_000
    draws = SecretDraws(seed=20260 + int(count.mean))
    ks = np.array([draw_trial_count(count, draws) for _ in range(n)])
    top = int(ks.max())
    pmf = np.array([count.pmf(k) for k in range(top + 1)])
    pmf[-1] += count.survival(top + 1)  # the tail beyond the largest draw joins the last cell
    observed = np.bincount(ks, minlength=top + 1).astype(float)
    expected = n * pmf
    if count.mean == 1 and count.distribution != "poisson":
        assert set(ks.tolist()) == {1}  # K = 1 surely
        return
    # merge cells (from the right, then from the left) until every expected count is >= 5
    obs, exp, acc_o, acc_e = [], [], 0.0, 0.0
    for o, e in zip(observed[::-1], expected[::-1]):
        acc_o, acc_e = acc_o + o, acc_e + e
        if acc_e >= 5:
            obs.append(acc_o), exp.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0:
        obs[-1] += acc_o
        exp[-1] += acc_e
    assert sum(exp) == pytest.approx(n, rel=1e-9)
    p_value = stats.chisquare(obs, exp).pvalue
    assert p_value > 1e-3, p_value
    ks_all = np.arange(top + 1)
    sd = math.sqrt(float((pmf * (ks_all - count.mean) ** 2).sum()))
    assert abs(ks.mean() - count.mean) <= 4.5 * sd / math.sqrt(n)


def test_continue_probabilities_are_the_conditional_survival():
    """P(trial k runs | k - 1 ran) = P(K >= k) / P(K >= k - 1); the first trial of a truncated
    negative binomial always runs, a Poisson search may run none (P = e^-mean)."""
    for count in LAWS:
        for k in range(1, 8):
            before = count.survival(k - 1)
            expected = count.survival(k) / before if before > 0 else 0.0
            assert continue_probability(count, k) == pytest.approx(expected, rel=1e-12)
    assert continue_probability(TrialCount("geometric", 5), 1) == 1.0
    assert continue_probability(TrialCount("poisson", 5), 1) == pytest.approx(1 - math.exp(-5), rel=1e-12)
    assert continue_probability(TrialCount("geometric", 4), 9) == pytest.approx(0.75, rel=1e-12)  # memoryless


def test_secure_mode_draws_from_the_csprng_and_refuses_a_seed():
    """The CSPRNG: 2,000 searches of mean 5 average within 4.5 standard errors of 5 (geometric:
    variance mean (mean - 1) = 20)."""
    draws = SecretDraws(secure_mode=True)
    ks = [draw_trial_count(TrialCount("geometric", 5), draws) for _ in range(2000)]
    assert abs(np.mean(ks) - 5) <= 4.5 * math.sqrt(20 / 2000)
    assert draws.state() is None  # nothing to save, nothing to leak
    with pytest.raises(ValueError, match="seed=3 with secure_mode=True"):
        SecretDraws(secure_mode=True, seed=3)
    with pytest.raises(ValueError, match="seed=-1"):
        SecretDraws(seed=-1)


def test_only_a_seeded_generator_has_a_state():
    assert SecretDraws().state() is None
    seeded = SecretDraws(seed=5)
    seeded.uniform()
    state = seeded.state()
    again = SecretDraws(seed=5, state=state)
    assert [again.uniform() for _ in range(3)] == [seeded.uniform() for _ in range(3)]
