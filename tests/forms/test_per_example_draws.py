"""The per-example form's premise made structural (issue 38, items 1, 3 and 7).

* A step is exactly one Poisson draw: the loader make_private returns (and
  BatchMemoryManager's) counts the physical batches it delivers, and ``optimizer.step()``
  must follow exactly one; an accumulation loop (``step()`` every k batches) is refused.
  At noise 0 each released update equals brute-force clipping of exactly one draw's
  examples (:func:`tests.oracles.per_example_clipped_mean`).
* A forward takes the batch in hand of the returned loader (a view or copy of it), once:
  several examples built by hand in any dimension are refused.
* The automatic switch at batch_size=1 warns once.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from opacus import PrivacyEngine
from opacus.layers import DPGRU
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn

import opacus_rc  # noqa: F401
import opacus_rc.forms as forms
from opacus_rc.forms.per_example import PerExampleOptimizer

from tests.models import SequenceClassifier, token_task
from tests.oracles import per_example_clipped_mean

#: every test also with the batches copied as on a device (tests/conftest.py, issue 52)
pytestmark = pytest.mark.usefixtures("batches_as_on_a_device")

C = 0.05


def _ce(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def private(n=4, batch_size=2, noise=0.0, seed=5, model=None, data=None, **options):
    torch.manual_seed(0)
    model = model or SequenceClassifier()
    engine = PrivacyEngine(accountant="rc_prv")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the automatic switch's warning: tested below
        out = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=torch.utils.data.DataLoader(data or token_task(n=n), batch_size=batch_size),
            noise_multiplier=noise, max_grad_norm=C, clipping="randomized", seed=seed, **options,
        )
    return model, engine, out


# --- item 1: a step is one Poisson draw -----------------------------------------------------


def test_accumulation_every_k_batches_is_refused():
    """n = 4, q = 0.5, k = 2 (the measured case): before, a release held one example's
    clipped gradient twice and was charged as one micro-batch; now the first step() that
    follows two physical batches is refused, and every later one."""
    model, engine, (module, optimizer, loader) = private(per_example_backward=True)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="followed 2 physical batches.*gradient_accumulation_steps"):
        for _ in range(20):
            for i, (x, y) in enumerate(loader):
                _ce(module, x, y).backward()
                if (i + 1) % 2 == 0:
                    optimizer.step()
                    optimizer.zero_grad()
    assert engine.accountant.history == [] or all(h[3].micro_batches == 1 for h in engine.accountant.history)
    released = engine.accountant.history
    with pytest.raises(ValueError, match="optimizer.step\\(\\) refused"):
        optimizer.step()  # sticky: the run must end
    assert engine.accountant.history == released
    if not released:
        assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_two_steps_after_one_batch_are_refused():
    _, _, (module, optimizer, loader) = private(n=8, batch_size=4, per_example_backward=True)
    with pytest.raises(ValueError, match="called twice for one physical batch"):
        for x, y in loader:
            _ce(module, x, y).backward()
            optimizer.step()
            optimizer.step()


def _copy(model):
    """The model's parameters in a fresh model (no hook: a deep copy would copy them)."""
    reference = SequenceClassifier()
    reference.load_state_dict(model.state_dict())
    return reference


def _lockstep_releases(module, optimizer, loader, model, steps):
    """Iterate in lockstep; for each real step, the update and the draw's examples."""
    out, xs, ys = [], [], []
    reference = _copy(model)
    while len(out) < steps:
        for x, y in loader:
            xs += list(x)
            ys += list(y)
            _ce(module, x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
            if not optimizer._is_last_step_skipped:
                update = {n: r.detach() - p.detach() for (n, p), r in zip(model.named_parameters(), reference.parameters())}
                out.append((update, xs, ys, reference))
                xs, ys, reference = [], [], _copy(model)
                if len(out) == steps:
                    break
    return out


@pytest.mark.parametrize("managed", [False, True])
def test_each_release_is_exactly_one_draw(managed):
    """At noise 0 each release equals brute-force clipping of exactly the examples of one
    draw over the public B, charged as one micro-batch; with BatchMemoryManager on top too."""
    n, b = 8, 2
    model, engine, (module, optimizer, loader) = private(n=n, batch_size=b, per_example_backward=True)
    if managed:
        loader = BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=optimizer).__enter__()
    releases = _lockstep_releases(module, optimizer, loader, model, steps=6)
    assert any(len(xs) >= 2 for _, xs, _, _ in releases), "no draw of two: pick another seed"
    for update, xs, ys, reference in releases:
        want = per_example_clipped_mean(reference, _ce, xs, ys, C, b) if xs else None
        for name, _ in model.named_parameters():
            expected = torch.zeros_like(update[name]) if want is None else want[name]
            torch.testing.assert_close(update[name], expected, rtol=1e-5, atol=1e-6, msg=name)
    history = engine.accountant.history
    assert sum(h[2] for h in history) == 6 and all(h[3].micro_batches == 1 for h in history)


