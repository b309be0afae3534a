"""Noise and Poisson sampling under clipping="randomized" never come from torch's global
generator (issue 21, item 3).

A script that calls ``torch.manual_seed(0)`` at the top (as every example does) and is
resumed used to replay its noise and its Poisson batches: resumed steps 3 and 4 equalled
steps 1 and 2, so their difference was noise-free. The plugin now owns its noise and
Poisson generators, seeded from ``os.urandom`` unless the user asks for a reproducible run
(``seed=``, Opacus's ``noise_generator=`` / the DataLoader's ``generator=``).

The runs below have zero gradients (inputs 0, a bias-free linear layer), so every update
(the noisy averaged gradient the optimizer applies) is pure noise, ``N(0, sigma^2 C^2) / B``. "Differ" is exact inequality of float
tensors drawn from fresh streams (two equal 8-entry Gaussian draws or two equal Poisson
masks over 64 examples at q = 1/8 have probability < 1e-7); "replay" is bit equality.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_rc.sketch import NOISE_STREAM, POISSON_STREAM, SKETCH_STREAM, DeviceStreams

N, D, BATCH, SIGMA, C = 64, 4, 8, 1.0, 1.0
MODES = ("ghost", "hooks")


def _loader(**kwargs) -> DataLoader:
    """Zero inputs, labels and the example index (to read the Poisson batches)."""
    data = TensorDataset(torch.zeros(N, D), torch.arange(N) % 2, torch.arange(N))
    return DataLoader(data, batch_size=BATCH, **kwargs)


def _build(mode: str, loader_kwargs=None, **options):
    """What a script does after ``torch.manual_seed(0)``: model, engine, make_private."""
    torch.manual_seed(0)
    model = nn.Linear(D, 2, bias=False)
    engine = PrivacyEngine(accountant="rc_prv")
    out = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=_loader(**(loader_kwargs or {})), criterion=nn.CrossEntropyLoss(),
        noise_multiplier=SIGMA, max_grad_norm=C, grad_sample_mode=mode,
        clipping="randomized", sketch_size=2, **options,
    )
    crit = out[2] if mode == "ghost" else nn.CrossEntropyLoss()
    return engine, model, out[0], out[1], crit, out[-1]


def _steps(run, n: int = 2):
    """``n`` steps from one pass over the loader: (updates, batches' example indices); an
    update is the step's noisy averaged gradient, ``N(0, sigma^2 C^2) / B`` here."""
    _, model, module, opt, crit, loader = run
    updates, batches = [], []
    it = iter(loader)
    for _ in range(n):
        x, y, idx = next(it)
        crit(module(x), y).backward()
        opt.step()
        updates.append(model.weight.grad.detach().clone())  # the noisy averaged gradient
        opt.zero_grad()
        batches.append(idx.tolist())
    return updates, batches


def _resumed(mode: str, **options):
    """Steps 1, 2; checkpoint; ``torch.manual_seed(0)`` and a fresh make_private that loads
    it; steps 3, 4."""
    run = _build(mode, **options)
    first = _steps(run)
    buf = io.BytesIO()
    engine, _, module, opt = run[:4]
    engine.save_checkpoint(path=buf, module=module, optimizer=opt)
    resumed = _build(mode, **options)
    buf.seek(0)
    resumed[0].load_checkpoint(path=buf, module=resumed[2], optimizer=resumed[3])
    return first, _steps(resumed)


@pytest.mark.parametrize("mode", MODES)
def test_resumed_script_with_global_seed_draws_fresh_noise_and_batches(mode):
    (u12, b12), (u34, b34) = _resumed(mode)
    for before, after in zip(u12, u34):
        assert before.abs().sum() > 0  # pure noise, not a zero update
        assert not torch.equal(before, after)
    assert b12 != b34 and b12[0] != b34[0] and b12[1] != b34[1]


@pytest.mark.parametrize("mode", MODES)
def test_fresh_make_private_after_global_seed_draws_fresh_noise_and_batches(mode):
    (u_a, b_a), (u_b, b_b) = _steps(_build(mode)), _steps(_build(mode))
    assert not torch.equal(u_a[0], u_b[0]) and b_a[0] != b_b[0]


@pytest.mark.parametrize("mode", MODES)
def test_noise_never_comes_from_the_global_generator(mode):
    """Steps (Poisson batches, sketches, noise) leave torch's global generator untouched,
    and re-seeding torch between construction and the step changes nothing the plugin
    draws from (with an explicit seed, the update is the same whatever the global state)."""
    run = _build(mode)
    state = torch.random.get_rng_state()
    _steps(run)
    assert torch.equal(torch.random.get_rng_state(), state)
    updates = []
    for global_seed in (1, 2):
        run = _build(mode, seed=123)
        torch.manual_seed(global_seed)
        updates.append(_steps(run, 1))
    assert torch.equal(updates[0][0][0], updates[1][0][0]) and updates[0][1] == updates[1][1]


@pytest.mark.parametrize("mode", MODES)
def test_plugin_seed_is_reproducible_and_resuming_it_is_refused(mode):
    """``seed=``: two runs agree bit for bit. Resuming a seeded run with the seed would
    replay steps 1 and 2's noise (a privacy hazard: the difference of two updates with the
    same noise is noise-free), so it is refused; ``accept_replayed_noise=True`` lets it run,
    and the resumed steps do repeat steps 1 and 2."""
    (u_a, b_a), (u_b, b_b) = _steps(_build(mode, seed=7)), _steps(_build(mode, seed=7))
    assert all(torch.equal(a, b) for a, b in zip(u_a, u_b)) and b_a == b_b
    with pytest.raises(ValueError, match="seed= with seed= replays its noise.*accept_replayed_noise=True"):
        _resumed(mode, seed=7)
    (u12, b12), (u34, b34) = _resumed(mode, seed=7, accept_replayed_noise=True)
    assert all(torch.equal(a, b) for a, b in zip(u12, u34)) and b12 == b34  # the replay it accepted
    (u_c, b_c) = _steps(_build(mode, seed=8))
    assert not torch.equal(u_a[0], u_c[0]) and b_a != b_c


def test_same_integer_gives_three_independent_streams():
    """The noise, Poisson and sketch streams of one seed are derived with distinct domain
    tags: for the same integer they share no draws. 64,000 pairs: sample correlation
    ~N(0, 1/64000), 5 sd = 0.02."""
    root = np.random.SeedSequence(42)
    draws = [
        torch.randn(64_000, generator=DeviceStreams(root, tag).generator("cpu"))
        for tag in (NOISE_STREAM, POISSON_STREAM, SKETCH_STREAM)
    ]
    plain = torch.randn(64_000, generator=torch.Generator().manual_seed(42))
    for i, a in enumerate(draws):
        assert not torch.equal(a, plain)
        for b in draws[i + 1:]:
            assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1]) < 0.02


