"""Chunked LM head and next-token loss for randomized clipping (issue 23).

:class:`ChunkedLMHeadLoss` replaces a causal LM's head and loss: from the final hidden states
(B, T, d) and the labels (B, T) it works ``block_size`` positions at a time, so no more than
one block's (B x block_size x V) logits exist. Per block: ``z = A W^T (+ b)``, ``G = d loss_i
/ d z`` (softmax minus one-hot, scaled per sequence), the body's gradient ``H = G W``, the
head's per-example sketch ``A_b^T (G_b P)``; the weight gradient ``sum_i u_i A_i^T G_i`` comes
from recomputed blocks. Forms, tied heads, FSDP2, checkpointing: docs/lm_head.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .clipped_sums import keep_rows, wide_dtype
from .estimators import ghost_sq_norms, sketch_side
from .forms import form_of
from .forms.bookkeeping import Record
from .forms.fsdp import head_unit, is_fsdp_module
from .norm_samplers import tied_row_sketch
from .recompute import NON_REENTRANT, REENTRANT, forward_replay
from .units import RowUnits, per_row, regroup_rows, sum_rows_by_unit, unit_layout
from .values import HUTCHINSON, HUTCHPP

REDUCTIONS = ("mean", "sum")
_LOW = (torch.float16, torch.bfloat16)


def controlling_module(layer: nn.Module):
    """The randomized-clipping grad-sample module hooked on ``layer`` (None if none): the
    two-pass (``"ghost"``), book-keeping (``"hooks"``) or FSDP2 (``"ghost_fsdp"``) form; a
    ``ValueError`` when another Opacus mode hooks it (``layer.forward`` is never called)."""
    for hook in layer._forward_hooks.values():
        # Opacus's grad-sample modules / hooks objects register ``self.capture_activations_hook``
        owner = getattr(hook, "__self__", None)
        if owner is None or not hasattr(owner, "capture_backprops_hook"):  # not Opacus's hooks
            continue
        form = form_of(owner)
        if form is not None and form.per_layer:
            return owner
        raise ValueError(
            f"ChunkedLMHeadLoss needs clipping='randomized' (grad_sample_mode='ghost', "
            f"'hooks' or, under FSDP2, 'ghost_fsdp'); its lm_head is hooked by "
            f"{type(owner).__name__}, which cannot compute per-sample gradients of a head "
            "whose forward it never sees"
        )
    return None


@dataclass
class _Plan:
    """What one forward decided and kept for its backward(s)."""

    block_size: int
    compute_dtype: torch.dtype
    # the head module and its parameters themselves (saved tensors unpack as other tensor
    # objects under activation checkpointing: per-parameter state goes on these)
    layer: nn.Module
    weight: nn.Parameter
    bias: Optional[nn.Parameter]
    owner: Any = None  # the grad-sample module whose hooks are on (None: no norms)
    tied: bool = False  # as the owner's begin_head_use said
    kept: Optional["_HeadNorms"] = None  # the rows' sums for the norms, until the norm pass
    delivered: bool = False
    half: bool = False  # a half-precision call: the clipped pass's sums go to the owner in float32


def _logits(a: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], dtype) -> torch.Tensor:
    """The block's logits in ``dtype`` (the autocast dtype, as ``F.linear`` would run),
    returned in float32 for the softmax."""
    b = None if bias is None else bias.to(dtype)
    return F.linear(a.to(dtype), weight.to(dtype), b).float()


def _softmax_grad(p: torch.Tensor, target: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(p - onehot(target)) * scale`` in place on the softmax ``p``: ``d loss_i / d z``,
    ``scale`` per position = 1 / (valid tokens of the sequence), or 1 with
    ``reduction="sum"``, and 0 at ignored positions."""
    p.scatter_add_(-1, target[..., None], torch.full_like(p[..., :1], -1.0))
    return p.mul_(scale[..., None])


