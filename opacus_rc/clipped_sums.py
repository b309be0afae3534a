"""A layer's clipped sum over a batch, ``S = sum_i c_i grad_i``, from its per-example values.

Book-keeping assembles every clipped sum with these at the step; the two-pass forms use them
for the layers whose clipped sum autograd does not compute in half precision
(:mod:`opacus_rc.half_precision`). Each sum is accumulated, and returned, in float32 or wider
(``torch.promote_types(dtype, float32)``): the per-example values may be half precision, the
sum over the examples never is (issue 52; rounded to bf16, one example more or less can move
it by far more than C).

``c`` (B,) are the clip factors, ``keep`` (B,) bool the examples kept (a dropped example's rows
are zeroed first: nothing non-finite reaches the sum).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .estimators import PROMOTION_CHUNK_ELEMENTS, as_sequence, summed_product


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a clipped sum is accumulated in: float32 or wider."""
    return torch.promote_types(dtype, torch.float32)


def _half(t: torch.Tensor) -> bool:
    return wide_dtype(t.dtype) != t.dtype


def keep_rows(t: torch.Tensor, keep: Optional[torch.Tensor]) -> torch.Tensor:
    """``t`` with the rows (first dimension) of dropped examples set to 0."""
    if keep is None:
        return t
    return torch.where(keep.reshape(-1, *([1] * (t.dim() - 1))), t, torch.zeros((), dtype=t.dtype, device=t.device))


def _per_position(c: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Each example's factor repeated over its ``t.shape[1]`` positions: (B * T,)."""
    return c[:, None].expand(t.shape[0], t.shape[1]).reshape(-1)


def clipped_linear_weight(
    a: torch.Tensor, g: torch.Tensor, c: torch.Tensor, keep: Optional[torch.Tensor] = None, *, transposed: bool = False
) -> torch.Tensor:
    """``sum_i c_i G_i^T A_i`` for a (p x d) weight (``transposed``: ``sum_i c_i A_i^T G_i``, Hugging
    Face ``Conv1D``'s (d x p)), over (B, T) flattened: one matmul, float32 or wider."""
    a, g = as_sequence(keep_rows(a, keep)), as_sequence(keep_rows(g, keep))
    if not (_half(g) or _half(a)):
        cg = g * c.to(g.dtype)[:, None, None]
        flat = cg.reshape(-1, cg.shape[-1]), a.reshape(-1, a.shape[-1]).to(g.dtype)
        return summed_product(*(flat[::-1] if transposed else flat))
    flat_g, flat_a = g.reshape(-1, g.shape[-1]), a.reshape(-1, a.shape[-1])
    rows = _per_position(c, g)
    return summed_product(flat_a, flat_g, rows) if transposed else summed_product(flat_g, flat_a, rows)


def clipped_bias(g: torch.Tensor, c: torch.Tensor, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sum_i c_i sum_t G_i[t]``, float32 or wider."""
    g = as_sequence(keep_rows(g, keep))
    if not _half(g):
        return torch.einsum("b,btp->p", c.to(g.dtype), g)
    wide = wide_dtype(g.dtype)
    return g.sum(dim=1, dtype=wide).mul_(c.to(wide)[:, None]).sum(dim=0)


def clipped_embedding(
    ids: torch.Tensor,
    g: torch.Tensor,
    c: torch.Tensor,
    keep: Optional[torch.Tensor] = None,
    *,
    layer: nn.Embedding,
) -> torch.Tensor:
    """``sum_i c_i onehot(ids_i)^T G_i`` as a dense (V x d) gradient (padding row zero), float32 or
    wider: half-precision output gradients are promoted a chunk of examples at a time."""
    g = keep_rows(g, keep)
    ids = ids.reshape(ids.shape[0], math.prod(ids.shape[1:]))
    g = g.reshape(*ids.shape, g.shape[-1])
    wide = wide_dtype(g.dtype)
    out = torch.zeros(layer.num_embeddings, g.shape[-1], dtype=wide, device=g.device)
    whole = not _half(g) or g.shape[0] == 0
    step = max(1, g.shape[0] if whole else PROMOTION_CHUNK_ELEMENTS // max(1, g[0].numel()))
    for start in range(0, g.shape[0], step):
        part = slice(start, start + step)
        rows = g[part].to(wide) * c[part].to(wide)[:, None, None]
        out.index_add_(0, ids[part].reshape(-1), rows.reshape(-1, g.shape[-1]))
    if layer.padding_idx is not None:
        out[layer.padding_idx] = 0
    return out


def clipped_grad_sample(gs: torch.Tensor, c: torch.Tensor, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sum_i c_i g_i`` from per-example gradients ``gs`` (B, ...), float32 or wider."""
    gs = keep_rows(gs.to(wide_dtype(gs.dtype)), keep)
    return torch.einsum("i,i...", c.to(gs), gs)


__all__ = [
    "clipped_bias", "clipped_embedding", "clipped_grad_sample", "clipped_linear_weight", "keep_rows", "wide_dtype",
]
