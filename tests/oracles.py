"""Independent privacy computations the accountant and the audit are tested against.

Nothing here imports the accountant's PRV code or the audit's references: the references are
built from dp_accounting's PLDs, plain quadrature with scipy and closed forms.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from scipy import integrate, optimize, stats


def gaussian_delta(eps: float, mu: float) -> float:
    """Closed-form delta(eps) of the Gaussian mechanism N(0, 1) vs N(mu, 1) (sensitivity/sigma =
    mu; Balle & Wang 2018, Thm. 8): Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)."""
    return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)


def gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact epsilon at ``delta`` of the Gaussian mechanism with sensitivity/sigma = ``mu``."""
    if gaussian_delta(0.0, mu) <= delta:
        return 0.0
    return optimize.brentq(lambda e: gaussian_delta(e, mu) - delta, 0.0, 50.0, xtol=1e-12)


def binomial_copies(micro_batches: int, q: float):
    """``(q_m, j, w)``: P(example in some micro-batch), j = 1..m, P(J = j | J >= 1)."""
    j = np.arange(1, micro_batches + 1)
    q_m = 1.0 - (1.0 - q) ** micro_batches
    return q_m, j, stats.binom.pmf(j, micro_batches, q) / q_m


def revealed_pld_epsilon(
    sigma: float,
    q: float,
    z: Sequence[float],
    p: Sequence[float],
    p_inf: float,
    steps: int,
    delta: float,
    micro_batches: int = 1,
    d: float = 1e-3,
) -> float:
    """Revealed-Z composition with dp_accounting: per Z bin the remove-direction PLD of the
    mixture ``sum_j Bin(j; m, q) N(j z, sigma^2)`` vs ``N(0, sigma^2)`` (pessimistic),
    mixed bin by bin, self-composed by dp_accounting."""
    from dp_accounting.pld import pld_pmf
    from dp_accounting.pld import privacy_loss_distribution as pld

    q_m, j, w = binomial_copies(micro_batches, q)
    mass, inf_mass = {}, 0.0
    for zi, pi in zip(z, p):
        pmf = pld.from_mixture_gaussian_mechanism(
            sigma, np.concatenate([[0.0], zi * j]), np.concatenate([[1 - q_m], q_m * w]),
            value_discretization_interval=d,
        )._pmf_remove
        for i, v in enumerate(pmf._probs):
            mass[pmf._lower_loss + i] = mass.get(pmf._lower_loss + i, 0.0) + pi * v
        inf_mass += pi * pmf._infinity_mass
    if p_inf > 0:  # infinite bin: log(1-q_m) w.p. 1-q_m (rounded up), inf w.p. q_m
        i = math.ceil(math.log1p(-q_m) / d)
        mass[i] = mass.get(i, 0.0) + p_inf * (1 - q_m)
        inf_mass += p_inf * q_m
    lo, hi = min(mass), max(mass)
    probs = np.array([mass.get(i, 0.0) for i in range(lo, hi + 1)])
    dense = pld_pmf.DensePLDPmf(d, lo, probs, inf_mass, True)
    return dense.self_compose(steps).get_epsilon_for_delta(delta)


