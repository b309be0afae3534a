"""The chunked LM head and loss (opacus_rc.lm_head, issue 23): per-sequence losses, the
body's gradient and the head's per-example norm a block of positions at a time.

Exact norms (T <= k): the update equals brute-force per-sequence clipping of the unchunked
model (plain autograd, one sequence at a time). Sketched: it equals the unchunked
randomized path for the same sketches (same sketch_seed). Two-pass and book-keeping."""

import copy

import pytest
import torch
import torch.nn.functional as F
from opacus import PrivacyEngine
from torch import nn

from opacus_rc.lm_head import ChunkedLMHeadLoss
from tests.oracles import per_example_clipped_mean

C = 0.05  # small enough that every sequence is clipped


class TinyLM(nn.Module):
    """Embedding -> Linear -> tanh -> LayerNorm (the body: ``forward`` returns the hidden
    states) and an LM head, optionally tied to the embedding, optionally with a bias."""

    def __init__(self, vocab=24, d=16, tied=False, bias=False, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.tok = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=bias)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, x):
        return self.norm(torch.tanh(self.fc(self.tok(x))))


def batch(n, t, vocab, seed=0, all_ignored=(), pad_tail=2):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (n, t), generator=gen)
    y = torch.randint(0, vocab, (n, t), generator=gen)
    y[:, t - pad_tail:] = -100
    for i in all_ignored:
        y[i] = -100
    return x, y


def per_sequence_ce(logits, y):
    tok = F.cross_entropy(logits.transpose(1, 2), y, ignore_index=-100, reduction="none")
    return tok.sum(dim=1) / (y != -100).sum(dim=1).clamp(min=1)


def step(model, x, y, *, chunked, mode="ghost", block_size=3, wrap_model=True, bookkeeping=False,
         autocast=False, shift=False, **options):
    """One noiseless SGD(lr=1) step on the batch; returns (update by name, losses)."""
    model = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    head_loss = ChunkedLMHeadLoss(model.head, block_size=block_size, shift_labels=shift)
    criterion = head_loss if chunked else nn.CrossEntropyLoss(ignore_index=-100)
    engine = PrivacyEngine(accountant="rc_prv")
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x))
    kwargs = dict(module=model, optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0),
                  data_loader=loader, noise_multiplier=0.0, max_grad_norm=C, poisson_sampling=False,
                  grad_sample_mode=mode, clipping="randomized", wrap_model=wrap_model,
                  **{"sketch_size": 16, "sketch_seed": 3, **options})
    if mode == "ghost":
        kwargs.update(criterion=criterion, bookkeeping=bookkeeping)
        module, opt, crit, _ = engine.make_private(**kwargs)
    else:
        module, opt, _ = engine.make_private(**kwargs)
        crit = None
    body = module if wrap_model else model
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        hidden = body(x)
        if chunked:
            loss = crit(hidden, y) if crit is not None else head_loss(hidden, y)
        else:
            logits = model.head(hidden)
            if shift:
                logits, yy = logits[:, :-1], y[:, 1:]
            else:
                yy = y
            if crit is not None:
                loss = crit(logits.reshape(-1, logits.shape[-1]), yy.reshape(-1), shape=logits.shape[:2])
            else:
                loss = per_sequence_ce(logits.float(), yy).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    update = {n: before[n] - p.detach() for n, p in model.named_parameters() if p.requires_grad}
    return update, float(loss.item() if hasattr(loss, "item") else loss)


def brute_force(model, x, y, shift=False):
    def loss_of(m, xi, yi):
        logits = m.head(m(xi))
        if shift:
            logits, yi = logits[:, :-1], yi[:, 1:]
        return per_sequence_ce(logits, yi)[0]

    return per_example_clipped_mean(copy.deepcopy(model), loss_of, x, y, C, len(x))


def assert_close(a, b, atol=1e-6, rtol=1e-4):
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], atol=atol, rtol=rtol, msg=lambda m: f"{n}: {m}")


# --- losses ------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 3, 8, 100])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_losses_and_gradients_equal_unchunked(block_size, reduction):
    model = TinyLM(bias=True)
    x, y = batch(3, 8, 24, all_ignored=(1,))
    hidden = model(x)
    head = ChunkedLMHeadLoss(model.head, block_size=block_size, reduction=reduction)
    head.reduction = "none"
    ours = head(hidden, y)
    tok = F.cross_entropy(model.head(hidden).transpose(1, 2), y, ignore_index=-100, reduction="none")
    ref = per_sequence_ce(model.head(hidden), y) if reduction == "mean" else tok.sum(dim=1)
    torch.testing.assert_close(ours, ref)
    assert ours[1] == 0
    w = torch.tensor([0.3, -1.2, 2.0])
    g_ours = torch.autograd.grad((ours * w).sum(), list(model.parameters()), retain_graph=True)
    g_ref = torch.autograd.grad((ref * w).sum(), list(model.parameters()))
    for a, b in zip(g_ours, g_ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_shift_labels_match_hugging_face_convention():
    model = TinyLM()
    x, _ = batch(2, 7, 24)
    labels = x.clone()
    labels[0, -2:] = -100
    hidden = model(x)
    head = ChunkedLMHeadLoss(model.head, block_size=2, shift_labels=True)
    logits = model.head(hidden)[:, :-1]
    ref = F.cross_entropy(logits.reshape(-1, 24), labels[:, 1:].reshape(-1), ignore_index=-100)
    per_seq = per_sequence_ce(logits, labels[:, 1:])
    head.reduction = "none"
    torch.testing.assert_close(head(hidden, labels), per_seq)
    head.reduction = "mean"
    torch.testing.assert_close(head(hidden, labels), per_seq.mean())
    assert ref.shape == ()


def test_invalid_arguments_raise():
    with pytest.raises(ValueError, match="block_size"):
        ChunkedLMHeadLoss(nn.Linear(4, 8), block_size=0)
    with pytest.raises(ValueError, match="nn.Linear"):
        ChunkedLMHeadLoss(nn.Embedding(4, 8))
    with pytest.raises(ValueError, match="reduction"):
        ChunkedLMHeadLoss(nn.Linear(4, 8), reduction="none")
    with pytest.raises(ValueError, match=r"\(B, T, d\)"):
        ChunkedLMHeadLoss(nn.Linear(4, 8))(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))