def test_ranks_draw_independent_poisson_masks_and_noise(monkeypatch):
    """Poisson and noise streams fold the rank into the spawn key: ranks of one seed draw
    different masks (DDP samples per rank; the same seed on every rank would tie them)."""
    import opacus_rc.sketch as sk

    draws = {}
    for rank in (0, 1):
        monkeypatch.setattr(sk, "_process_rank", lambda rank=rank: rank)
        for tag in (NOISE_STREAM, POISSON_STREAM):
            gen = DeviceStreams(np.random.SeedSequence(5), tag, per_rank=True).generator("cpu")
            draws[rank, tag] = torch.rand(1000, generator=gen)
    for tag in (NOISE_STREAM, POISSON_STREAM):
        assert not torch.equal(draws[0, tag], draws[1, tag])


def test_make_private_with_epsilon_passes_seed_on(monkeypatch):
    import opacus_rc.integration as integration

    monkeypatch.setattr(integration, "get_noise_multiplier_rc", lambda **kw: 1.0)

    def run():
        torch.manual_seed(0)
        model = nn.Linear(D, 2, bias=False)
        out = PrivacyEngine(accountant="rc_prv").make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=_loader(), criterion=nn.CrossEntropyLoss(), target_epsilon=3.0,
            target_delta=1e-5, epochs=1, max_grad_norm=C, grad_sample_mode="ghost",
            clipping="randomized", sketch_size=2, seed=11,
        )
        return _steps((None, model, out[0], out[1], out[2], out[-1]))

    (u_a, b_a), (u_b, b_b) = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(u_a, u_b)) and b_a == b_b
