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
from tests.models import TinyLM, hf_model, lm_batch
from tests.oracles import per_example_clipped_mean

C = 0.05  # small enough that every sequence is clipped


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
    data = (x, y) if len(x) else (torch.zeros(4, x.shape[1], dtype=torch.long),) * 2  # empty batch
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data), batch_size=len(data[0]))
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
        ChunkedLMHeadLoss(nn.Linear(4, 8), reduction="avg")
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


@pytest.mark.parametrize("mode", ["ghost", "hooks"])
@pytest.mark.parametrize("sketching", ["per_example", "shared"])
def test_tied_embedding_and_head_sum_their_sketched_uses(sketching, mode):
    """Tied weights (two-pass and book-keeping): the head's projection with the weight's row
    sketch is summed with the embedding's before the norm, exactly as the unchunked path does."""
    model = TinyLM(vocab=40, tied=True)
    x, y = batch(3, 20, 40)
    opts = dict(sketch_size=4, sketching=sketching, mode=mode)
    ours, _ = step(model, x, y, chunked=True, **opts)
    ref, _ = step(model, x, y, chunked=False, **opts)
    assert_close(ours, ref)


@pytest.mark.parametrize("setup", MODES)
def test_tied_embedding_and_head_exact_update_equals_brute_force(setup):
    """A tied weight of V = 24 rows <= k = 32: its row sketch is the identity, so the norm of the
    summed uses is exact, in every form (book-keeping: one record of the embedding's and the
    chunked head's uses); the update is plain per-sequence clipping."""
    model = TinyLM(tied=True, bias=True)
    x, y = batch(4, 8, 24, all_ignored=(2,))
    ours, _ = step(model, x, y, chunked=True, sketch_size=32, **setup)
    assert_close(ours, brute_force(model, x, y))


# --- activation checkpointing, bf16 autocast, empty batches, micro-batches ----------------


class CheckpointedLM(TinyLM):
    """The body under activation checkpointing: its forward is recomputed inside the
    backward pass(es)."""

    reentrant = False

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(lambda e: self.norm(torch.tanh(self.fc(e))), self.tok(x), use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("setup", MODES[:3])
def test_checkpointed_body_exact_update_equals_brute_force(setup, reentrant):
    model = CheckpointedLM(bias=True)
    model.reentrant = reentrant
    x, y = batch(4, 8, 24)
    ours, _ = step(model, x, y, chunked=True, **setup)
    assert_close(ours, brute_force(TinyLM(bias=True), x, y))


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("setup", SKETCHED[:2])
def test_checkpointed_head_equals_unchunked(setup, reentrant):
    """The head loss itself inside a checkpointed region: a non-reentrant recomputation
    leaves the grad-sample module's state alone, a reentrant one (whose real forward ran
    without gradients) is the pass; the update is the unchunked one."""
    from torch.utils.checkpoint import checkpoint

    model = TinyLM(vocab=40)
    x, y = batch(3, 20, 40)
    ref, _ = step(model, x, y, chunked=False, sketch_size=4, **setup)
    original = ChunkedLMHeadLoss.forward
    try:
        ChunkedLMHeadLoss.forward = lambda self, h, l: checkpoint(original, self, h, l, use_reentrant=reentrant)
        ours, _ = step(model, x, y, chunked=True, sketch_size=4, **setup)
    finally:
        ChunkedLMHeadLoss.forward = original
    assert_close(ours, ref)


@pytest.mark.parametrize("setup", SKETCHED[:2])
def test_bf16_autocast_matches_unchunked(setup):
    """Under bf16 autocast the logits run in bf16 and the loss, softmax and sketch
    arithmetic in float32, as in the unchunked path: the updates agree to bf16 precision. A
    plain mean loss (book-keeping's) in half precision is refused by name (the 1/n of the realised
    batch rounded into every example's gradient: docs/guide.md, "The mean loss's rounding")."""
    model = TinyLM(vocab=40)
    x, y = batch(3, 20, 40)
    if setup["mode"] == "hooks":
        with pytest.raises(ValueError, match="loss_reduction='mean' with a model that computes in half precision"):
            step(model, x, y, chunked=True, autocast=True, sketch_size=4, **setup)
        return
    ours, loss = step(model, x, y, chunked=True, autocast=True, sketch_size=4, **setup)
    ref, ref_loss = step(model, x, y, chunked=False, autocast=True, sketch_size=4, **setup)
    assert abs(loss - ref_loss) < 2e-2
    for n in ref:
        scale = float(ref[n].abs().max())
        assert float((ours[n] - ref[n]).abs().max()) <= 3e-2 * scale + 1e-6, n


@pytest.mark.parametrize("setup", MODES)
def test_empty_batch_updates_nothing(setup):
    model = TinyLM(bias=True)
    x, y = batch(4, 8, 24)
    ours, _ = step(model, x[:0], y[:0], chunked=True, **setup)
    assert all(float(u.abs().max()) == 0.0 for u in ours.values())


@pytest.mark.parametrize("mode", ["ghost", "hooks"])
def test_micro_batches_equal_unchunked(mode):
    """Two backward passes (micro-batches) before one step: the same sketches as the
    unchunked path, the same accumulated update."""

    def run(chunked):
        model = TinyLM(vocab=40, bias=True)
        x, y = batch(4, 20, 40)
        head_loss = ChunkedLMHeadLoss(model.head, block_size=3)
        engine = PrivacyEngine(accountant="rc_prv")
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=2)
        crit = head_loss if chunked else nn.CrossEntropyLoss(ignore_index=-100)
        kwargs = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                      data_loader=loader, noise_multiplier=0.0, max_grad_norm=C, poisson_sampling=False,
                      grad_sample_mode=mode, clipping="randomized", sketch_size=4, sketch_seed=5,
                      sketching="shared")
        if mode == "ghost":
            module, opt, crit, _ = engine.make_private(criterion=crit, **kwargs)
        else:
            module, opt, _ = engine.make_private(**kwargs)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        for xb, yb in loader:
            hidden = module(xb)
            if chunked:
                loss = crit(hidden, yb) if mode == "ghost" else head_loss(hidden, yb)
            else:
                logits = model.head(hidden)
                loss = (crit(logits.reshape(-1, 40), yb.reshape(-1), shape=logits.shape[:2]) if mode == "ghost"
                        else per_sequence_ce(logits, yb).mean())
            loss.backward()
        opt.step()
        return {n: before[n] - p.detach() for n, p in model.named_parameters()}

    assert_close(run(True), run(False))


