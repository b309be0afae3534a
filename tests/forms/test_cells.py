"""Issue 53's cells: tied weights in book-keeping, and tied weights and the chunked LM head at
``privacy_unit="user"`` in book-keeping and the two-pass form.

At sigma = 0 the released update equals brute force (:mod:`tests.oracles`: autograd on each row
alone; per example, or each user's mean over their rows, clipped to C): every norm is exact here
(each unit's sequence no longer than the sketch, the tied weight's rows no more than k, so its row
sketch is the identity). Removing one user moves the released sum by at most C. Tolerance: float32
summation order (1e-6 absolute on updates of order 1e-2).
"""

from __future__ import annotations

import copy

import pytest
import torch
from opacus import PrivacyEngine
from torch import nn

import opacus_rc  # noqa: F401
from opacus_rc.lm_head import ChunkedLMHeadLoss

from tests.models import TinyLM
from tests.oracles import per_example_clipped_mean, per_user_clipped_mean

C, VOCAB, T = 0.05, 24, 4
FORMS = {
    "bookkeeping": dict(grad_sample_mode="bookkeeping"),
    "two_pass": dict(grad_sample_mode="ghost"),
    "ghost_bookkeeping": dict(grad_sample_mode="ghost", bookkeeping=True),
}


class TiedClassifier(nn.Module):
    """Embedding -> tanh(Linear) -> an output layer tied to the embedding (V x d), mean-pooled:
    the tied weight's per-example gradient is the sum of its two uses'."""

    def __init__(self, vocab: int = VOCAB, d: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, d)
        self.out = nn.Linear(d, vocab)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc(self.emb(x)))).mean(dim=1)


def data(n: int = 12, users: int = 4, seed: int = 0):
    """Rows of T tokens with a class label (for the classifier) and row ``r`` owned by user ``r % users``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, T), generator=gen)
    y = torch.randint(0, VOCAB, (n,), generator=gen)
    return x, y, [r % users for r in range(n)]


def head_loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The chunked head's per-sequence next-token loss, averaged (labels: the inputs)."""
    inner = getattr(model, "_module", model)
    return ChunkedLMHeadLoss(inner.head, block_size=3, shift_labels=True)(model(x), x)


def unchunked_lm_loss(module: nn.Module, crit, x: torch.Tensor) -> torch.Tensor:
    """The next-token loss through the model's own head (the unchunked path): per sequence, the
    mean over its T - 1 predicted tokens; the ghost criterion's ``shape=`` call in two passes."""
    head = getattr(module, "_module", module).head
    logits = head(module(x))[:, :-1]
    flat = logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1)
    if crit is not None:
        return crit(*flat, shape=logits.shape[:2])
    return nn.functional.cross_entropy(*flat, reduction="none").view(logits.shape[:2]).mean(dim=1).mean()


def released(model: nn.Module, form: str, x, y, owners=None, *, chunked: bool = False, lm: bool = False,
             **sketch) -> dict:
    """One step (sigma 0, lr 1) on the whole batch: each parameter's update; ``owners``: the rows'
    users (every user drawn with all their rows: rate 1, k above every count), else example level;
    ``chunked``: the next-token loss through the chunked head, ``lm``: through the model's own."""
    model = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    options = dict(FORMS[form])
    if owners is not None:
        options.update(privacy_unit="user", user_ids=owners, max_examples_per_user=64, sample_rate=1.0,
                       expected_batch_size=1)  # the released sum itself
    else:
        options.update(poisson_sampling=False)
    criterion = ChunkedLMHeadLoss(model.head, block_size=3, shift_labels=True) if chunked else nn.CrossEntropyLoss()
    module, optimizer, *rest = PrivacyEngine(accountant="rc_prv").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), criterion=criterion,
        data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x)),
        noise_multiplier=0.0, max_grad_norm=C, clipping="randomized", seed=1, **{"sketch_size": 32, **sketch},
        **options,
    )
    crit = rest[0] if len(rest) == 2 else None
    for xb, yb in rest[-1]:
        if chunked:
            loss = crit(module(xb), xb) if crit is not None else head_loss_of(module, xb)
        elif lm:
            loss = unchunked_lm_loss(module, crit, xb)
        else:
            loss = crit(module(xb), yb) if crit is not None else nn.functional.cross_entropy(module(xb), yb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if not optimizer._is_last_step_skipped:
            break
    return {n: before[n] - p.detach() for n, p in model.named_parameters()}


def assert_updates(ours: dict, expected: dict) -> None:
    assert ours.keys() == expected.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], expected[name].to(ours[name]), atol=1e-6, rtol=1e-4,
                                   msg=lambda m: f"{name}: {m}")


