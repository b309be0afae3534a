"""opacus_rc.registration: importing opacus_rc must leave every Opacus mode exactly as it was."""

import copy

import opacus
import pytest
import torch
from opacus.accountants.registry import create_accountant
from torch import nn

from opacus_rc import integration, registration
from opacus_rc.accounting.accountant import RCPRVAccountant

from .models import token_task

MODES = [
    ({"clipping": "flat", "grad_sample_mode": "hooks"}),
    ({"clipping": "per_layer", "grad_sample_mode": "hooks"}),
    ({"clipping": "flat", "grad_sample_mode": "functorch"}),
    ({"clipping": "flat", "grad_sample_mode": "ghost"}),
    (
        {
            "clipping": "adaptive",
            "grad_sample_mode": "hooks",
            "target_unclipped_quantile": 0.5,
            "clipbound_learning_rate": 0.2,
            "max_clipbound": 10.0,
            "min_clipbound": 0.01,
            "unclipped_num_std": 1.0,
        }
    ),
]


def run(model, options):
    """Classes returned by make_private and the parameters after two noisy steps (the
    engine is Opacus's own after ``registration.uninstall()``)."""
    engine = opacus.PrivacyEngine(accountant="prv")
    data = token_task(n=32, t=12)
    max_grad_norm = [0.5] * len(list(model.parameters())) if options["clipping"] == "per_layer" else 0.5
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        criterion=nn.CrossEntropyLoss(),
        data_loader=torch.utils.data.DataLoader(data, batch_size=16),
        noise_multiplier=1.0,
        max_grad_norm=max_grad_norm,
        poisson_sampling=False,
        noise_generator=torch.Generator().manual_seed(0),
        **options,
    )
    module, opt, dl = out[0], out[1], out[-1]
    crit = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    for x, y in dl:
        crit(module(x), y).backward()
        opt.step()
        opt.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return [type(o) for o in out], params, engine.get_epsilon(1e-5)


@pytest.mark.parametrize("options", MODES, ids=lambda o: f"{o['clipping']}-{o['grad_sample_mode']}")
def test_mode_behaves_as_without_opacus_rc(model_factory, options):
    init = model_factory(seed=4)
    with_rc = run(copy.deepcopy(init), dict(options))
    registration.uninstall()
    try:
        assert type(opacus.PrivacyEngine()) is integration.OpacusPrivacyEngine
        without_rc = run(copy.deepcopy(init), dict(options))
    finally:
        registration.install()
    assert with_rc[0] == without_rc[0]
    for name in with_rc[1]:
        torch.testing.assert_close(with_rc[1][name], without_rc[1][name], rtol=0, atol=0)
    assert with_rc[2] == without_rc[2]


def test_install_is_idempotent():
    """A second install sets each name of PATCHES to the same value (nothing wrapped twice),
    so one uninstall still restores Opacus's own, and the accountant stays registered."""
    try:
        registration.install()
        registration.install()
        for owner, name, value in registration.PATCHES:
            assert vars(owner)[name] is value, name
        assert type(create_accountant("rc_prv")) is RCPRVAccountant
        registration.uninstall()
        for (owner, name, _), original in zip(registration.PATCHES, registration.ORIGINALS):
            assert vars(owner)[name] is original, name
        assert type(opacus.PrivacyEngine(accountant="prv")) is integration.OpacusPrivacyEngine
    finally:
        registration.install()
    assert type(opacus.PrivacyEngine(accountant="rc_prv")) is integration.PrivacyEngine