def test_nonfinite_skip_drops_the_sequence():
    """Book-keeping with nonfinite="skip": a sequence whose hidden states are not finite
    contributes nothing (the head's recomputation never sees its rows)."""
    model = TinyLM(bias=True)
    x, y = batch(4, 8, 24)
    head_loss = ChunkedLMHeadLoss(model.head, block_size=3)
    engine = PrivacyEngine(accountant="rc_prv")
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    module, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=loader,
        noise_multiplier=0.0, max_grad_norm=C, poisson_sampling=False, clipping="randomized",
        sketch_size=16, nonfinite="skip")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    hidden = module(x)
    poison = torch.zeros_like(hidden)
    poison[1, 3, 0] = float("inf")
    head_loss(hidden + poison, y).backward()
    opt.step()
    assert opt.skipped_examples == 1
    ours = {n: before[n] - p.detach() for n, p in model.named_parameters()}
    assert all(torch.isfinite(u).all() for u in ours.values())
    keep = [0, 2, 3]
    ref = brute_force(TinyLM(bias=True), x[keep], y[keep])
    assert_close(ours, {n: r * 3 / 4 for n, r in ref.items()})


# --- Hugging Face causal LMs; refusals ------------------------------------------------------


def hf_step(model, causal_lm, x, labels, positions, chunked: bool, mode: str):
    """One private step (noise 0, seeded sketches) of ``model`` whose Hugging Face causal
    LM is ``causal_lm`` (the model itself, or the one under PEFT): chunked head
    (``from_causal_lm`` + ``hidden_states``) or the model's own head; the update of each
    trainable parameter."""
    from opacus_rc.lm_head import from_causal_lm, hidden_states

    engine = PrivacyEngine(accountant="rc_prv")
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, labels), batch_size=4)
    head_loss = from_causal_lm(causal_lm, block_size=16)
    crit = head_loss if chunked else nn.CrossEntropyLoss(ignore_index=-100)
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = dict(module=model, optimizer=torch.optim.SGD(params, lr=1.0),
                  data_loader=loader, noise_multiplier=0.0, max_grad_norm=C, poisson_sampling=False,
                  grad_sample_mode=mode, clipping="randomized", sketch_size=8, sketch_seed=1)
    if mode == "ghost":
        module, opt, crit, _ = engine.make_private(criterion=crit, **kwargs)
    else:
        module, opt, _ = engine.make_private(**kwargs)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    inner = module if causal_lm is model else causal_lm
    if chunked:
        hidden = hidden_states(inner, input_ids=x, position_ids=positions)
        loss = crit(hidden, labels) if mode == "ghost" else head_loss(hidden, labels)
    else:
        logits = inner(input_ids=x, position_ids=positions).logits[:, :-1]
        flat = (logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        loss = (crit(*flat, shape=logits.shape[:2]) if mode == "ghost"
                else per_sequence_ce(logits, labels[:, 1:]).mean())
    loss.backward()
    opt.step()
    return {n: before[n] - p.detach() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("name", ["llama", "llama_tied", "gpt2"])
@pytest.mark.parametrize("mode", ["ghost", "hooks"])
def test_hugging_face_causal_lm_equals_unchunked(name, mode):
    """``from_causal_lm`` + ``hidden_states`` on a Hugging Face model (labels as the model
    takes them, shifted inside): the update equals the model's own head and the ghost
    criterion's ``shape=`` path for the same sketches (GPT-2 ties its head too: book-keeping
    sums the tied uses as the two passes do)."""
    x, labels = lm_batch(4)
    positions = torch.arange(x.shape[1]).repeat(x.shape[0], 1)

    def run(chunked):
        model = hf_model(name)
        model.train()
        return hf_step(model, model, x, labels, positions, chunked, mode)

    assert_close(run(True), run(False), atol=1e-6, rtol=1e-3)


def test_other_opacus_modes_are_refused():
    model = TinyLM()
    x, y = batch(2, 8, 24)
    engine = PrivacyEngine(accountant="prv")
    head_loss = ChunkedLMHeadLoss(model.head)
    module, opt, crit, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), criterion=head_loss,
        data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=2),
        noise_multiplier=0.0, max_grad_norm=1.0, grad_sample_mode="ghost", poisson_sampling=False)
    with pytest.raises(ValueError, match="clipping='randomized'"):
        crit(module(x), y)


