"""Book-keeping: randomized clipping in one backward pass.

``make_private(..., clipping="randomized", grad_sample_mode="bookkeeping")`` trains a
plain-loss script (the 3-tuple) in one backward pass; so do ``"hooks"`` (unless the model is
checkpointed: :func:`opacus_rc.forms.resolve_form`) and ``"ghost"`` with ``bookkeeping=True``
(the 4-tuple; its criterion a :class:`DPLossBookkeeping`).

Instead of a second backward pass on the rescaled loss, the clipped gradient of a layer
is assembled after the one ordinary backward pass from what its hooks kept (Bu et al.
2023, fastDP's "book-keeping"):

* linear weight (p x d): ``sum_i c_i G_i^T A_i = (c * G)^T A`` (one matmul, the cost of
  the ordinary weight gradient, which the backward pass therefore skips);
* bias: ``sum_i c_i sum_t G_i[t]``;
* embedding (V x d): ``index_add`` of ``c_i G_i[t]`` at the token ids.

Per-sample norms come from the same estimators as the two-pass method (sketched weight,
exact bias/embedding), so the clipped gradient is the same for the same sketches. Other
trainable layers get Opacus's exact per-sample gradients (``p.grad_sample``). Every sum over
the examples is accumulated in float32 or wider, whatever the activations' precision
(:mod:`opacus_rc.clipped_sums`; issue 52).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from opacus.grad_sample import GradSampleHooks, GradSampleModule
from opacus.optimizers import DistributedDPOptimizer, DPOptimizer
from opacus.optimizers.optimizer import _mark_as_processed
from opacus.utils.module_utils import trainable_parameters
from torch import nn

from ..clip_guard import BuiltSumsGuard, Expected, coarsest_dtype, complete_unused
from ..clipped_sums import (
    clipped_bias, clipped_embedding, clipped_grad_sample, clipped_linear_weight, wide_dtype,
)
from ..estimators import as_sequence
from ..grad_sample import PerExampleStore, head_used_twice_error
from ..half_precision import check_no_mean_in_half, reduced_for_backward
from ..norm_samplers import RANDOMIZED_NORM_SAMPLERS
from ..optimizer import SketchedClippingMixin, SumsAllReducedInFloat32
from ..per_parameter import count_uses, set_summed
from ..recompute import late_use_error, missing_per_sample_error
from ..refusals import refusal
from ..units import mean_clip_factors, sum_rows_by_unit, unit_sizes
from .two_pass import DPLossRandomizedClipping
from ..values import SKIP

# --- Records: what one backward pass leaves for a parameter -------------------------------

@dataclass
class Record:
    """What one backward pass left for one parameter of a book-kept layer: ``sq_norms``, the
    per-sample squared norms (B,), and ``clipped(c, keep=None)``, ``sum_i c_i grad_i`` over the
    examples with ``keep[i]`` (a dropped example's rows are zeroed first)."""

    sq_norms: torch.Tensor
    clipped: Callable[[torch.Tensor], torch.Tensor]
    #: the physical batch's rows (None: one per entry of ``sq_norms``; fewer entries when
    #: the rows were regrouped into users, :func:`~opacus_rc.units.regroup_rows`)
    rows: Optional[int] = None

    @property
    def row_count(self) -> int:
        return self.batch_size if self.rows is None else self.rows

    @property
    def batch_size(self) -> int:
        return int(self.sq_norms.shape[0])


class RecordStore:
    """The records of the step, per parameter (by identity): owned by the book-keeping module,
    filled by its layers' hooks (and the chunked head), consumed by the optimizer's step."""

    def __init__(self) -> None:
        self._records: Dict[int, List[Record]] = {}

    def add(self, param: nn.Parameter, record: Record) -> None:
        self._records.setdefault(id(param), []).append(record)

    def of(self, param: nn.Parameter) -> List[Record]:
        return self._records.get(id(param), [])

    def take(self, param: nn.Parameter) -> List[Record]:
        """``param``'s records of the step, consumed."""
        return self._records.pop(id(param), [])

    def __len__(self) -> int:
        """The parameters with records."""
        return len(self._records)

    def clear(self) -> None:
        """Drop every record (per-example values: they would reach ``torch.save(model)``)."""
        self._records.clear()


# --- The grad-sample module ---------------------------------------------------------------

BOOKKEPT_LAYERS = (nn.Linear, nn.Embedding)


def _bookkept(module: nn.Module) -> bool:
    """Layers book-kept exactly by type (subclasses, e.g. MultiheadAttention's output
    projection, go through Opacus's per-sample gradients)."""
    return type(module) in BOOKKEPT_LAYERS


class BookkeepingMixin(PerExampleStore):
    """Records, for linear and embedding layers, the per-sample squared norms and a closure
    ``c -> sum_i c_i grad_i`` (:class:`Record`); every other trainable layer gets Opacus's
    per-sample gradients. Linear layers skip their weight-gradient matmul in the backward pass.

    A tied parameter (owned by several layers, e.g. an embedding and the LM head) has one record
    per pass, of its summed uses: the norm of ``sum_l P^T grad_l`` (each use's projection on the
    parameter's row sketch P: :meth:`~opacus_rc.grad_sample.PerExampleStore.tied_projection`; exact
    when it has at most k rows) and the clipped sum ``sum_l sum_i c_i grad_{l,i}``; autograd
    computes none of it (its embedding's in-module gradient is stripped as a linear layer's is
    deferred), so any gradient it has after the pass is a use outside its layers.
    """

    def _setup(self) -> None:
        layers = [m for m in self._module.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
        owners: Dict[int, List[nn.Module]] = {}
        for m in layers:
            for p in m.parameters(recurse=False):
                if p.requires_grad:
                    owners.setdefault(id(p), []).append(m)
        #: the layers owning a tied parameter (every parameter of theirs goes through its projection)
        self._tied_layers = {id(m): m for ms in owners.values() if len(ms) > 1 for m in ms}
        for m in self._tied_layers.values():
            if not _bookkept(m):  # per-sample gradients of Opacus's layers give no projection
                raise refusal("tied_layer", layer=type(m).__name__, form="book-keeping",
                              supported=", ".join(c.__name__ for c in BOOKKEPT_LAYERS))
        #: the ids of the tied parameters, and the layers owning each
        self._tied = {pid: ms for pid, ms in owners.items() if len(ms) > 1}
        #: per tied parameter, this pass's running sum of its uses' projections and their clipped sums
        self._tied_uses: Dict[int, Tuple[torch.Tensor, List[Callable]]] = {}
        #: the step's records, read by the optimizer that follows this module
        self.records = RecordStore()
        self._pending_uses: Dict[nn.Module, List[Any]] = {}  # this pass's uses, per layer
        self._recorded_in_pass: set = set()  # layers whose record of this pass is complete
        self._clear_queued = False  # end-of-backward reset of _recorded_in_pass queued
        self._defer_weight_grads()

    @property
    def deferred_layers(self) -> Tuple[nn.Module, ...]:
        """As the base's, and the layers owning a tied parameter: autograd computes none of their
        gradients (:meth:`strips_in_module_grads`)."""
        deferred = super().deferred_layers
        seen = {id(m) for m in deferred}
        return (*deferred, *(m for key, m in self._tied_layers.items() if key not in seen))

    def strips_in_module_grads(self, layer: nn.Module, inputs: Any) -> bool:
        """As the base's; also a training call (hooks on) of a layer owning a tied parameter, whose
        clipped sum is built from its records."""
        half = super().strips_in_module_grads(layer, inputs)
        training = self.hooks_enabled and layer.training and torch.is_grad_enabled()
        return half or (training and id(layer) in self._tied_layers)

    def _on_pass_start(self) -> None:
        """A new forward pass: no layer is recorded in it yet, and a tied parameter's sum that an
        earlier pass left incomplete (a forward without its backward) is not continued."""
        self._recorded_in_pass.clear()
        self._clear_queued = False
        self._tied_uses.clear()

    def begin_head_use(self, layer: nn.Module, weight: nn.Parameter, bias: Optional[nn.Parameter]) -> bool:
        """As the base, refusing an earlier use in the pass of a head parameter that is not tied
        (its record would miss it); a tied weight's uses are summed (:meth:`_add_tied_use`)."""
        super().begin_head_use(layer, weight, bias)
        own = [p for p in (weight, bias) if p is not None and p.requires_grad and id(p) not in self._tied]
        if any(p._forward_counter > 1 for p in own):
            raise head_used_twice_error(bookkeeping=True)
        return weight.requires_grad and id(weight) in self._tied

    def deliver_head(self, layer: nn.Module, values: Any) -> None:
        """The chunked head's records of this pass (``values.records()``, per unit of the batch), a
        tied weight's use joining its running sum; a later use of an untied head parameter in the
        pass is refused (its record would miss it)."""
        self.expect_forward()
        own = [p for p in values.params if id(p) not in self._tied]
        if any(p._forward_counter != 1 for p in own) or layer in self._pending_uses:
            raise head_used_twice_error(bookkeeping=True)
        for p in values.params:
            count_uses(p, -1)
        for p, record in values.records().items():
            self.records.add(p, record)
        if values.tied:
            weight = layer.weight
            self._add_tied_use(layer, weight, values.contributions["weight"], values.clipped[weight], values.rows)

    def _refuse_use_after_its_norm(self, module: nn.Module) -> None:
        """Refuse a replayed use of a layer whose record of this backward pass is complete (a
        second record: a second clip factor for one example); the backward's end clears the set."""
        if module in self._recorded_in_pass:
            raise late_use_error(type(module).__name__)
        if not self._clear_queued:
            self._clear_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_pass_start)

    def forbid_grad_accumulation(self) -> None:
        """Allowed: ``rc_prv`` charges the micro-batches (:mod:`opacus_rc.accounting.multiplicity`)."""
        self.allow_grad_accumulation()

    def capture_activations_hook(self, module, forward_input, _forward_output) -> None:
        self._capture(
            module, forward_input,
            lambda: super(BookkeepingMixin, self).capture_activations_hook(module, forward_input, _forward_output),
        )

    def capture_backprops_hook(
        self, module: nn.Module, _forward_input, forward_output, loss_reduction: str, batch_first: bool
    ) -> None:
        """Keep this use's ``(A, G)``; at the layer's last use in the pass, one record of the
        uses concatenated along the sequence (:func:`concatenate_uses`): a layer applied L times
        has the per-example norm of its summed gradient and counts as one micro-batch."""
        self._awaiting_forward = True
        if self.hooks_enabled:
            check_no_mean_in_half(loss_reduction, forward_output[0], int(forward_output[0].shape[0 if batch_first else 1]))
        if not self.hooks_enabled or not _bookkept(module):
            return super().capture_backprops_hook(
                module, _forward_input, forward_output, loss_reduction, batch_first
            )
        activations, backprops = self.rearrange_grad_samples(
            module=module,
            backprops=forward_output[0].detach(),
            loss_reduction=loss_reduction,
            batch_first=batch_first,
        )
        params = [p for _, p in trainable_parameters(module)]
        for param in params:
            count_uses(param, -1)
        if len(module.activations) == 0 and hasattr(module, "max_batch_len"):
            del module.max_batch_len
        if id(module) in self._tied_layers:  # each use projected, summed per parameter
            rows = int(backprops.shape[0])
            a, g = self.regrouped(module, activations[0], backprops)
            for param, contribution in self.tied_projection(module)(module, [a], g, self.sketcher).items():
                self._add_tied_use(module, param, contribution, _clipped_sum(module, param, a, g), rows)
            return
        uses = self._pending_uses.setdefault(module, [])
        uses.append((activations[0], backprops))
        if any(param._forward_counter > 0 for param in params):
            return  # more uses of this layer in this pass are still to come
        a, g = concatenate_uses(module, self._pending_uses.pop(module))
        self._recorded_in_pass.add(module)
        rows = int(g.shape[0])  # a unit's rows as one sequence of all its tokens
        a, g = self.regrouped(module, a, g)
        norms = RANDOMIZED_NORM_SAMPLERS[type(module)](module, [a], g, self.sketcher)
        for param, norm in norms.items():
            self.records.add(param, Record(norm.pow(2), _clipped_sum(module, param, a, g), rows))

    def _add_tied_use(self, layer: nn.Module, param: nn.Parameter, contribution: torch.Tensor, clipped: Callable,
                      rows: int) -> None:
        """One use through ``layer`` of ``param`` (tied, or another parameter of a layer owning a tied
        one): its per-unit projection ``contribution`` and clipped sum ``clipped(c, keep)``; at its
        last use in the pass (its use count at 0), one record: the squared norm of the summed
        projections and the sum of the uses' clipped sums."""
        total, uses = self._tied_uses.pop(id(param), (None, []))
        total = contribution if total is None else total + contribution
        uses.append(clipped)
        if param._forward_counter > 0:
            self._tied_uses[id(param)] = (total, uses)
            return
        self._recorded_in_pass.update(self._tied.get(id(param), [layer]))
        self.records.add(param, Record(total.flatten(start_dim=1).pow(2).sum(dim=1), functools.partial(_summed, uses), rows))

    def forget_per_example_values(self) -> None:
        """Drop what a refused step left: the layers' pending uses and the parameters'
        records (per-example values; they would reach ``torch.save(model)``)."""
        self._pending_uses.clear()
        self._tied_uses.clear()
        self.records.clear()


def concatenate_uses(module: nn.Module, uses: List[Any]) -> Any:
    """One ``(A, G)`` for the uses ``[(A_l, G_l)]`` of a layer in one pass, concatenated along
    the (flattened) sequence dimension (``sum_l G_l^T A_l = G^T A``): ``(B, sum_l T_l, d)``
    and ``(B, sum_l T_l, p)`` (ids ``(B, sum_l T_l)`` for an embedding)."""
    if len(uses) == 1:
        return uses[0]
    batch = {int(a.shape[0]) for a, _ in uses}
    if len(batch) != 1:
        raise ValueError(
            f"{type(module).__name__} was applied {len(uses)} times in one forward pass to "
            f"inputs of different batch sizes {sorted(batch)}: per-example gradients need "
            "every use to see the whole batch along dimension 0"
        )
    ids = isinstance(module, nn.Embedding)
    a = torch.cat([x.reshape(x.shape[0], math.prod(x.shape[1:])) if ids else as_sequence(x) for x, _ in uses], dim=1)
    g = torch.cat([as_sequence(y) for _, y in uses], dim=1)
    return a, g


def _summed(uses: List[Callable], c: torch.Tensor, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The clipped sums of a tied parameter's uses, added: ``sum_l sum_i c_i grad_{l,i}``."""
    total = uses[0](c, keep)
    for clipped in uses[1:]:
        total = total + clipped(c, keep)
    return total


def _clipped_sum(module: nn.Module, param: nn.Parameter, a: torch.Tensor, g: torch.Tensor):
    if isinstance(module, nn.Embedding):
        return functools.partial(clipped_embedding, a, g, layer=module)
    if param is module.weight:
        return functools.partial(clipped_linear_weight, a, g)
    return functools.partial(clipped_bias, g)


class GradSampleModuleBookkeeping(BookkeepingMixin, GradSampleModule):
    """Wrapping form of book-keeping randomized clipping (``grad_sample_mode="hooks"``)."""


class GradSampleHooksBookkeeping(BookkeepingMixin, GradSampleHooks):
    """Hooks (``wrap_model=False``) form of book-keeping randomized clipping."""


# --- The optimizer ------------------------------------------------------------------------

class BookkeepingClippingMixin:
    """Clipping by book-keeping: norms and clipped sums of book-kept parameters from their
    records, of the others from Opacus's ``p.grad_sample``."""

    #: the step releases only the sums built here, never ``p.grad``
    clip_guard_class = BuiltSumsGuard

    @property
    def _record_store(self) -> RecordStore:
        """The records of the module this optimizer follows (refused when it follows none)."""
        module = self.bound_module()
        if module is None:
            raise ValueError(
                "the book-keeping optimizer clips from the records of the module it follows: "
                "call module.follow_steps(optimizer) (make_private does)"
            )
        return module.records

    def _records(self, p: torch.nn.Parameter) -> List[Record]:
        return self._record_store.of(p)

    def complete_batch(self, rows: int) -> List[torch.nn.Parameter]:
        """:func:`~opacus_rc.clip_guard.complete_unused` after a backward pass of ``rows``
        examples (zeros: a record of zero norms and clipped sum)."""
        return complete_unused(
            self.params, rows, lambda p: bool(self._records(p)) or getattr(p, "grad_sample", None) is not None,
            lambda p: self._record_store.add(p, Record(torch.zeros(rows, device=p.device), lambda c, keep=None: torch.zeros_like(p))),
        )

    def _exact_grad_sample(self, p: torch.nn.Parameter) -> torch.Tensor:
        """Opacus's per-sample gradient of a parameter that is not book-kept (per user at
        user level: the sum of the user's rows')."""
        if getattr(p, "grad_sample", None) is None:
            raise missing_per_sample_error(self.describe_parameter(p), self.bound_module().no_backward_cause())
        gs = self._get_flat_grad_sample(p)
        return sum_rows_by_unit(gs, self._step_units(gs.shape[0]))

    def _per_sample_sq_norms(self, p: torch.nn.Parameter) -> torch.Tensor:
        records = self._records(p)
        if records:
            return torch.cat([r.sq_norms for r in records])
        return self._exact_grad_sample(p).flatten(start_dim=1).pow(2).sum(dim=1)

    @property
    def grad_samples(self) -> List[Optional[torch.Tensor]]:
        """Opacus's per-sample gradients, one entry per parameter; None for a book-kept one. A step
        whose forwards took only empty batches and ran no backward pass contributes zeros."""
        recorded = any(self._records(p) or getattr(p, "grad_sample", None) is not None for p in self.params)
        if not recorded and not self.bound_module().step_took_rows:
            self.complete_batch(0)
        return [None if self._records(p) else self._exact_grad_sample(p) for p in self.params]

    def _passes_recorded(self) -> int:
        """Backward passes recorded since the last ``step()`` call: one record (book-kept
        layers) or one per-sample gradient (the others) per pass."""
        counts = [1]
        for p in self.params:
            gs = getattr(p, "grad_sample", None)
            counts.append(len(self._records(p)) or (len(gs) if isinstance(gs, list) else 0))
        return max(counts)

    def _note_outside_uses(self) -> None:
        """Flag a parameter also used outside its modules' forward (dropped from the built sums:
        refused): autograd's ``p.grad`` must be zero for a deferred layer (a linear one, or one
        called in half precision: :mod:`opacus_rc.half_precision`), else the
        in-module batch sum (:meth:`~opacus_rc.clip_guard.ClipGuard.flag_outside_uses`; limits:
        docs/accounting.md, "Parameters used outside their module")."""
        module = self.bound_module()
        deferred = {id(p) for m in module.deferred_layers for p in m.parameters(recurse=False)}
        fresh = self.clip_guard.take_fresh()
        expected: List[Tuple[torch.nn.Parameter, Expected]] = []
        for p in self.params:
            if p.grad is None or p.grad.is_sparse:
                continue
            if id(p) in deferred:  # autograd computes none of it: any entry is an outside use
                if self._records(p) or getattr(p, "grad_sample", None) is not None:
                    expected.append((p, None))
                continue  # (no per-example values: the step's "no record" refusal applies)
            sums = self._in_module_sum(p) if fresh else None
            if sums is not None:
                expected.append((p, sums))
        self.clip_guard.flag_outside_uses(expected)

    def _in_module_sum(self, p: torch.nn.Parameter):
        """:data:`~opacus_rc.clip_guard.Expected` of a parameter that is not deferred, from its
        records or Opacus's per-sample gradients; None when the step has neither."""
        records = self._records(p)
        if records:
            parts = [r.clipped(torch.ones_like(r.sq_norms)) for r in records]
            dtype = coarsest_dtype(x.dtype for x in parts)
            sizes = [r.row_count for r in records]
            norms = torch.cat([r.sq_norms for r in records]).float().sqrt()
        elif isinstance(getattr(p, "grad_sample", None), (torch.Tensor, list)):
            gs = p.grad_sample if isinstance(p.grad_sample, list) else [p.grad_sample]
            dtype = coarsest_dtype(g.dtype for g in gs)
            parts = [g.float().sum(dim=0) for g in gs]
            sizes = [g.shape[0] for g in gs]
            norms = torch.cat([g.float().flatten(start_dim=1).norm(dim=1) for g in gs])
        else:
            return None
        parts = [x.float().view_as(p) for x in parts]
        if self.bound_module().loss_reduction == "mean":  # (the backward's reduction: the module's)
            parts = [x / max(1, n) for x, n in zip(parts, sizes)]
            norms = norms / max(1, max(sizes))
        return sum(parts), dtype, norms

    def _step_units(self, rows: int) -> Any:
        """The units of the step's physical batch (of ``rows`` rows)."""
        return self.bound_module().batch.units_of(rows)

    def _unit_sizes(self, count: int) -> torch.Tensor:
        """``m_u`` of the ``count`` units the step's records hold (their rows in the batch)."""
        units = self.bound_module().batch.units
        if units.one_row_each:
            return torch.ones(count)
        sizes = unit_sizes(units)
        if len(sizes) != count:
            self.drop_step()
            raise ValueError(
                "book-keeping clips the units of one physical batch per step: one backward pass per step, on "
                "its batch (per_example_backward=True spreads a user's rows over backward passes)"
            )
        return sizes

    def clip_and_accumulate(self) -> None:
        self._note_outside_uses()
        # counted before the records are consumed: averaging and the accountant read it
        self.count_backward_pass(self._passes_recorded())
        sq = torch.stack([self._per_sample_sq_norms(p).float() for p in self.params]).sum(dim=0)
        keep = self._finite_examples(sq)
        if keep is not None:
            sq = torch.where(keep, sq, torch.zeros_like(sq))
        # a user's unit is the mean of their m_u rows: norm ||S_u|| / m_u, factor c_u / m_u on S_u
        rows = self._unit_sizes(sq.shape[0]).to(sq)
        clip = mean_clip_factors(sq.sqrt(), rows, self.max_grad_norm)
        if keep is not None:
            clip = clip * keep
        for p in self.params:
            records = self._record_store.take(p)
            if records:
                grad, start = None, 0
                for r in records:
                    rows = slice(start, start + r.batch_size)
                    kept = None if keep is None else keep[rows]
                    part = r.clipped(clip[rows], kept).to(wide_dtype(p.dtype)).view_as(p)
                    grad = part if grad is None else grad + part
                    start += r.batch_size
            else:
                grad = clipped_grad_sample(self._exact_grad_sample(p).to(wide_dtype(p.dtype)), clip, keep)
                _mark_as_processed(p.grad_sample)
            set_summed(p, grad if p.summed_grad is None else p.summed_grad + grad)

    def _finite_examples(self, sq: torch.Tensor) -> Optional[torch.Tensor]:
        """Under ``nonfinite="raise"``: None, and the norms join the step's non-finite check.
        Under ``"skip"``: the mask of examples to keep (the others contribute nothing and are
        counted in :attr:`skipped_examples`). No host synchronisation either way."""
        if self.nonfinite != SKIP:
            self.note_finite("per-sample gradient norm", sq)
            return None
        finite = sq.isfinite()
        self.note_skipped(~finite)
        return finite

    def zero_grad(self, set_to_none: bool = False) -> None:
        super().zero_grad(set_to_none)
        module = self.bound_module()
        if module is not None:
            module.records.clear()


class RandomizedClippingBookkeepingOptimizer(
    BookkeepingClippingMixin, SketchedClippingMixin, DPOptimizer
):
    """:class:`~opacus.optimizers.DPOptimizer` with randomized clipping by book-keeping
    (one backward pass; ``grad_sample_mode="hooks"``)."""


class DistributedRandomizedClippingBookkeepingOptimizer(
    SumsAllReducedInFloat32, BookkeepingClippingMixin, SketchedClippingMixin, DistributedDPOptimizer
):
    """Distributed (DDP) book-keeping: each rank clips its own examples, rank 0 alone adds
    the noise, and the clipped sums are all-reduced (Opacus's ``DistributedDPOptimizer``)."""

    refusals_across_ranks = True


# --- The criterion of ghost-clipping scripts ----------------------------------------------

class DPLossBookkeeping(DPLossRandomizedClipping):
    """The criterion of a ghost script under book-keeping or the per-example form: the ghost
    criterion's call (``criterion(logits, targets, shape=...)``) and per-sample losses, reduced
    (``loss_reduction``) to an ordinary tensor whose ``backward()`` is the one pass needed."""

    def __call__(self, *args: Any, shape=None, **kwargs: Any) -> torch.Tensor:
        per_sample = super().__call__(*args, shape=shape, **kwargs).loss_per_sample
        return reduced_for_backward(per_sample, self.loss_reduction, self.module.loss_reduction)


def bookkeeping_criterion(module: Any, optimizer: Any, arguments: Mapping[str, Any]) -> DPLossBookkeeping:
    """The ghost script's criterion for ``make_private``'s ``arguments`` (``criterion``, default
    ``nn.CrossEntropyLoss()`` as Opacus's, and ``loss_reduction``)."""
    criterion = arguments["criterion"] if arguments["criterion"] is not None else nn.CrossEntropyLoss()
    return DPLossBookkeeping(module, optimizer, criterion, arguments["loss_reduction"])
