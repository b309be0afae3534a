"""Tests of the weighted chi-square CDF, the envelope claim and the envelope of Z.

Tolerances (derived, not tuned):
* contour inversion: relative error <= 1e-10 (its half-step error estimate is < 1e-11 in
  these ranges and scipy's chi2 reference is accurate to ~1e-14 relative);
* Imhof: absolute error <= 1e-10 (quadrature tolerance 1e-12 per piece, three pieces);
* Monte Carlo: binomial standard error ``se = sqrt(p (1 - p) / n)``; two-sided checks use
  5 se (false-alarm rate 6e-7 per comparison), one-sided "never exceeds" checks allow
  ``p + 4.5 se`` (3.4e-6 per comparison), both far below 1e-3 over the whole file.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from opacus_rc.accounting import envelope as env
from tools import verify_envelope as ve
from tools.weighted_chi2 import (
    contour_logcdf,
    imhof_cdf,
    sketch_weights,
    weighted_chi2_cdf,
)

REL_TOL_CONTOUR = 1e-10
ABS_TOL_IMHOF = 1e-10
Z_TWO_SIDED = 5.0
Z_ONE_SIDED = 4.5


def _hypoexponential_cdf(x: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """``P(sum_i beta_i E_i <= x)``, E_i ~ Exp(1), distinct ``beta``: closed form
    ``1 - sum_i prod_{j!=i} beta_i/(beta_i - beta_j) e^{-x/beta_i}``."""
    out = np.zeros_like(x)
    for i, bi in enumerate(beta):
        coef = np.prod([bi / (bi - bj) for j, bj in enumerate(beta) if j != i])
        out += coef * np.exp(-x / bi)
    return 1.0 - out


def _mc_w(w: np.ndarray, k: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """Draws of ``W = sum_j w_j chi2_k / k``."""
    return rng.chisquare(k, size=(n, len(w))) @ (np.asarray(w) / k)


# ----------------------------------------------------------------- weighted chi-square


@pytest.mark.parametrize("k", [1, 2, 5, 16, 64])
def test_contour_matches_scipy_chi2_including_tiny_tails(k):
    x = np.concatenate([np.geomspace(1e-4, 0.1, 12), np.linspace(0.1, 2.5, 25)])
    logp, err = contour_logcdf(x, np.array([1.0 / k]), np.array([float(k)]), return_error=True)
    ref = stats.chi2.logcdf(k * x, k)
    assert np.all(ref > -700)  # the comparison covers tails down to ~1e-300
    assert np.max(np.abs(logp - ref)) < REL_TOL_CONTOUR
    assert np.max(err) < 1e-10


@pytest.mark.parametrize("k", [1, 3, 32])
def test_two_equal_weights_unmerged_equal_chi2_with_summed_dof(k):
    # a chi2_k + a chi2_k = a chi2_2k, evaluated through the general (unmerged) path
    a = 0.5 / k
    lam, nu = np.array([a, a]), np.array([float(k), float(k)])
    x = np.concatenate([np.geomspace(1e-3, 0.1, 5), np.linspace(0.15, 2.0, 12)])
    ref = stats.chi2.cdf(x / a, 2 * k)
    got = np.exp(contour_logcdf(x, lam, nu))
    assert np.max(np.abs(got / ref - 1)) < REL_TOL_CONTOUR
    assert np.max(np.abs(imhof_cdf(x, lam, nu) - ref)) < ABS_TOL_IMHOF


@pytest.mark.parametrize("w", [[0.7, 0.3], [0.5, 0.3, 0.2], [0.9, 0.09, 0.01]])
def test_unequal_weights_match_hypoexponential_closed_form(w):
    # k = 2: chi2_2 / 2 is Exp(1), so W = sum_j w_j E_j is hypoexponential
    w = np.array(w)
    lam, nu = sketch_weights(w, 2)
    x = np.linspace(0.05, 3.0, 20)
    ref = _hypoexponential_cdf(x, w)
    assert np.max(np.abs(np.exp(contour_logcdf(x, lam, nu)) / ref - 1)) < 1e-9  # cancellation in ref
    assert np.max(np.abs(imhof_cdf(x, lam, nu) - ref)) < ABS_TOL_IMHOF


def test_contour_and_imhof_agree_on_random_weights():
    rng = np.random.default_rng(1)
    for k in (1, 4, 16):
        for _ in range(3):
            w = rng.dirichlet(np.full(int(rng.integers(2, 7)), 0.5))
            lam, nu = sketch_weights(w, k)
            x = np.array([0.02, 0.3, 0.8, 1.0, 1.7])
            p_c = weighted_chi2_cdf(x, lam, nu)
            p_i, e_i = imhof_cdf(x, lam, nu, return_error=True)
            assert np.max(np.abs(p_c - p_i)) < ABS_TOL_IMHOF
            assert np.max(e_i) < ABS_TOL_IMHOF


def test_contour_matches_monte_carlo():
    rng = np.random.default_rng(2)
    n = 200_000
    for w, k in (([0.6, 0.25, 0.15], 1), ([0.5, 0.5 - 1e-3, 1e-3], 4), (rng.dirichlet(np.ones(8)), 8)):
        draws = _mc_w(np.array(w), k, n, rng)
        x = np.array([0.2, 0.5, 0.8, 1.0, 1.3])
        p = weighted_chi2_cdf(x, *sketch_weights(np.array(w), k))
        freq = (draws[:, None] < x).mean(0)
        se = np.sqrt(p * (1 - p) / n)
        assert np.all(np.abs(freq - p) <= Z_TWO_SIDED * se), (w, k, freq, p)


def test_weighted_chi2_input_validation():
    with pytest.raises(ValueError, match="lam"):
        contour_logcdf(np.array([0.5]), np.array([-0.1, 1.0]), np.array([1.0, 1.0]))
    with pytest.raises(ValueError, match="nu"):
        contour_logcdf(np.array([0.5]), np.array([1.0]), np.array([0.0]))
    with pytest.raises(ValueError, match="x"):
        contour_logcdf(np.array([0.0]), np.array([1.0]), np.array([1.0]))
    with pytest.raises(ValueError, match="method"):
        weighted_chi2_cdf(np.array([0.5]), np.array([1.0]), np.array([1.0]), method="davies")
    with pytest.raises(ValueError, match="k"):
        sketch_weights(np.array([1.0]), 0)
    lam, nu = sketch_weights(np.array([0.25, 0.0, 0.5, 0.25]), 4)
    np.testing.assert_allclose(lam, [0.125, 0.0625])
    np.testing.assert_allclose(nu, [4.0, 8.0])
    assert weighted_chi2_cdf(np.array([-1.0, 0.0]), lam, nu).tolist() == [0.0, 0.0]


# ------------------------------------------------------------------- envelope claim


def test_quick_adversarial_search_finds_no_violation():
    results = ve.run_search(ve.K_MAIN, quick=True, imhof_pairs=3)
    assert [r.k for r in results] == list(ve.K_MAIN)
    for r in results:
        assert r.n_vectors >= 60
        assert r.n_violations == 0, r.violations
        # the supremum is approached at the vertex, up to rounding only
        assert r.max_log_ratio < ve.REL_TOL
        assert r.max_log_ratio > -1e-6  # the vertex neighbourhood is in the search
        assert r.closest_nonvertex_log_ratio < 0
        assert r.max_contour_err < 1e-9
        assert r.imhof_max_abs < ABS_TOL_IMHOF


def test_search_detects_a_violation_above_one():
    # Sanity check of the detector: just above x = 1 mixtures exceed the single chi2
    # (docs/maths.md section 3: k=32, x=1.1 gives 0.728 vs 0.681), so the same code must flag it.
    k, x = 32, np.array([1.1])
    vecs = [("grid2", np.array([0.5, 0.5]))]
    logp, err = ve.evaluate(k, vecs, x)
    res = ve.summarize(k, vecs, x, logp, err)
    assert res.n_violations == 1
    assert np.exp(logp[0, 0]) == pytest.approx(0.728, abs=1e-3)


def test_verified_k_matches_the_search_set():
    assert env.VERIFIED_K == frozenset(ve.K_MAIN) | frozenset(ve.K_EXTRA) | frozenset(ve.K_LARGE)
    assert {2048, 4096, 10000, 100000} <= env.VERIFIED_K
    assert len(ve.weight_vectors(np.random.default_rng(0))) * len(ve.K_MAIN) >= 10_000


@pytest.mark.parametrize("k", [1, 2, 3, 8, 32, 100, 1024])
def test_chernoff_bounds_the_chi2_tail_and_every_mixture(k):
    x = np.concatenate([np.geomspace(1e-4, 0.1, 20), np.linspace(0.1, 1.0, 91)])
    x = x[0.5 * k * (np.log(x) + 1 - x) > -700]  # where the bound does not underflow
    ch = env.chernoff_lower_tail(x, k)
    assert np.all(np.log(ch) >= stats.chi2.logcdf(k * x, k) - 1e-12)
    rng = np.random.default_rng(k)
    for w in (np.array([0.5, 0.5]), rng.dirichlet(np.ones(4))):
        p = weighted_chi2_cdf(x, *sketch_weights(w, k))
        assert np.all(p <= ch * (1 + 1e-10))


def test_envelope_lower_tail_edges_and_fallback(caplog):
    x = np.array([-1.0, 0.0, 0.5, 1.0, 1.5])
    out = env.envelope_lower_tail(x, 32)
    assert out[0] == 0 and out[1] == 0 and out[4] == 1.0
    assert out[2] == pytest.approx(stats.chi2.cdf(16, 32), rel=1e-14)
    assert 2000 not in env.VERIFIED_K and env.verified_divisor(2000) == 125
    np.testing.assert_array_equal(
        env.envelope_lower_tail(x, 2000),
        np.minimum(env.chernoff_lower_tail(x, 2000), env.envelope_lower_tail(x, 125)))
    with pytest.raises(ValueError, match="k"):
        env.envelope_lower_tail(x, 0)


def test_divisor_rule_bounds_mixtures_and_beats_chernoff():
    # k = 130 (unverified, largest verified divisor 65): chi2_130/130 is the mean of two
    # chi2_65/65, so every mixture at k = 130 is a mixture at k = 65 and must lie below its
    # single-chi2 tail; checked with the exact contour CDF (relative error 1e-10).
    k, x = 130, np.concatenate([np.geomspace(1e-3, 0.1, 5), np.linspace(0.2, 1.0, 9)])
    assert env.verified_divisor(k) == 65
    bound = env.envelope_lower_tail(x, k)
    rng = np.random.default_rng(5)
    for w in (np.array([1.0]), np.array([0.7, 0.3]), rng.dirichlet(np.ones(5))):
        logp = contour_logcdf(x, *sketch_weights(w, k))
        assert np.all(logp <= np.log(bound) + REL_TOL_CONTOUR)
    # near x = 1 the divisor's tail is tighter than Chernoff (k = 20,000, x = 0.99:
    # P(chi2_10000/10000 < 0.99) = 0.24 vs e^{10000 (log 0.99 + 0.01)} = 0.60)
    xm = np.array([0.99])
    assert env.verified_divisor(20_000) == 10_000
    assert env.envelope_lower_tail(xm, 20_000)[0] == pytest.approx(stats.chi2.cdf(9900, 10_000), rel=1e-12)
    assert env.envelope_lower_tail(xm, 20_000)[0] < 0.5 * env.chernoff_lower_tail(xm, 20_000)[0]


# ------------------------------------------------------------------ envelope of Z


@pytest.mark.parametrize("k", [1, 8, 32])
def test_envelope_sf_properties_and_monte_carlo(k):
    z = np.concatenate([[0.0, 0.5, 0.999], np.linspace(1.0, 4.0, 61)])
    sf = env.envelope_sf(z, k)
    assert np.all(sf[:3] == 1.0)
    assert np.all(np.diff(sf) <= 0)
    assert sf[3] == pytest.approx(stats.chi2.cdf(k, k), rel=1e-14)
    np.testing.assert_allclose(env.envelope_cdf(z, k), 1 - sf, atol=1e-14)
    rng = np.random.default_rng(10 + k)
    n = 200_000
    zstar = np.maximum(1.0, np.sqrt(k / rng.chisquare(k, size=n)))
    freq = (zstar[:, None] > z).mean(0)
    se = np.sqrt(sf * (1 - sf) / n)
    assert np.all(np.abs(freq - sf) <= Z_TWO_SIDED * se + 1e-12)


@pytest.mark.parametrize("k, draws, bin_ratio", [(16, 1, 0.01), (32, 1, 0.04), (32, 3, 0.05)])
def test_production_bins_dominate_and_sum_to_one(k, draws, bin_ratio):
    """The accountant's bins (envelope_mixture, the one binning function): every bin is
    rounded up, so P(binned > z) >= P(Z_max > z) for every z, with P(Z_max > z) =
    min(1, draws * P(Z* > z)) (the union bound for accumulated micro-batches); the top
    mass p_inf is at most the tail budget; probabilities sum to 1."""
    from opacus_rc.accounting.prv import envelope_mixture

    tail = 1e-9
    mix = envelope_mixture(k, tail, bin_ratio=bin_ratio, draws=draws)
    z_bins, p_bins = np.array(mix.z), np.array(mix.p)
    assert z_bins[0] >= 1.0 and np.all(np.diff(z_bins) > 0) and np.all(p_bins >= 0)
    assert p_bins.sum() + mix.p_inf == pytest.approx(1.0, abs=1e-12)
    assert mix.p_inf <= tail * (1 + 1e-9)
    # bins are 1 + bin_ratio wide, COARSE_STRIDE times that in the far tail (tiny mass)
    from opacus_rc.accounting.prv.mixtures import COARSE_STRIDE, COARSE_TAIL

    ratio = z_bins[1:] / z_bins[:-1]
    near = np.minimum(1.0, draws * env.envelope_sf(z_bins[:-1], k)) >= COARSE_TAIL * tail
    assert np.all(ratio[near] <= 1 + bin_ratio + 1e-12)
    assert np.all(ratio <= (1 + bin_ratio) ** COARSE_STRIDE + 1e-12)
    z = np.concatenate([np.linspace(0.9, z_bins[-1] * 1.2, 2000), z_bins, z_bins * (1 - 1e-9)])
    binned_sf = np.array([p_bins[z_bins > zz].sum() for zz in z]) + mix.p_inf
    true_sf = np.minimum(1.0, draws * env.envelope_sf(z, k))
    assert np.all(binned_sf >= true_sf - 1e-12)


def _envelope_quantiles(k: int) -> tuple:
    """Levels p with envelope quantiles x_p <= 1: P(chi2_k/k < x_p) = p."""
    p = np.array([1e-3, 1e-2, 0.05, 0.1, 0.2, 0.3, 0.4])
    p = p[p < stats.chi2.cdf(k, k)]
    return p, stats.chi2.ppf(p, k) / k


def _assert_below_envelope(ratio: np.ndarray, k: int, label: str) -> None:
    p, xp = _envelope_quantiles(k)
    n = ratio.size
    freq = (ratio[:, None] < xp).mean(0)
    bound = p + Z_ONE_SIDED * np.sqrt(p * (1 - p) / n)
    assert np.all(freq <= bound), (label, k, freq, p)


@pytest.mark.parametrize("k", [1, 4, 32])
def test_monte_carlo_w_never_exceeds_envelope_quantiles(k):
    rng = np.random.default_rng(100 + k)
    n = 100_000
    spectra = {
        "dirichlet(0.3, m=5)": rng.dirichlet(np.full(5, 0.3)),
        "dirichlet(1, m=20)": rng.dirichlet(np.ones(20)),
        "near vertex": np.array([1 - 1e-3, 1e-3]),
        "geometric 0.5": 0.5 ** np.arange(16),
        "power law 1/i": 1.0 / np.arange(1, 33),
        "spike + flat": np.concatenate([[0.9], np.full(9, 0.1 / 9)]),
        "flat m=4": np.ones(4),
    }
    for label, w in spectra.items():
        _assert_below_envelope(_mc_w(w / w.sum(), k, n, rng), k, label)


def _gradients_with_spectrum(sv: np.ndarray, d: int, p: int, gen: torch.Generator):
    """(A, G) with T = len(sv) tokens and M = A^T G having singular values ``sv``."""
    t = len(sv)
    ua, _ = torch.linalg.qr(torch.randn(d, t, generator=gen, dtype=torch.float64))
    ug, _ = torch.linalg.qr(torch.randn(p, t, generator=gen, dtype=torch.float64))
    a = ua.T  # (T, d) with orthonormal rows
    g = torch.diag(torch.as_tensor(sv, dtype=torch.float64)) @ ug.T  # (T, p)
    return a, g


@pytest.mark.parametrize("estimator", ["hutchinson", "hutchpp"])
def test_real_estimator_ratios_never_exceed_envelope_quantiles(estimator):
    from opacus_rc.estimators import hutchinson_sq_norms, hutchpp_sq_norms, sketch_rows

    gen = torch.Generator().manual_seed(7)
    d, p, k, n = 12, 10, 8, 40_000
    for sv in (np.array([1.0, 1e-2]), np.array([1.0, 0.8, 0.5, 0.3, 0.1]), np.ones(3),
               np.abs(np.random.default_rng(3).standard_normal(6))):
        a, g = _gradients_with_spectrum(sv, d, p, gen)
        rows = sketch_rows(d, p, "auto")
        acts, backs = a.expand(n, -1, -1), g.expand(n, -1, -1)
        tail = torch.randn(n, rows, k, generator=gen, dtype=torch.float64) / np.sqrt(k)
        if estimator == "hutchinson":
            est = hutchinson_sq_norms(acts, backs, tail)
        else:
            head = torch.randn(n, rows, 1, generator=gen, dtype=torch.float64)
            est = hutchpp_sq_norms(acts, backs, head, tail)
        exact = float((a.T @ g).pow(2).sum())
        assert exact == pytest.approx(float((sv**2).sum()), rel=1e-12)
        # Hutch++: only the residual's k vectors are random, so the tail-k envelope applies
        _assert_below_envelope(est.numpy() / exact, k, f"{estimator} sv={sv}")


def test_reference_logcdf_survives_underflow():
    x = np.array([1e-4, 1e-2, 0.3, 1.0])
    for k in (8, 64):  # scipy is finite here: the two must agree
        np.testing.assert_allclose(ve.reference_logcdf(x, k), stats.chi2.logcdf(k * x, k), rtol=1e-12)
    k = 1024  # scipy underflows at small x; the series must match the contour inversion
    ref = ve.reference_logcdf(x, k)
    assert np.all(np.isfinite(ref)) and ref[0] < -4000
    got = contour_logcdf(x, np.array([1.0 / k]), np.array([float(k)]))
    np.testing.assert_allclose(got, ref, rtol=1e-12)


def test_large_k_section_is_spliced_into_the_doc():
    sec = ve.LARGE_HEADING + "\n\nnew\n"
    doc = "# T\n\n## Result\n\nr\n\n## Why the vertex\n\nw\n"
    once = ve.splice_section(doc, sec)
    assert once.index(ve.LARGE_HEADING) < once.index("## Why the vertex") and "r\n" in once
    twice = ve.splice_section(once, sec.replace("new", "newer"))
    assert twice.count(ve.LARGE_HEADING) == 1 and "newer" in twice and "\nnew\n" not in twice
    assert twice.endswith("## Why the vertex\n\nw\n")