def single_step_epsilon(
    sigma: float,
    q: float,
    z: Sequence[float],
    p: Sequence[float],
    p_inf: float,
    delta: float,
    micro_batches: int = 1,
) -> float:
    """Epsilon of ONE revealed-Z step by quadrature of the hockey-stick divergence
    ``E_z[ int (P_z - e^eps Q)_+ ]`` in both directions (``P_z`` the mixture over
    ``J ~ Bin(m, q)`` copies of sensitivity ``J z``, ``Q = N(0, sigma^2)``); the top bin
    ``p_inf`` is infinite sensitivity."""
    q_m, j, w = binomial_copies(micro_batches, q)

    def pdf_p(x, zi):
        comps = stats.norm.pdf(x[:, None], loc=(zi * j)[None, :], scale=sigma) @ w
        return (1 - q_m) * stats.norm.pdf(x, scale=sigma) + q_m * comps

    x = np.linspace(-12 * sigma, 12 * sigma + micro_batches * max(z), 40_001)

    def delta_at(eps: float) -> float:
        qx = stats.norm.pdf(x, scale=sigma)
        remove, add = q_m * p_inf, p_inf * max(0.0, 1.0 - math.exp(eps) * (1 - q_m))
        for zi, pi in zip(z, p):
            px = pdf_p(x, zi)
            remove += pi * integrate.trapezoid(np.maximum(px - math.exp(eps) * qx, 0.0), x)
            add += pi * integrate.trapezoid(np.maximum(qx - math.exp(eps) * px, 0.0), x)
        return max(remove, add)

    return optimize.brentq(lambda e: delta_at(e) - delta, 1e-6, 60.0, xtol=1e-6)


def envelope_bins_linear(k: int, micro_batches: int, z_max: float, n_bins: int):
    """``Z_max`` bins on a linear grid from scipy's chi-square directly (k verified, so
    ``P(Z* > z) = P(chi2_k < k / z^2)``), union bound over the m slots, rounded up."""
    edges = np.linspace(1.0, z_max, n_bins + 1)
    sf = np.minimum(1.0, micro_batches * stats.chi2.cdf(k / edges**2, df=k))
    p = np.concatenate([[1.0 - sf[0]], sf[:-1] - sf[1:]])
    return edges, p, float(sf[-1])


def per_example_clipped_mean(model, loss_of, xs, ys, max_grad_norm: float, normaliser: float):
    """Brute-force DP-SGD update without noise: for each example alone, plain autograd's
    gradient of ``loss_of(model, x_i, y_i)``, clipped to ``max_grad_norm`` (flat L2 over all
    trainable parameters), summed and divided by the public ``normaliser``. Returns
    ``{name: update}``. No hook, sketch or per-sample machinery is involved."""
    import torch

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    for x, y in zip(xs, ys):
        grads = torch.autograd.grad(loss_of(model, x[None], y[None]), list(params.values()))
        norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads))
        scale = min(1.0, max_grad_norm / (float(norm) + 1e-6))
        for (n, _), g in zip(params.items(), grads):
            total[n] += scale * g
    return {n: t / normaliser for n, t in total.items()}


def per_user_clipped_mean(model, loss_of, xs, ys, users, max_grad_norm: float, normaliser: float):
    """Brute-force user-level DP-SGD update without noise: for each user, the mean of plain
    autograd's gradients of ``loss_of(model, x_r, y_r)`` over their rows (``users[r]``: the
    owner of row r), clipped to ``max_grad_norm`` (flat L2), summed over users and divided
    by the public ``normaliser``. Returns ``{name: update}``."""
    import torch

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    for user in dict.fromkeys(users):
        rows = [r for r, u in enumerate(users) if u == user]
        mean = [torch.zeros_like(p, dtype=torch.float64) for p in params.values()]
        for r in rows:
            grads = torch.autograd.grad(loss_of(model, xs[r][None], ys[r][None]), list(params.values()))
            for m, g in zip(mean, grads):
                m += g.double() / len(rows)
        norm = torch.sqrt(sum(m.pow(2).sum() for m in mean))
        scale = min(1.0, max_grad_norm / (float(norm) + 1e-6))
        for (n, _), m in zip(params.items(), mean):
            total[n] += (scale * m).to(total[n].dtype)
    return {n: t / normaliser for n, t in total.items()}


def cyclic_part(secret: bytes, key, bands: int) -> int:
    """A unit's part of the cycle (banded noise), computed here with hashlib:
    ``BLAKE2b_secret(repr(key)) mod bands`` over a 64-bit little-endian digest."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(repr(key).encode(), key=secret, digest_size=8).digest(), "little") % bands
