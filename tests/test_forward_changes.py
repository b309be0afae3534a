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
    assert watch.take().names() == ["buffer 'running' was changed in place"] and watch.take().names() == []
    watch.remove()
    model(torch.randn(2, 4))
    assert watch.take().names() == []


# --- issue 46, path 4: changes the version counters and the forward's own hooks did not see ----

class Writer(RunningMean):
    """A classifier whose forward writes ``how``: through ``.data`` (in place or assigned), the
    model's state moved by the data (500 x the batch mean: 500 C at C = 1)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, x):
        moved = 500 * x.mean(0).detach()
        if self.how == "buffer.data.add_":
            self.running.data.add_(moved)
        elif self.how == "buffer.data =":
            self.running.data = self.running + moved
        elif self.how == "bias.data.add_":
            self.fc.bias.data.add_(moved[:2])
        elif self.how == "weight.data =":
            self.fc.weight.data = self.fc.weight + moved[:2, None]
        return self.fc(x)


def _moves(model, x):
    """A hook's write: the buffer moved by the data."""
    model.running.data.add_(500 * x.mean(0).detach())


def _refused(model, form, name, register=None):
    before = {n: t.detach().clone() for n, t in model.named_parameters()}
    module, optimizer, criterion, loader = _private(model, form)
    if register is not None:
        register(model, module)
    with pytest.raises(ValueError, match=f"refused: {name} was (changed in place|replaced|added) during the forward.*"
                       "Nothing was released.*the model holds the change"):
        _train(module, optimizer, criterion, loader)
    # no update released: the parameters the forward did not write are as they were
    assert all(torch.equal(b, model.get_parameter(n)) for n, b in before.items() if n not in name)


@pytest.mark.parametrize("form", ["two_pass", "bookkeeping"])
@pytest.mark.parametrize("how, name", [
    ("buffer.data.add_", "buffer 'running'"), ("buffer.data =", "buffer 'running'"),
    ("bias.data.add_", "parameter 'fc.bias'"), ("weight.data =", "parameter 'fc.weight'"),
])
def test_a_write_through_data_is_refused_by_name(form, how, name):
    _refused(Writer(how), form, name)


@pytest.mark.parametrize("form", ["two_pass", "bookkeeping"])
def test_a_pre_hook_registered_before_make_private_is_refused(form):
    model = RunningMean()
    model.forward = lambda x: model.fc(x)
    model.register_forward_pre_hook(lambda m, args: _moves(m, args[0]))
    _refused(model, form, "buffer 'running'")


@pytest.mark.parametrize("form", ["two_pass", "bookkeeping"])
def test_a_forward_hook_registered_after_make_private_is_refused(form):
    model = RunningMean()
    model.forward = lambda x: model.fc(x)
    _refused(model, form, "buffer 'running'",
             register=lambda m, _: m.register_forward_hook(lambda m, args, out: _moves(m, args[0])))


@pytest.mark.parametrize("form", ["two_pass", "bookkeeping"])
def test_a_forward_hook_on_a_submodule_under_no_grad_is_refused(form):
    model = RunningMean()
    model.forward = lambda x: model.fc(x)

    def hook(fc, args, out):
        with torch.no_grad():
            fc.bias.add_(out.mean())  # in place, no_grad, on a submodule's parameter

    _refused(model, form, "parameter 'fc.bias'", register=lambda m, _: m.fc.register_forward_hook(hook))


class Memory(RunningMean):
    """State kept across forward passes outside parameters and buffers: a list of earlier
    batches' features (``keep="list"``) or a tensor attribute (``keep="tensor"``)."""

    def __init__(self, keep: str):
        super().__init__()
        self.keep, self.memory = keep, ([] if keep == "list" else torch.zeros(4))

    def forward(self, x):
        if self.keep == "list":
            self.memory.append(x.mean(0).detach())
            return self.fc(x + sum(self.memory))
        self.memory.data.add_(x.mean(0).detach())
        return self.fc(x + self.memory)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("keep", ["list", "tensor"])
def test_state_kept_in_a_module_attribute_is_refused(form, keep):
    """Changed in place (a list appended to, a tensor added to): refused at the first step."""
    _refused(Memory(keep), form, r"attribute 'memory' of the model \(Memory\)")


@pytest.mark.parametrize("form", ["two_pass", "bookkeeping"])
def test_evaluation_forwards_and_harmless_hooks_still_train(form):
    """Between steps: the loop's own change, then evaluation forwards in eval mode (no_grad);
    hooks that only read; every step runs and the model trains."""
    model = RunningMean()
    model.forward = lambda x: model.fc(x)
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    module, optimizer, criterion, loader = _private(model, form)
    model.register_forward_hook(lambda m, args, out: seen.append(float(out.detach().sum())))
    start = model.fc.weight.detach().clone()

    def evaluate():
        with torch.no_grad():
            model.running.add_(1.0)  # the loop's own change, after the step
        module.eval()
        with torch.no_grad():
            module(torch.randn(3, 4))
        module.train()

    for _ in range(2):
        _train(module, optimizer, criterion, loader, between=evaluate)
    assert float(model.running[0]) == 2 * len(loader) and not torch.equal(start, model.fc.weight)


def test_the_digest_sees_one_bit_a_swap_and_every_dtype():
    from opacus_rc.forward_changes import digests

    def digest(x):
        return digests([x])[0]

    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool, torch.complex64):
        x = (torch.randn(1000) > 0).to(dtype) if dtype == torch.bool else torch.randn(1000).to(dtype)
        d = digest(x)
        y = x.clone()
        y[7] = ~y[7] if dtype == torch.bool else y[7] + 1
        z = x.clone()
        z[[3, 900]] = z[[900, 3]]
        assert int(d) == int(digest(x.clone())) and int(d) != int(digest(y))
        assert bool(x[3] == x[900]) or int(d) != int(digest(z))
    f = torch.tensor([1.0, 2.0])
    assert int(digest(f)) != int(digest(f.view(torch.int32).add(1).view(torch.float32)))  # one ulp


@pytest.mark.parametrize("form", ["two_pass", "bookkeeping"])
def test_a_pre_hook_on_the_returned_wrapper_is_refused(form):
    """A pre-hook on the module make_private returned runs before the model's own pre-hooks."""
    model = RunningMean()
    model.forward = lambda x: model.fc(x)
    _refused(model, form, "buffer 'running'",
             register=lambda _, wrapper: wrapper.register_forward_pre_hook(lambda m, args: _moves(model, args[0])))


def test_packed_digests_name_only_the_tensor_that_changed():
    """Small tensors are hashed packed together, large ones alone: one flipped bit anywhere
    changes its own tensor's digest and no other."""
    from opacus_rc.forward_changes import digests

    xs = [torch.randn(n) for n in (0, 3, 129, 70000)] + [torch.randn(11).bfloat16()[1:], torch.ones(7, dtype=torch.bool)]
    d = digests(xs)
    assert d.tolist() == [int(digests([x])[0]) for x in xs]
    for k, x in enumerate(xs[1:], 1):
        for pos in (0, x.numel() - 1):
            y = [t.clone() for t in xs]
            y[k].view(torch.uint8)[pos * x.element_size()] ^= 1
            assert (digests(y) != d).tolist() == [j == k for j in range(len(xs))]
