"""A ghost-mode script in one backward pass: make_private(..., grad_sample_mode="ghost",
clipping="randomized", bookkeeping=True) keeps the 4-tuple and the loop, and gives the
two-pass result (same sketches, noise 0)."""

import copy

import pytest
import torch
from opacus import PrivacyEngine
from torch import nn

from opacus_rc.forms.bookkeeping import DPLossBookkeeping
from tests.models import Decoder, markov_tokens, token_task

from .test_bookkeeping import run_with_engine


def ghost_script(model, x, y, **options):
    """A ghost-clipping script's loop (:func:`tests.forms.test_bookkeeping.run_with_engine`),
    unchanged whatever ``options`` say; sketching at the library's default."""
    params, out, engine = run_with_engine(model, "ghost", x, y, **{"sketching": "per_example", **options})
    return params, out[1], out[2], engine


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
    model = Decoder(vocab=64, d=32, layers=1, heads=2, max_len=64)
    seq = markov_tokens(8, 40, 64)
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