def test_plain_training_without_privacy():
    """No grad-sample module: an ordinary fused head + loss (the weight gradient recomputed
    block by block in the backward pass)."""
    model = TinyLM(bias=True)
    x, y = batch(3, 8, 24)
    loss = ChunkedLMHeadLoss(model.head, block_size=2)(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    ref = torch.autograd.grad(per_sequence_ce(model.head(model(x)), y).mean(), list(model.parameters()))
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(ChunkedLMHeadLoss(model.head)(model(x), y), loss.detach())


@pytest.mark.parametrize("mode", ["ghost", "hooks"])
def test_peft_lora_with_frozen_head_equals_unchunked(mode):
    """PEFT LoRA on the attention projections, the head frozen: no head norm, only the
    body's (LoRA) gradient, clipped per sequence as by the unchunked path."""
    import peft

    x, labels = lm_batch(4)
    positions = torch.arange(x.shape[1]).repeat(x.shape[0], 1)

    def run(chunked):
        model = peft.get_peft_model(
            hf_model("llama"),
            peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
        )
        model.train()
        for n, p in model.named_parameters():  # non-zero LoRA B so that A has a gradient too
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(len(n)))
        assert not model.get_output_embeddings().weight.requires_grad
        return hf_step(model, model.base_model.model, x, labels, positions, chunked, mode)

    ours, ref = run(True), run(False)
    assert ours and all("lora" in n for n in ours)
    assert_close(ours, ref, atol=1e-7, rtol=1e-3)


def test_fsdp_grad_sample_module_controls_the_head_which_must_be_its_own_unit():
    """The FSDP2 form is accepted (tests/test_lm_head_fsdp.py runs it on 2 ranks); a head
    that is not a fully_shard unit itself is refused under it, naming fully_shard."""
    from opacus_rc.forms.fsdp import GradSampleHooksRandomizedClippingFSDP, head_unit
    from opacus_rc.lm_head import controlling_module

    class Fake(GradSampleHooksRandomizedClippingFSDP):
        def __init__(self):  # no process group needed: only its type is looked at
            pass

        def capture_activations_hook(self, *args):
            pass

    head = nn.Linear(4, 8)
    owner = Fake()
    head.register_forward_hook(owner.capture_activations_hook)
    assert controlling_module(head) is owner
    with pytest.raises(ValueError, match=r"fully_shard\(lm_head\)"):
        head_unit(head, owner)
    assert head_unit(nn.Linear(4, 8), None) is None  # no FSDP2: nothing to run around the head


def test_output_passes_on_a_checkpointed_model_are_refused_with_the_alternative():
    """A plain-loss script on a checkpointed Hugging Face model runs two passes from the LM
    head's output (opacus_rc.forms.output_passes, issue 22), which the chunked head never
    produces: refused at the head's forward, naming grad_sample_mode='bookkeeping'; that
    works."""
    from opacus_rc.lm_head import from_causal_lm, hidden_states

    x, labels = lm_batch(4)
    positions = torch.arange(x.shape[1]).repeat(4, 1)
    for bookkeeping in (None, True):
        model = hf_model("llama")
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        head = from_causal_lm(model, block_size=16)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, labels), batch_size=4)
        module, opt, _ = PrivacyEngine(accountant="rc_prv").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=loader,
            noise_multiplier=0.0, max_grad_norm=C, poisson_sampling=False, clipping="randomized",
            sketch_size=8, **({} if bookkeeping is None else {"bookkeeping": bookkeeping}))
        if bookkeeping is None:
            with pytest.raises(ValueError, match="grad_sample_mode='bookkeeping'"):
                head(hidden_states(module, input_ids=x, position_ids=positions), labels)
        else:
            head(hidden_states(module, input_ids=x, position_ids=positions), labels).backward()
            opt.step()


