"""rc_prv at sample rate 1 (full batch, the privacy audit's setting) against the
closed-form Gaussian mechanism (Balle & Wang 2018): an independent computation."""

import pytest

from opacus_rc.accounting.accountant import RCPRVAccountant

from tests.oracles import gaussian_epsilon


@pytest.mark.parametrize("sigma", [1.0, 2.0])
def test_full_batch_deterministic_matches_gaussian_mechanism(sigma):
    """Within the accountant's eps_error (0.01 by default) and never below the truth."""
    acc = RCPRVAccountant()
    acc.history = [(sigma, 1.0, 1)]
    exact = gaussian_epsilon(1.0 / sigma, 1e-2)  # N(0, s^2) vs N(1, s^2): mu = 1/sigma
    eps = acc.get_epsilon(1e-2)
    assert exact <= eps <= exact + 0.02


@pytest.mark.parametrize("k", [4, 32])
def test_full_batch_randomized_is_finite_and_above_deterministic(k):
    acc = RCPRVAccountant()
    acc.history = [(2.0, 1.0, 1)]
    eps = acc.get_epsilon(1e-2, estimator="hutchinson", sketch_size=k)
    assert gaussian_epsilon(1.0 / 2.0, 1e-2) < eps < float("inf")
