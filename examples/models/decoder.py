"""A small causal decoder (Embedding, Linear, LayerNorm, attention) and synthetic text.

Built from plain ``nn`` layers so every trainable layer is one Opacus knows: attention
projections and MLPs are ``nn.Linear`` (norms sketched), embeddings are exact, LayerNorm
goes through Opacus's per-sample gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class TinyDecoder(nn.Module):
    """GPT-style decoder: token + position embeddings, ``n_layers`` blocks, LM head.

    ``forward(tokens)`` maps (B, T) token ids to (B, T, vocab) logits.
    """

    def __init__(
        self,
        vocab: int = 512,
        d_model: int = 128,
        n_layers: int = 2,
        n_heads: int = 4,
        max_len: int = 4096,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # Positions carry the batch dimension so the per-sample hooks see (B, T).
        positions = torch.arange(tokens.shape[1], device=tokens.device).repeat(tokens.shape[0], 1)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def markov_text(
    n: int, length: int, vocab: int, *, branching: int = 4, seed: int = 0
) -> torch.Tensor:
    """``n`` token sequences of ``length + 1`` from a random sparse Markov chain.

    Each token has ``branching`` successors, so a model can lower the next-token loss
    from ln(vocab) towards ln(branching): a task with a known floor.
    """
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, branching), generator=gen)
    seq = torch.empty(n, length + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, vocab, (n,), generator=gen)
    choice = torch.randint(0, branching, (n, length), generator=gen)
    for t in range(length):
        seq[:, t + 1] = successors[seq[:, t], choice[:, t]]
    return seq
