"""Issue 38, item 4: a change a forward pass makes to a parameter or buffer depends on the
data and reaches the released model without noise. ``nn.Embedding(max_norm=...)`` is
refused at ``make_private``; any other in-place change or replacement made during a
forward pass refuses the next step by name, in every form, before anything is released.
Changes made between forward passes (the optimizer's update, ``load_state_dict``, the
loop's own) are not refused, and a model that changes nothing trains as before."""

from __future__ import annotations

import pytest
import torch
from opacus import PrivacyEngine
from torch import nn

import opacus_rc  # noqa: F401
from opacus_rc.forward_changes import ForwardChanges, watched_model

FORMS = {
    "per_example": dict(per_example_backward=True),
    "two_pass": dict(grad_sample_mode="ghost"),
    "bookkeeping": dict(bookkeeping=True),
}


class RunningMean(nn.Module):
    """A linear classifier that keeps a running mean of its inputs in a buffer, in place
    (``self.running.mul_(0.9).add_(...)``) or by reassignment (``self.running = ...``)."""

    def __init__(self, reassign: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 2)
        self.reassign = reassign
        self.register_buffer("running", torch.zeros(4))

    def forward(self, x):
        if self.reassign:
            self.running = 0.9 * self.running + 0.1 * x.mean(0).detach()
        else:
            self.running.mul_(0.9).add_(0.1 * x.mean(0).detach())
        return self.fc(x)


def _private(model, form, batch_size=4, **options):
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.zeros(16, dtype=torch.long))
    out = PrivacyEngine(accountant="rc_prv").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(data, batch_size=batch_size), noise_multiplier=0.0,
        max_grad_norm=1.0, clipping="randomized", criterion=nn.CrossEntropyLoss(), poisson_sampling=False,
        **FORMS[form], **options,
    )
    criterion = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    module = out[0] if isinstance(out[0], nn.Module) else model  # wrap_model=False: the model itself
    return module, out[1], criterion, out[-1]


def _train(module, optimizer, criterion, loader, between=None):
    for x, y in loader:
        criterion(module(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if between is not None:
            between()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("reassign", [False, True])
def test_a_running_buffer_refuses_the_step_by_name(form, reassign):
    model = RunningMean(reassign)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="refused: buffer 'running' was " + ("replaced" if reassign else "changed in place")
                       + " during the forward pass.*Nothing was released"):
        _train(*_private(model, form))
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))  # nothing released


@pytest.mark.parametrize("wrap_model", [True, False])
def test_a_parameter_changed_in_the_forward_is_refused(wrap_model):
    class Renormalised(RunningMean):
        def forward(self, x):
            with torch.no_grad():
                self.fc.weight[int(x[0, 0] > 0)].mul_(0.5)  # which row depends on the data
            return self.fc(x)

    with pytest.raises(ValueError, match="parameter 'fc.weight' was changed in place"):
        _train(*_private(Renormalised(), "bookkeeping", wrap_model=wrap_model))


@pytest.mark.parametrize("form", ["per_example", "bookkeeping", "two_pass"])
def test_embedding_with_max_norm_is_refused_at_make_private(form):
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Flatten(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="embedding '0' has max_norm=1.0.*in place.*which tokens were seen.*max_norm=None"):
        _private(model, form)


def test_flat_clipping_is_left_to_opacus():
    """``clipping="flat"`` is Opacus's path: the plugin neither refuses nor watches it."""
    model = RunningMean()
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.zeros(8, dtype=torch.long))
    module, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(data, batch_size=4), noise_multiplier=0.0, max_grad_norm=1.0,
        poisson_sampling=False,
    )
    _train(module, optimizer, nn.CrossEntropyLoss(), loader)
    assert model.running.abs().sum() > 0


@pytest.mark.parametrize("form", FORMS)
def test_changes_between_forward_passes_are_not_refused(form):
    """The optimizer's update, load_state_dict, a change the loop makes between steps."""
    model = RunningMean()
    model.forward = lambda x: model.fc(x)  # nothing changes in the forward pass
    module, optimizer, criterion, loader = _private(model, form)

    steps = []

    def between():
        steps.append(1)
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
        with torch.no_grad():
            model.fc.weight.mul_(0.99)
            model.running.add_(1.0)

    _train(module, optimizer, criterion, loader, between)
    assert float(model.running[0]) == len(steps) == len(loader)  # every step ran


def test_the_watch_reports_once_and_stops_when_removed():
    model = RunningMean()
    watch = ForwardChanges(watched_model(model))
    model(torch.randn(2, 4))
    assert watch.take() == ["buffer 'running' was changed in place"] and watch.take() == []
    watch.remove()
    model(torch.randn(2, 4))
    assert watch.take() == []
