"""Book-keeping (one backward pass, grad_sample_mode="hooks") gives the two-pass result."""

import copy

import pytest
import torch
from opacus import PrivacyEngine
from torch import nn

from tests.models import Decoder, TokenLM, markov_tokens, tiny_llama, token_task


def run(model, mode, x, y, **options):
    """Parameters after ``steps`` SGD steps, noise 0, seeded sketches, and make_private's outputs."""
    params, out, _ = run_with_engine(model, mode, x, y, **options)
    return params, out


def run_with_engine(model, mode, x, y, *, steps=1, lm=False, micro=1, **options):
    """:func:`run`, and its engine."""
    engine = PrivacyEngine(accountant="rc_prv")
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        criterion=nn.CrossEntropyLoss(),
        data_loader=torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, y), batch_size=len(x) // micro
        ),
        noise_multiplier=0.0,
        max_grad_norm=0.1,
        poisson_sampling=False,
        grad_sample_mode=mode,
        clipping="randomized",
        **{"sketch_size": 4, "sketch_seed": 3, "sketching": "shared", **options},
    )
    module, opt = out[0], out[1]
    crit = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    for _ in range(steps):
        for xb, yb in zip(x.chunk(micro), y.chunk(micro)):
            logits = module(xb)
            if lm:
                loss = crit(logits.reshape(-1, logits.shape[-1]), yb.reshape(-1), shape=logits.shape[:2]) \
                    if len(out) == 4 else nn.functional.cross_entropy(
                        logits.reshape(-1, logits.shape[-1]), yb.reshape(-1), reduction="none"
                    ).view(yb.shape).mean(1).mean()
            else:
                loss = crit(logits, yb)
            loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}, out, engine


@pytest.mark.parametrize("estimator", ["hutchinson", "hutchpp"])
@pytest.mark.parametrize("sketching", ["shared", "per_example"])
def test_bookkeeping_equals_two_pass(model_factory, estimator, sketching):
    """Same sketches (same seed, same draw order), noise 0, 2 steps: equal parameters up
    to float32 summation order (rtol 1e-4)."""
    x, y = token_task(n=16, t=48).tensors
    init = model_factory(seed=5)
    two_pass, out_g = run(copy.deepcopy(init), "ghost", x, y, steps=2, estimator=estimator, sketching=sketching)
    bookkept, out_h = run(copy.deepcopy(init), "hooks", x, y, steps=2, estimator=estimator, sketching=sketching)
    assert len(out_g) == 4 and len(out_h) == 3  # Opacus's return shapes per mode
    for k in two_pass:
        torch.testing.assert_close(bookkept[k], two_pass[k], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("arch", ["decoder", "llama"])
def test_bookkeeping_lm_equals_two_pass(arch):
    """The causal decoder (attention, LayerNorm, embeddings) and a Llama model (RMSNorm,
    rotary, SwiGLU, no biases) with a per-sequence LM loss."""
    torch.manual_seed(0)
    if arch == "llama":
        model = TokenLM(tiny_llama(layers=1))
    else:
        model = Decoder(vocab=64, d=32, layers=1, heads=2, max_len=64)
    seq = markov_tokens(8, 40, 64)
    x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    two_pass, _ = run(copy.deepcopy(model), "ghost", x, y, lm=True)
    bookkept, _ = run(copy.deepcopy(model), "hooks", x, y, lm=True)
    for k in two_pass:
        torch.testing.assert_close(bookkept[k], two_pass[k], rtol=1e-4, atol=1e-6)


def test_bookkeeping_skips_weight_gradients_in_backward(model_factory):
    """The ordinary backward pass leaves linear weights' .grad untouched (the weight
    gradient is assembled by book-keeping instead)."""
    x, y = token_task(n=8, t=48).tensors
    model = model_factory()
    _, (module, opt, _) = run(model, "hooks", x, y, steps=0)
    nn.functional.cross_entropy(module(x), y).backward()
    assert model.fc1.weight.grad is None and model.fc2.weight.grad is None
    assert model.norm.weight.grad is not None  # other layers: ordinary autograd


def test_bookkeeping_accumulates_micro_batches(model_factory):
    """Two micro-batches then one step equal one batch (shared sketches per step)."""
    x, y = token_task(n=16, t=48).tensors
    init = model_factory(seed=6)
    one, _ = run(copy.deepcopy(init), "hooks", x, y)
    two, out = run(copy.deepcopy(init), "hooks", x, y, micro=2)
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=1e-4, atol=1e-6)


def test_plain_opacus_hooks_script_switches_with_one_flag(model_factory):
    """The most common Opacus script: default grad_sample_mode, 3-tuple, plain
    loss.backward(); optimizer.step(); only clipping="randomized" (and the accountant)
    differ. It learns with noise on."""
    torch.manual_seed(0)
    model = model_factory(seed=7)
    engine = PrivacyEngine(accountant="rc_prv")
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.02),
        data_loader=torch.utils.data.DataLoader(token_task(n=512, t=64), batch_size=64),
        noise_multiplier=0.7,
        max_grad_norm=1.0,
        clipping="randomized",
        sketch_size=16,
    )
    losses = []
    for _ in range(5):
        for x, y in loader:
            if len(x) == 0:
                continue
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert 0 < engine.get_epsilon(1e-5) < float("inf")


class SubclassedLinear(nn.Linear):
    """A Linear subclass (like MultiheadAttention's output projection): no randomized
    norm sampler is registered for its type, so both paths treat it exactly."""


def test_linear_subclass_goes_through_exact_per_sample_gradients(model_factory):
    x, y = token_task(n=16, t=48).tensors
    init = model_factory(seed=8)
    sub = SubclassedLinear(init.fc2.in_features, init.fc2.out_features)
    sub.load_state_dict(init.fc2.state_dict())
    init.fc2 = sub
    two_pass, _ = run(copy.deepcopy(init), "ghost", x, y)
    bookkept, _ = run(copy.deepcopy(init), "hooks", x, y)
    for k in two_pass:
        torch.testing.assert_close(bookkept[k], two_pass[k], rtol=1e-4, atol=1e-6)


class _TiedLM(nn.Module):
    """An embedding whose weight is also the output head's (tied weights)."""

    def __init__(self, vocab: int = 11, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.emb(x)).mean(dim=1)


@pytest.mark.parametrize("sketching", ["shared", "per_example"])
@pytest.mark.parametrize("mode", ["bookkeeping", "hooks"])
def test_tied_weights_equal_two_pass(mode, sketching):
    """A weight shared by two layers has one record of its summed uses (each use's projection on
    the weight's row sketch, as the two-pass form sums them; before: refused): the same sketches
    (V = 11 rows > k = 4) give the two-pass update, 2 steps. Exact norms against brute force:
    tests/forms/test_cells.py."""
    torch.manual_seed(0)
    model = _TiedLM()
    x = torch.randint(0, 11, (8, 5))
    y = x[:, 0]
    two_pass, _ = run(copy.deepcopy(model), "ghost", x, y, steps=2, sketching=sketching)
    bookkept, _ = run(copy.deepcopy(model), mode, x, y, steps=2, sketching=sketching)
    for k in two_pass:
        torch.testing.assert_close(bookkept[k], two_pass[k], rtol=1e-4, atol=1e-6)
    assert not torch.equal(two_pass["emb.weight"], model.emb.weight.detach())
