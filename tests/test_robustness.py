"""Bad input, faults, checkpoints and secure mode with clipping="randomized"."""

import copy
import io

import pytest
import torch
from opacus import PrivacyEngine
from torch import nn

from opacus_rc.config import SketchConfig
from opacus_rc.norm_samplers import linear_norm_sample
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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_model_accumulates_sketch_in_float32(dtype):
    """Norm estimates of a half-precision layer match the float64 computation on the same
    (rounded) inputs and sketch to float32 accuracy, not half precision."""
    layer = nn.Linear(64, 96).to(dtype)
    a = torch.randn(3, 80, 64).to(dtype)
    g = torch.randn(3, 80, 96).to(dtype)
    low = linear_norm_sample(layer, [a], g, Sketcher(SketchConfig(sketch_size=8), seed=1))
    ref = linear_norm_sample(
        layer.double(), [a.double()], g.double(), Sketcher(SketchConfig(sketch_size=8), seed=1)
    )
    for p_low, p_ref in zip(low.values(), ref.values()):
        assert p_low.dtype == torch.float32
        torch.testing.assert_close(p_low.double(), p_ref, rtol=1e-5, atol=0)


def test_sketch_larger_than_layer_dimensions(model_factory):
    """k = 500 exceeds every width (d = 16, hidden 24) and T = 40: works, and the
    estimates stay finite and positive."""
    model = model_factory()
    engine, module, opt, crit, _ = private(model, sketch_size=500, exact_when_cheaper=False)
    x, y = token_task(n=8, t=40).tensors
    norms = step(module, opt, crit, x, y)
    assert (norms > 0).all()


class Scale(nn.Module):
    """A layer no norm sampler knows: handled by Opacus's functorch per-sample gradients."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.scale


def test_layer_without_norm_sampler_goes_through_exact_per_sample_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), Scale(16), nn.Linear(16, 2))
    flat = copy.deepcopy(model)

    class Pool(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(x).mean(1)

    x, y = token_task(n=8, t=20).tensors
    results = []
    for m, clipping, acc in [(Pool(model), "randomized", "rc_prv"), (Pool(flat), "flat", "prv")]:
        engine = PrivacyEngine(accountant=acc)
        module, opt, crit, _ = engine.make_private(
            module=m, optimizer=torch.optim.SGD(m.parameters(), lr=1.0),
            criterion=nn.CrossEntropyLoss(),
            data_loader=torch.utils.data.DataLoader(token_task(n=8, t=20), batch_size=8),
            noise_multiplier=0.0, max_grad_norm=0.1, poisson_sampling=False,
            grad_sample_mode="ghost", clipping=clipping,
        )
        step(module, opt, crit, x, y)
        results.append(copy.deepcopy(m.state_dict()))
    for k in results[0]:  # T = 20 <= k = 32: exact everywhere, equal to Opacus ghost
        torch.testing.assert_close(results[0][k], results[1][k], rtol=1e-5, atol=1e-7)


def test_unsupported_module_gets_opacus_clear_error():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    engine = PrivacyEngine(accountant="rc_prv")
    with pytest.raises(Exception, match="BatchNorm"):
        engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            criterion=nn.CrossEntropyLoss(),
            data_loader=torch.utils.data.DataLoader(
                torch.utils.data.TensorDataset(torch.randn(8, 8), torch.zeros(8).long()), batch_size=4
            ),
            noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ghost", clipping="randomized",
        )


def build_run(seed=0):
    torch.manual_seed(seed)
    model = SequenceClassifier()
    return model, *private(model, noise=0.8, seed=seed)


SECRET_SEED = 987_654_321  # sketch and noise seed: must not appear in a default checkpoint


def _train_save_and_resume(**save_kwargs):
    """2 steps, checkpoint, step 3; a fresh run (same seeds) loads the checkpoint and
    takes its step 3. Returns both step-3 states, the engines and the checkpoint bytes."""
    x, y = token_task(n=16, t=40).tensors
    model, engine, module, opt, crit, _ = build_run(SECRET_SEED)
    for _ in range(2):
        step(module, opt, crit, x, y)
    buf = io.BytesIO()
    engine.save_checkpoint(path=buf, module=module, optimizer=opt, **save_kwargs)
    eps_saved = engine.get_epsilon(1e-5)
    step(module, opt, crit, x, y)
    uninterrupted = copy.deepcopy(model.state_dict())
    model2, engine2, module2, opt2, crit2, _ = build_run(SECRET_SEED)
    buf.seek(0)
    engine2.load_checkpoint(path=buf, module=module2, optimizer=opt2)
    eps_resumed = engine2.get_epsilon(1e-5)
    step(module2, opt2, crit2, x, y)
    assert eps_resumed == eps_saved  # the accountant's history round-trips
    return uninterrupted, model2.state_dict(), engine, engine2, eps_resumed, buf.getvalue(), module


def _holds(obj, predicate) -> bool:
    if predicate(obj):
        return True
    if isinstance(obj, dict):
        return any(_holds(k, predicate) or _holds(v, predicate) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return any(_holds(v, predicate) for v in obj)
    return False


def test_checkpoint_holds_no_generator_state_or_seed_by_default():
    """Default: neither the sketch seed nor any generator state is in the checkpoint (nor
    in optimizer.state_dict()); the resumed run reports the same epsilon and draws fresh
    randomness (its step 3 differs from the uninterrupted one)."""
    first, resumed, engine, engine2, eps_resumed, raw, module = _train_save_and_resume()
    assert engine2.get_epsilon(1e-5) == engine.get_epsilon(1e-5)
    checkpoint = torch.load(io.BytesIO(raw), weights_only=False)
    generator_states = (torch.Generator().get_state().shape, )
    assert not _holds(checkpoint, lambda o: isinstance(o, torch.Tensor) and o.dtype == torch.uint8
                      and o.shape in generator_states)
    assert module.sketcher.seed == SECRET_SEED
    assert not _holds(checkpoint, lambda o: isinstance(o, int) and not isinstance(o, bool) and o == SECRET_SEED)
    assert not _holds(checkpoint, lambda o: isinstance(o, str) and ("generator" in o or "seed" in o))
    (sigma, rate, steps, sketch), = engine2.accountant.history
    assert sketch.randomized and steps == 3
    assert any(not torch.equal(resumed[k], first[k]) for k in first)


def test_checkpoint_with_rng_state_resumes_bit_exactly():
    """include_rng_state=True (documented as secret as the data): the sketch and noise
    generators round-trip, and step 3 equals the uninterrupted one bit for bit."""
    first, resumed, engine, engine2, eps_resumed, raw, _ = _train_save_and_resume(include_rng_state=True)
    assert engine2.get_epsilon(1e-5) == engine.get_epsilon(1e-5)
    for k, v in resumed.items():
        torch.testing.assert_close(v, first[k], rtol=0, atol=0)
    with pytest.raises(ValueError, match="include_rng_state"):
        engine.save_checkpoint(path=io.BytesIO(), module=nn.Linear(2, 2), include_rng_state="yes")


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
