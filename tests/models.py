"""The models and data the tests build in more than one file (fixtures stay in conftest.py).

Plain ``nn`` models first (classifiers, a chunked-head LM, a causal decoder), then Hugging Face
causal LMs built from small configs (random weights, seeded, nothing downloaded; transformers
is imported only when one is built), then the synthetic data. The tests of the plugin use
these, never ``examples/`` (tests/test_layout.py checks it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# ------------------------------------------------------------------------- plain nn models


class SequenceClassifier(nn.Module):
    """Embedding -> Linear -> LayerNorm -> Linear, mean-pooled over the sequence."""

    def __init__(self, vocab: int = 32, d: int = 16, hidden: int = 24, classes: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc1 = nn.Linear(d, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(self.norm(torch.tanh(self.fc1(self.emb(x))))).mean(dim=1)


class CheckpointedSequenceClassifier(SequenceClassifier):
    """:class:`SequenceClassifier` (same parameters, same initialisation) whose
    Linear -> tanh -> LayerNorm runs under ``torch.utils.checkpoint``."""

    def __init__(self, *args, use_reentrant: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.use_reentrant = use_reentrant

    def _middle(self, h):
        return self.norm(torch.tanh(self.fc1(h)))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self._middle, self.emb(x), use_reentrant=self.use_reentrant)
        return self.fc2(h).mean(dim=1)


class HeadModel(nn.Module):
    """Embedding -> Linear body -> a linear head used through ChunkedLMHeadLoss (its forward
    returns the hidden states)."""

    def __init__(self, vocab: int = 32, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.body = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        return torch.tanh(self.body(self.emb(x)))


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


def positions(ids: torch.Tensor) -> torch.Tensor:
    """Position ids of a (B, T) batch, materialised per example (shape (B, T)): per-sample
    hooks see every input of a layer with its batch dimension."""
    return torch.arange(ids.shape[1], device=ids.device).repeat(ids.shape[0], 1)


class Decoder(nn.Module):
    """A causal LM of plain ``nn`` layers, each one Opacus knows: token and position
    embeddings; per layer a pre-LayerNorm attention (separate Linear q, k, v and output
    projections around ``scaled_dot_product_attention``) and a pre-LayerNorm GELU MLP, both
    residual; a final LayerNorm and an untied bias-free head. ``(B, T)`` ids to
    ``(B, T, vocab)`` logits."""

    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 1, heads: int = 2, max_len: int = 64):
        super().__init__()
        self.heads = heads
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.layers = nn.ModuleList(
            nn.ModuleDict({
                "attn_norm": nn.LayerNorm(d), "q": nn.Linear(d, d), "k": nn.Linear(d, d),
                "v": nn.Linear(d, d), "o": nn.Linear(d, d),
                "mlp_norm": nn.LayerNorm(d), "up": nn.Linear(d, 4 * d), "down": nn.Linear(4 * d, d),
            })
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def attention(self, layer: nn.ModuleDict, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = (layer[name](h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for name in "qkv")
        mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return layer["o"](mixed.transpose(1, 2).reshape(b, t, d))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(positions(ids))
        for layer in self.layers:
            x = x + self.attention(layer, layer["attn_norm"](x))
            x = x + layer["down"](F.gelu(layer["up"](layer["mlp_norm"](x))))
        return self.head(self.norm(x))


# ------------------------------------------------------------- Hugging Face causal LMs


def _small(vocab: int, layers: int, max_len: int) -> dict:
    """The fields of a Llama-family config at test size (hidden 32, MLP 64, 2 heads)."""
    return dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=max_len)


def tiny_llama(seed: int = 0, *, vocab: int = 64, layers: int = 2, max_len: int = 64, **config):
    """``transformers.LlamaForCausalLM`` (RMSNorm, rotary positions, SwiGLU, no biases) from a
    small config, initialised after ``torch.manual_seed(seed)``; ``config``: more
    ``LlamaConfig`` fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**_small(vocab, layers, max_len), **config))


