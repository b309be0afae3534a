"""One example per backward pass: exact flat clipping at the cost of non-private training.

When a backward pass holds one example, its gradient *is* that example's per-sample
gradient: one norm over ``p.grad`` of every trainable parameter (any layer type)::

    g_i = grad of loss(x_i),   c_i = min(1, C / (||g_i|| + 1e-6)),   S += c_i g_i  (float32)

and at the logical step Opacus's ``(S + N(0, sigma^2 C^2)) / B``; the ``rc_prv`` accountant
charges it as exact clipping (Opacus's ``prv``). :class:`PerExampleHooks` (wrapping form:
:class:`PerExampleModule`) enforces the premise (docs/forms.md, "What it enforces"): each
outermost forward takes one example (else ``ValueError`` at the forward), each backward pass
holds at most one example's forwards since the last clip and reaches no earlier one, and no
forward's graph reaches a tensor an earlier forward created (:func:`earlier_graph_reached`);
else the step is refused. The clip runs when the backward pass ends, from a callback queued
by the gradient of the forward's output.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from opacus.grad_sample.gsm_base import AbstractGradSampleHooks, AbstractGradSampleModule
from opacus.optimizers import DistributedDPOptimizerFastGradientClipping, DPOptimizerFastGradientClipping
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._pytree import tree_leaves

from ..clip_guard import PerExampleGuard
from ..draws import EVALUATION_HINT, BatchReader
from ..estimators import at_least_float32
from ..optimizer import RandomizedClippingMixin, SumsAllReducedInFloat32
from ..per_parameter import set_summed
from ..recompute import forward_replay
from ..values import SKIP
from .fsdp import _contains_fsdp

#: Opacus's guard against a zero norm in the clip factor
_EPS = 1e-6
#: the sequence number of the autograd nodes that accumulate into a leaf (AccumulateGrad)
_LEAF_SEQUENCE_NR = 2**64 - 1


def earlier_graph_reached(output: Any, since: int, tracked_from: int) -> bool:
    """Whether the autograd graph of ``output`` reaches a node created before ``since`` (the
    end of the previous outermost forward) and not before ``tracked_from`` (the start of the
    first one), by autograd's sequence numbers (increasing per node a thread creates; a node's
    inputs are older): a node of an earlier forward, whose example's gradient this backward
    would carry again. The walk descends only through the nodes created since ``since``."""
    stack = [leaf.grad_fn for leaf in tree_leaves(output) if isinstance(leaf, torch.Tensor)]
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        number = node._sequence_nr()
        if number == _LEAF_SEQUENCE_NR or number < tracked_from:
            continue  # a parameter's accumulator, or built before training (a weight transform)
        if number < since:
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def state_holding_graphs(model: nn.Module, tracked_from: int) -> List[str]:
    """The module attributes (``"module.attribute"``; lists, tuples and dicts searched) holding
    a tensor of a graph built since ``tracked_from`` (:func:`earlier_graph_reached`): the names
    a refusal gives."""
    names = []
    for prefix, module in model.named_modules():
        for key, value in vars(module).items():
            if key.startswith("_"):  # nn.Module's own bookkeeping (parameters, buffers, hooks)
                continue
            grad_fns = (getattr(leaf, "grad_fn", None) for leaf in tree_leaves(value))
            if any(f is not None and f._sequence_nr() >= tracked_from for f in grad_fns):
                names.append(f"{prefix}.{key}" if prefix else key)
    return names


def examples_in(args: Any, kwargs: Dict[str, Any], batch_first: bool) -> Optional[int]:
    """The batch size of a forward call: the largest batch dimension among its first tensor
    argument (positional first, then keyword) and its tensors of two or more dimensions
    (ids, masks, positions, embeddings: a 1-D ``cache_position`` is not batched); None
    when no argument is a tensor with a batch dimension."""
    dim = 0 if batch_first else 1
    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.dim() > dim]
    if not tensors:
        return None
    return max(int(t.shape[dim]) for t in tensors if t is tensors[0] or t.dim() >= 2)


def batch_error(n: Optional[int]) -> ValueError:
    got = "no tensor argument to read it from" if n is None else f"a batch of {n}"
    return ValueError(
        f"the per-example form clips one example per backward pass; the model's forward got {got}. "
        "Iterate the data loader make_private returned (it yields one example per physical "
        "batch), BatchMemoryManager(max_physical_batch_size=1), or DPTrainer; or choose another "
        f"form: make_private(..., per_example_backward=False). {EVALUATION_HINT}"
    )


class PerExampleClipping(BatchReader):
    """The per-example form's clipping, attached to the model ``m`` (Opacus's hooks-object
    interface: ``forbid_grad_accumulation``, ``remove_hooks``, ``cleanup``).

    Args:
        max_grad_norm: the clipping bound C.
        batch_first: the batch dimension of the forward's tensors (Opacus's meaning).
    """

    def __init__(self, m: nn.Module, *, batch_first: bool = True, loss_reduction: str = "mean",
                 max_grad_norm: float, **_sketch: Any) -> None:
        super().__init__(m, batch_first=batch_first, loss_reduction=loss_reduction)
        self._setup_clipping(max_grad_norm)

    def _setup_clipping(self, max_grad_norm: float) -> None:
        check_supported(self._module)
        self.max_grad_norm = float(max_grad_norm)
        self.hooks_enabled = True
        self._params = [p for p in self._module.parameters() if p.requires_grad]  # each once
        self._examples = 0  # examples of the outermost forwards since the last clip (0 or 1 each)
        self._forward_ids: List[int] = []  # their sequence numbers
        self._reached: set = set()  # forwards whose output this backward pass reached
        self._next_id = 0
        self._depth: List[bool] = []  # per open forward call: whether it is an outermost one
        # autograd sequence numbers: at the start of the first outermost forward, at the end
        # of the last one (see earlier_graph_reached)
        self._tracked_from: Optional[int] = None
        self._last_forward_end: Optional[int] = None
        self._queued = False
        self._refusal: Optional[str] = None
        self._grouped: Optional[bool] = None  # inside one_physical_batch(): whether a backward ran
        self._optimizer: Optional[Any] = None
        #: the running gradient of the unit whose rows are passing (one gradient-sized buffer) and its draw
        self._user_sum: Optional[Dict[int, Tuple[nn.Parameter, torch.Tensor]]] = None
        self._user_draw: Any = None
        self._handles = []
        for module in self._module.modules():
            self._handles.append(module.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_forward, always_call=True))
        self._handles.extend(self.watch_batches(self._module))

    # --- Opacus's hooks-object interface --------------------------------------------------

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def follow_steps(self, optimizer: Any) -> None:
        """Clip for ``optimizer`` (``make_private`` links them; objects built by hand call it)."""
        self._optimizer = weakref.ref(optimizer)
        optimizer.bind_module(self)

    def forget_per_example_values(self) -> None:
        """Drop what a refused step left (forward counts; called at every ``step()``, so a user's
        running sum, spanning the skipped steps of one draw, is kept: :meth:`_refuse` drops it)."""
        self._examples = 0
        self._forward_ids.clear()
        self._reached.clear()

    # --- what the optimizer reads -----------------------------------------------------------

    def take_refusal(self) -> Optional[str]:
        """Why the clipped sums cannot be released (None: they can); reported once."""
        refusal, self._refusal = self._refusal, None
        return refusal

    @contextlib.contextmanager
    def one_physical_batch(self) -> Iterator[None]:
        """The backward passes inside (DPTrainer's rows of one physical batch) count as one micro-batch."""
        self._grouped = False
        try:
            yield
        finally:
            ran, self._grouped = self._grouped, None
            optimizer = self._bound_optimizer()
            if ran and optimizer is not None:
                optimizer.count_backward_pass()

    def take_batch(self, batch: Any) -> None:
        """One forward per batch of a plugin loader (a second would clip its example twice)."""
        if not batch.draw.signalled and any(b is batch for b in self._step_batches):
            self.refuse_step(ValueError(
                "the per-example form clips one example per backward pass: a batch of the loader "
                f"make_private returned went through a second forward pass; one forward per batch. {EVALUATION_HINT}"
            ))
        super().take_batch(batch)

    @property
    def user_pending(self) -> bool:
        """A user's rows have started and not ended: the step must not release yet."""
        return self._user_sum is not None

    def _add_to_user(self, grads: List[Tuple[nn.Parameter, torch.Tensor]]) -> Optional[List[Tuple[nn.Parameter, torch.Tensor]]]:
        """Add one row's gradient to its user's running sum; at the user's last row, the
        user's mean ``(1/m_u) sum_r g_r`` (the unit that is clipped), else None."""
        units = self.batch.units_of(1)
        if units.single_rows:  # an example: the unit is the row
            return grads
        if self._user_draw is not self.batch.draw:  # a unit's rows never span two draws
            self._user_sum, self._user_draw = None, self.batch.draw
        total = self._user_sum if self._user_sum is not None else {}
        for p, g in grads:
            if id(p) in total:
                total[id(p)][1].add_(g)
            else:  # the first row's buffer, in float32 or wider: a half-precision sum would round each row
                total[id(p)] = (p, at_least_float32(g))
        if not bool(units.last[0]):
            self._user_sum = total
            return None
        self._user_sum = None
        size = float(units.sizes[0])
        return [(p, g.div_(size)) for p, g in total.values()]

    # --- the forward passes ------------------------------------------------------------------

    def _pre_forward(self, module: nn.Module, args: Any, kwargs: Dict[str, Any]) -> None:
        if self._depth or not self.hooks_enabled or not torch.is_grad_enabled() or forward_replay() is not None:
            self._depth.append(False)  # inside a counted forward, untracked, or a replay
            return
        try:
            n = examples_in(args, kwargs, self.batch_first)
            if n is None or n > 1:
                raise batch_error(n)
        except ValueError:
            self._depth.append(False)
            raise
        self._release_zeroed_grads()
        if self._tracked_from is None:
            self._tracked_from = self._last_forward_end = torch.autograd._get_sequence_nr()
        self._depth.append(True)
        self._examples += n
        self._forward_ids.append(self._next_id)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        outermost = self._depth.pop() if self._depth else False
        if not outermost:
            return
        forward_id, self._next_id = self._next_id, self._next_id + 1
        self._check_state_across_forwards(output)
        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(self._output_gradient_hook(forward_id))

    def _check_state_across_forwards(self, output: Any) -> None:
        """Refuse the step when this forward's graph reaches an earlier forward's
        (:func:`earlier_graph_reached`), naming the module attributes that hold one."""
        since, tracked_from = self._last_forward_end, self._tracked_from
        self._last_forward_end = torch.autograd._get_sequence_nr()
        if not earlier_graph_reached(output, since, tracked_from):
            return
        held = state_holding_graphs(self._module, tracked_from)
        where = (
            "the model keeps attribute " + ", ".join(repr(name) for name in held) + ", which holds"
            if held else "a tensor kept by the model (in a closure or a global) holds"
        )
        self._refuse(
            f"a forward pass reached the graph of an earlier forward pass: {where} a tensor of "
            "a forward pass's graph across forward passes, so this example's backward pass would carry an earlier example's "
            "gradient again, beyond its clip. Detach state kept across forward passes "
            "(e.g. self.prev = h.detach())"
        )

    def _output_gradient_hook(self, forward_id: int):
        def hook(_grad: torch.Tensor) -> None:
            self._reached.add(forward_id)
            if not self._queued:  # the backward pass that reached the model's output
                self._queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._clip)

        return hook

    def _release_zeroed_grads(self) -> None:
        """Gradients left in ``p.grad`` since the last clip: the zeros of ``zero_grad``
        (dropped) or a gradient that did not come through a clip (refused at the step)."""
        optimizer = self._bound_optimizer()
        for p in self._params:
            if p.grad is None:
                continue
            if optimizer is None or not optimizer.clip_guard.accepts(p):  # only zero_grad marks here
                shape = f"a parameter of shape {tuple(p.shape)}"
                where = shape if optimizer is None else optimizer.describe_parameter(p)
                self._refuse(f"a gradient of {where} was added outside a clipped backward pass")
            p.grad = None

    # --- the clip, when a backward pass ends -------------------------------------------------

    def _clip(self) -> None:
        """``S += min(1, C / (||g|| + 1e-6)) g`` for the gradient ``g`` of the one example
        of the backward pass that just ended (every trainable parameter's ``p.grad``)."""
        self._queued = False
        grads = [(p, p.grad) for p in self._params if p.grad is not None]
        for p, _ in grads:
            p.grad = None
        examples, ids, reached = self._examples, self._forward_ids, self._reached
        self._examples = 0
        self._forward_ids, self._reached = [], set()
        optimizer = self._bound_optimizer()
        if optimizer is None:
            return self._refuse("no optimizer follows this module (call module.follow_steps(optimizer))")
        if examples > 1 or not reached <= set(ids):
            return self._refuse(
                f"a backward pass held {examples} examples' forward passes since the last clip"
                + ("" if reached <= set(ids) else ", and reached the graph of an earlier, clipped one")
                + f": each backward pass must hold one example. {self.no_backward_cause(likely=False)}".rstrip()
            )
        if self._grouped is not None:
            self._grouped = True
        else:
            optimizer.count_backward_pass()
        if examples == 0 or not grads:  # an empty batch: a zero contribution
            return
        grads = self._add_to_user(grads)  # the clipped unit: the mean of its rows (an example: itself)
        if grads is None:
            return  # the unit's rows continue
        norm = torch.linalg.vector_norm(
            torch.stack(torch._foreach_norm([g for _, g in grads], dtype=torch.float32))
        )
        factor = (self.max_grad_norm / (norm + _EPS)).clamp(max=1.0)
        if optimizer.nonfinite == SKIP:
            finite = torch.isfinite(norm)
            factor = torch.where(finite, factor, torch.zeros_like(factor))
            optimizer.note_skipped(~finite)
            for _, g in grads:
                torch.nan_to_num_(g, nan=0.0, posinf=0.0, neginf=0.0)
        else:
            optimizer.note_finite("per-sample gradient norm", norm)
        optimizer.add_clipped(grads, factor)

    def _refuse(self, why: str) -> None:
        self._refusal = self._refusal or why
        self._user_sum = None
        self.forget_per_example_values()

    def _bound_optimizer(self) -> Optional[Any]:
        return None if self._optimizer is None else self._optimizer()