# --- exact norms (T <= k): brute-force per-sequence clipping of the unchunked model ------

MODES = [
    pytest.param(dict(mode="ghost"), id="two-pass"),
    pytest.param(dict(mode="ghost", wrap_model=False), id="two-pass-hooks"),
    pytest.param(dict(mode="hooks"), id="book-keeping"),
    pytest.param(dict(mode="hooks", wrap_model=False), id="book-keeping-hooks"),
    pytest.param(dict(mode="ghost", bookkeeping=True), id="ghost-bookkeeping"),
]


@pytest.mark.parametrize("setup", MODES)
@pytest.mark.parametrize("block_size", [1, 3, 100])
def test_exact_update_equals_brute_force(setup, block_size):
    """T = 8 <= k = 16: every norm exact; the update is plain per-sequence clipping."""
    model = TinyLM(bias=True)
    x, y = batch(4, 8, 24, all_ignored=(2,))
    ours, loss = step(model, x, y, chunked=True, block_size=block_size, **setup)
    assert_close(ours, brute_force(model, x, y))
    ref_loss = per_sequence_ce(model.head(model(x)), y).mean()
    assert abs(loss - float(ref_loss)) < 1e-5


@pytest.mark.parametrize("setup", MODES[:3])
def test_exact_update_with_shifted_labels(setup):
    model = TinyLM()
    x, _ = batch(3, 8, 24)
    labels = x.clone()
    labels[1, -3:] = -100
    ours, _ = step(model, x, labels, chunked=True, shift=True, **setup)
    assert_close(ours, brute_force(model, x, labels, shift=True))


@pytest.mark.parametrize("setup", MODES[:3])
def test_frozen_head_gives_the_body_gradient_only(setup):
    """A frozen head (PEFT-style): no head norm; the body's update is per-sequence clipped."""
    model = TinyLM()
    model.head.weight.requires_grad_(False)
    x, y = batch(3, 8, 24)
    ours, _ = step(model, x, y, chunked=True, **setup)
    assert "head.weight" not in ours
    assert_close(ours, brute_force(model, x, y))


# --- sketched: the unchunked randomized path with the same sketches -----------------------

SKETCHED = [
    pytest.param(dict(mode="ghost"), id="two-pass"),
    pytest.param(dict(mode="hooks"), id="book-keeping"),
    pytest.param(dict(mode="ghost", sketching="shared"), id="two-pass-shared"),
    pytest.param(dict(mode="hooks", sketching="shared"), id="book-keeping-shared"),
    pytest.param(dict(mode="ghost", estimator="hutchpp"), id="two-pass-hutchpp"),
    pytest.param(dict(mode="hooks", estimator="hutchpp", wrap_model=False), id="book-keeping-hutchpp"),
]


@pytest.mark.parametrize("setup", SKETCHED)
@pytest.mark.parametrize("vocab", [40, 8])  # sketch on the vocabulary side (V > d), input side (V < d)
def test_sketched_update_equals_unchunked(setup, vocab):
    model = TinyLM(vocab=vocab, bias=True)
    x, y = batch(3, 20, vocab, all_ignored=(0,))
    opts = dict(sketch_size=4, **setup)
    ours, loss = step(model, x, y, chunked=True, block_size=3, **opts)
    ref, ref_loss = step(model, x, y, chunked=False, **opts)
    assert_close(ours, ref)
    assert abs(loss - ref_loss) < 1e-5
    # and the sketch really bites: not the exact update
    exact = brute_force(model, x, y)
    assert not torch.allclose(ours["head.weight"], exact["head.weight"], atol=1e-6, rtol=1e-3)


@pytest.mark.parametrize("sketching", ["per_example", "shared"])
def test_tied_embedding_and_head_sum_their_sketched_uses(sketching):
    """Tied weights (two-pass): the head's projection with the weight's row sketch is summed
    with the embedding's before the norm, exactly as the unchunked path does."""
    model = TinyLM(vocab=40, tied=True)
    x, y = batch(3, 20, 40)
    opts = dict(sketch_size=4, sketching=sketching)
    ours, _ = step(model, x, y, chunked=True, **opts)
    ref, _ = step(model, x, y, chunked=False, **opts)
    assert_close(ours, ref)


def test_tied_weights_under_book_keeping_raise():
    model = TinyLM(vocab=40, tied=True)
    x, y = batch(2, 20, 40)
    with pytest.raises(ValueError, match="tied weights"):
        step(model, x, y, chunked=True, mode="hooks")