def ce(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def head_ce(model, x, _y):
    return head_loss_of(model, x)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_tied_weights_equal_brute_force_per_example(form):
    """Book-keeping keeps one record of a tied weight's summed uses (before: refused); its
    update, like the two-pass form's, is per-example clipping of the whole gradient."""
    x, y, _ = data()
    model = TiedClassifier()
    expected = per_example_clipped_mean(copy.deepcopy(model), ce, x, y, C, len(x))
    assert_updates(released(model, form, x, y), expected)


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("chunked", [False, True], ids=["tied_layers", "tied_chunked_head"])
def test_tied_weights_equal_brute_force_per_user(form, chunked):
    """privacy_unit="user" with a tied weight (before: refused in the two-pass form and in
    book-keeping): each user's rows regrouped into one sequence, its tied uses projected and
    summed; the update is each user's mean gradient clipped once."""
    x, y, owners = data()
    if chunked:
        model, loss_of = TinyLM(vocab=VOCAB, tied=True), head_ce
    else:
        model, loss_of = TiedClassifier(), ce
    expected = per_user_clipped_mean(copy.deepcopy(model), loss_of, x, y, owners, C, 1.0)
    assert_updates(released(model, form, x, y, owners, chunked=chunked), expected)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_chunked_head_equals_brute_force_per_user(form):
    """privacy_unit="user" with the chunked LM head (before: refused in book-keeping and the
    two-pass form): the head's per-row products summed over each user's rows with the user's
    sketch (exact here), its clipped sum weighted by the user's factor."""
    x, y, owners = data()
    model = TinyLM(vocab=VOCAB, bias=True)
    expected = per_user_clipped_mean(copy.deepcopy(model), head_ce, x, y, owners, C, 1.0)
    assert_updates(released(model, form, x, y, owners, chunked=True), expected)


@pytest.mark.parametrize("estimator", ["hutchinson", "hutchpp"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("form", ["bookkeeping", "two_pass"])
def test_sketched_chunked_head_per_user_equals_the_unchunked_head(form, tied, estimator):
    """Sketched norms (a user's 3 rows of 4 tokens: 12 > k = 4; 24 rows of the tied weight > k): the
    chunked head at user level gives the update of the model's own head for the same sketches
    (the head's sketch is each user's, its rows' products summed before the norm)."""
    x, y, owners = data()
    model = TinyLM(vocab=VOCAB, tied=tied, bias=True)
    sketch = dict(sketch_size=4, estimator=estimator)
    ours = released(model, form, x, y, owners, chunked=True, **sketch)
    expected = released(model, form, x, y, owners, lm=True, **sketch)
    assert_updates(ours, expected)
    exact = per_user_clipped_mean(copy.deepcopy(model), head_ce, x, y, owners, C, 1.0)
    assert not torch.allclose(ours["head.bias"], exact["head.bias"].float(), atol=1e-6, rtol=1e-3)  # it sketched


@pytest.mark.parametrize("form", ["bookkeeping", "two_pass"])
def test_removing_one_user_moves_the_sum_by_at_most_C(form):
    """A tied LM through the chunked head, every user drawn: the released sums with and without
    user 0 (3 rows) differ by at most C (by more at example level, the control)."""
    x, y, owners = data()
    keep = [r for r, u in enumerate(owners) if u != 0]
    model = TinyLM(vocab=VOCAB, tied=True, bias=True)

    def flat(update: dict) -> torch.Tensor:
        return torch.cat([u.double().flatten() for u in update.values()])

    with_user = flat(released(model, form, x, y, owners, chunked=True))
    without = flat(released(model, form, x[keep], y[keep], [owners[r] for r in keep], chunked=True))
    assert (with_user - without).norm() <= C * (1 + 1e-5)
    examples = flat(released(model, form, x, y, chunked=True)) * len(x) - \
        flat(released(model, form, x[keep], y[keep], chunked=True)) * len(keep)
    assert examples.norm() > 1.5 * C  # three rows, each clipped to C


class SubclassTied(TiedClassifier):
    """The tied output layer a subclass of nn.Linear: book-keeping gives it Opacus's per-sample
    gradients, which have no projection to sum with the embedding's use."""

    def __init__(self) -> None:
        super().__init__()

        class Out(nn.Linear):
            pass

        out = Out(8, VOCAB)
        out.weight = self.emb.weight
        self.out = out


def test_tied_weight_through_a_layer_without_a_projection_is_refused_by_name():
    x, y, _ = data()
    with pytest.raises(ValueError, match=r"parameter tying through Out .*is not supported: a tied parameter's "
                                         r"per-example gradient is the sum of its uses"):
        released(SubclassTied(), "bookkeeping", x, y)


def test_a_packed_row_through_a_layer_whose_input_is_not_per_token_is_refused_by_name():
    """A batch of packed rows (its examples token ranges of a row, opacus_rc.packing) through a
    classifier that pools before its last layer: that layer's input is one per row, not per token,
    so it cannot be split into the examples: refused, naming the layer and the reason."""
    from opacus_rc.draws import Batch, Draw
    from opacus_rc.packing import Segments
    from opacus_rc.units import RowUnits

    class Pooled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.fc = nn.Embedding(32, 24), nn.Linear(24, 2)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.fc(self.emb(ids).mean(dim=1))

    model = Pooled()
    x = torch.randint(0, 32, (1, 7))
    module, optimizer, _ = PrivacyEngine(accountant="rc_prv").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0, max_grad_norm=C,
        data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, 0]), batch_size=1),
        poisson_sampling=False, clipping="randomized", grad_sample_mode="bookkeeping", per_example_backward=False,
    )
    segments = Segments.of_rows(torch.tensor([[0, 1, 2, 0, 1, 2, 3]]), [3, 4])
    optimizer.ledger.deliver(x, Batch(Draw(1, signalled=True), 0, RowUnits.singletons(2), segments))
    with pytest.raises(ValueError, match=r"a packed row \(several examples in one row\) through Linear, whose input "
                                         r"has shape \(1, 24\) is not supported: .*one entry per token"):
        nn.functional.cross_entropy(module(x), torch.zeros(1, dtype=torch.long)).backward()