def check_supported(module: nn.Module) -> None:
    """Refuse models the per-example form cannot clip exactly: torch's DDP and FSDP2."""
    if isinstance(module, DDP):
        raise ValueError(
            "the per-example form needs Opacus's DifferentiallyPrivateDistributedDataParallel, "
            "not torch's DistributedDataParallel: DDP's backward pass averages one rank's example "
            "with the other ranks' before it is clipped"
        )
    if _contains_fsdp(module):
        raise ValueError(
            "the per-example form does not support FSDP2: a sharded gradient's exact norm needs "
            "every rank's shard before the clip; use grad_sample_mode='ghost_fsdp' with "
            "per_example_backward=False"
        )


class PerExampleHooks(PerExampleClipping, AbstractGradSampleHooks):
    """Hooks (``wrap_model=False``) form of the per-example form."""


class PerExampleModule(PerExampleClipping, AbstractGradSampleModule):
    """Wrapping (``wrap_model=True``) form of the per-example form."""


class PerExampleOptimizerMixin(RandomizedClippingMixin):
    """Releases the per-example form's clipped sums: Opacus's noise and averaging on
    ``S`` (no sketch: ``sketch_config`` None, the accountant charges exact clipping)."""

    def __init__(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        kwargs.pop("sketch_config", None)  # the engine's, for every form: exact norms here
        super().__init__(optimizer, **kwargs)

    #: the step refuses what the module recorded and a gradient no clip consumed
    clip_guard_class = PerExampleGuard

    def complete_batch(self, rows: int) -> List[torch.nn.Parameter]:
        """Nothing to complete: each row's whole gradient was clipped."""
        return []

    def add_clipped(self, grads: List[Any], factor: torch.Tensor) -> None:
        """``p.summed_grad += factor * g`` (float32) for each ``(p, g)`` of one example's gradient
        (the first example's buffer becomes the running sum, in place), claimed by its draw."""
        module = self.bound_module()
        if module._step_batches == [module.batch]:  # (several: the step refuses them)
            self.claim_batches([module.batch])
        for p, g in grads:
            if p.summed_grad is None:
                set_summed(p, (g if g.dtype == torch.float32 else g.float()).mul_(factor))
            else:
                p.summed_grad.addcmul_(g, factor)

    def accumulate(self) -> None:
        """The running sums are ``p.summed_grad`` already; zeros where no example reached."""
        for p in self.params:
            p.grad = None  # zero_grad's zeros, if any
            if p.summed_grad is None:
                set_summed(p, torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32)))

    def add_noise(self) -> None:
        """Opacus's noise on the float32 sum; ``p.grad`` in the parameter's dtype. At user
        level, refused while a user's rows are still passing (the sum holds none of them)."""
        module = self.bound_module()
        if module is not None and module.user_pending:
            self.drop_step()
            raise ValueError(
                "privacy_unit='user': the step came before the last of a user's rows in the draw; each "
                "physical batch of the loader make_private returned must be followed by one step()"
            )
        super().add_noise()
        for p in self.params:
            if p.grad is not None and p.grad.dtype != p.dtype:
                p.grad = p.grad.to(p.dtype)


class PerExampleOptimizer(PerExampleOptimizerMixin, DPOptimizerFastGradientClipping):
    """The per-example form's DP optimizer (one process)."""


class DistributedPerExampleOptimizer(
    SumsAllReducedInFloat32, PerExampleOptimizerMixin, DistributedDPOptimizerFastGradientClipping
):
    """DDP (Opacus's DPDDP): each rank clips its own examples; the clipped sums are
    all-reduced once per logical step, after rank 0 alone added the noise (Opacus)."""

    refusals_across_ranks = True


__all__ = [
    "PerExampleHooks", "PerExampleModule", "PerExampleOptimizer",
    "DistributedPerExampleOptimizer", "check_supported", "examples_in",
]
