"""A layer applied several times in one forward pass (an RNN cell, a weight-shared stack)
contributes the norm of its *summed* per-example gradient and counts as one micro-batch.

Charged as L micro-batches with L clip factors, an example present once would contribute up
to L*C while the accountant assumed C per copy (issue 21, item 1). With exact norms (every
layer's total sequence length <= k) and no noise the update must equal brute-force
per-example clipping (tests/oracles.py), to float32 round-off (rtol 1e-4)."""

from __future__ import annotations

import pytest
import torch
from opacus import PrivacyEngine
from torch import nn

from .conftest import mode_options
from .oracles import per_example_clipped_mean

B, T, D = 6, 4, 8
C = 0.05  # below every example's gradient norm here: every example is clipped


class ReusedLinear(nn.Module):
    """x -> lin(tanh(lin(x))) -> head: one Linear applied twice."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.head = nn.Linear(D, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(torch.tanh(self.lin(x))))).mean(dim=1)


class LoopRNN(nn.Module):
    """A hand-written RNN: one cell Linear over T steps of (B, D) inputs, embedding input."""

    def __init__(self, vocab: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, D)
        self.cell = nn.Linear(2 * D, D)
        self.head = nn.Linear(D, 2)

    def forward(self, ids):
        e = self.emb(ids)
        h = torch.zeros(ids.shape[0], D)
        for t in range(ids.shape[1]):
            h = torch.tanh(self.cell(torch.cat([e[:, t], h], dim=1)))
        return self.head(h)


class SharedStack(nn.Module):
    """ALBERT-style: one block (Linear, LayerNorm, Linear) applied three times."""

    def __init__(self, vocab: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, D)
        self.up = nn.Linear(D, 2 * D)
        self.norm = nn.LayerNorm(2 * D)
        self.down = nn.Linear(2 * D, D)
        self.head = nn.Linear(D, 2)

    def forward(self, ids):
        h = self.emb(ids)
        for _ in range(3):
            h = h + self.down(torch.tanh(self.norm(self.up(h))))
        return self.head(h).mean(dim=1)


def data(model_cls, seed=0):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (B,), generator=gen)
    if model_cls is ReusedLinear:
        return torch.randn(B, T, D, generator=gen), y
    return torch.randint(0, 16, (B, 6 if model_cls is LoopRNN else T), generator=gen), y


def loss_of(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def private_update(model, x, y, mode):
    """p.grad after one step (noise 0), and the accountant's record."""
    engine = PrivacyEngine(accountant="rc_prv")
    options = mode_options(mode)
    out = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        criterion=nn.CrossEntropyLoss(),
        data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=B),
        noise_multiplier=0.0, max_grad_norm=C, poisson_sampling=False, clipping="randomized",
        sketch_size=32, sketch_seed=0, **options,
    )
    module, opt = out[0], out[1]
    crit = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    crit(module(x), y).backward()
    opt.step()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}, engine.accountant.history


@pytest.mark.parametrize("mode", ["hooks", "bookkeeping=True"])
@pytest.mark.parametrize("model_cls", [ReusedLinear, LoopRNN, SharedStack])
def test_reused_layer_equals_per_example_clipping(model_cls, mode):
    torch.manual_seed(0)
    model = model_cls()
    x, y = data(model_cls)
    want = per_example_clipped_mean(model, loss_of, x, y, C, normaliser=B)
    got, history = private_update(model, x, y, mode)
    for name, update in want.items():
        torch.testing.assert_close(got[name], update, rtol=1e-4, atol=1e-7, msg=name)
    (record,) = history
    assert record[-1].micro_batches == 1  # one backward pass, one micro-batch


def test_weight_used_twice_with_equal_gradients_is_bounded_by_c():
    """Two uses with equal gradients: the per-example gradient is 2g; the clipped
    contribution has norm C (not 2C, as with one clip factor per use)."""
    torch.manual_seed(0)
    lin = nn.Linear(D, 1, bias=False)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return (self.lin(x) + self.lin(x)).sum(dim=(1, 2))

    model = Twice()
    x = torch.randn(1, T, D)
    engine = PrivacyEngine(accountant="rc_prv")
    module, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=1),
        noise_multiplier=0.0, max_grad_norm=1e-3, poisson_sampling=False, clipping="randomized",
        loss_reduction="sum", per_example_backward=False,  # the sketched forms' bookkeeping
    )
    module(x).sum().backward()
    opt.step()
    assert lin.weight.grad.norm().item() == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.parametrize("mode", ["hooks", "bookkeeping=True"])
def test_albert_lora_shared_layers_equal_per_example_clipping(mode):
    """Hugging Face ALBERT shares one layer group across its 4 layers; with PEFT LoRA on
    the attention projections every LoRA factor is used 4 times per pass."""
    from peft import LoraConfig, get_peft_model
    from transformers import AlbertConfig, AlbertForSequenceClassification

    torch.manual_seed(0)
    config = AlbertConfig(
        vocab_size=32, embedding_size=8, hidden_size=16, num_hidden_layers=4,
        num_attention_heads=2, intermediate_size=32, max_position_embeddings=16,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
    )
    base = AlbertForSequenceClassification(config)
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["query", "value"], lora_dropout=0.0))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 32, (B, T), generator=gen), torch.randint(0, 2, (B,), generator=gen)

    class Logits(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids):
            return self.inner(input_ids=ids).logits

    wrapped = Logits(model)
    want = per_example_clipped_mean(wrapped, loss_of, x, y, C, normaliser=B)
    got, history = private_update(wrapped, x, y, mode)
    for name, update in want.items():
        torch.testing.assert_close(got[name], update, rtol=1e-4, atol=1e-7, msg=name)
    assert history[0][-1].micro_batches == 1
