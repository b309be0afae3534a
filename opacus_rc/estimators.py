"""Sketched estimators of per-sample squared gradient norms of linear layers.

For one linear layer, example ``i`` has input ``A_i`` (T x d) and output gradient
``G_i`` (T x p); its weight gradient is ``M_i = A_i^T G_i`` (d x p). We estimate
``n_i = ||M_i||_F^2`` without forming ``M_i`` (d x p) or ``A_i A_i^T`` (T x T):

* Hutchinson: ``n_hat_i = ||M_i P||_F^2 = ||A_i^T (G_i P)||_F^2`` with ``P`` (p x k),
  i.i.d. N(0, 1/k) entries, so ``E[P P^T] = I`` and ``E n_hat_i = n_i``.
* Hutch++ (Meyer et al. 2021): ``Q = qr(M_i S)`` spans the dominant columns, the head
  ``||Q^T M_i||_F^2`` is exact and Hutchinson estimates the residual
  ``||(I - Q Q^T) M_i||_F^2``.

Memory is O(B k (T + d + p)); FLOPs O(B T k (d + p)). The sketch may sit on the output
side (``P`` multiplies ``G``) or the input side (``P`` multiplies ``A``, i.e. the same
estimator applied to ``M_i^T = G_i^T A_i``): ``side="auto"`` sketches the larger of
(d, p), so the per-sample result (B x min(d, p) x k) is the smaller one.

This module is pure tensor math: no Opacus, no state. Sketches are passed in; drawing
them (and their randomness) is the caller's business (see :mod:`opacus_rc.grad_sample`).
Shapes: ``activations`` is (B, ..., d), ``backprops`` is (B, ..., p); a sketch is either
shared (rows, k) or per example (B, rows, k).
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import torch

SIDES = ("auto", "output", "input")
_LOW_PRECISION = (torch.float16, torch.bfloat16)
#: Half-precision inputs are promoted to float32 this many elements at a time (a chunk of
#: sequence positions), not whole: at the LM head of a long sequence the whole (T x vocab)
#: output gradient in float32 would be as large as ghost clipping's T x T matrices.
PROMOTION_CHUNK_ELEMENTS = 1 << 24


def as_sequence(t: torch.Tensor) -> torch.Tensor:
    """(B, ..., n) -> (B, T, n) with T the product of the middle dimensions (a view)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:-1]), t.shape[-1])


