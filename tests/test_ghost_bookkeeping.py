"""A ghost-mode script in one backward pass: make_private(..., grad_sample_mode="ghost",
clipping="randomized", bookkeeping=True) keeps the 4-tuple and the loop, and gives the
two-pass result (same sketches, noise 0)."""

import copy

import pytest
import torch
from opacus import PrivacyEngine
from torch import nn

from examples.models import TinyDecoder, markov_text
from opacus_rc.forms.bookkeeping import DPLossBookkeeping

from .conftest import token_task


def ghost_script(model, x, y, *, lm=False, micro=1, steps=1, **options):
    """A ghost-clipping script's loop, unchanged whatever ``options`` say."""
    engine = PrivacyEngine(accountant="rc_prv")
    model, optimizer, criterion, _ = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        criterion=nn.CrossEntropyLoss(),
        data_loader=torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, y), batch_size=len(x) // micro
        ),
        noise_multiplier=0.0,
        max_grad_norm=0.1,
        poisson_sampling=False,
        grad_sample_mode="ghost",
        clipping="randomized",
        **{"sketch_size": 4, "sketch_seed": 3, **options},
    )
    for _ in range(steps):
        for xb, yb in zip(x.chunk(micro), y.chunk(micro)):
            logits = model(xb)
            if lm:
                loss = criterion(logits.reshape(-1, logits.shape[-1]), yb.reshape(-1), shape=logits.shape[:2])
            else:
                loss = criterion(logits, yb)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}, optimizer, criterion, engine


def assert_same(a, b):
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("estimator", ["hutchinson", "hutchpp"])
def test_ghost_bookkeeping_equals_two_pass(model_factory, estimator):
    x, y = token_task(n=16, t=48).tensors
    init = model_factory(seed=5)
    two, opt2, _, _ = ghost_script(copy.deepcopy(init), x, y, steps=2, estimator=estimator)
    one, opt1, crit, _ = ghost_script(copy.deepcopy(init), x, y, steps=2, estimator=estimator, bookkeeping=True)
    assert type(opt2).__name__ == "RandomizedClippingOptimizer"
    assert type(opt1).__name__ == "RandomizedClippingBookkeepingOptimizer"
    assert isinstance(crit, DPLossBookkeeping)
    assert_same(one, two)


def test_ghost_bookkeeping_lm_with_ignored_labels_equals_two_pass():
    """Per-sequence privacy unit through ``shape=``, ``-100`` labels excluded per sequence."""
    torch.manual_seed(0)
    model = TinyDecoder(vocab=64, d_model=32, n_layers=1, n_heads=2, max_len=64)
    seq = markov_text(8, 40, 64)
    x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    y[:4, -10:] = -100  # padded tails on half the sequences
    two, *_ = ghost_script(copy.deepcopy(model), x, y, lm=True)
    one, *_ = ghost_script(copy.deepcopy(model), x, y, lm=True, bookkeeping=True)
    assert_same(one, two)


def test_ghost_bookkeeping_accumulates_micro_batches_and_accounts_alike(model_factory):
    x, y = token_task(n=16, t=48).tensors
    init = model_factory(seed=2)
    two, _, _, e2 = ghost_script(copy.deepcopy(init), x, y, micro=2)
    one, _, _, e1 = ghost_script(copy.deepcopy(init), x, y, micro=2, bookkeeping=True)
    assert_same(one, two)
    assert e1.accountant.history == e2.accountant.history


def test_loss_behaves_like_a_tensor(model_factory):
    x, y = token_task(n=8, t=48).tensors
    _, _, crit, _ = ghost_script(model_factory(), x, y, steps=0, bookkeeping=True)
    loss = crit(torch.randn(8, 2, requires_grad=True), y)
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0
    assert (loss / 2).item() == pytest.approx(loss.item() / 2)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"bookkeeping": "yes"}, "bookkeeping='yes' is invalid"),
        ({"bookkeeping": True, "clipping": "flat"}, "only applies with clipping='randomized'"),
        ({"bookkeeping": True, "grad_sample_mode": "ghost_fsdp"}, "accepted values with bookkeeping=True"),
    ],
)
def test_invalid_bookkeeping_options(model_factory, options, match):
    x, y = token_task(n=8, t=48).tensors
    model = model_factory()
    kwargs = dict(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        criterion=nn.CrossEntropyLoss(),
        data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8),
        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ghost", clipping="randomized",
    )
    kwargs.update(options)
    with pytest.raises(ValueError, match=match):
        PrivacyEngine(accountant="rc_prv").make_private(**kwargs)
