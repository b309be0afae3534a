"""A Llama-style causal LM (Hugging Face ``LlamaForCausalLM``) built from a small config
with random weights (nothing downloaded), behind the same ``forward(tokens) -> logits``
interface as :class:`~examples.models.TinyDecoder`.

RMSNorm, rotary positions, SwiGLU MLP (``intermediate = 8d/3`` rounded up to 64), no
biases, untied LM head, ``scaled_dot_product_attention``: the layer mix of real Llama
models, at benchmark sizes. Needs ``transformers`` (an optional extra).
"""

from __future__ import annotations

import torch
from torch import nn


def swiglu_width(d_model: int) -> int:
    """Llama's MLP width: 8d/3 rounded up to a multiple of 64."""
    return -(-8 * d_model // 3 // 64) * 64


class LlamaLM(nn.Module):
    """``LlamaForCausalLM`` mapping (B, T) token ids to (B, T, vocab) logits.

    Position ids are passed with the batch dimension (B, T) so that per-sample hooks
    see every input per example.
    """

    def __init__(
        self, vocab: int = 512, d_model: int = 128, n_layers: int = 2, n_heads: int = 2, max_len: int = 4096
    ) -> None:
        super().__init__()
        try:
            from transformers import LlamaConfig, LlamaForCausalLM
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("LlamaLM needs transformers: pip install 'opacus-rc[hf]'") from e
        config = LlamaConfig(
            vocab_size=vocab, hidden_size=d_model, intermediate_size=swiglu_width(d_model),
            num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_heads,
            max_position_embeddings=max_len, tie_word_embeddings=False, attn_implementation="sdpa",
        )
        self.lm = LlamaForCausalLM(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device).repeat(tokens.shape[0], 1)
        return self.lm(input_ids=tokens, position_ids=positions, use_cache=False).logits
