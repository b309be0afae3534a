"""Issue 52, path 9: a plain module attribute that a forward pass assigns is allowed unless a
later training forward pass reads the value an earlier one wrote (opacus_rc/carried_state.py).

A cached activation kept for inspection (``self.last = h.detach()``, never read by a later
forward pass) trains in every form and loop, and its releases equal those of the same model
without the cache line, bit for bit. A recurrent state (``self.h = f(x, self.h)``) is refused by
name at the step whose forward pass read it, with nothing of that step released: across steps,
across the physical batches of one Poisson draw (BatchMemoryManager), and across two forward
passes before one step. Parameters and buffers changed by a forward pass stay refused."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from opacus import PrivacyEngine
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.utils.checkpoint import checkpoint

import opacus_rc  # noqa: F401
from opacus_rc.forms import form_of
from opacus_rc.forms.output_passes import OutputPasses
from opacus_rc.forward_changes import ForwardChanges

FORMS = {
    "per_example": dict(per_example_backward=True),
    "two_pass": dict(grad_sample_mode="ghost"),
    "bookkeeping": dict(bookkeeping=True),
    "output_passes": dict(grad_sample_mode="hooks"),  # a plain loss on the checkpointed model
}
CARRIED = (r"attribute 'h' of module 'block' \(Block\) was read by a later training forward pass.*"
           "a value written by one forward pass was read by a later one.*Nothing was released or charged")


class Block(nn.Module):
    """Linear -> tanh, keeping ``keep`` in attributes: ``"cache"``, its activation for
    inspection (read back in the same forward pass only); ``"state"``, a recurrent state that
    the next forward pass reads (``self.h = f(x, self.h)``); ``"monitor"``, the cache, read by
    forward passes in evaluation mode; None, nothing."""

    def __init__(self, keep):
        super().__init__()
        self.fc, self.keep, self.h = nn.Linear(4, 8), keep, None

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        if self.keep == "state":
            if self.h is not None:
                h = h + self.h
            self.h = h.mean(0).detach()
        elif self.keep is not None:
            if self.keep == "monitor" and not self.training:
                h = h + 0 * self.last.mean()  # an evaluation forward reads what training kept
            self.last = h.detach()  # for plotting later
            assert self.last.shape[0] == x.shape[0]  # a read of this forward's own value
        return h


class Net(nn.Module):
    """A :class:`Block` and a linear head; ``checkpointed``: the block under a non-reentrant
    checkpoint (Hugging Face's flag set, so that a plain loss runs the output passes)."""

    def __init__(self, keep, checkpointed=False):
        super().__init__()
        torch.manual_seed(0)
        self.block, self.out = Block(keep), nn.Linear(8, 2)
        if checkpointed:
            self.gradient_checkpointing = True

    def forward(self, x):
        if getattr(self, "gradient_checkpointing", False):
            return self.out(checkpoint(self.block, x, use_reentrant=False))
        return self.out(self.block(x))


def _private(keep, form, *, poisson=True, noise=0.5):
    model = Net(keep, checkpointed=form == "output_passes")
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))
    out = PrivacyEngine(accountant="rc_prv").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=torch.utils.data.DataLoader(data, batch_size=8), noise_multiplier=noise, max_grad_norm=1.0,
        clipping="randomized", criterion=nn.CrossEntropyLoss(), poisson_sampling=poisson, seed=0, **FORMS[form],
    )
    assert form_of(out[0]).name == form or isinstance(getattr(out[0], "output_passes", None), OutputPasses)
    if isinstance(out[0], nn.Module) and out[0] is not model:  # the wrapper's state is the model's
        assert list(out[0].state_dict()) == ["_module." + k for k in model.state_dict()]
    criterion = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    return model, out[0], out[1], criterion, out[-1]