def _as_dtype(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The output gradient as autograd would hand it to a linear layer run in ``dtype``
    (rounded to half precision under autocast), for float32 arithmetic."""
    return g.to(dtype).float() if dtype in _LOW else g


def _added(total: Optional[torch.Tensor], part: torch.Tensor) -> torch.Tensor:
    return part if total is None else total.add_(part)


class _Blocks(NamedTuple):
    """What the forward kept, from which the blocks' output gradients are recomputed."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    target: torch.Tensor
    scale: torch.Tensor
    lse: torch.Tensor  # the log-sum-exp of the logits (B, T)
    size: int
    dtype: torch.dtype

    def recomputed(self, rows: Optional[torch.Tensor] = None):
        """Yield ``(start, A_b, G_b)`` (G_b float32, rounded as autograd would round it), the
        logits recomputed from A, W and the kept log-sum-exp; ``rows``: per-example weights
        (B,) multiplied into G_b."""
        cd, c, scale = self.dtype, self.size, self.scale
        for s in range(0, self.hidden.shape[1], c):
            a = self.hidden[:, s : s + c]
            weights = scale[:, s : s + c] if rows is None else scale[:, s : s + c] * rows[:, None]
            z = _logits(a, self.weight, self.bias, cd).sub_(self.lse[:, s : s + c, None])  # softmax from the lse
            g = _softmax_grad(z.exp_(), self.target[:, s : s + c], weights)
            del z
            yield s, a, _as_dtype(g, cd)
            del g  # (callers drop theirs too: one block's logits alive at a time)

    def weighted_grads(self, u: torch.Tensor, wants_w: bool = True, wants_b: bool = True):
        """``sum_i u_i A_i^T G_i`` (V x d) and ``sum_i u_i sum_t G_i[t]`` (V), block by block, summed
        in float32 or wider (never rounded to the parameters' half precision: issue 52)."""
        weight, bias = self.weight, self.bias
        wide = wide_dtype(self.dtype)
        grad_w = torch.zeros(weight.shape, dtype=wide, device=weight.device) if wants_w else None
        grad_b = torch.zeros(bias.shape, dtype=wide, device=bias.device) if wants_b else None
        for _, a, g in self.recomputed(rows=u):
            if wants_w:  # (G_b is float32, rounded as autograd would round it: a block of A promoted)
                grad_w.addmm_(g.reshape(-1, g.shape[-1]).t().to(wide), a.reshape(-1, a.shape[-1]).to(wide))
            if wants_b:
                grad_b += g.sum(dim=(0, 1))
            del g
        return grad_w, grad_b


class _ChunkedHeadLoss(torch.autograd.Function):
    """Per-sequence next-token losses (B,) from hidden states, a block at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, scale, plan: _Plan):
        batch, t, d = hidden.shape
        cd, c = plan.compute_dtype, plan.block_size
        need_hidden = ctx.needs_input_grad[0]
        losses = torch.zeros(batch, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(batch, t, dtype=torch.float32, device=hidden.device)
        h1 = torch.empty(batch, t, d, dtype=cd, device=hidden.device) if need_hidden else None
        acc = None if plan.owner is None else _HeadNorms(
            plan.owner.sketcher, hidden, weight, bias, plan.tied, plan.owner.batch.units_of(batch))
        for s in range(0, t, c):
            a = hidden[:, s : s + c]
            z = _logits(a, weight, bias, cd)
            tgt, sc = target[:, s : s + c], scale[:, s : s + c]
            picked = z.gather(-1, tgt[..., None])[..., 0]
            top = z.amax(dim=-1, keepdim=True)
            e = z.sub_(top).exp_()  # one exponential per logit: softmax and log-sum-exp from it
            total = e.sum(dim=-1, keepdim=True)
            block_lse = (top + total.log())[..., 0]
            lse[:, s : s + c] = block_lse
            losses += ((block_lse - picked) * sc).sum(dim=1)
            if need_hidden or acc is not None:
                g = _softmax_grad(e.div_(total), tgt, sc)
                if need_hidden:
                    h1[:, s : s + c] = torch.matmul(g.to(cd), weight.to(cd))
                if acc is not None:
                    acc.add(s, a, _as_dtype(g, cd))
            z = e = g = None  # one block's logits alive at a time (g, e and z share them)
        plan.kept = acc
        ctx.plan, ctx.h1 = plan, h1
        ctx.save_for_backward(hidden, weight, bias, target, scale, lse)
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        plan: _Plan = ctx.plan
        blocks = _Blocks(*ctx.saved_tensors, plan.block_size, plan.compute_dtype)
        u = grad_losses.float()
        grad_hidden = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_hidden = (ctx.h1 * u[:, None, None]).to(blocks.hidden.dtype)  # float32 product
        owner = plan.owner
        if owner is not None and owner.hooks_enabled:
            if plan.delivered:
                raise RuntimeError(
                    "ChunkedLMHeadLoss: a second backward pass with the grad-sample hooks on "
                    "over the same forward; per-example norms are computed once per forward"
                )
            plan.delivered = True
            _deliver(plan, blocks._replace(weight=plan.weight, bias=plan.bias), u)
            return grad_hidden, None, None, None, None, None
        wants_w, wants_b = ctx.needs_input_grad[1], blocks.bias is not None and ctx.needs_input_grad[2]
        if wants_w or wants_b:
            grad_w, grad_b = blocks.weighted_grads(u, wants_w, wants_b)
        if plan.half:  # the float32 clipped sums go to the form, not to autograd (opacus_rc.half_precision)
            for name, total in (("weight", grad_w), ("bias", grad_b)):
                if total is not None:
                    owner.deliver_clipped_sum(plan.layer, name, total)
            return grad_hidden, None, None, None, None, None
        return grad_hidden, grad_w, grad_b, None, None, None


class _HeadNorms:
    """How this pass computes the head's per-unit norms, mirroring the unchunked path
    (:func:`opacus_rc.norm_samplers.weight_sq_norms`, ``Sketcher.estimate``, the tied
    :func:`opacus_rc.norm_samplers.linear_projection`, on the rows regrouped into their units,
    :func:`opacus_rc.units.regroup_uses`: the same sketches give the same norms). The forward sums
    each row's values over the blocks (sketched products (B, rows_left, k) with its unit's sketch,
    the exact output gradient when the unit's sequence is no longer than k, the bias gradient
    (B, V)); :meth:`finish` reduces them to the units once the rows' loss factors are known."""

    def __init__(self, sketcher, hidden: torch.Tensor, weight, bias, tied: bool, units: RowUnits) -> None:
        (batch, t, d), vocab, device = hidden.shape, weight.shape[0], hidden.device
        config, k = sketcher.config, sketcher.config.sketch_size
        slot, _, count = unit_layout(units, batch, device)
        self.units, self.slot = units, None if count == batch else slot  # (None: each row its own unit)
        longest = 1 if self.slot is None else int(units.sizes.max())  # a unit's sequence: its rows' tokens
        self.hidden, self.weight, self.bias = hidden, weight.requires_grad, bias is not None and bias.requires_grad
        self.side, self.sketches = "output", {}
        self.out: Dict[str, torch.Tensor] = {}
        self.products: Dict[str, torch.Tensor] = {}
        if not self.weight:
            self.how = "none"
        elif tied:  # the weight's row sketch, shared with the embedding's use
            self.how = "tied"
            self.sketches["tail"] = tied_row_sketch(weight, count, sketcher, device)
        elif config.exact_when_cheaper and t * longest <= k:
            self.how = "exact"
            self.g_all = torch.empty(batch, t, vocab, dtype=torch.float32, device=device)
        else:  # "hutchinson" | "hutchpp", the same keys and order as Sketcher.estimate's
            self.how, self.side = config.estimator, sketch_side(d, vocab, "auto")
            rows = vocab if self.side == "output" else d
            for name in ("tail", "head") if self.how == HUTCHPP else ("tail",):
                self.sketches[name] = sketcher.gaussian(count, rows, k, device, key=(weight, name))
        self.row_sketches = {name: self._per_row(sketch) for name, sketch in self.sketches.items()}
        self.rows_left = vocab if self.side == "input" else d
        if self.bias:
            self.out["bias"] = torch.zeros(batch, vocab, dtype=torch.float32, device=device)

    def _per_row(self, per_unit: torch.Tensor) -> torch.Tensor:
        """Each row's share of a per-unit tensor (U, ...) -> (B, ...); a 2-D sketch, shared, as it is."""
        return per_unit if per_unit.dim() == 2 or self.slot is None else per_unit[self.slot]

    def _oriented(self, a: torch.Tensor, g: torch.Tensor):
        return (a.float(), g) if self.side == "output" else (g, a.float())

    def add(self, start: int, a: torch.Tensor, g: torch.Tensor) -> None:
        if self.bias:
            self.out["bias"] += g.sum(dim=1)
        if self.how == "exact":
            self.g_all[:, start : start + g.shape[1]] = g
        elif self.weight:
            left, right = self._oriented(a, g)
            for name, sketch in self.row_sketches.items():
                part = torch.matmul(left.transpose(1, 2), torch.matmul(right, sketch))
                self.products[name] = _added(self.products.get(name), part)

    def _product(self, name: str) -> torch.Tensor:
        """A summed sketched product (zeros for a sequence of no position)."""
        if name not in self.products:
            k = self.sketches[name].shape[-1]
            return torch.zeros(self.hidden.shape[0], self.rows_left, k, device=self.hidden.device)
        return self.products[name]

    def finish(self, recompute, s: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The per-unit quantities the backward needs, ``s`` (B,) each row's factor on its loss's
        gradient: ``"sq"`` (U,) the squared norm of ``sum_{r in u} s_r d loss_r / d W`` (exact or
        estimated) or ``"proj"`` (U, d, k) its tied projection; ``"bias"`` (U, V)."""
        units, out = self.units, {}

        def summed(t: torch.Tensor) -> torch.Tensor:  # sum_{r in u} s_r t_r, per unit
            return sum_rows_by_unit(t * s.reshape(-1, *([1] * (t.dim() - 1))).to(t.dtype), units)

        if self.bias:
            out["bias"] = summed(self.out["bias"])
        if self.how == "exact":
            g = self.g_all * s[:, None, None]
            out["sq"] = ghost_sq_norms(regroup_rows(self.hidden, units), regroup_rows(g, units))
            del self.g_all
        elif self.how == "tied":
            out["proj"] = summed(self._product("tail"))
        elif self.how == HUTCHINSON:
            out["sq"] = summed(self._product("tail")).pow(2).sum(dim=(1, 2))
        elif self.how == HUTCHPP:  # exact head on the range of M S, Hutchinson on the residual
            q, _ = torch.linalg.qr(summed(self._product("head")))  # (U, rows_left, r)
            q_rows, head = self._per_row(q), None
            for _, a, g in recompute(rows=s):
                left, right = self._oriented(a, g)
                head = _added(head, torch.matmul(torch.matmul(left, q_rows).transpose(1, 2), right))
                del g, left, right
            head_sq = (
                sum_rows_by_unit(head, units).pow(2).sum(dim=(1, 2)) if head is not None
                else torch.zeros(q.shape[0], device=q.device)
            )
            mp = summed(self._product("tail"))
            residual = mp - torch.matmul(q, torch.matmul(q.transpose(1, 2), mp))
            out["sq"] = head_sq + residual.pow(2).sum(dim=(1, 2))
        self.products.clear()
        return out


def _trainable(layer_params):
    return [p for p in layer_params if p is not None and p.requires_grad]


@dataclass
class HeadValues:
    """The chunked head's per-unit values of one pass (the units of the batch: its rows, or their
    users at ``privacy_unit="user"``), handed to its grad-sample module (``deliver_head``), which
    decides where they go.

    Attributes:
        tied: the use is tied (``begin_head_use`` said so at the forward).
        params: the head's trainable parameters (the objects the forward used).
        rows: the rows of the batch.
        contributions: ``{name: per-unit contribution}``: ``||sum_{r in u} s_r grad_r W||`` (U,),
            or ``sum_{r in u} s_r P^T grad_r W`` (U, d, k) for a tied weight; ``sum_{r in u} s_r
            sum_t G_r[t]`` (U, V) for the bias.
        clipped: ``{parameter: clipped(c, keep=None)}``, ``sum_u c_u sum_{r in u} s_r grad_r``
            (book-keeping's clipped sums, recomputed block by block).
        sq_norms: ``{parameter: (U,)}`` the squared norms of an untied use (book-keeping's records).
    """

    tied: bool
    params: List[nn.Parameter]
    rows: int
    contributions: Dict[str, torch.Tensor]
    clipped: Dict[nn.Parameter, Callable[..., torch.Tensor]]
    sq_norms: Dict[nn.Parameter, torch.Tensor]

    def records(self) -> Dict[nn.Parameter, Record]:
        """Book-keeping's :class:`~opacus_rc.forms.bookkeeping.Record` of each untied parameter."""
        return {p: Record(sq, self.clipped[p], self.rows) for p, sq in self.sq_norms.items()}


def _deliver(plan: _Plan, blocks: _Blocks, u: torch.Tensor) -> None:
    """First backward with the hooks on: hand the head's per-unit values to the grad-sample
    module (:class:`HeadValues`)."""
    owner, acc, weight, bias = plan.owner, plan.kept, plan.weight, plan.bias
    plan.kept = None
    # The factor of example i's gradient of the loss the values are taken of: Opacus's hooks multiply
    # the output gradient by n under loss_reduction="mean" (that of n * mean_i l_i: per example, of l_i).
    s = u * u.shape[0] if owner.loss_reduction == "mean" else u
    kept = acc.finish(blocks.recomputed, s)
    contributions: Dict[str, torch.Tensor] = {}
    clipped: Dict[nn.Parameter, Callable[..., torch.Tensor]] = {}
    sq_norms: Dict[nn.Parameter, torch.Tensor] = {}
    if weight.requires_grad:
        contributions["weight"] = kept["proj"] if "proj" in kept else kept["sq"].clamp(min=0).sqrt()
        clipped[weight] = _bookkept_clip(blocks, s, acc.units, which=0)
        if "sq" in kept:
            sq_norms[weight] = kept["sq"]
    if bias is not None and bias.requires_grad:
        contributions["bias"] = kept["bias"]
        clipped[bias] = _bookkept_clip(blocks, s, acc.units, which=1)
        sq_norms[bias] = kept["bias"].pow(2).sum(dim=1)
    values = HeadValues(plan.tied, _trainable([weight, bias]), int(u.shape[0]), contributions, clipped, sq_norms)
    owner.deliver_head(plan.layer, values)


def _bookkept_clip(blocks: _Blocks, s: torch.Tensor, units: RowUnits, which: int):
    """Book-keeping's clipped sum of the head's weight (``which`` 0), ``sum_r c_{u(r)} s_r A_r^T G_r``,
    or bias (1), ``sum_r c_{u(r)} s_r sum_t G_r[t]`` (``c``, ``keep``: per unit): ``clipped(c,
    keep=None)`` of a :class:`Record`, recomputed block by block at ``optimizer.step()`` from what
    the forward kept (A, labels, log-sum-exp), never from a stored (T x V)."""

    def clipped(c: torch.Tensor, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        c, keep = per_row(c, units), None if keep is None else per_row(keep, units)
        # dropped units: zero rows, so nothing non-finite reaches the sum
        a, kept_lse, rows = (keep_rows(x, keep) for x in (blocks.hidden, blocks.lse, c.float() * s))
        with torch.no_grad():
            return blocks._replace(hidden=a, lse=kept_lse).weighted_grads(rows, which == 0, which == 1)[which]

    return clipped


def _check_reduction(reduction: str) -> None:
    if reduction not in (*REDUCTIONS, "none"):
        raise ValueError(f"reduction={reduction!r} is invalid; accepted values: 'mean', 'sum', 'none'")


class ChunkedLMHeadLoss(nn.Module):
    """LM head + next-token cross-entropy, a block of positions at a time (docs/lm_head.md).

    ``forward(hidden, labels)``: hidden states (B, T, d) and labels (B, T) to the per-sequence
    losses (B,) (``reduction="none"``) or their batch mean or sum; a sequence's loss is the
    mean (``"sum"``: the sum) over its non-ignored tokens, Opacus's ghost-criterion convention.

    Args:
        lm_head: the model's output layer, an ``nn.Linear`` (V x d weight, optional bias),
            trainable or frozen, possibly tied to the input embedding.
        block_size: positions per block (a block's logits are B x block_size x V floats).
        ignore_index: label ignored in the loss (and in the per-sequence count).
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (the per-sequence losses (B,), each
            the mean over its tokens); ``"mean"``/``"sum"`` is also the per-sequence
            convention (Opacus sets ``reduction="none"`` while it computes per-sample losses).
        shift_labels: labels are the inputs' ids (Hugging Face convention), shifted here.
    """

    def __init__(
        self,
        lm_head: nn.Linear,
        block_size: int = 1024,
        *,
        ignore_index: int = -100,
        reduction: str = "mean",
        shift_labels: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(lm_head, nn.Linear):
            raise ValueError(
                f"lm_head must be an nn.Linear (V x d weight); got {type(lm_head).__name__}"
            )
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} is invalid; accepted values: a positive int")
        _check_reduction(reduction)
        self.lm_head = lm_head
        self.block_size = block_size
        self.ignore_index = ignore_index
        # per-sequence convention (fixed): "none" returns per-sequence means
        self.loss_reduction = "mean" if reduction == "none" else reduction
        self.reduction = reduction  # batch reduction; Opacus sets "none" for per-sample losses
        self._forward_reduction = reduction  # the reduction of the last forward (see forward)
        self.shift_labels = shift_labels

    def extra_repr(self) -> str:
        return f"block_size={self.block_size}, reduction={self.loss_reduction!r}, shift_labels={self.shift_labels}"

    def _targets(self, labels: torch.Tensor):
        if self.shift_labels:
            pad = torch.full_like(labels[:, :1], self.ignore_index)
            labels = torch.cat([labels[:, 1:], pad], dim=1)
        valid = labels != self.ignore_index
        target = torch.where(valid, labels, torch.zeros_like(labels))
        scale = valid.float()
        if self.loss_reduction == "mean":
            scale = scale / valid.sum(dim=1, keepdim=True).clamp(min=1)
        return target, scale

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if hidden.dim() != 3 or labels.shape != hidden.shape[:2]:
            raise ValueError(
                f"ChunkedLMHeadLoss takes hidden states (B, T, d) and labels (B, T); got "
                f"{tuple(hidden.shape)} and {tuple(labels.shape)}"
            )
        _check_reduction(self.reduction)
        layer = self.lm_head
        owner = controlling_module(layer)
        if owner is not None and owner.hooks_enabled and owner.output_passes is not None:
            raise ValueError(
                "ChunkedLMHeadLoss computes the loss without the LM head's output, which the "
                "two passes from the model's output (a plain-loss script on a checkpointed "
                "model) clip at: use grad_sample_mode='bookkeeping' (or bookkeeping=True) in "
                "make_private, or grad_sample_mode='ghost' with this module as the criterion"
            )
        # A reentrant checkpoint's replay reduces as the region's forward did (Opacus's
        # criterion sets reduction="none" for that call only, and has restored it since).
        if forward_replay() == REENTRANT:
            reduction = self._forward_reduction
        else:
            reduction = self._forward_reduction = self.reduction
        target, scale = self._targets(labels)
        fsdp = head_unit(layer, owner)
        if fsdp is None:
            return self._reduced(self._losses(layer, owner, hidden, target, scale), reduction)
        hidden = fsdp.pre_forward(hidden)  # lm_head.weight: the unsharded parameter from here
        try:
            losses = self._losses(layer, owner, hidden, target, scale)
        except BaseException:
            fsdp.failed_forward(hidden)
            raise
        return self._reduced(fsdp.post_forward(hidden, losses), reduction)

    @staticmethod
    def _reduced(losses: torch.Tensor, reduction: str) -> torch.Tensor:
        return losses if reduction == "none" else getattr(losses, reduction)()  # mean() or sum()

    def _losses(self, layer: nn.Module, owner: Any, hidden: torch.Tensor, target, scale) -> torch.Tensor:
        """The per-sequence losses (B,), registering the pass with ``owner`` when its hooks
        are on (norms in the backward pass)."""
        weight, bias = layer.weight, layer.bias
        device_type = hidden.device.type
        autocast = torch.amp.is_autocast_available(device_type)
        if autocast and torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
        else:
            dtype = torch.promote_types(hidden.dtype, weight.dtype)
        plan = _Plan(self.block_size, dtype, layer, weight, bias)
        # a non-reentrant checkpoint's replay only regenerates saved tensors (a reentrant one is the pass)
        replay = forward_replay()
        training = torch.is_grad_enabled() and layer.training and replay != NON_REENTRANT
        if owner is not None and owner.hooks_enabled and training and _trainable([weight, bias]):
            if replay is None:  # as its forward hook would (a reentrant replay starts none)
                owner.start_pass(layer)
            plan.owner = owner
            plan.tied = owner.begin_head_use(layer, weight, bias)
            plan.half = owner.half_precision_call(layer, hidden)
        with torch.autocast(device_type, enabled=False) if autocast else contextlib.nullcontext():
            return _ChunkedHeadLoss.apply(hidden, weight, bias, target, scale, plan)


def hidden_states(model: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The final hidden states (B, T, d) of a Hugging Face causal LM (its base model's
    ``last_hidden_state``; the LM head is not run), also through a grad-sample module
    (``wrap_model=True``); of an empty batch (an empty Poisson draw), (0, T, d) of zero
    contribution. Not for an FSDP2 root (``ValueError``): FSDP2 needs the root's own forward to run."""
    inner = getattr(model, "_module", model)
    base = getattr(inner, "base_model", None)
    if is_fsdp_module(inner) and base is not None and base is not inner:
        raise ValueError(
            f"hidden_states() would call the base model of an FSDP2 root ({type(inner).__name__}), "
            "skipping the root's forward, which FSDP2 needs: shard a module whose forward "
            "returns the hidden states (e.g. one returning lm.model(...).last_hidden_state, "
            "lm_head inside it as its own unit) and call that root"
        )
    if base is None or base is inner:
        raise ValueError(
            f"{type(inner).__name__} has no separate base model; pass the hidden states "
            "of your model's body to ChunkedLMHeadLoss directly"
        )
    key = "inputs_embeds" if kwargs.get("inputs_embeds") is not None else "input_ids"
    ids = kwargs.get(key, args[0] if args else None)
    if isinstance(ids, torch.Tensor) and ids.dim() > 1 and ids.shape[0] == 0:
        return _empty_draw(base, inner.get_output_embeddings(), key, ids)
    return base(*args, **kwargs).last_hidden_state


def _empty_draw(base: nn.Module, head: nn.Linear, key: str, ids: torch.Tensor) -> torch.Tensor:
    """The hidden states (0, T, d) of an empty Poisson draw, which Hugging Face's attention
    cannot reshape: each trainable layer of ``base`` runs on 0 rows instead (its input's shape
    from a run of one row without gradients), so its hooks see the empty batch and it
    contributes zero, as in a model that runs on 0 rows."""
    shapes: Dict[nn.Module, torch.Tensor] = {}
    layers = [m for m in base.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]

    def note(module: nn.Module, args: tuple) -> None:
        if args and isinstance(args[0], torch.Tensor):
            shapes.setdefault(module, args[0])

    hooks = [m.register_forward_pre_hook(note) for m in layers]
    try:
        with torch.no_grad():
            base(**{key: ids.new_zeros(1, *ids.shape[1:])})
    finally:
        for hook in hooks:
            hook.remove()
    total = head.weight.new_zeros(0, ids.shape[1], head.in_features)
    for m, x in shapes.items():
        total = total + m(x.new_zeros(0, *x.shape[1:])).sum()
    return total


def from_causal_lm(model: nn.Module, block_size: int = 1024, **kwargs: Any) -> ChunkedLMHeadLoss:
    """A :class:`ChunkedLMHeadLoss` on a Hugging Face causal LM's output embeddings
    (``shift_labels=True``: labels as the model takes them)."""
    inner = getattr(model, "_module", model)
    kwargs.setdefault("shift_labels", True)
    return ChunkedLMHeadLoss(inner.get_output_embeddings(), block_size, **kwargs)
