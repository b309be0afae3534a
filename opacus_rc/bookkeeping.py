"""Book-keeping (single backward pass) for randomized clipping.

Instead of a second backward pass on the rescaled loss, the clipped gradient of a layer
is assembled after the one ordinary backward pass from what its hooks kept (Bu et al.
2023, fastDP's "book-keeping"):

* linear weight (p x d): ``sum_i c_i G_i^T A_i = (c * G)^T A`` (one matmul, the cost of
  the ordinary weight gradient, which the backward pass therefore skips);
* bias: ``sum_i c_i sum_t G_i[t]``;
* embedding (V x d): ``index_add`` of ``c_i G_i[t]`` at the token ids.

Per-sample norms come from the same estimators as the two-pass method (sketched weight,
exact bias/embedding), so the clipped gradient is the same for the same sketches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Record:
    """What one backward pass left for one parameter of a book-kept layer.

    ``clipped(c, keep=None)`` returns ``sum_i c_i grad_i`` for the pass's examples (only
    those with ``keep[i]``: a dropped example's rows are zeroed first, so its non-finite
    values cannot reach the sum); ``sq_norms`` are the per-sample squared norms
    (estimated or exact), shape (B,).
    """

    sq_norms: torch.Tensor
    clipped: Callable[[torch.Tensor], torch.Tensor]

    @property
    def batch_size(self) -> int:
        return int(self.sq_norms.shape[0])


def keep_rows(t: torch.Tensor, keep: Optional[torch.Tensor]) -> torch.Tensor:
    """``t`` with the rows (first dimension) of dropped examples set to 0."""
    if keep is None:
        return t
    return torch.where(keep.reshape(-1, *([1] * (t.dim() - 1))), t, torch.zeros((), dtype=t.dtype, device=t.device))


def as_sequence(t: torch.Tensor) -> torch.Tensor:
    """(B, ..., n) -> (B, T, n) with T the product of the middle dimensions."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:-1]), t.shape[-1])


def clipped_linear_weight(
    a: torch.Tensor, g: torch.Tensor, c: torch.Tensor, keep: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``sum_i c_i G_i^T A_i`` for a (p x d) weight: ``(c * G)^T A`` flattened over (B, T)."""
    a, g = as_sequence(keep_rows(a, keep)), as_sequence(keep_rows(g, keep))
    cg = g * c.to(g.dtype)[:, None, None]
    return cg.reshape(-1, cg.shape[-1]).t().mm(a.reshape(-1, a.shape[-1]).to(g.dtype))


def clipped_bias(g: torch.Tensor, c: torch.Tensor, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sum_i c_i sum_t G_i[t]``."""
    g = as_sequence(keep_rows(g, keep))
    return torch.einsum("b,btp->p", c.to(g.dtype), g)


def clipped_embedding(
    ids: torch.Tensor,
    g: torch.Tensor,
    c: torch.Tensor,
    keep: Optional[torch.Tensor] = None,
    *,
    layer: nn.Embedding,
) -> torch.Tensor:
    """``sum_i c_i onehot(ids_i)^T G_i`` as a dense (V x d) gradient (padding row zero)."""
    g = keep_rows(g, keep)
    ids = ids.reshape(ids.shape[0], math.prod(ids.shape[1:]))
    g = g.reshape(*ids.shape, g.shape[-1])
    rows = (g * c.to(g.dtype)[:, None, None]).reshape(-1, g.shape[-1])
    out = torch.zeros(layer.num_embeddings, g.shape[-1], dtype=g.dtype, device=g.device)
    out.index_add_(0, ids.reshape(-1), rows)
    if layer.padding_idx is not None:
        out[layer.padding_idx] = 0
    return out


class _LinearDeferredWeightGrad(torch.autograd.Function):
    """``F.linear`` whose backward computes the parameter gradients only when
    ``wanted()`` says so: book-keeping never needs them from autograd, the two-pass
    method only in its second (clipped) pass."""

    @staticmethod
    def forward(ctx, x, weight, bias, wanted: Callable[[], bool]):
        ctx.save_for_backward(x, weight)
        ctx.wanted = wanted
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        # Under autocast the forward ran in lower precision than the saved tensors: the
        # products run in the output gradient's dtype (autograd casts each gradient back
        # to its input's dtype).
        dtype = grad_out.dtype
        grad_x = grad_out.matmul(weight.to(dtype)) if ctx.needs_input_grad[0] else None
        grad_w = grad_b = None
        if ctx.wanted():
            g = grad_out.reshape(-1, grad_out.shape[-1])
            if ctx.needs_input_grad[1]:
                grad_w = g.t().mm(x.reshape(-1, x.shape[-1]).to(dtype))
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_b = g.sum(dim=0)
        return grad_x, grad_w, grad_b, None


def _never() -> bool:
    return False


def linear_forward_deferring_weight_grad(
    layer: nn.Linear, x: torch.Tensor, wanted: Callable[[], bool] = _never
) -> torch.Tensor:
    """Forward of ``layer`` whose parameter gradients autograd computes only when
    ``wanted()`` (default: never; book-keeping assembles them instead)."""
    return _LinearDeferredWeightGrad.apply(x, layer.weight, layer.bias, wanted)
