"""Issue 52, path 10: two refusals that named the wrong cause, in every form.

* A parameter frozen when ``make_private`` ran and unfrozen later has no per-example clipping
  set up: its first training forward pass is refused, naming the parameter and that cause (it
  was "the layer's backward hook did not run", or Opacus's hook failing with an AttributeError
  when the layer kept another trainable parameter), with nothing of that step released.
* A validation forward in train mode with gradients on, before the training forward: refused as
  before (a tied parameter's uses and hooks do not match, no per-sample gradient, or the
  per-example form's own refusals), the message now naming the cause: a training-mode forward
  pass whose output had no backward pass (found exactly: its output's gradient hook never ran
  before the next training forward pass)."""

from __future__ import annotations

import pytest
import torch
from opacus import PrivacyEngine
from torch import nn
from torch.utils.checkpoint import checkpoint

import opacus_rc  # noqa: F401
from opacus_rc.forms import form_of
from opacus_rc.forms.output_passes import OutputPasses

FORMS = {
    "per_example": dict(per_example_backward=True),
    "two_pass": dict(grad_sample_mode="ghost"),
    "bookkeeping": dict(bookkeeping=True),
    "bookkeeping_hooks": dict(grad_sample_mode="hooks"),
    "output_passes": dict(grad_sample_mode="hooks"),  # on the checkpointed model
}
EVALUATION = r"validation or monitoring.*torch.no_grad\(\) or after model.eval\(\)"
FOUND = (r"Cause: a training-mode forward pass whose output had no backward pass \(e.g. a validation or monitoring "
         r"forward with the model in train mode and gradients on\) ran before the next forward pass; run such "
         r"forward passes under torch.no_grad\(\) or after model.eval\(\)")


class Net(nn.Module):
    """Linear -> tanh -> Linear; ``checkpointed``: the first layer under a non-reentrant
    checkpoint (Hugging Face's flag set: a plain loss runs the output passes)."""

    def __init__(self, checkpointed=False):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)
        if checkpointed:
            self.gradient_checkpointing = True

    def forward(self, x):
        if getattr(self, "gradient_checkpointing", False):
            return self.fc2(checkpoint(lambda t: torch.tanh(self.fc1(t)), x, use_reentrant=False))
        return self.fc2(torch.tanh(self.fc1(x)))


def _private(form, freeze=None):
    """(model, module, optimizer, criterion, loader) of ``form``; ``freeze``: the parameters
    frozen before make_private ("layer": all of fc1, "weight": fc1.weight only)."""
    model = Net(checkpointed=form == "output_passes")
    if freeze is not None:
        (model.fc1 if freeze == "layer" else model.fc1.weight).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))
    out = PrivacyEngine(accountant="rc_prv").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=torch.utils.data.DataLoader(data, batch_size=8), noise_multiplier=0.5, max_grad_norm=1.0,
        clipping="randomized", criterion=nn.CrossEntropyLoss(), seed=0, **FORMS[form],
    )
    name = form.split("_hooks")[0]
    assert form_of(out[0]).name == name or isinstance(getattr(out[0], "output_passes", None), OutputPasses)
    criterion = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    return model, out[0], out[1], criterion, out[-1]


def _parameters(model):
    return [p.detach().clone() for p in model.parameters()]


def _release(module, optimizer, criterion, batches, before_forward=lambda: None):
    """Train until one release: forward, backward, step per physical batch."""
    for x, y in batches:
        before_forward()
        criterion(module(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if not optimizer._is_last_step_skipped:
            return


@pytest.mark.parametrize("freeze", ["layer", "weight"])
@pytest.mark.parametrize("form", FORMS)
def test_a_parameter_unfrozen_after_make_private_is_refused_naming_it(form, freeze):
    """One release with fc1 (or its weight) frozen, then unfrozen: the next training forward
    pass is refused, naming the parameters and the cause; nothing more is released, and the
    refusal ends the run."""
    model, module, optimizer, criterion, loader = _private(form, freeze)
    batches = iter(loader)
    _release(module, optimizer, criterion, batches)
    released = _parameters(model)
    model.fc1.requires_grad_(True)
    names = "parameters 'fc1.weight', 'fc1.bias' were" if freeze == "layer" else "parameter 'fc1.weight' was"
    cause = (f"refused: {names} frozen \\(requires_grad=False\\) when make_private ran and (is|are) trainable now: "
             "make_private set up no per-example clipping for (it|them), so (its gradient|their gradients) would "
             "never be clipped. Unfreeze (it|them) before make_private, or run make_private again after unfreezing")
    with pytest.raises(ValueError, match=cause):
        _release(module, optimizer, criterion, batches)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), released))
    (model.fc1 if freeze == "layer" else model.fc1.weight).requires_grad_(False)
    with pytest.raises(ValueError, match=cause):  # the refusal ended the run
        _release(module, optimizer, criterion, batches)


