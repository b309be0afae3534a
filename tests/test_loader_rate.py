"""``poisson_sampling=False`` is charged the loader's own rate (issue 21, item 4).

Without Poisson sampling the loader is used as given: fixed-size batches of ``B`` out of
``n`` (shuffled or not). The only defensible charge is its own rate,
``q = max(B / n, 1 / len(loader))`` (the two agree when ``B`` divides ``n``); an explicit
``sample_rate=`` that differs from it (relative tolerance 1e-9) used to be charged
silently (batches of 25 out of 500 charged at 0.01: epsilon 2.17 reported instead of
12.66) and is now a ValueError naming ``sample_rate`` and ``poisson_sampling``. The
accountant still assumes Poisson subsampling: a shuffled fixed-size loader is only
approximated by it (docs/accounting.md, "What the guarantee assumes").
"""

from __future__ import annotations

import math

import pytest
import torch
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from opacus_rc.integration import loader_rate, public_sampling

MODES = ("ghost", "hooks")


def _loader(n: int = 500, batch_size: int = 25, **kwargs) -> DataLoader:
    gen = torch.Generator().manual_seed(n)
    data = TensorDataset(torch.randn(n, 4, generator=gen), torch.randint(0, 2, (n,), generator=gen))
    return DataLoader(data, batch_size=batch_size, **kwargs)


def _private(loader, mode="ghost", method="make_private", **kwargs):
    model = nn.Linear(4, 2)
    engine = PrivacyEngine(accountant="rc_prv")
    common = dict(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(), data_loader=loader, max_grad_norm=1.0,
        clipping="randomized", grad_sample_mode=mode, poisson_sampling=False, seed=0,
    )
    if method == "make_private":
        return engine, engine.make_private(noise_multiplier=1.0, **common, **kwargs)
    return engine, engine.make_private_with_epsilon(
        target_epsilon=3.0, target_delta=1e-5, epochs=1, **common, **kwargs
    )


def _charged_rate(engine, out) -> float:
    module, opt, loader = out[0], out[1], out[-1]
    x, y = next(iter(loader))
    loss = out[2](module(x), y) if len(out) == 4 else nn.functional.cross_entropy(module(x), y)
    loss.backward()
    opt.step()
    return engine.accountant.history[-1][1]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shuffle", [False, True])
def test_mismatched_sample_rate_is_refused(mode, shuffle):
    with pytest.raises(ValueError, match=r"sample_rate=0\.01 .*poisson_sampling=False.*accepted values"):
        _private(_loader(shuffle=shuffle), mode, sample_rate=0.01)
    with pytest.raises(ValueError, match="sample_rate=0.01"):  # the calibration path too
        _private(_loader(shuffle=shuffle), mode, method="epsilon", sample_rate=0.01)


@pytest.mark.parametrize("mode", MODES)
def test_matching_sample_rate_is_accepted_and_charged(mode):
    """25 / 500 = 0.05: accepted, to float tolerance (1e-9 relative), and charged."""
    for rate in (0.05, 25 / 500, 0.05 * (1 + 1e-12)):
        engine, out = _private(_loader(), mode, sample_rate=rate)
        assert out[-1].batch_size == 25  # the loader as given, not a Poisson loader
        assert _charged_rate(engine, out) == pytest.approx(0.05, rel=1e-9)
    with pytest.raises(ValueError, match="sample_rate"):
        _private(_loader(), mode, sample_rate=0.05 * (1 + 1e-6))


@pytest.mark.parametrize("mode", MODES)
def test_default_charge_is_the_loaders_rate(mode):
    """No sample_rate: q = max(B / n, 1 / len(loader)): 25 / 510 (len 21, 1/21 would
    undercharge) and, with drop_last=True (len 20), 1 / 20."""
    engine, out = _private(_loader(510), mode)
    assert _charged_rate(engine, out) == 25 / 510 > 1 / 21
    engine, out = _private(_loader(510, drop_last=True), mode)
    assert _charged_rate(engine, out) == 1 / 20 > 25 / 510
    engine, out = _private(_loader(500), mode)
    assert _charged_rate(engine, out) == 1 / 20 == 25 / 500


def test_calibration_uses_the_loaders_rate(monkeypatch):
    import opacus_rc.integration as integration

    calls = []
    monkeypatch.setattr(integration, "get_noise_multiplier_rc", lambda **kw: calls.append(kw) or 1.5)
    engine, out = _private(_loader(510), "hooks", method="epsilon")
    assert calls[0]["sample_rate"] == 25 / 510
    assert _charged_rate(engine, out) == 25 / 510


def test_calibration_counts_every_batch_of_the_loader_as_given():
    """Issue 46 path 9 at example level: 510 rows in batches of 25, q = 25/510, 21 batches an
    epoch. On main sigma was calibrated for int(1 / q) = 20 steps: one epoch spent epsilon
    3.03 against a target of 3. Now for 21 steps: epsilon within the calibration's window
    [3 - 0.01, 3] (epsilon_tolerance's default)."""
    engine, out = _private(_loader(510), "hooks", method="epsilon")
    module, optimizer, loader = out
    for x, y in loader:
        nn.functional.cross_entropy(module(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert sum(entry[2] for entry in engine.accountant.history) == len(loader) == 21
    assert 3.0 - 0.01 <= engine.get_epsilon(1e-5) <= 3.0


@pytest.mark.parametrize("secure, options", [
    (False, dict(poisson_sampling=False)),  # 21 batches of 25 of 510 rows
    (False, dict()),  # Poisson at 1 / 21
    (False, dict(sample_rate=0.3)),  # int(1 / 0.3) = 3 draws an epoch, not 10 in 3 epochs
    (True, dict(sample_rate=0.3)),  # the CSPRNG's Poisson loader
    (False, dict(privacy_unit="user", user_ids=[r % 8 for r in range(510)], sample_rate=0.625)),  # round(1.6)
])
def test_calibration_counts_the_steps_the_returned_loader_runs(monkeypatch, secure, options):
    """Issue 46 path 9: make_private_with_epsilon(epochs=3) calibrates for 3 x len(loader)
    steps of the loader it returns, on every kind of loader (recorded, not run)."""
    import opacus_rc.integration as integration

    calls = []
    monkeypatch.setattr(integration, "get_noise_multiplier_rc", lambda **kw: calls.append(kw) or 1.5)
    model = nn.Linear(4, 2)
    out = PrivacyEngine(accountant="rc_prv", secure_mode=secure).make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=_loader(510),
        target_epsilon=3.0, target_delta=1e-5, epochs=3, max_grad_norm=1.0, clipping="randomized",
        grad_sample_mode="hooks", **options,
    )
    assert calls[0]["steps"] == 3 * len(out[-1]) and "epochs" not in calls[0]


def test_loader_rate_and_poisson_default():
    data = _loader(401, 8).dataset
    sharded = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    assert len(sharded) == 26 and loader_rate(sharded) == 16 / 401  # B over all ranks
    assert loader_rate(_loader(10, 25)) == 1.0  # one batch holding the whole dataset
    # Poisson sampling samples at 1/len(loader) (or sample_rate=): unchanged
    assert public_sampling(_loader(510)).sample_rate == 1 / 21
    assert public_sampling(_loader(510), sample_rate=0.01).sample_rate == 0.01
    assert public_sampling(_loader(510), poisson_sampling=False).sample_rate == 25 / 510
    assert math.isclose(
        public_sampling(_loader(510), sample_rate=25 / 510, poisson_sampling=False).sample_rate,
        25 / 510,
    )