def _train(module, optimizer, criterion, batches, steps, between=None):
    """``steps`` releases over ``batches``: forward, backward, ``optimizer.step()`` per physical
    batch; ``between()`` after each release."""
    released = 0
    for x, y in batches:
        criterion(module(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if not optimizer._is_last_step_skipped:
            released += 1
            if between is not None:
                between()
            if released == steps:
                return
    raise AssertionError("the loader ran out")


def _run(keep, form, loop, steps=3, between=None):
    model, module, optimizer, criterion, loader = _private(keep, form)
    if loop == "plain":
        _train(module, optimizer, criterion, loader, steps, between)
    else:
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=optimizer) as batches:
            _train(module, optimizer, criterion, batches, steps, between)
    return model, optimizer


def _parameters(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("loop", ["plain", "bmm"])
@pytest.mark.parametrize("form", FORMS)
def test_a_cached_activation_trains_as_without_it(form, loop):
    cached, _ = _run("cache", form, loop)
    plain, _ = _run(None, form, loop)
    assert all(torch.equal(p, q) for p, q in zip(cached.parameters(), plain.parameters()))
    assert not torch.equal(cached.block.fc.weight, Net(None).block.fc.weight)  # it trained
    assert type(cached.block) is Block and cached.block.last.shape[1] == 8  # the last batch's, to inspect
    assert cached.state_dict().keys() == plain.state_dict().keys()


@pytest.mark.parametrize("form", ["two_pass", "bookkeeping"])
def test_evaluation_forwards_read_the_cache_and_the_loop_inspects_it(form):
    """Reads outside training forward passes: an evaluation forward (before the first step
    too, with the model in eval mode under no_grad) and the loop's own, between steps."""
    model, module, optimizer, criterion, loader = _private("monitor", form)
    plain, *_ = _private(None, form)
    seen = []

    def evaluate():
        seen.append(model.block.last.norm())
        module.eval()
        with torch.no_grad():
            module(torch.randn(5, 4))
        module.train()

    with torch.no_grad():
        model.block.last = torch.zeros(1, 8)  # (the monitor's first reference, set by the loop)
    evaluate()
    _train(module, optimizer, criterion, loader, 3, between=evaluate)
    assert len(seen) == 4
    ref, ref_module, ref_optimizer, ref_criterion, ref_loader = _private(None, form)
    _train(ref_module, ref_optimizer, ref_criterion, ref_loader, 3)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


class Cached(Block):
    """A :class:`Block` of a class of its own (no other test's watch shares it)."""


def test_a_cached_model_copies_saves_and_is_given_back_its_class():
    module, optimizer, criterion, loader = _private_with_block(Cached("cache"), "two_pass")
    model = module._module
    _train(module, optimizer, criterion, loader, 3)
    assert isinstance(Cached.__dict__["last"], object)  # watched: a descriptor on the class
    twin = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (twin, loaded):
        assert type(other.block) is Cached and torch.equal(other.block.last, model.block.last)
        assert other.state_dict().keys() == model.state_dict().keys()
        assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), model.state_dict().values()))
    optimizer._forward_changes.remove()
    assert "last" not in Cached.__dict__ and torch.equal(twin.block.last, model.block.last)


def _released_then_refused(form, loop):
    """The parameters before training and after each release, and the refusal, of a run of the
    recurrent block (BatchMemoryManager: physical batches of 2)."""
    model, module, optimizer, criterion, loader = _private("state", form)
    releases = [_parameters(model)]
    batches = loader if loop == "plain" else BatchMemoryManager(
        data_loader=loader, max_physical_batch_size=2, optimizer=optimizer).__enter__()
    with pytest.raises(ValueError, match=CARRIED) as refused:
        _train(module, optimizer, criterion, batches, 3, between=lambda: releases.append(_parameters(model)))
    return model, releases, refused.value


@pytest.mark.parametrize("form", FORMS)
def test_a_recurrent_state_is_refused_at_the_step_that_reads_it(form):
    """Plain loop: step 1 read no earlier forward pass's value and is released; step 2's
    forward pass reads step 1's state: refused, nothing of it released."""
    model, releases, _ = _released_then_refused(form, "plain")
    assert len(releases) == (1 if form == "per_example" else 2)  # (per example: draw 1's second batch)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), releases[-1]))


@pytest.mark.parametrize("form", FORMS)
def test_a_state_carried_between_the_physical_batches_of_one_draw_is_refused(form):
    """BatchMemoryManager: one Poisson draw in physical batches of 2, a step after each; the
    second physical batch's forward pass reads the first's state: nothing released."""
    model, releases, _ = _released_then_refused(form, "bmm")
    assert len(releases) == 1 and all(torch.equal(p, q) for p, q in zip(model.parameters(), releases[0]))


