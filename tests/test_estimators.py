"""Statistical tests of the Hutchinson / Hutch++ estimators against exact norms.

Exact per-sample squared norms come from Opacus's own per-sample gradients
(``compute_linear_grad_sample``), an independent computation.
"""

import math

import pytest
import torch
from opacus.grad_sample.linear import compute_linear_grad_sample
from torch import nn

from opacus_rc.estimators import (
    embedding_sq_norms,
    ghost_sq_norms,
    hutchinson_sq_norms,
    hutchpp_sq_norms,
    sketch_rows,
)

N_SKETCHES = 2000


def exact_sq_norms(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    layer = nn.Linear(a.shape[-1], g.shape[-1], bias=False).double()
    gs = compute_linear_grad_sample(layer, [a], g)[layer.weight]
    return gs.reshape(gs.shape[0], -1).pow(2).sum(1)


def draw(rows: int, k: int, gen: torch.Generator, batch: int = 0) -> torch.Tensor:
    shape = (batch, rows, k) if batch else (rows, k)
    return torch.randn(shape, generator=gen, dtype=torch.float64) / math.sqrt(k)


def sample_estimates(a, g, estimator, side, k, gen, n=N_SKETCHES):
    """n independent estimates for every example: (n, B). Per-example sketches on a
    replicated batch give n independent draws in one call; a shared-sketch loop is
    checked separately."""
    b = a.shape[0]
    rows = sketch_rows(a.shape[-1], g.shape[-1], side)
    reps_a = a.repeat(n, *([1] * (a.dim() - 1)))
    reps_g = g.repeat(n, *([1] * (g.dim() - 1)))
    tail = draw(rows, k, gen, batch=n * b)
    if estimator == "hutchinson":
        est = hutchinson_sq_norms(reps_a, reps_g, tail, side=side)
    else:
        est = hutchpp_sq_norms(reps_a, reps_g, draw(rows, k, gen, batch=n * b), tail, side=side)
    return est.reshape(n, b)


SHAPES = [
    (3, (), 7, 5),  # 2-D inputs: B x d
    (2, (9,), 6, 10),  # B x T x d
    (2, (4, 5), 12, 8),  # B x T1 x T2 x d
    (2, (40,), 20, 16),
]


@pytest.mark.parametrize("estimator", ["hutchinson", "hutchpp"])
@pytest.mark.parametrize("side", ["output", "input"])
@pytest.mark.parametrize("b,middle,d,p", SHAPES)
def test_unbiased_within_4_standard_errors(estimator, side, b, middle, d, p):
    gen = torch.Generator().manual_seed(1234)
    a = torch.randn(b, *middle, d, generator=gen, dtype=torch.float64)
    g = torch.randn(b, *middle, p, generator=gen, dtype=torch.float64)
    exact = exact_sq_norms(a, g)
    k = 3  # small k: large variance makes the test sensitive to a scale error
    est = sample_estimates(a, g, estimator, side, k, gen)
    se = est.std(0) / math.sqrt(N_SKETCHES)
    # Hutch++ with k >= rank is exact (se ~ 0): allow float64 round-off then.
    assert torch.all((est.mean(0) - exact).abs() <= 4 * se + 1e-9 * exact)


@pytest.mark.parametrize("side", ["output", "input"])
def test_shared_sketch_unbiased(side):
    """One sketch for the whole batch (the default sketching), 2000 fresh sketches."""
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(3, 11, 6, generator=gen, dtype=torch.float64)
    g = torch.randn(3, 11, 9, generator=gen, dtype=torch.float64)
    exact = exact_sq_norms(a, g)
    rows = sketch_rows(6, 9, side)
    est = torch.stack(
        [hutchinson_sq_norms(a, g, draw(rows, 2, gen), side=side) for _ in range(N_SKETCHES)]
    )
    se = est.std(0) / math.sqrt(N_SKETCHES)
    assert torch.all((est.mean(0) - exact).abs() <= 4 * se)


def spectrum_matrix_inputs(singular_values, t, gen):
    """A (1, T, d), G (1, T, p) with A^T G having exactly the given singular values."""
    r = len(singular_values)
    q, _ = torch.linalg.qr(torch.randn(t, r, generator=gen, dtype=torch.float64))
    u, _ = torch.linalg.qr(torch.randn(r, r, generator=gen, dtype=torch.float64))
    a = (q @ u @ torch.diag(torch.as_tensor(singular_values, dtype=torch.float64)))[None]
    g = (q @ u)[None]
    return a, g


@pytest.mark.parametrize("k", [2, 8])
@pytest.mark.parametrize("side", ["output", "input"])
def test_hutchinson_relative_variance_matches_theory(k, side):
    """Var(n_hat/n) = 2 sum_j w_j^2 / k, w = normalised squared singular values.

    With N = 4000 draws the sample variance of a chi-square mixture has relative
    standard error sqrt((kappa - 1)/N) <= sqrt(7/4000) ~ 4.2% (excess kurtosis
    kappa - 3 <= 12/k_eff <= 6 here); the tolerance of 15% is ~3.6 such errors.
    """
    gen = torch.Generator().manual_seed(11)
    s = torch.tensor([3.0, 2.0, 1.0, 0.5, 0.25])
    a, g = spectrum_matrix_inputs(s, 12, gen)
    w = s**2 / (s**2).sum()
    theory = 2 * (w**2).sum().item() / k
    est = sample_estimates(a, g, "hutchinson", side, k, gen, n=4000)[:, 0]
    rel = est / exact_sq_norms(a, g)[0]
    assert rel.var().item() == pytest.approx(theory, rel=0.15)


def test_hutchpp_has_lower_variance_on_decaying_spectrum():
    gen = torch.Generator().manual_seed(5)
    s = 0.6 ** torch.arange(16, dtype=torch.float64)
    a, g = spectrum_matrix_inputs(s, 40, gen)
    k = 4
    var_h = sample_estimates(a, g, "hutchinson", "output", k, gen).var().item()
    var_pp = sample_estimates(a, g, "hutchpp", "output", k, gen).var().item()
    # Theory: the head removes the top-k directions, leaving a tail with
    # sum w^2 about 0.6^(4k)/(1-0.6^4)... i.e. orders of magnitude less variance.
    assert var_pp < 0.05 * var_h


def test_ghost_formula_matches_per_sample_gradients():
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(4, 13, 5, generator=gen, dtype=torch.float64)
    g = torch.randn(4, 13, 7, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(ghost_sq_norms(a, g), exact_sq_norms(a, g))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_accumulate_in_float32(dtype):
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(2, 64, 32, generator=gen).to(dtype)
    g = torch.randn(2, 64, 48, generator=gen).to(dtype)
    sketch = torch.randn(48, 16, generator=gen) / 4
    est = hutchinson_sq_norms(a, g, sketch)
    ref = hutchinson_sq_norms(a.double(), g.double(), sketch.double())
    assert est.dtype == torch.float32
    torch.testing.assert_close(est.double(), ref, rtol=1e-4, atol=0)


def test_sketch_larger_than_layer_is_exact_for_hutchpp():
    """With more head vectors than min(d, p), Q spans everything: the estimate is exact."""
    gen = torch.Generator().manual_seed(9)
    a = torch.randn(3, 20, 4, generator=gen, dtype=torch.float64)
    g = torch.randn(3, 20, 6, generator=gen, dtype=torch.float64)
    rows = sketch_rows(4, 6, "auto")
    est = hutchpp_sq_norms(a, g, draw(rows, 64, gen), draw(rows, 64, gen))
    torch.testing.assert_close(est, exact_sq_norms(a, g))


def per_sample_embedding_sq_norms(layer: nn.Embedding, ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Independent reference: one autograd backward per example through the layer."""
    out = []
    for i in range(ids.shape[0]):
        layer.zero_grad()
        (layer(ids[i : i + 1]) * g[i : i + 1]).sum().backward()
        out.append(layer.weight.grad.pow(2).sum())
    return torch.stack(out)


@pytest.mark.parametrize("padding_idx", [None, 0])
@pytest.mark.parametrize("shape", [(5, 17), (3, 4, 6), (2, 1)])
def test_embedding_norms_match_per_sample_gradients(padding_idx, shape):
    """Sort-and-segment norms equal autograd's per-example gradients (repeated ids and
    the padding row included; vocabulary 6, so most ids repeat)."""
    gen = torch.Generator().manual_seed(5)
    layer = nn.Embedding(6, 4, padding_idx=padding_idx).double()
    ids = torch.randint(0, 6, shape, generator=gen)
    g = torch.randn(*shape, 4, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(
        embedding_sq_norms(ids, g, padding_idx), per_sample_embedding_sq_norms(layer, ids, g)
    )


def test_embedding_norms_equal_opacus_ghost_norm_sampler():
    from opacus.grad_sample.embedding_norm_sample import compute_embedding_norm_sample

    gen = torch.Generator().manual_seed(6)
    layer = nn.Embedding(50, 8)
    ids = torch.randint(0, 50, (4, 64), generator=gen)
    g = torch.randn(4, 64, 8, generator=gen)
    want = compute_embedding_norm_sample(layer, [ids], g)[layer.weight].pow(2)
    torch.testing.assert_close(embedding_sq_norms(ids, g), want, rtol=1e-5, atol=1e-6)
    assert embedding_sq_norms(ids[:0], g[:0]).shape == (0,)


def test_embedding_norms_need_no_host_synchronisation():
    from benchmarks.host_sync import HostSyncCounter

    ids = torch.randint(0, 50, (4, 64))
    g = torch.randn(4, 64, 8, dtype=torch.bfloat16)
    with HostSyncCounter() as syncs:
        out = embedding_sq_norms(ids, g, padding_idx=3)
    assert syncs.where == [] and out.dtype == torch.float32
