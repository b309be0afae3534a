"""opacus_rc.prepare: what make_private builds (the plugin's module, optimizer and
criterion) and the Poisson loader's generator."""

import pytest
import torch
from opacus import PrivacyEngine

import opacus_rc

from .test_options import make_private_classifier
from .test_rng_streams import MODES, _build, _steps


def test_returns_ghost_four_tuple_and_carries_sketch_config(model_factory):
    engine = PrivacyEngine(accountant="rc_prv")
    model = model_factory()
    out = make_private_classifier(
        engine, model, n=32,
        grad_sample_mode="ghost",
        clipping="randomized",
        estimator="hutchpp",
        sketch_size=16,
    )
    assert len(out) == 4
    module, opt, crit, _ = out
    assert isinstance(module, opacus_rc.GradSampleModuleRandomizedClipping)
    assert isinstance(opt, opacus_rc.RandomizedClippingOptimizer)
    assert (opt.estimator, opt.sketch_size, opt.sketching) == ("hutchpp", 16, "per_example")  # the default
    assert module.sketcher.config == opt.sketch_config


@pytest.mark.parametrize("mode", MODES)
def test_opacus_generators_are_reproducible(mode):
    """Opacus's own ways: ``noise_generator=`` seeds the noise, the DataLoader's
    ``generator=`` the Poisson masks; each reproduces its own stream only."""

    def run(noise_seed, loader_seed):
        return _steps(_build(
            mode, noise_generator=torch.Generator().manual_seed(noise_seed),
            loader_kwargs={"generator": torch.Generator().manual_seed(loader_seed)},
        ))

    (u_a, b_a), (u_b, b_b) = run(1, 2), run(1, 2)
    assert all(torch.equal(a, b) for a, b in zip(u_a, u_b)) and b_a == b_b
    (u_c, b_c) = run(1, 3)
    assert torch.equal(u_a[0], u_c[0]) and b_a != b_c
    (u_d, b_d) = run(4, 2)
    assert not torch.equal(u_a[0], u_d[0]) and b_a == b_d


def test_only_noise_seeded_keeps_poisson_fresh():
    (_, b_a), (_, b_b) = (
        _steps(_build("ghost", noise_generator=torch.Generator().manual_seed(1))) for _ in range(2)
    )
    assert b_a != b_b