def as_sequences(activations: torch.Tensor, backprops: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reshape (B, ..., d) and (B, ..., p) to (B, T, d), (B, T, p) in float32 or wider.

    Half-precision inputs are promoted so the sketch arithmetic accumulates in float32.
    """
    a, g = as_sequence(activations), as_sequence(backprops)
    dtype = _wide(a, g)
    return a.to(dtype), g.to(dtype)


def sketch_side(d: int, p: int, side: str = "auto") -> str:
    """The side the sketch multiplies: ``"output"`` (P is p x k) or ``"input"`` (d x k).

    ``"auto"`` sketches the larger dimension; FLOPs are the same on both sides.
    """
    if side not in SIDES:
        raise ValueError(f"side={side!r} is not supported; accepted values: {SIDES}")
    if side == "auto":
        return "output" if p >= d else "input"
    return side


def sketch_rows(d: int, p: int, side: str) -> int:
    """Number of rows of the sketch for a (d x p) gradient on the given side."""
    return p if sketch_side(d, p, side) == "output" else d


def _orient(activations: torch.Tensor, backprops: torch.Tensor, side: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(B, T, .) views (left, right) of the inputs so that the sketched gradient is ``left^T right @ P``."""
    a, g = as_sequence(activations), as_sequence(backprops)
    return (a, g) if sketch_side(a.shape[-1], g.shape[-1], side) == "output" else (g, a)


def _wide(*tensors: torch.Tensor) -> torch.dtype:
    """The accumulation dtype: the inputs' promoted dtype, float32 for half precision."""
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def _sum_over_positions(left: torch.Tensor, right: torch.Tensor, fn) -> torch.Tensor:
    """``fn(left, right)`` for a product that sums over the sequence positions (dim 1) of
    both (B, T, .) inputs, in float32 or wider: inputs already that wide go in whole;
    half-precision ones are promoted and summed chunk by chunk of positions
    (:data:`PROMOTION_CHUNK_ELEMENTS`), never copied whole."""
    dtype = _wide(left, right)
    if left.dtype == dtype and right.dtype == dtype:
        return fn(left, right)
    batch, t = left.shape[0], left.shape[1]
    step = max(1, PROMOTION_CHUNK_ELEMENTS // max(1, batch * (left.shape[2] + right.shape[2])))
    total = fn(left[:, :0].to(dtype), right[:, :0].to(dtype))  # zeros of the right shape
    for start in range(0, t, step):
        total = total.add_(fn(left[:, start : start + step].to(dtype), right[:, start : start + step].to(dtype)))
    return total


def sketched_product(left: torch.Tensor, right: torch.Tensor, sketch: torch.Tensor) -> torch.Tensor:
    """``left_i^T (right_i P_i)`` for every example: (B, rows_left, k), in float32 or wider
    (half-precision inputs promoted a chunk of positions at a time)."""
    p = sketch.to(_wide(left, right))
    return _sum_over_positions(left, right, lambda l, r: torch.matmul(l.transpose(1, 2), torch.matmul(r, p)))


def summed_product(left: torch.Tensor, right: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sum_r w_r left[r]^T right[r]`` over the rows of (N, p) and (N, d) inputs (``weights``: w (N,),
    or 1): a linear layer's (p, d) weight gradient summed over a batch, accumulated in float32 or
    wider. Half-precision inputs are promoted (and weighted) a chunk of rows at a time
    (:data:`PROMOTION_CHUNK_ELEMENTS`), never copied whole; the sum is never rounded to half
    precision (issue 52)."""
    dtype = _wide(left, right)
    if left.dtype == dtype and right.dtype == dtype:
        return (left if weights is None else left * weights.to(dtype)[:, None]).t().mm(right)
    out = torch.zeros(left.shape[1], right.shape[1], dtype=dtype, device=left.device)
    step = max(1, PROMOTION_CHUNK_ELEMENTS // max(1, left.shape[1] + right.shape[1]))
    for start in range(0, left.shape[0], step):
        rows = slice(start, start + step)
        part = left[rows].to(dtype)
        if weights is not None:
            part = part * weights[rows].to(dtype)[:, None]  # (out of place: left may be float32 already)
        out.addmm_(part.t(), right[rows].to(dtype))
    return out


def summed_rows(t: torch.Tensor) -> torch.Tensor:
    """``sum_r t[r]`` over the rows of (N, p): a bias's batch sum, accumulated in float32 or
    wider (a half-precision input is not copied)."""
    return t.sum(dim=0, dtype=_wide(t))


def at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 when it is in half precision, else as it is."""
    return t.float() if t.dtype in _LOW_PRECISION else t


def _per_sample_sq_norm(x: torch.Tensor) -> torch.Tensor:
    return x.pow(2).sum(dim=tuple(range(1, x.dim())))


def hutchinson_sq_norms(
    activations: torch.Tensor,
    backprops: torch.Tensor,
    sketch: torch.Tensor,
    side: str = "auto",
) -> torch.Tensor:
    """Hutchinson estimate of ``||A_i^T G_i||_F^2`` for every example ``i``.

    ``n_hat_i = ||A_i^T (G_i P)||_F^2`` with ``P`` ~ N(0, 1/k): unbiased, and
    ``n_hat_i / n_i = sum_j w_j chi2_k / k`` (w: normalised squared singular values).

    Args:
        activations: (B, ..., d) layer inputs.
        backprops: (B, ..., p) gradients of the loss w.r.t. the layer outputs.
        sketch: (rows, k) or (B, rows, k) with N(0, 1/k) entries, ``rows`` from
            :func:`sketch_rows`.
        side: ``"auto"``, ``"output"`` or ``"input"``.

    Returns (B,) estimated squared norms.
    """
    left, right = _orient(activations, backprops, side)
    return _per_sample_sq_norm(sketched_product(left, right, sketch))


def hutchpp_sq_norms(
    activations: torch.Tensor,
    backprops: torch.Tensor,
    head_sketch: torch.Tensor,
    tail_sketch: torch.Tensor,
    side: str = "auto",
) -> torch.Tensor:
    """Hutch++ estimate of ``||A_i^T G_i||_F^2`` for every example ``i``.

    ``Q_i = qr(M_i S)``; ``n_hat_i = ||Q_i^T M_i||_F^2 + ||(I - Q_i Q_i^T) M_i P||_F^2``
    with ``P`` ~ N(0, 1/k) (k = tail size): exact head, unbiased Hutchinson on the residual.

    Args:
        activations, backprops: as in :func:`hutchinson_sq_norms`.
        head_sketch: (rows, r) or (B, rows, r), any full-rank random matrix (its scale
            does not matter: only its range is used).
        tail_sketch: (rows, k) or (B, rows, k) with N(0, 1/k) entries.
        side: ``"auto"``, ``"output"`` or ``"input"``.
    """
    left, right = _orient(activations, backprops, side)
    q, _ = torch.linalg.qr(sketched_product(left, right, head_sketch))  # (B, rows_left, r)
    head = _per_sample_sq_norm(
        _sum_over_positions(left, right, lambda l, r: torch.matmul(torch.matmul(l, q).transpose(1, 2), r))
    )
    mp = sketched_product(left, right, tail_sketch)  # M_i P: (B, rows_left, k)
    residual = mp - torch.matmul(q, torch.matmul(q.transpose(1, 2), mp))
    return head + _per_sample_sq_norm(residual)


def ghost_sq_norms(activations: torch.Tensor, backprops: torch.Tensor) -> torch.Tensor:
    """Exact ``||A_i^T G_i||_F^2 = <A_i A_i^T, G_i G_i^T>`` (ghost clipping's formula).

    Costs B T^2 (d + p) FLOPs and B T^2 memory: cheaper than a k-vector sketch when
    T <= k, where it replaces the estimate.
    """
    a, g = as_sequences(activations, backprops)
    aat = torch.matmul(a, a.transpose(1, 2))
    ggt = torch.matmul(g, g.transpose(1, 2))
    return (aat * ggt).sum(dim=(1, 2)).clamp(min=0)


def bias_grads(backprops: torch.Tensor) -> torch.Tensor:
    """Per-sample bias gradients ``sum_t G_i[t]``: (B, p), at least float32."""
    return at_least_float32(as_sequence(backprops)).sum(dim=1)


def bias_sq_norms(backprops: torch.Tensor) -> torch.Tensor:
    """Exact squared norm of the per-sample bias gradient ``sum_t G_i[t]``."""
    return bias_grads(backprops).pow(2).sum(dim=1)


def embedding_sq_norms(
    ids: torch.Tensor, backprops: torch.Tensor, padding_idx: "int | None" = None
) -> torch.Tensor:
    """Exact ``||onehot(ids_i)^T G_i||_F^2 = sum_v ||sum_{t: ids_i[t] = v} G_i[t]||^2``
    for an embedding layer, without leaving the device.

    Each example's ids are sorted; runs of equal ids get consecutive slots and the
    output gradients are summed per slot (``scatter_add``), so the shapes never depend
    on the data (no ``unique``: no host synchronisation). The padding row receives no
    gradient and is left out. Memory O(B T d) in float32 or wider.

    Args:
        ids: (B, ...) token ids.
        backprops: (B, ..., d) output gradients.
        padding_idx: the layer's padding index, or None.
    """
    ids = ids.reshape(ids.shape[0], math.prod(ids.shape[1:]))
    g = at_least_float32(backprops.reshape(*ids.shape, backprops.shape[-1]))
    if padding_idx is not None:
        g = g.masked_fill((ids == padding_idx)[..., None], 0)
    sorted_ids, order = ids.sort(dim=1, stable=True)
    starts = torch.ones_like(sorted_ids, dtype=torch.bool)
    starts[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    run_of_sorted = starts.cumsum(dim=1) - 1  # slot of each sorted position
    slot = torch.empty_like(run_of_sorted).scatter_(1, order, run_of_sorted)
    sums = torch.zeros_like(g).scatter_add_(1, slot[..., None].expand_as(g), g)
    return sums.pow(2).sum(dim=(1, 2))