def test_batch_memory_manager_accumulation_is_refused_in_sketched_forms():
    """BatchMemoryManager's loader over a sketched form: an accumulation loop is refused too."""
    _, _, (module, optimizer, loader) = private(n=16, batch_size=8, per_example_backward=False)
    assert not isinstance(optimizer, PerExampleOptimizer)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=optimizer) as managed:
        with pytest.raises(ValueError, match="followed 2 physical batches"):  # at the second batch's forward
            for i, (x, y) in enumerate(managed):
                _ce(module, x, y).backward()
                if (i + 1) % 2 == 0:
                    optimizer.step()
                    optimizer.zero_grad()


def test_batch_memory_manager_of_one_over_the_poisson_loader():
    """per_example_backward=False is not the only way out: a larger batch_size and
    BatchMemoryManager(max_physical_batch_size=1) over the returned loader releases whole draws."""
    model, engine, (module, optimizer, loader) = private(n=8, batch_size=4, per_example_backward=True)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=1, optimizer=optimizer) as managed:
        releases = _lockstep_releases(module, optimizer, managed, model, steps=2)
    for update, xs, ys, reference in releases:
        if xs:
            want = per_example_clipped_mean(reference, _ce, xs, ys, C, 4)
            for name in want:
                torch.testing.assert_close(update[name], want[name], rtol=1e-5, atol=1e-6)


# --- item 3: a forward takes the batch in hand -----------------------------------------------


class SeqFirst(nn.Module):
    """Opacus's DPGRU over (T, B, F) input (batch in dim 1) and a linear head."""

    def __init__(self, f: int = 3, h: int = 4):
        super().__init__()
        self.gru = DPGRU(f, h)
        self.fc = nn.Linear(h, 2)

    def forward(self, x, *extra):
        out, _ = self.gru(x)
        return self.fc(out[-1])


def _seq_data(n=8, t=1, f=3):
    gen = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, t, f, generator=gen), torch.randint(0, 2, (n,), generator=gen))


def _first_batch(loader):
    it = iter(loader)
    x, y = next(it)
    while len(x) == 0:
        x, y = next(it)
    return it, x, y


def test_a_second_forward_of_one_batch_and_a_forward_of_several_examples_are_refused():
    """A batch of the loader goes through one forward: a second is refused by name; a forward
    whose tensors hold several examples along the batch dimension is refused by the argument
    check. (Which batch a forward takes is its place in the delivery order, not its values: a
    transposed or cast copy of the delivered example is that example, docs/forms.md.)"""
    data = _seq_data()
    _, _, (module, optimizer, loader) = private(n=8, batch_size=4, model=SeqFirst(), data=data,
                                                per_example_backward=True)
    it, x, y = _first_batch(loader)
    module(x.transpose(0, 1).contiguous().float())
    with pytest.raises(ValueError, match="went through a second forward pass"):
        module(x.transpose(0, 1))
    _, _, (module, optimizer, loader) = private(n=8, batch_size=4, model=SeqFirst(), data=data,
                                                per_example_backward=True)
    it, x, y = _first_batch(loader)
    with pytest.raises(ValueError, match="clips one example per backward pass; the model's forward got a batch of 4"):
        module(data.tensors[0][:4])  # four examples, batch first


def test_a_forward_after_the_iteration_is_refused_and_hand_built_objects_are_unchanged():
    data = _seq_data()
    _, _, (module, optimizer, loader) = private(n=8, batch_size=4, model=SeqFirst(), data=data,
                                                per_example_backward=True)
    x = data.tensors[0][:1].transpose(0, 1)
    module(x)  # the loader never iterated: the argument check alone (as DPTrainer's rows)
    for _ in loader:
        pass
    with pytest.raises(ValueError, match="did not deliver|already released|held 2 examples"):  # at its forward, or its step
        module(x).sum().backward()
        optimizer.step()
    with torch.no_grad():
        module(data.tensors[0][:4].transpose(0, 1))  # no gradient: not a training forward


# --- item 7: the automatic switch warns once ----------------------------------------------------


def test_automatic_switch_warns_once_with_the_expected_batch():
    forms._logged_automatic = False
    torch.manual_seed(0)

    def make():
        model = SequenceClassifier()
        return PrivacyEngine(accountant="rc_prv").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=torch.utils.data.DataLoader(token_task(n=40), batch_size=1), noise_multiplier=1.0,
            max_grad_norm=C, clipping="randomized",
        )

    with pytest.warns(UserWarning, match=r"(?s)per-example form.*expected logical batch.*1 example.*"
                                         r"BatchMemoryManager\(max_physical_batch_size=1\).*per_example_backward=False"):
        make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make()  # once
    assert not [w for w in caught if "per-example form" in str(w.message)]