def hf_model(name: str, vocab: int = 64) -> nn.Module:
    """A one-layer Hugging Face causal LM, eager attention, no dropout, seed 0: ``"gpt2"``
    (tied head), ``"llama"``, ``"llama_tied"`` or ``"qwen2"``."""
    import transformers

    torch.manual_seed(0)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=vocab, n_embd=32, n_layer=1, n_head=2, n_positions=128,
            attn_implementation="eager", bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # deterministic forward
        ))
    if name in ("llama", "llama_tied"):
        return tiny_llama(0, vocab=vocab, layers=1, max_len=128, attn_implementation="eager",
                          tie_word_embeddings=name == "llama_tied")
    return transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**_small(vocab, 1, 128), attn_implementation="eager"))


class TokenLM(nn.Module):
    """A Hugging Face causal LM seen as ``(B, T)`` ids -> ``(B, T, vocab)`` logits, with
    per-example position ids (:func:`positions`) and no cache."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, position_ids=positions(ids), use_cache=False).logits


# -------------------------------------------------------------------------------- data


def token_task(n: int = 256, t: int = 24, vocab: int = 32, seed: int = 0):
    """Sequences whose label sets the share of low-id tokens (3/4 vs 1/4): a task
    that a mean-pooled model learns in a few dozen noisy steps."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=gen)
    p_low = torch.where(y == 1, 0.75, 0.25)[:, None].expand(n, t)
    low = torch.bernoulli(p_low, generator=gen).bool()
    half = vocab // 2
    x = torch.where(
        low,
        torch.randint(0, half, (n, t), generator=gen),
        torch.randint(half, vocab, (n, t), generator=gen),
    )
    return torch.utils.data.TensorDataset(x, y)


def markov_tokens(n: int, length: int, vocab: int, *, successors: int = 4, seed: int = 0) -> torch.Tensor:
    """``(n, length + 1)`` tokens walked on a random sparse Markov chain: each token has
    ``successors`` possible next tokens, so the next-token loss can fall from ln(vocab)
    towards ln(successors)."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(0, vocab, (vocab, successors), generator=gen)
    walk = [torch.randint(0, vocab, (n,), generator=gen)]
    picks = torch.randint(0, successors, (n, length), generator=gen)
    for column in picks.T:
        walk.append(table[walk[-1], column])
    return torch.stack(walk, dim=1)


def patterned_ids(n: int, t: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Rows ``(j mod 7) + 7 s`` (``s`` drawn in {0, 1, 2} per row): a pattern an LM learns in a
    few steps."""
    return (torch.arange(t)[None] % 7 + 7 * torch.randint(0, 3, (n, 1), generator=gen)) % vocab


def lm_batch(n: int, seed: int = 0, *, t: int = 48, vocab: int = 64):
    """:func:`patterned_ids` and their labels, the last 5 targets padded (``-100``)."""
    x = patterned_ids(n, t, vocab, torch.Generator().manual_seed(seed))
    labels = x.clone()
    labels[:, -5:] = -100  # ignore_index padding
    return x, labels


def rows(n: int = 24, seed: int = 1, *, t: int = 16, vocab: int = 64):
    """:func:`patterned_ids` and their labels; the last few targets of some rows are
    ignored (-100)."""
    g = torch.Generator().manual_seed(seed)
    ids = patterned_ids(n, t, vocab, g)
    labels = ids.clone()
    cut = torch.randint(t // 2, t + 1, (n,), generator=g)
    for i in range(n):
        labels[i, cut[i]:] = -100
    return ids, labels


class RowDataset(torch.utils.data.Dataset):
    """:func:`rows` as the Trainer's dicts of ``input_ids`` and ``labels``."""

    def __init__(self, n: int = 24) -> None:
        self.ids, self.labels = rows(n)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}