@pytest.mark.parametrize("form, refusal", [
    ("two_pass", r"a tied parameter's forward uses and backward hooks do not match.*"),
    ("bookkeeping", r"no per-sample gradient for parameter 'fc1.weight': the layer's backward hook did not run in "
                    r"this backward pass. "),
    ("bookkeeping_hooks", r"no per-sample gradient for parameter 'fc1.weight': .*"),
    ("output_passes", r"a tied parameter's forward uses and backward hooks do not match.*"),
])
def test_a_validation_forward_in_train_mode_is_refused_naming_it(form, refusal):
    """``model(val_x)`` in train mode with gradients on, then the training forward and backward:
    refused as before, the message naming the forward pass without its backward pass."""
    model, module, optimizer, criterion, loader = _private(form)
    before = _parameters(model)
    with pytest.raises(ValueError, match=refusal + FOUND):
        _release(module, optimizer, criterion, loader, before_forward=lambda: module(torch.randn(3, 4)))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("form", ["two_pass", "bookkeeping", "output_passes"])
def test_a_validation_forward_after_the_backward_pass_still_trains(form):
    """The monitoring forward after ``backward()`` (its output without a backward pass too) is
    not refused in these forms: the training forward's hooks had paired up, and the step
    forgets what the monitoring forward captured. The releases equal those without it."""
    runs = []
    for monitor in (False, True):
        model, module, optimizer, criterion, loader = _private(form)
        batches = iter(loader)
        for _ in range(3):
            x, y = next(batches)
            criterion(module(x), y).backward()
            if monitor:
                module(torch.randn(3, 4))
            optimizer.step()
            optimizer.zero_grad()
        runs.append(_parameters(model))
    assert all(torch.equal(p, q) for p, q in zip(*runs)) and not torch.equal(runs[0][0], Net().fc1.weight)


@pytest.mark.parametrize("validation", ["batch", "row"])
def test_a_validation_forward_in_the_per_example_form_names_it(validation):
    """The per-example form refuses it at the forward pass (a batch of several rows, or a row that
    takes the loader's batch before the real forward): the message says what to do if it is a
    validation forward."""
    model, module, optimizer, criterion, loader = _private("per_example")
    before = _parameters(model)
    rows = 3 if validation == "batch" else 1
    # (one row: the forward takes the loader's next batch, and the real forward is then a second one of it)
    what = "the model's forward got a batch of 3" if rows > 1 else "went through a second forward pass"
    with pytest.raises(ValueError, match=f"{what}.*If this forward pass is a {EVALUATION}"):
        _release(module, optimizer, criterion, loader, before_forward=lambda: module(torch.randn(rows, 4)))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_a_forward_without_backward_before_an_example_is_named_in_the_per_example_form():
    """Tensors no plugin loader delivered (the form's clip then counts examples per backward
    pass): a forward without its backward, then an example's forward and backward, is refused
    at the step ("2 examples' forward passes"), naming the forward without a backward."""
    model, module, optimizer, criterion, _ = _private("per_example")
    before = _parameters(model)
    x, y = torch.randn(2, 4), torch.zeros(2, dtype=torch.long)
    module(x[:1])
    criterion(module(x[1:]), y[1:]).backward()
    with pytest.raises(ValueError, match="a backward pass held 2 examples' forward passes.*" + FOUND):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