@pytest.mark.parametrize("first", ["training", "evaluation"])
@pytest.mark.parametrize("form", ["two_pass", "bookkeeping", "output_passes"])
def test_two_forward_passes_before_one_step_are_refused(form, first):
    """Opacus's own loader, two forward passes before one step: two micro-batches accumulated,
    or an evaluation forward (no_grad) whose write the training forward reads. The first step
    is refused: nothing released."""
    model, module, optimizer, criterion, loader = _private("state", form, poisson=False)
    before = _parameters(model)
    x, y = next(iter(loader))
    with pytest.raises(ValueError, match=CARRIED):
        if first == "training":
            criterion(module(x[:4]), y[:4]).backward()
        else:
            with torch.no_grad():
                module(x)
        criterion(module(x[4:]), y[4:]).backward()
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


class CachesAndCounts(Block):
    """Caches its activation and also keeps a running statistic in a buffer (in place) or
    moves a parameter through ``.data``."""

    def __init__(self, how):
        super().__init__("cache")
        self.how = how
        self.register_buffer("running", torch.zeros(8))

    def forward(self, x):
        h = super().forward(x)
        if self.how == "buffer":
            self.running.mul_(0.9).add_(0.1 * h.mean(0).detach())
        else:
            self.fc.bias.data.add_(h.mean(0).detach())
        return h


@pytest.mark.parametrize("how, name", [("buffer", "buffer 'block.running'"), ("parameter", "parameter 'block.fc.bias'")])
@pytest.mark.parametrize("form", ["per_example", "two_pass", "bookkeeping"])
def test_parameters_and_buffers_changed_beside_a_cache_stay_refused(form, how, name):
    module, optimizer, criterion, loader = _private_with_block(CachesAndCounts(how), form)
    before = _parameters(module._module if isinstance(module, nn.Module) and hasattr(module, "_module") else module)
    with pytest.raises(ValueError, match=f"refused: {name} was changed in place during the forward pass.*"
                       "Nothing was released or charged, but the model holds the change"):
        _train(module, optimizer, criterion, loader, 2)
    model = module._module if hasattr(module, "_module") else module
    assert all(torch.equal(p, q) for (n, p), q in zip(model.named_parameters(), before) if n != "block.fc.bias")


def _private_with_block(block, form):
    """(module, optimizer, criterion, loader) of make_private around :class:`Net` with ``block``."""
    model = Net(None)
    block.fc.load_state_dict(model.block.fc.state_dict())
    model.block = block
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))
    out = PrivacyEngine(accountant="rc_prv").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=torch.utils.data.DataLoader(data, batch_size=8), noise_multiplier=0.0, max_grad_norm=1.0,
        clipping="randomized", criterion=nn.CrossEntropyLoss(), seed=0, **FORMS[form],
    )
    return out[0], out[1], (out[2] if len(out) == 4 else nn.CrossEntropyLoss()), out[-1]


# --- the watch on its own --------------------------------------------------------------------

class Kept(nn.Module):
    """``h`` assigned by each forward pass; read by it first when ``read``; a class default."""

    h = None

    def __init__(self):
        super().__init__()
        self.read = False

    def forward(self, x):
        y = x + (self.h if self.read and self.h is not None else 0)
        self.h = y.detach()
        return y


def _step(watch, model, x):
    model(x)
    return watch.take().names()


def test_a_watched_attribute_names_its_later_read_and_the_loop_can_clear_it():
    model = nn.Sequential(Kept())
    watch = ForwardChanges(model)
    x = torch.randn(2, 3)
    assert _step(watch, model, x) == [] and "h" in Kept.__dict__  # assigned: watched, not a change
    assert _step(watch, model, x) == []  # assigned again, never read
    model[0].read = True
    assert "attribute 'h' of module '0' (Kept) was read by a later training forward pass" in _step(watch, model, x)[0]
    model[0].h = model[0].h.detach()  # the loop's write of a tensor: it may carry the old value
    assert len(_step(watch, model, x)) == 1
    model[0].h = None  # holds nothing: cleared
    assert _step(watch, model, x) == []
    model.eval()
    assert _step(watch, model, x) == []  # an evaluation forward's read
    with torch.no_grad():
        model.train()
        assert _step(watch, model, x) == []  # a forward without gradients
    del model[0].h
    assert model[0].h is None  # the class default, through the watch
    watch.remove()
    assert Kept.__dict__["h"] is None and Kept().h is None  # the class's own entry, given back


def test_a_watched_attribute_changed_in_place_by_a_later_forward_is_a_read():
    model = nn.Sequential(Kept())
    watch = ForwardChanges(model)
    model(torch.randn(2, 3))
    watch.take()
    model[0].forward = lambda x: model[0].h.add_(x)
    assert "was read by a later training forward pass" in _step(watch, model, torch.randn(2, 3))[0]
    watch.remove()
