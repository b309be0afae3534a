"""opacus_rc.csprng: the secure-mode random source and its wiring.

Secure draws cannot be seeded, so the statistical checks use fixed sample sizes and
tolerances derived from the sampling distribution of each statistic:

* mean of N draws of N(0, 1): standard error 1/sqrt(N); bound 5 SE (a false failure has
  probability 6e-7);
* sample variance: SE sqrt(2 / (N - 1)); bound 5 SE;
* fourth moment: Var(z^4) = E z^8 - (E z^4)^2 = 105 - 9 = 96, SE sqrt(96 / N); bound 5 SE;
* lag-1 correlation of independent draws: SE 1/sqrt(N); bound 5 SE;
* Kolmogorov-Smirnov against N(0, 1): reject only at p < 1e-6;
* Bernoulli(p) frequency over N draws: SE sqrt(p (1 - p) / N); bound 5 SE;
* Poisson batch sizes Bin(n, q) over S batches: mean SE sqrt(n q (1 - q) / S), sample
  variance SE ~ sqrt(2 / (S - 1)) n q (1 - q) (normal approximation); bounds 5 SE.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import os
import pickle
import sys

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn

from opacus_rc import csprng
from opacus_rc.csprng import (
    CSPRNG,
    SecretStateError,
    SecureDPDataLoader,
    SecurePoissonSampler,
    secure_bernoulli,
    secure_noise,
    secure_standard_normal,
)

from .models import SequenceClassifier, token_task

N = 2**20  # > 30 CPU chunks of noise: chunk boundaries are exercised
FIVE_SE_MEAN = 5 / math.sqrt(N)
FIVE_SE_VAR = 5 * math.sqrt(2 / (N - 1))
FIVE_SE_M4 = 5 * math.sqrt(96 / N)
KS_ALPHA = 1e-6


def _check_standard_normal(z: torch.Tensor) -> None:
    z = z.flatten().double()
    assert z.numel() == N and bool(torch.isfinite(z).all())
    assert abs(z.mean().item()) < FIVE_SE_MEAN
    assert abs(z.var().item() - 1) < FIVE_SE_VAR
    assert abs(z.pow(4).mean().item() - 3) < FIVE_SE_M4
    lag1 = torch.corrcoef(torch.stack([z[:-1], z[1:]]))[0, 1].item()
    assert abs(lag1) < FIVE_SE_MEAN
    assert stats.kstest(z.numpy(), "norm").pvalue > KS_ALPHA


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_standard_normal_mean_variance_ks(dtype):
    z = secure_standard_normal((2, N // 2), dtype=dtype)
    assert z.shape == (2, N // 2) and z.dtype == dtype
    _check_standard_normal(z)


@pytest.mark.parametrize("cipher", ["aes-256-ctr", "chacha20"])
def test_noise_mean_variance_ks(cipher):
    """std * N(0, 1) as the halved sum of four normals: shape, dtype, moments, KS."""
    reference = torch.zeros(N // 4, 4)
    noise = CSPRNG(cipher).noise(2.5, reference)
    assert noise.shape == reference.shape and noise.dtype == torch.float32
    _check_standard_normal(noise / 2.5)


def test_noise_options():
    assert torch.equal(secure_noise(0.0, torch.ones(3)), torch.zeros(3))
    assert secure_noise(1.0, torch.zeros(5, dtype=torch.float64)).dtype == torch.float64
    assert secure_noise(1.0, torch.zeros((), dtype=torch.bfloat16)).shape == ()
    assert secure_noise(1.0, torch.zeros(0)).shape == (0,)
    with pytest.raises(ValueError, match="std"):
        secure_noise(-1.0, torch.zeros(3))
    with pytest.raises(ValueError, match="std"):
        secure_noise(float("nan"), torch.zeros(3))
    for n in (1, 2, 3, 2**15 + 1):  # odd sizes and a partial last chunk
        assert secure_standard_normal(n).shape == (n,)
        assert bool(torch.isfinite(secure_noise(1e-200, torch.zeros(n, dtype=torch.float64))).all())


def test_radius_is_exact_at_u_equal_one():
    """u = 1 (probability 2^-53) gives radius 0, not 0 * inf."""
    u = torch.tensor([1.0, 0.5, 2.0**-53], dtype=torch.float64)
    r = csprng._radius_(u.clone())
    expected = torch.sqrt(-2 * torch.log(u))
    torch.testing.assert_close(r.abs(), expected, rtol=1e-15, atol=0)


def test_no_repeat_across_calls_and_generators():
    """Fresh counter block per call and fresh key per generator: 2^17 64-bit words from
    two calls, and normals from two calls and two generators, have no repeat (a repeat
    by chance has probability < 2^-30)."""
    g = CSPRNG()
    words = torch.cat([g.words(2**16), g.words(2**16)])
    assert torch.unique(words).numel() == words.numel()
    assert not torch.equal(CSPRNG().words(8), CSPRNG().words(8))
    draws = torch.cat(
        [secure_standard_normal(3 * 2**15 + 5, dtype=torch.float64) for _ in range(2)]
        + [secure_noise(1.0, torch.zeros(3 * 2**15 + 5, dtype=torch.float64)) for _ in range(2)]
    )
    assert torch.unique(draws).numel() == draws.numel()
    assert len({g.random_bytes(32) for _ in range(100)}) == 100


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_does_not_replay_the_parent_stream():
    g = CSPRNG()
    g.words(1)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: the same object, same call counter
        os.close(read)
        os.write(write, g.random_bytes(32))
        os._exit(0)
    os.close(write)
    child = os.read(read, 32)
    os.waitpid(pid, 0)
    os.close(read)
    assert len(child) == 32 and child != g.random_bytes(32)


def test_uniform_and_bernoulli():
    u = csprng.default_generator().uniform(N)
    assert u.dtype == torch.float64 and float(u.min()) >= 0 and float(u.max()) < 1
    assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / N)
    assert stats.kstest(u.numpy(), "uniform").pvalue > KS_ALPHA
    for p in (0.01, 0.3):
        hits = secure_bernoulli(p, N)
        assert hits.dtype == torch.bool
        assert abs(hits.double().mean().item() - p) < 5 * math.sqrt(p * (1 - p) / N)
    assert bool(secure_bernoulli(1.0, 100).all()) and not bool(secure_bernoulli(0.0, 100).any())
    with pytest.raises(ValueError, match="p="):
        secure_bernoulli(1.5, 3)


def test_generator_state_is_never_exposed():
    g = CSPRNG()
    key = g._CSPRNG__key  # the only way in: name-mangled, never serialised
    for attempt in (
        lambda: pickle.dumps(g),
        lambda: copy.copy(g),
        lambda: copy.deepcopy(g),
        g.state_dict,
        lambda: g.load_state_dict({}),
        lambda: pickle.dumps(g.stream()),
        lambda: pickle.dumps(SecurePoissonSampler(num_samples=4, sample_rate=0.5, generator=g)),
    ):
        with pytest.raises(SecretStateError, match="refused"):
            attempt()
    assert issubclass(SecretStateError, TypeError)
    assert key.hex() not in repr(g) and "secret" in repr(g)
    with pytest.raises(ValueError, match="cipher"):
        CSPRNG("rc4")


def test_poisson_sampler_batch_size_is_binomial():
    n, q, steps = 1000, 0.05, 400
    sampler = SecurePoissonSampler(num_samples=n, sample_rate=q, steps=steps)
    assert len(sampler) == steps
    assert len(SecurePoissonSampler(num_samples=n, sample_rate=q)) == int(1 / q)
    batches = list(sampler)
    sizes = np.array([len(b) for b in batches], dtype=float)
    mean, var = n * q, n * q * (1 - q)
    assert abs(sizes.mean() - mean) < 5 * math.sqrt(var / steps)
    assert abs(sizes.var(ddof=1) - var) < 5 * math.sqrt(2 / (steps - 1)) * var
    for b in batches:
        assert b == sorted(set(b)) and all(0 <= i < n for i in b)
    # every example is sampled at rate q: inclusion counts ~ Bin(steps, q), pooled
    counts = np.bincount(np.concatenate([np.array(b, dtype=int) for b in batches]), minlength=n)
    assert abs(counts.mean() / steps - q) < 5 * math.sqrt(q * (1 - q) / (n * steps))
    with pytest.raises(ValueError, match="sample_rate"):
        SecurePoissonSampler(num_samples=n, sample_rate=0.0)


def test_poisson_sampler_rank_shares_partition_the_dataset():
    """Distributed: rank r samples the fixed share r, r + W, ...: disjoint shares whose
    union is the dataset; with q = 1 every example is drawn exactly once per step."""
    n, world = 10, 3
    shares = [
        next(iter(SecurePoissonSampler(num_samples=n, sample_rate=1.0, rank=r, world_size=world)))
        for r in range(world)
    ]
    assert sorted(i for s in shares for i in s) == list(range(n))
    for r, s in enumerate(shares):
        assert all(i % world == r for i in s)
    assert SecurePoissonSampler(num_samples=n, sample_rate=0.5, rank=0, world_size=world).num_samples == 4
    with pytest.raises(ValueError, match="rank"):
        SecurePoissonSampler(num_samples=n, sample_rate=0.5, rank=3, world_size=3)


def test_secure_data_loader_and_batch_memory_manager():
    from opacus.utils.batch_memory_manager import BatchSplittingSampler

    data = torch.utils.data.TensorDataset(torch.randn(64, 3), torch.arange(64))
    loader = SecureDPDataLoader.from_data_loader(torch.utils.data.DataLoader(data, batch_size=16))
    assert isinstance(loader.batch_sampler, SecurePoissonSampler)
    assert loader.sample_rate == 0.25 and len(loader) == 4
    for x, y in loader:
        assert x.shape[0] == y.shape[0] and x.shape[1:] == (3,)
    # an empty Poisson batch keeps the structure (Opacus's collate wrapper)
    empty = SecureDPDataLoader(data, sample_rate=1e-12)
    x, y = next(iter(empty))
    assert x.shape == (0, 3) and y.shape == (0,)
    # BatchMemoryManager sees a Poisson sampler (expected physical batches)
    assert len(BatchSplittingSampler(sampler=loader.batch_sampler, max_batch_size=8, optimizer=None)) == 8


class _Spy(CSPRNG):
    """Counts what the default generator serves."""

    def __init__(self):
        super().__init__()
        self.calls = {"standard_normal": 0, "noise": 0, "bernoulli": 0}

    def standard_normal(self, *args, **kwargs):
        self.calls["standard_normal"] += 1
        return super().standard_normal(*args, **kwargs)

    def noise(self, *args, **kwargs):
        self.calls["noise"] += 1
        return super().noise(*args, **kwargs)

    def bernoulli(self, *args, **kwargs):
        self.calls["bernoulli"] += 1
        return super().bernoulli(*args, **kwargs)


@pytest.mark.parametrize("grad_sample_mode", ["ghost", "hooks"])
def test_privacy_engine_secure_mode_end_to_end_without_torchcsprng(monkeypatch, grad_sample_mode):
    """PrivacyEngine(secure_mode=True, accountant="rc_prv") + clipping="randomized" trains
    without torchcsprng: the loader's masks, the sketches and the noise all come from the
    CSPRNG, torch's pseudo-random generator is never drawn from during training, the loss
    goes down and epsilon is reported."""
    from opacus import PrivacyEngine

    from opacus_rc.sketch import Sketcher

    monkeypatch.setitem(sys.modules, "torchcsprng", None)  # absent, whatever is installed
    with pytest.raises(ImportError):
        import torchcsprng  # noqa: F401
    spy = _Spy()
    monkeypatch.setattr(csprng, "_default", spy)

    torch.manual_seed(0)
    model = SequenceClassifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = torch.utils.data.DataLoader(token_task(n=256), batch_size=64)
    engine = PrivacyEngine(secure_mode=True, accountant="rc_prv")
    assert engine.secure_mode and engine.secure_rng is None
    out = engine.make_private(
        module=model, optimizer=optimizer, criterion=nn.CrossEntropyLoss(), data_loader=loader,
        noise_multiplier=2.0, max_grad_norm=1.0, grad_sample_mode=grad_sample_mode,
        clipping="randomized", sketch_size=16,  # T = 24 > k: linear layers are sketched
    )
    if grad_sample_mode == "ghost":
        module, opt, criterion, dp_loader = out
    else:
        (module, opt, dp_loader), criterion = out, nn.CrossEntropyLoss()
    assert isinstance(dp_loader, SecureDPDataLoader)
    assert opt.secure_mode and module.sketcher.secure_mode
    assert isinstance(module.sketcher, Sketcher)

    losses = []
    for epoch in range(4):
        batches = list(dp_loader)  # DataLoader draws a worker base seed from torch's RNG
        before = torch.random.get_rng_state()
        epoch_losses = []
        for x, y in batches:
            loss = criterion(module(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            epoch_losses.append(loss.item())
        assert torch.equal(torch.random.get_rng_state(), before), "torch's PRNG was used"
        losses.append(float(np.mean(epoch_losses)))
    assert spy.calls["bernoulli"] == 4 * len(dp_loader)
    assert spy.calls["noise"] >= 4 * len(dp_loader)  # one per parameter tensor and step
    assert spy.calls["standard_normal"] >= 4 * len(dp_loader)  # fresh sketches every step
    assert losses[-1] < 0.85 * losses[0], losses
    eps = engine.get_epsilon(1e-5)
    assert 0 < eps < math.inf


def test_secure_mode_without_torchcsprng_refuses_other_paths(monkeypatch):
    """Only the randomized path is served without torchcsprng: other accountants keep
    Opacus's ImportError at construction, other clipping modes get it at make_private."""
    from opacus import PrivacyEngine

    monkeypatch.setitem(sys.modules, "torchcsprng", None)
    with pytest.raises(ImportError, match="torchcsprng"):
        PrivacyEngine(secure_mode=True, accountant="prv")
    engine = PrivacyEngine(secure_mode=True, accountant="rc_prv")
    model = nn.Linear(3, 2)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(8, 3), torch.zeros(8, dtype=torch.long)),
        batch_size=4,
    )
    with pytest.raises(ImportError, match="torchcsprng"):
        engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, clipping="flat",
        )
    with pytest.raises(ValueError, match="poisson_sampling"):
        engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            clipping="randomized", poisson_sampling=False,
        )


def test_torchcsprng_is_not_installed_here():
    """The suite's environment has no torchcsprng: secure mode above ran without it."""
    assert importlib.util.find_spec("torchcsprng") is None


def test_benchmark_entry_point_runs():
    """Smoke test of ``python -m benchmarks.secure_noise`` (times are not asserted)."""
    from benchmarks.secure_noise import main, measure

    threads = torch.get_num_threads()
    try:
        result = measure(params=10_000, reps=1)
        assert set(result["median_s"]) == {"torch", "secure", "opacus_secure_formula"}
        assert result["ratio_median"] > 0
        assert main(["--params", "1000", "--reps", "1", "--methods", "torch,secure"]) == 0
    finally:
        torch.set_num_threads(threads)
