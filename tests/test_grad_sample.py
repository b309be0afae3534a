"""opacus_rc.grad_sample: the randomized grad-sample module's layers without a norm sampler
(Opacus's functorch per-sample gradients) and the layers it cannot handle."""

import copy

import pytest
import torch
from opacus import PrivacyEngine
from torch import nn

from .models import token_task
from .test_robustness import step


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
