"""Bad input, faults and secure mode with clipping="randomized"."""

import copy

import pytest
import torch
from opacus import PrivacyEngine
from torch import nn

from opacus_rc.config import SketchConfig
from opacus_rc.sketch import Sketcher

from .models import SequenceClassifier, token_task


def private(model, *, data=None, batch_size=8, poisson=False, noise=0.5, seed=0, lr=0.1, **options):
    engine = PrivacyEngine(accountant="rc_prv")
    data = data if data is not None else token_task(n=32, t=40)
    module, opt, crit, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        criterion=nn.CrossEntropyLoss(),
        data_loader=torch.utils.data.DataLoader(data, batch_size=batch_size),
        noise_multiplier=noise,
        max_grad_norm=1.0,
        poisson_sampling=poisson,
        grad_sample_mode="ghost",
        clipping="randomized",
        noise_generator=torch.Generator().manual_seed(seed + 100),
        **{"sketch_size": 8, "sketch_seed": seed, "per_example_backward": False, **options},
    )
    return engine, module, opt, crit, loader


def step(module, opt, crit, x, y):
    """One step; returns the estimated per-sample norms (Opacus's debugging copy, read
    between backward and step: the step clears it)."""
    crit(module(x), y).backward()
    norms = getattr(module, "_per_sample_gradient_norms", None)
    opt.step()
    opt.zero_grad()
    return norms


class NaNAfterFirst(nn.Module):
    """A model whose output becomes NaN for one example (a data-dependent fault)."""

    def __init__(self):
        super().__init__()
        self.inner = SequenceClassifier()

    def forward(self, x):
        out = self.inner(x)
        bad = (x[:, 0] == 0)[:, None]
        return torch.where(bad, torch.full_like(out, float("nan")), out)


def test_non_finite_loss_raises_and_parameters_stay_finite(model_factory):
    model = NaNAfterFirst()
    before = copy.deepcopy(model.state_dict())
    engine, module, opt, crit, _ = private(model)
    x, y = token_task(n=8, t=40).tensors
    x[3, 0] = 0
    crit(module(x), y).backward()  # checked on the device: refused at the step
    with pytest.raises(FloatingPointError, match="non-finite per-sample loss"):
        opt.step()
    opt.zero_grad()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k])
    assert len(engine.accountant.history) == 0


def test_non_finite_gradient_refuses_the_step(model_factory):
    model = model_factory()
    engine, module, opt, crit, _ = private(model)
    x, y = token_task(n=8, t=40).tensors
    crit(module(x), y).backward()
    model.fc1.weight.grad[0, 0] = float("inf")  # a fault inside the clipped pass
    opt.mark_clipped()  # ... which then hands the tensor over as its output
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(FloatingPointError, match="non-finite clipped gradient"):
        opt.step()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k])
    assert len(engine.accountant.history) == 0


def test_empty_poisson_batches_are_skipped_cleanly(model_factory):
    """A tiny sample rate makes most Poisson batches empty: no error, finite params,
    and the accountant is charged for every step (empty or not), as in Opacus."""
    model = model_factory()
    data = token_task(n=64, t=40)
    engine, module, opt, crit, loader = private(model, data=data, batch_size=1, poisson=True)
    steps = empty = 0
    for x, y in loader:
        empty += len(x) == 0
        step(module, opt, crit, x, y)
        steps += 1
    assert empty > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert sum(h[2] for h in engine.accountant.history) == steps


@pytest.mark.parametrize("batch, t", [(1, 40), (4, 1), (1, 1)])
def test_batch_size_one_and_sequence_length_one(model_factory, batch, t):
    model = model_factory()
    engine, module, opt, crit, _ = private(model)
    x, y = token_task(n=batch, t=t).tensors
    norms = step(module, opt, crit, x, y)
    assert norms.shape == (batch,)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_sketch_larger_than_layer_dimensions(model_factory):
    """k = 500 exceeds every width (d = 16, hidden 24) and T = 40: works, and the
    estimates stay finite and positive."""
    model = model_factory()
    engine, module, opt, crit, _ = private(model, sketch_size=500, exact_when_cheaper=False)
    x, y = token_task(n=8, t=40).tensors
    norms = step(module, opt, crit, x, y)
    assert (norms > 0).all()


def test_secure_mode_draws_sketches_and_noise_from_os_urandom():
    """secure_mode: sketches and noise come from os.urandom (no PRNG): a sketch seed is
    refused, identically built runs differ, and the draws are N(0, 1/k) and N(0, sigma^2 C^2).
    Secure draws cannot be seeded, so the checks are distributional with tolerances far
    beyond sampling error: 2^18 draws give mean SE 0.002 and variance SE 0.0028 (6 SE
    tolerances) and a KS test at alpha = 1e-6."""
    from scipy import stats

    with pytest.raises(ValueError, match="sketch_seed must be None when secure_mode=True"):
        Sketcher(SketchConfig(), seed=1, secure_mode=True)
    sketcher = Sketcher(SketchConfig(sketch_size=4), secure_mode=True)
    first = sketcher.gaussian(1, 2**16, 4, torch.device("cpu"))
    second = sketcher.gaussian(1, 2**16, 4, torch.device("cpu"))
    assert not torch.equal(first, second)
    z = (first * 2).flatten().double()  # N(0, 1/4) scaled to N(0, 1)
    assert abs(z.mean().item()) < 6 * 2**-9
    assert abs(z.var().item() - 1) < 6 * 0.0028
    assert stats.kstest(z.numpy(), "norm").pvalue > 1e-6

    from opacus_rc.optimizer import RandomizedClippingOptimizer

    draws = []
    for _ in range(2):
        p = nn.Parameter(torch.zeros(2**18))
        opt = RandomizedClippingOptimizer(
            torch.optim.SGD([p], lr=1.0), noise_multiplier=2.0, max_grad_norm=0.5,
            expected_batch_size=1, secure_mode=True,
        )
        p.grad = torch.zeros(2**18)
        opt.mark_clipped()  # as the plugin's clipped pass does (a hand-set gradient is refused)
        opt.step()
        draws.append(-p.detach().double())  # the update is -noise: N(0, (2 * 0.5)^2)
    assert not torch.equal(draws[0], draws[1])
    assert abs(draws[0].mean().item()) < 6 * 2**-9
    assert abs(draws[0].var().item() - 1) < 6 * 0.0028
    assert stats.kstest(draws[0].numpy(), "norm").pvalue > 1e-6
