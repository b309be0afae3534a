"""End-to-end behaviour of clipping="randomized" through Opacus's PrivacyEngine."""

import copy
import math

import pytest
import torch
from opacus import PrivacyEngine
from torch import nn

from .models import token_task


def loader(dataset, batch_size):
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size)


def one_step_update(model, data, *, accountant="rc_prv", lr=1.0, **make_private_kwargs):
    """Parameters after one SGD(lr) step on the single batch ``data`` (noise 0)."""
    engine = PrivacyEngine(accountant=accountant)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = engine.make_private(
        module=model,
        optimizer=opt,
        criterion=nn.CrossEntropyLoss(),
        data_loader=loader(data, len(data)),
        noise_multiplier=0.0,
        max_grad_norm=0.05,
        poisson_sampling=False,
        **make_private_kwargs,
    )
    opt = out[1]
    # wrap_model=False returns a hooks object: the caller keeps using its own model.
    forward = out[0] if make_private_kwargs.get("wrap_model", True) else model
    x, y = data.tensors
    if len(out) == 4:
        loss = out[2](forward(x), y)
    else:
        loss = nn.functional.cross_entropy(forward(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, out[0]


def relative_error(a, b):
    num = sum((a[n] - b[n]).pow(2).sum() for n in a)
    den = sum(b[n].pow(2).sum() for n in b)
    return math.sqrt(num / den)


def test_large_k_matches_opacus_flat_clipping(model_factory):
    """noise 0, k = 20,000, sketching forced (exact_when_cheaper=False).

    Relative error of an estimated norm: sd <= sqrt(2/k)/2 = 0.5%; every example is
    clipped (C = 0.05), so each clipped contribution is off by <= ~4 sd = 2% at worst
    and the update (a sum of 16 of them plus exact parts) by less: tolerance 2%.
    """
    data = token_task(n=16, t=48)
    init = model_factory(seed=1)
    start = {n: p.detach().clone() for n, p in init.named_parameters()}
    flat, _ = one_step_update(copy.deepcopy(init), data, accountant="prv")
    rc, _ = one_step_update(
        copy.deepcopy(init),
        data,
        grad_sample_mode="ghost",
        clipping="randomized",
        sketch_size=20_000,
        exact_when_cheaper=False,
        sketch_seed=0,
    )
    d_flat = {n: flat[n] - start[n] for n in start}
    d_rc = {n: rc[n] - start[n] for n in start}
    assert relative_error(d_rc, d_flat) < 0.02


@pytest.mark.parametrize("wrap_model", [True, False])
def test_exact_when_t_le_k_equals_opacus_ghost(model_factory, wrap_model):
    """T = 24 <= k = 32: linear norms are exact, so the update equals ghost clipping's."""
    data = token_task(n=16, t=24)
    init = model_factory(seed=2)
    ghost, _ = one_step_update(
        copy.deepcopy(init), data, accountant="prv", grad_sample_mode="ghost", wrap_model=wrap_model
    )
    rc, _ = one_step_update(
        copy.deepcopy(init),
        data,
        grad_sample_mode="ghost",
        clipping="randomized",
        wrap_model=wrap_model,
    )
    for n in ghost:
        torch.testing.assert_close(rc[n], ghost[n], rtol=1e-5, atol=1e-7)


def estimated_norms(module, crit, x, y):
    loss = crit(module(x), y)
    loss.backward()
    return module.per_sample_gradient_norms.clone()


def test_sketches_are_seeded_fresh_and_independent_of_data(model_factory):
    """Same seed -> same norms; a later step draws new sketches; the estimates of the
    same batch vary across steps (fresh sketches), and differ between seeds."""
    x, y = token_task(n=8, t=64)[:]

    def build(seed):
        engine = PrivacyEngine(accountant="rc_prv")
        model = model_factory(seed=0)
        module, opt, crit, _ = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            criterion=nn.CrossEntropyLoss(),
            data_loader=loader(token_task(n=8, t=64), 8),
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            grad_sample_mode="ghost",
            clipping="randomized",
            sketch_size=4,
            sketch_seed=seed,
        )
        return module, opt, crit

    m1, o1, c1 = build(123)
    m2, o2, c2 = build(123)
    m3, o3, c3 = build(456)
    n1a = estimated_norms(m1, c1, x, y)
    o1.step()  # lr 0: a new step, new sketches
    o1.zero_grad()
    n1b = estimated_norms(m1, c1, x, y)
    n2a = estimated_norms(m2, c2, x, y)
    n3a = estimated_norms(m3, c3, x, y)
    torch.testing.assert_close(n1a, n2a)
    assert not torch.allclose(n1a, n1b)
    assert not torch.allclose(n1a, n3a)


def train(engine_kwargs, make_private_kwargs, model, epochs=8, seed=0):
    torch.manual_seed(seed)
    engine = PrivacyEngine(**engine_kwargs)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    data = token_task(n=512, t=64, seed=seed)
    module, opt, crit, dl = engine.make_private(
        module=model,
        optimizer=opt,
        criterion=nn.CrossEntropyLoss(),
        data_loader=loader(data, 64),
        noise_multiplier=0.7,
        max_grad_norm=1.0,
        **make_private_kwargs,
    )
    losses = []
    for _ in range(epochs):
        for x, y in dl:
            if len(x) == 0:
                continue
            loss = crit(module(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, engine


@pytest.mark.parametrize("estimator", ["hutchinson", "hutchpp"])
def test_unchanged_opacus_loop_learns_with_noise(model_factory, estimator):
    """Only the flag differs from an Opacus ghost-clipping loop; T = 64 > k = 8 so
    the linear norms are really estimated. Start loss ~ln 2 = 0.69; it must halve."""
    losses, engine = train(
        {"accountant": "rc_prv"},
        {
            "grad_sample_mode": "ghost",
            "clipping": "randomized",
            "estimator": estimator,
            "sketch_size": 8,
            "sketch_seed": 0,
        },
        model_factory(seed=3),
    )
    start = losses[0]  # first batch, before any update
    end = sum(losses[-8:]) / 8
    assert start > 0.6
    assert end < 0.5 * start
    assert 0 < engine.get_epsilon(1e-5) < float("inf")


def test_make_private_with_epsilon_calibrates_for_randomized_clipping(model_factory):
    """sigma from make_private_with_epsilon(clipping="randomized") reaches the target
    epsilon after the planned epoch (calibration tolerance 0.01 plus the accountant's
    eps_error 0.01), and is larger than the deterministic calibration's."""
    data = token_task(n=64, t=40)
    sigmas = {}
    for clipping, accountant in [("randomized", "rc_prv"), ("flat", "prv")]:
        engine = PrivacyEngine(accountant=accountant)
        model = model_factory()
        module, opt, crit, dl = engine.make_private_with_epsilon(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            criterion=nn.CrossEntropyLoss(),
            data_loader=loader(data, 16),
            target_epsilon=3.0,
            target_delta=1e-5,
            epochs=1,
            max_grad_norm=1.0,
            grad_sample_mode="ghost",
            clipping=clipping,
            **({"sketch_size": 16} if clipping == "randomized" else {}),
        )
        sigmas[clipping] = opt.noise_multiplier
        if clipping == "randomized":
            for _ in range(len(dl)):  # the planned epoch: 4 steps at q = 1/4
                x, y = next(iter(dl))  # Poisson batch, possibly empty
                crit(module(x), y).backward()
                opt.step()
                opt.zero_grad()
            assert len(engine.accountant.history) == 1
            assert engine.accountant.history[0][2] == len(dl)
            assert 2.95 <= engine.get_epsilon(1e-5) <= 3.0 + 0.02
    assert sigmas["randomized"] > sigmas["flat"]