# --- the head used more than once in a pass --------------------------------------------------


def _two_uses_step(model, x, y, order, mode="ghost"):
    """One noiseless two-pass step whose per-sequence loss uses the head twice: the chunked
    loss and ``aux = 0.1 mean(head(h)^2)`` (``order``: which comes first; ``"unchunked"``:
    the cross-entropy through ``model.head`` too). Returns the update by name."""
    from opacus_rc.forms.two_pass import DPTensorRandomizedClipping

    model = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    head_loss = ChunkedLMHeadLoss(model.head, block_size=3)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x))
    module, opt, *_ = PrivacyEngine(accountant="rc_prv").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=loader,
        noise_multiplier=0.0, max_grad_norm=C, poisson_sampling=False, grad_sample_mode=mode,
        clipping="randomized", criterion=head_loss, sketch_size=16, sketch_seed=3,
    )
    head_loss.reduction = "none"  # per-sequence losses, as Opacus's criterion asks for them
    hidden = module(x)
    aux = lambda: 0.1 * model.head(hidden).pow(2).mean(dim=(1, 2))  # noqa: E731
    if order == "chunked_first":
        losses = head_loss(hidden, y)
        losses = losses + aux()
    elif order == "aux_first":
        first = aux()
        losses = first + head_loss(hidden, y)
    elif order == "chunked_twice":
        losses = head_loss(hidden, y) + head_loss(hidden, y)
    else:
        first = aux()
        losses = first + per_sequence_ce(model.head(hidden), y)
    if mode == "ghost":
        DPTensorRandomizedClipping(module, opt, losses, "mean").backward()
    else:  # book-keeping: a plain loss
        losses.mean().backward()
    opt.step()
    return {n: before[n] - p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["ghost", "bookkeeping"])
@pytest.mark.parametrize("order", ["chunked_twice", "chunked_first"])
def test_a_second_use_of_the_head_after_the_chunked_loss_is_refused(order, mode):
    """The chunked loss takes its norm of the head as untied when it runs first: a later use
    of the head in the pass (a second call, or the head applied directly) would be left out of
    that norm, an under-estimated norm (two-pass: about 27% too large an update when this
    ran), so the step is refused; book-keeping refuses any second use."""
    x, y = batch(4, 8, 24)
    with pytest.raises(ValueError, match="more than once in one forward pass"):
        _two_uses_step(TinyLM(), x, y, order, mode)


def test_the_head_applied_before_the_chunked_loss_is_a_tied_use():
    """A direct use of the head before the chunked loss: both uses join one running sum (the
    same row sketch), as two direct uses of the head do on the unchunked path."""
    x, y = batch(4, 8, 24)
    assert_close(_two_uses_step(TinyLM(), x, y, "aux_first"), _two_uses_step(TinyLM(), x, y, "unchunked"))


@pytest.mark.parametrize("mode, checkpointing", [("ghost", False), ("hooks", False), ("ghost", True),
                                                  ("bookkeeping", True), ("per_example", True)])
def test_empty_poisson_draw_through_a_hugging_face_body_updates_nothing(mode, checkpointing):
    """An empty Poisson draw through ``hidden_states`` (Hugging Face's attention cannot reshape
    0 rows: examples/long_context.py crashed in 2 of 7 runs, issue 46): a step of zero
    contribution, as elsewhere, then an ordinary step."""
    from opacus_rc.lm_head import from_causal_lm, hidden_states

    model = hf_model("llama")
    model.train()
    if checkpointing:
        model.activation_checkpointing_enable()
    x, labels = lm_batch(4)
    engine = PrivacyEngine(accountant="rc_prv")
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, labels), batch_size=4)
    head_loss = from_causal_lm(model, block_size=16)
    kwargs = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=loader,
                  noise_multiplier=0.0, max_grad_norm=C, grad_sample_mode=mode, clipping="randomized")
    if mode == "per_example":
        kwargs.update(grad_sample_mode="ghost", per_example_backward=True)
    if kwargs["grad_sample_mode"] == "ghost":
        module, opt, crit, _ = engine.make_private(criterion=head_loss, **kwargs)
    else:
        (module, opt, _), crit = engine.make_private(**kwargs), head_loss
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for rows in (0, 1 if mode == "per_example" else 4):
        hidden = hidden_states(module, input_ids=x[:rows])
        assert hidden.shape == (rows, x.shape[1], model.config.hidden_size)
        crit(hidden, labels[:rows]).backward()
        opt.step()
        opt.zero_grad()
        moved = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
        assert moved == (set() if rows == 0 else set(before)), rows
