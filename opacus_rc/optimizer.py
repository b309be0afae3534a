"""Optimizers for randomized clipping.

They behave exactly like Opacus's fast-gradient-clipping optimizers (the gradients they
see are already clipped by the second backward pass; they add N(0, sigma^2 C^2) noise
and average) and additionally carry the :class:`~opacus_rc.config.SketchConfig`, which
the ``rc_prv`` accountant reads in its step hook.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch

from opacus.optimizers import DistributedDPOptimizerFastGradientClipping, DPOptimizerFastGradientClipping
from opacus.optimizers.optimizer import (
    _check_processed_flag,
    _generate_noise,
    _mark_as_processed,
)
from torch.optim import Optimizer

from .config import SketchConfig
from .finite import FORWARD_CHANGE, OUTSIDE_USE, NonFiniteGuard, failed_kinds
from .forward_changes import ForwardChanges, watched_model
from .sketch import NOISE_STREAM, DeviceStreams, check_seed
from .values import RAISE


_LEGACY_STATE_KEY = "opacus_rc"  # generator states stored by versions up to 0.1.0
#: key of ``optimizer.state_dict()`` saying the run drew its noise from ``seed=``
SEEDED_STATE_KEY = "opacus_rc_seeded"
logger = logging.getLogger(__name__)


def _grad_mark(grad: torch.Tensor) -> Any:
    """What identifies a gradient tensor as it is now: the object and its version
    counters (a DTensor's and its local shard's; autograd bumps them on every in-place
    accumulation)."""
    local = getattr(grad, "_local_tensor", grad)
    return weakref.ref(grad), grad._version, local._version


def _marked(mark: Any, grad: torch.Tensor) -> bool:
    """``grad`` is the tensor ``mark`` was taken of, unmodified since."""
    return mark is not None and mark[0]() is grad and mark[1:] == _grad_mark(grad)[1:]


def torch_ddp_cause(optimizer: Any) -> Optional[str]:
    """Why a gradient can miss the clip when a single-process ``optimizer`` steps inside a
    process group of several ranks: torch's ``DistributedDataParallel`` applied to the model
    after ``make_private`` (its backward pass all-reduces the gradients, outside the clip).
    None when no such group runs or the optimizer is a distributed one."""
    from opacus.optimizers import (
        DistributedDPOptimizer,
        DistributedDPOptimizerFastGradientClipping,
        FSDPOptimizerFastGradientClipping,
    )

    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    distributed = (DistributedDPOptimizer, DistributedDPOptimizerFastGradientClipping, FSDPOptimizerFastGradientClipping)
    if isinstance(optimizer, distributed):
        return None
    return (
        f"this optimizer is a single-process one but {dist.get_world_size()} ranks run: torch's "
        "DistributedDataParallel wrapping the model after make_private all-reduces the gradients "
        "in its backward pass, outside the clip. Wrap the model in Opacus's DPDDP before "
        "make_private instead (from opacus.distributed import "
        "DifferentiallyPrivateDistributedDataParallel as DPDDP; model = DPDDP(model); "
        "engine.make_private(module=model, ...)), and do not wrap what it returns"
    )


def unclipped_gradient_error(
    what: str, clipped_pass_ran: bool, output_passes: bool, ddp_cause: Optional[str] = None
) -> ValueError:
    """The refusal of a step whose gradient did not (all) come through the clipped pass
    (``ddp_cause``: :func:`torch_ddp_cause`, named first when it applies)."""
    if ddp_cause is not None:
        cause = ddp_cause
    elif output_passes:
        cause = (
            "the loss was not computed from the model's output that the privacy engine clips "
            "at, or read a trainable weight outside its module's forward (e.g. a fused LM head: "
            "F.linear(hidden, model.lm_head.weight)): compute the loss from the model's output "
            "(its logits), or freeze that parameter"
        )
    elif not clipped_pass_ran:
        cause = (
            "no clipped pass ran: with grad_sample_mode='ghost' (two passes) the loss must come "
            "from the criterion returned by make_private (model, optimizer, criterion, "
            "data_loader = engine.make_private(...); loss = criterion(output, target); "
            "loss.backward()), not from a plain loss.backward()"
        )
    else:
        cause = (
            "a gradient was added outside the clipped pass: a backward on a loss that is not the "
            "criterion returned by make_private (loss = criterion(output, target)), or a trainable "
            "weight read outside its module's forward (e.g. F.linear(hidden, model.lm_head.weight))"
        )
    return ValueError(
        f"optimizer.step() refused: {what} did not come through the clipped pass of this step "
        f"({cause}). Nothing was released or charged; call optimizer.zero_grad() before the "
        "next step"
    )


def complete_unused(
    params: List[torch.nn.Parameter], rows: int, has_values: Callable, zero: Callable
) -> List[torch.nn.Parameter]:
    """After a batch of ``rows`` examples, a parameter without per-example values
    (``has_values(p)`` False) gets exact zeros (``zero(p)``) when the batch did not use it
    (or was empty); returned instead when it has a gradient (no hook saw it: used outside its
    module), for the caller to refuse."""
    unseen = []
    for p in params:
        if has_values(p):
            continue
        if p.grad is not None and rows:
            unseen.append(p)
        else:
            zero(p)
    return unseen


#: Relative tolerance of the norm pass's in-module gradient check, by the dtype of the output
#: gradients it came from: float32 summation-order differences over up to ~10^6 terms
#: (B x T) stay below 1e-4 of the scale; half-precision output gradients are rounded once
#: more by autograd's own layer backward.
IN_MODULE_RTOL = {torch.float64: 1e-4, torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def in_module_excess(
    grad: Optional[torch.Tensor], expected: torch.Tensor, dtype: torch.dtype, per_example: Optional[torch.Tensor]
) -> torch.Tensor:
    """Whether autograd's gradient ``grad`` of a parameter (after the norm pass) differs from
    ``expected``, the batch sum of its in-module gradients (float32), by more than float
    rounding: ``||grad - expected|| > rtol S`` (:data:`IN_MODULE_RTOL`), with the scale
    ``S = ||expected|| + ||grad|| + sum_i ||g_i||`` (``per_example``: the examples' norms
    ``||g_i||`` in ``p.grad``'s units; the batch sum can cancel far below them while the
    rounding of its terms does not), as a 0-dim bool tensor on the device (no host
    synchronisation)."""
    got = torch.zeros_like(expected) if grad is None else grad.detach().float().view_as(expected)
    rtol = IN_MODULE_RTOL.get(dtype, 2e-2)
    scale = expected.norm() + got.norm()
    if per_example is not None:
        scale = scale + per_example.detach().float().sum().to(scale.device)
    return (got - expected).norm() > rtol * scale


class RandomizedClippingMixin:
    """The optimizer side of every clipping form of the plugin (``clipping="randomized"``):
    its steps and noise (the plugin's noise stream, micro-batch counting, the step's
    refusals). What the engine, the private Trainer and the accountant read of a form's
    optimizer is declared here (the form's row, :func:`opacus_rc.forms.form_of`, holds the
    rest): the traits :attr:`refusals_across_ranks`, :attr:`sketch_config` and the methods
    :meth:`count_backward_pass`, :meth:`check_cleared`, :meth:`note_finite`,
    :meth:`complete_batch`, :meth:`check_refused_steps`. The sketched forms add their
    sketch (:class:`SketchedClippingMixin`).

    Args:
        optimizer: wrapped optimizer.
        noise_seed: root of the plugin's noise stream (``None``: 128 bits from
            ``os.urandom``); used when no ``generator`` is given. Never torch's global
            generator: a script that re-seeds torch and resumes draws fresh noise.
        **kwargs: Opacus's optimizer arguments (noise_multiplier, max_grad_norm,
            expected_batch_size, loss_reduction, generator, secure_mode).
    """

    #: how the step's per-example norms were estimated: None for exact norms (the ``rc_prv``
    #: accountant charges such steps as Opacus's ``prv``); the sketched forms' sketch
    sketch_config: Optional[SketchConfig] = None
    #: a distributed form: the ranks agree on each refusal (every rank refuses together)
    refusals_across_ranks: bool = False

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        noise_seed: Optional[int] = None,
        nonfinite: str = RAISE,
        accept_replayed_noise: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(optimizer, **kwargs)
        self.seeded = noise_seed is not None  # the noise stream replays from its seed
        self.accept_replayed_noise = accept_replayed_noise
        #: set while PrivacyEngine.load_checkpoint runs: a seeded state is checked after it
        #: (a checkpoint with the generators' states continues the streams: no replay)
        self.deferred_seeded_resume: Optional[bool] = None
        check_seed("noise_seed", noise_seed)
        if noise_seed is not None and self.secure_mode:
            raise ValueError(
                "noise_seed must be None when secure_mode=True: secure noise comes from os.urandom"
            )
        #: the plugin's own noise stream (per device, rank folded in): see noise_generator()
        self.noise_streams = DeviceStreams(
            np.random.SeedSequence(noise_seed), NOISE_STREAM, per_rank=True
        )
        #: "raise" (default) or "skip" (book-keeping only): see ``make_private(nonfinite=)``
        self.nonfinite = nonfinite
        self._skipped = None  # device count of examples dropped under nonfinite="skip"
        self._nonfinite_guard = NonFiniteGuard()
        self.backward_passes = 0  # backward passes accumulated since the last real step
        self._draw_splits = 0  # of them, continuations of one Poisson draw (BatchMemoryManager)
        self._physical_batches: Optional[int] = None  # delivered since the last step(): see DrawLoader
        self._draw_refused = False  # a step was refused off a draw boundary: every later one is
        self._awaiting_zero_grad = False  # a real step was taken and zero_grad() not called
        self._holders: "weakref.WeakSet[Any]" = weakref.WeakSet()  # of per-example norms
        self._clipped_marks: Dict[int, Any] = {}  # per parameter: its gradient as a clipped pass left it
        self._grad_sample_module: Optional[Callable[[], Any]] = None  # weak: see bind_module()
        self._parameter_names: Dict[int, str] = {}
        self._norm_pass_module: Any = None  # set by the criterion's backward during its norm pass
        self._outside_flags: List[Any] = []  # (parameters, device flags) of the step's norm passes
        self._elsewhere_cache: Any = None  # (module, ids): see _used_elsewhere()
        self._forward_changes: Optional[ForwardChanges] = None  # see bind_module()
        self._forward_changed: List[str] = []  # what it saw, when the ranks decide together

    @property
    def accumulated_iterations(self) -> int:
        """Independent Poisson micro-batches accumulated into this step (at least 1).

        Every backward pass since the last real step counts, whatever API accumulated it
        (several ``loss.backward()`` per ``step()``, or Opacus's virtual steps through
        ``signal_skip_step``), except the physical batches that Opacus's
        BatchMemoryManager cut from one Poisson draw: ``m = passes - splits``. Averaging
        divides by ``expected_batch_size * m``; the ``rc_prv`` accountant records ``m``
        as the step's micro-batch multiplicity (an example is in ``Bin(m, q)`` of them).
        """
        return max(1, self.backward_passes - self._draw_splits)

    def count_backward_pass(self, passes: int = 1) -> None:
        """A form's clipped backward pass (``passes`` of them) joined the next step's sum:
        one micro-batch each for :attr:`accumulated_iterations`."""
        self.backward_passes += passes

    def signal_skip_step(self, do_skip: bool = True, same_draw: bool = False) -> None:
        """Opacus's virtual step: the next ``step()`` only clips and accumulates.

        ``same_draw=True`` declares that the next physical batch continues the same
        Poisson draw as this one (each example at most once in the logical batch), so the
        two are charged as one micro-batch; Opacus's BatchMemoryManager declares it
        (``import opacus_rc`` makes its ``BatchSplittingSampler`` signal
        ``same_draw=True``: :data:`opacus_rc.registration.PATCHES`). Any other skipped step accumulates an independent micro-batch and
        is charged as accumulation (:attr:`accumulated_iterations`).
        """
        if do_skip and same_draw:
            self._draw_splits += 1
        super().signal_skip_step(do_skip)

    # --- the draw boundaries of a loader that splits draws (opacus_rc.draws) ---------------

    def start_physical_batches(self) -> None:
        """A :class:`~opacus_rc.draws.DrawLoader` starts delivering physical batches: from
        now on every ``step()`` must follow exactly one of them."""
        if self._physical_batches is None:
            self._physical_batches = 0

    def note_physical_batch(self) -> None:
        """The loader delivered one physical batch to the script."""
        self._physical_batches = (self._physical_batches or 0) + 1

    def end_physical_batches(self) -> None:
        """The loader's iteration ended: with every batch stepped, steps are free again."""
        if self._physical_batches == 0:
            self._physical_batches = None

    def check_draw_boundary(self) -> None:
        """Refuse (ValueError) a ``step()`` that does not follow exactly one physical batch
        of a loader that splits Poisson draws (see :mod:`opacus_rc.draws`): the skip
        signals it queued would be popped out of step with the batches trained on, and a
        release would hold part of a draw, or two draws charged as one. Everything
        accumulated is dropped, and every later step is refused."""
        batches = self._physical_batches
        if not self._draw_refused and (batches is None or batches == 1):
            if batches is not None:
                self._physical_batches = 0
            return
        from .draws import accumulation_error

        self._draw_refused = True
        self._step_skip_queue.clear()
        self.backward_passes = self._draw_splits = 0
        for p in self.params:
            p.summed_grad = None
        self._forget_per_example_values()
        raise accumulation_error(batches or 0)

    @property
    def skipped_examples(self) -> int:
        """Examples dropped for a non-finite norm under ``nonfinite="skip"`` (local to this
        process: never saved). A data-dependent count, **not private**: for debugging on
        the training machine only; do not log or publish it. Reading it waits for the
        device."""
        return 0 if self._skipped is None else int(self._skipped)

    def note_finite(self, kind: str, *tensors: Optional[torch.Tensor]) -> None:
        """Check that every entry of ``tensors`` is finite before this step's update (on
        the device, decided once per step; see :mod:`opacus_rc.finite`). ``kind``: one of
        ``"per-sample loss"``, ``"per-sample gradient norm"``, ``"clipped gradient"``."""
        self._nonfinite_guard.note(kind, tensors)

    def pre_step(self, closure: Optional[Callable[[], float]] = None) -> Optional[bool]:
        """Opacus's pre-step (accumulate, noise, average, accountant hook) with the
        step's non-finite refusal decided before noise is drawn (see
        :meth:`_check_skip_next_step`). A refusal decided on the device for an earlier
        step is raised first."""
        self._raise_deferred_refusal(wait=False)
        self.check_cleared()
        self._check_forward_changes()
        self.check_draw_boundary()
        self.check_clipped_passes()
        taken = super().pre_step(closure)
        if taken:
            self.backward_passes = self._draw_splits = 0
            self._awaiting_zero_grad = True
        return taken

    def check_cleared(self) -> None:
        """Opacus's refusal of a loop without ``optimizer.zero_grad()`` between steps
        (its ``_processed`` flag does not survive book-keeping's assembled sums): the
        next backward would add raw, unclipped gradients into the noised sum."""
        if self._awaiting_zero_grad:
            raise ValueError(
                "Gradients haven't been cleared since the last optimizer step. In order to "
                "obtain privacy guarantees you must call optimizer.zero_grad() on each step "
                "(the DP optimizer's: model.zero_grad() does not clear what it accumulated)"
            )

    def zero_grad(self, set_to_none: bool = False) -> None:
        module = self._norm_pass_module
        if module is not None:  # Opacus's zero_grad between the two passes: the norm pass is over
            self._check_norm_pass(module)
        super().zero_grad(set_to_none)
        self._awaiting_zero_grad = False
        self.mark_clipped()  # zeroed in place (or None): a zero contribution

    # --- every gradient through a clipped pass --------------------------------------------

    def bind_module(self, module: Any) -> None:
        """The grad-sample module whose passes this optimizer steps (``follow_steps`` calls
        this): its per-example norms are checked and forgotten with each step, and
        refusals name its parameters."""
        self._grad_sample_module = weakref.ref(module)
        inner = getattr(module, "_module", module)
        self._parameter_names = {id(p): name for name, p in inner.named_parameters()}
        self._watch_forward_changes(module)

    def _watch_forward_changes(self, module: Any) -> None:
        """Watch the model's parameters and buffers across its forward passes
        (:mod:`opacus_rc.forward_changes`; buffers only under FSDP2, whose forward swaps the
        parameters' shards): the next step refuses a change one of them made."""
        if self._forward_changes is not None:
            self._forward_changes.remove()
        self._forward_changes = ForwardChanges(watched_model(module))

    def _check_forward_changes(self) -> None:
        """Refuse the step (ValueError naming them) when a forward pass of the model changed
        a parameter or buffer since the last step; nothing is released, the step's clipped
        sums are dropped. Distributed: decided with the step's device flags, agreed across
        ranks (:data:`~opacus_rc.finite.FORWARD_CHANGE`; no host synchronisation)."""
        watch = self._forward_changes
        changed = [] if watch is None else watch.take()
        if not changed:
            return
        if self.refusals_across_ranks:
            self._forward_changed = changed
            device = next((p.device for p in self.params), torch.device("cpu"))
            self.note_finite(FORWARD_CHANGE, torch.full((), float("inf"), device=device))
            return
        self._forget_per_example_values()
        for p in self.params:
            p.summed_grad = None
        raise watch.refusal(changed)

    def _bound_module(self) -> Any:
        return None if self._grad_sample_module is None else self._grad_sample_module()

    def describe_parameter(self, p: torch.Tensor) -> str:
        name = self._parameter_names.get(id(p))
        return f"parameter {name!r}" if name is not None else f"a trainable parameter of shape {tuple(p.shape)}"

    def mark_clipped(self) -> None:
        """Called by the plugin's clipped pass when it has left in ``p.grad`` exactly the
        step's clipped sum so far (and by ``zero_grad``): :meth:`check_clipped_passes`
        accepts these tensors, unmodified, and nothing else."""
        for p in self.params:
            if p.grad is not None:
                self._clipped_marks[id(p)] = _grad_mark(p.grad)

    def is_marked_clipped(self, p: torch.Tensor) -> bool:
        """``p.grad`` is what the last clipped pass (or ``zero_grad``) left, unmodified."""
        return p.grad is not None and _marked(self._clipped_marks.get(id(p)), p.grad)

    def zero_contribution(self, p: torch.Tensor) -> None:
        """``p``'s contribution is exact zeros (a parameter the batch did not use, an
        empty batch): ``p.grad`` zeros, accepted as clipped."""
        p.grad = torch.zeros_like(p)
        self._clipped_marks[id(p)] = _grad_mark(p.grad)

    def complete_batch(self, rows: int) -> List[torch.nn.Parameter]:
        """For a loop that runs its own backward passes (the private Trainer): after a
        physical batch of ``rows`` examples, a parameter the batch did not use contributes
        exact zeros; returns the parameters whose gradient no per-example hook saw (the
        caller refuses them). Two passes: the clipped sum is ``p.grad``, and the step
        refuses a gradient no clipped pass produced (:meth:`check_clipped_passes`)."""
        for p in self.params:
            if p.grad is None and getattr(p, "summed_grad", None) is None:
                self.zero_contribution(p)
        return []

    def check_clipped_passes(self, *, before_pass: bool = False) -> None:
        """Refuse (ValueError) unless every gradient the step would release came through a
        clipped pass of the plugin: each ``p.grad`` is the tensor the last clipped pass (or
        ``zero_grad``) left, unmodified, and no per-example norm waits for its clipped pass
        (a backward pass with the hooks on that was not the criterion's). Run by every
        ``step()`` (before anything is accumulated, noised or charged) and, with
        ``before_pass``, by each clipped pass before it keeps the step's earlier sums. A
        refusal forgets the per-example values of the pass."""
        module = self._bound_module()
        pending = module is not None and bool(getattr(module, "norm_pass_pending", lambda: False)())
        unclipped = [] if before_pass and self.backward_passes == 0 else [
            p for p in self.params if p.grad is not None and not _marked(self._clipped_marks.get(id(p)), p.grad)
        ]
        # a step with no gradient at all and no clipped pass (main: an internal AttributeError)
        nothing = not before_pass and self.backward_passes == 0 and all(p.grad is None for p in self.params)
        if pending or unclipped or nothing:
            self._refuse_unclipped(unclipped, pending or nothing, module)

    def _check_norm_pass(self, module: Any) -> None:
        """After the criterion's norm pass, refuse (before the clipped pass) a parameter whose
        gradient in it did not all come from its modules' forward, which the norms miss
        and the clipped pass would release (e.g. ``loss = criterion(model(x), y) +
        f(F.linear(h, lm_head.weight))``, or ``h @ emb.weight.T`` beside the embedding):

        * the linear layers of ``module`` compute no parameter gradient in it
          (:meth:`~opacus_rc.grad_sample.SketchingMixin._defer_weight_grads`), so a
          gradient of theirs came from a use outside the module's forward;
        * every other parameter whose hooks computed its per-example gradients (an
          embedding, Opacus's grad samplers: LayerNorm, RMSNorm, biases, ...) has the
          batch sum of its in-module gradients noted by them
          (:meth:`~opacus_rc.grad_sample.SketchingMixin.note_in_module_grad`): ``p.grad``
          must equal it, up to float rounding (:func:`in_module_excess`)."""
        patched = getattr(module, "_patched", ())
        elsewhere = self._used_elsewhere(module, patched)
        unclipped = [
            p for m in patched for p in m.parameters(recurse=False)
            if p.requires_grad and id(p) not in elsewhere and p.grad is not None
            and not _marked(self._clipped_marks.get(id(p)), p.grad)
        ]
        if unclipped:
            self._norm_pass_module = None
            self._refuse_unclipped(unclipped, False, module, outside=True)
        checked, excess = [], []
        for p in self.params:
            noted = getattr(p, "_in_module_grad", None)
            p._in_module_grad = None
            if noted is not None:
                checked.append(p)
                norms = getattr(p, "_norm_sample", None)  # the pass's per-example norms
                if norms is not None and getattr(self, "loss_reduction", "mean") == "mean":
                    norms = norms / max(1, norms.shape[0])  # p.grad is of the mean loss
                excess.append(in_module_excess(p.grad, *noted, norms))
        if excess:
            # decided on the device with the step's non-finite checks (no host
            # synchronisation here): refused by step() before anything is released
            excess = torch.stack([e.to(excess[0].device) for e in excess])
            self._outside_flags.append((checked, excess))
            self.note_finite(OUTSIDE_USE, torch.where(excess, float("inf"), 0.0))

    def _used_elsewhere(self, module: Any, patched: Any) -> set:
        """Ids of the parameters also owned by a layer that is not a deferred linear one (a
        weight tied to an embedding legitimately gets its gradient there); the model does
        not change during training: computed once per grad-sample module."""
        cached = self._elsewhere_cache
        if cached is None or cached[0] is not module:
            ids = {id(m) for m in patched}
            inner = getattr(module, "_module", module)
            found = {id(p) for m in inner.modules() if id(m) not in ids for p in m.parameters(recurse=False)}
            cached = self._elsewhere_cache = (module, found)
        return cached[1]

    def _outside_use_error(self) -> ValueError:
        """The refusal of a step one of whose norm passes found a parameter's gradient that
        did not all come from its modules' forward (reads the device flags: a refusal path)."""
        outside = []
        for params, flags in self._outside_flags:
            outside += [p for p, e in zip(params, flags.tolist()) if e and p not in outside]
        self._outside_flags = []
        what = "the gradient of " + (
            ", ".join(self.describe_parameter(p) for p in outside) if outside else "a parameter (on another rank)"
        )
        return ValueError(
            f"optimizer.step() refused: {what} did not come through the clipped pass of this step "
            "(it was used outside its module's forward as well as inside it, e.g. "
            "h @ model.emb.weight.T or F.layer_norm(h, ..., weight=model.norm.weight) beside the "
            "layer itself: the per-example norms miss that use). Use the parameter only through "
            "its module, or freeze it. Nothing was released or charged; call "
            "optimizer.zero_grad() before the next step"
        )

    def _refuse_unclipped(self, unclipped: List[torch.Tensor], pending: bool, module: Any, outside: bool = False) -> None:
        if unclipped:
            what = "the gradient of " + ", ".join(self.describe_parameter(p) for p in unclipped)
        elif pending and self.backward_passes > 0:
            what = "the per-example norms of a backward pass (their clipped pass never ran)"
        else:
            what = "the step's update (no clipped pass ran since the last step)"
        output_passes = module is not None and getattr(module, "output_passes", None) is not None
        ran = outside or (self.backward_passes > 0 and not pending)  # else: no clipped pass at all
        error = unclipped_gradient_error(what, ran, output_passes, torch_ddp_cause(self))
        self._forget_per_example_values()
        raise error

    def check_refused_steps(self) -> None:
        """Raise ``FloatingPointError`` if a step was refused on the device and not yet
        reported (fused optimizers report at the next ``step()``; call this after the
        last one). Waits for the device."""
        self._raise_deferred_refusal(wait=True)

    def _raise_deferred_refusal(self, wait: bool) -> None:
        refused = self._nonfinite_guard.arrived_refusal(wait=wait)
        if refused is not None and FORWARD_CHANGE in refused:
            raise ValueError(
                "an earlier step was refused on the device: a forward pass changed a parameter or "
                "buffer in place (parameters and optimizer state were not updated by it; the "
                "privacy accountant counted it). A refusal must end the run"
            )
        if refused is not None and OUTSIDE_USE in refused:
            raise ValueError(
                "an earlier step was refused on the device: the gradient of a parameter did not "
                "come through the clipped pass (it was used outside its module's forward as well "
                "as inside it; parameters and optimizer state were not updated by it; the privacy "
                "accountant counted it). A refusal must end the run"
            )
        if refused is not None:
            raise FloatingPointError(
                f"an earlier step met a non-finite {refused}: it was refused on the device "
                "(parameters and optimizer state were not updated by it; the privacy "
                "accountant counted it). A refusal must end the run (see nonfinite= in "
                "make_private)"
            )

    def _check_skip_next_step(self, pop_next: bool = True) -> bool:
        """Opacus's skip signal (BatchMemoryManager). On a real step, called by
        ``pre_step`` after clipping and before noise: the step's non-finite flags are
        decided here (:meth:`_decide_finite`)."""
        skip = super()._check_skip_next_step(pop_next)
        if pop_next and not skip:
            self._decide_finite()
        return skip

    def _clipped_sums(self) -> List[Optional[torch.Tensor]]:
        """The clipped gradient sums the noise will be added to."""
        return [p.summed_grad for p in self.params]

    def _decide_finite(self) -> None:
        """Refuse the step if a checked value was not finite. When the wrapped optimizer
        can skip an update on the device (``found_inf``: PyTorch's fused optimizers) the
        decision stays there; otherwise it costs the step's one host synchronisation."""
        guard = self._nonfinite_guard
        guard.note("clipped gradient", self._clipped_sums())
        device = next((p.device for p in self.params), torch.device("cpu"))
        ok, flags = guard.take(device, distributed=self.refusals_across_ranks)
        if getattr(self.original_optimizer, "_step_supports_amp_scaling", False):
            self.original_optimizer.found_inf = (~ok).float()
            guard.defer(ok, flags)
            return
        if not bool(ok):  # the step's one host synchronisation
            if OUTSIDE_USE in flags and not bool(flags[OUTSIDE_USE]):
                raise self._outside_use_error()
            if FORWARD_CHANGE in flags:
                changed, self._forward_changed = self._forward_changed, []
                raise ForwardChanges.refusal(changed)
            self._outside_flags = []
            raise FloatingPointError(
                f"non-finite {failed_kinds(flags)} in this batch: the step is refused "
                "before noise is added; parameters and the privacy accountant are "
                "unchanged. A refusal must end the run (see nonfinite= in make_private)"
            )

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[torch.Tensor]:
        try:
            return super().step(closure)
        finally:  # a device-side refusal flag is for this step only
            self.original_optimizer.__dict__.pop("found_inf", None)
            self._outside_flags = []
            self._forget_per_example_values()

    def forget_after_step(self, holder: Any) -> None:
        """``holder.per_sample_gradient_norms`` (Opacus's debugging copy of the last
        batch's norms) is cleared by the next ``step()``: per-example values do not
        outlive the step that used them (nor reach ``torch.save``/``deepcopy``)."""
        self._holders.add(holder)

    def _forget_per_example_values(self) -> None:
        for holder in self._holders:
            holder.per_sample_gradient_norms = None
        for p in self.params:
            p.grad_sample = None  # consumed by clipping (book-keeping's exact layers)
        module = self._bound_module()
        forget = getattr(module, "forget_per_example_values", None)
        if forget is not None:  # norms a refused step left (consumed by a clipped one)
            forget()

    def accumulate(self) -> None:
        """Move the clipped gradient into ``p.summed_grad`` without copying it (Opacus
        deep-copies): ``p.grad`` is released, so a later in-place zeroing cannot touch it."""
        for p in self.params:
            if p.grad is None:
                continue
            if p.summed_grad is not None:
                p.summed_grad.add_(p.grad.detach())
            else:
                p.summed_grad = p.grad.detach()
            p.grad = None

    def add_noise(self) -> None:
        """Opacus's Gaussian noise ``N(0, sigma^2 C^2)`` added in place into the clipped
        sum, whose buffer becomes ``p.grad`` (one parameter-sized buffer less than
        ``summed_grad + noise``). Distributed: only rank 0 adds noise, as in Opacus."""
        if getattr(self, "rank", 0) != 0:
            return super().add_noise()
        std = getattr(self, "_adjusted_noise_multiplier", self.noise_multiplier) * self.max_grad_norm
        for p in self.params:
            _check_processed_flag(p.summed_grad)
            noise = self._noise(std, p.summed_grad)
            _mark_as_processed(p.summed_grad)
            p.grad = p.summed_grad.add_(noise).view_as(p)

    def noise_generator(self, device: Any) -> torch.Generator:
        """The noise source on ``device``: the user's ``noise_generator`` (Opacus's
        ``generator``; reproducible, replays on resume) when given, else the plugin's own
        stream :attr:`noise_streams` (seeded from ``noise_seed`` or ``os.urandom``, never
        from torch's global generator)."""
        return self.generator if self.generator is not None else self.noise_streams.generator(device)

    def _noise(self, std: float, reference: torch.Tensor) -> torch.Tensor:
        """N(0, std^2) like ``reference``, from :meth:`noise_generator`. Secure mode: from
        :mod:`opacus_rc.csprng` (AES-CTR keystream, no PRNG), as the sum of 4 normals
        halved in float64, Opacus's guard against floating-point attacks."""
        if not self.secure_mode:
            return _generate_noise(
                std=std, reference=reference, generator=self.noise_generator(reference.device)
            )
        from .csprng import secure_noise

        return secure_noise(std, reference)

    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state; a seeded run's says so (:data:`SEEDED_STATE_KEY`,
        never the seed itself)."""
        state = super().state_dict()
        return {**state, SEEDED_STATE_KEY: True} if self.seeded else state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """The wrapped optimizer's state. Generator states are never part of it (see
        ``PrivacyEngine.save_checkpoint(..., include_rng_state=True)``); a legacy entry
        holding them is dropped. The state of a seeded run loaded into a seeded one is
        refused unless ``accept_replayed_noise=True`` (:meth:`check_seeded_resume`)."""
        state_dict = dict(state_dict)
        if state_dict.pop(_LEGACY_STATE_KEY, None) is not None:
            logger.warning("ignored the sketch/noise generator states of a legacy optimizer state_dict")
        seeded = bool(state_dict.pop(SEEDED_STATE_KEY, False))
        if self.deferred_seeded_resume is not None:
            self.deferred_seeded_resume = seeded
        else:
            self.check_seeded_resume(seeded)
        super().load_state_dict(state_dict)

    def check_seeded_resume(self, seeded_state: bool) -> None:
        """Refuse resuming a run that used ``seed=`` (``seeded_state``) with ``seed=``:
        the noise, Poisson and sketch streams start again from the seed, so the resumed
        steps draw the earlier steps' noise again, and the difference of two updates with
        the same noise is released without noise. ``accept_replayed_noise=True`` accepts it."""
        if seeded_state and self.seeded and not self.accept_replayed_noise:
            raise ValueError(
                "resuming a run that used seed= with seed= replays its noise: the resumed steps "
                "draw the earlier steps' noise again, and the difference of two updates with the "
                "same noise is released without noise (a privacy hazard). Resume without seed= "
                "(fresh randomness from os.urandom), or from a checkpoint saved with "
                "include_rng_state=True (the streams continue), or pass "
                "accept_replayed_noise=True to make_private to accept the hazard"
            )



class SketchedClippingMixin(RandomizedClippingMixin):
    """The optimizer of a sketched form: :class:`RandomizedClippingMixin` plus the sketch
    its per-example norms were estimated with, which the ``rc_prv`` accountant reads in its
    step hook (``sketch_config`` and its ``estimator``, ``sketch_size``, ``sketching``).

    Args:
        optimizer: wrapped optimizer.
        sketch_config: how the per-sample norms were estimated (default: Hutchinson,
            k = 32, one sketch shared by the batch).
        **kwargs: :class:`RandomizedClippingMixin`'s.
    """

    def __init__(self, optimizer: Optimizer, *, sketch_config: SketchConfig = SketchConfig(), **kwargs: Any) -> None:
        super().__init__(optimizer, **kwargs)
        self.sketch_config = sketch_config

    @property
    def estimator(self) -> str:
        return self.sketch_config.estimator

    @property
    def sketch_size(self) -> int:
        return self.sketch_config.sketch_size

    @property
    def sketching(self) -> str:
        return self.sketch_config.sketching


class RandomizedClippingOptimizer(SketchedClippingMixin, DPOptimizerFastGradientClipping):
    """:class:`~opacus.optimizers.DPOptimizerFastGradientClipping` for randomized clipping."""


class DistributedRandomizedClippingOptimizer(
    SketchedClippingMixin, DistributedDPOptimizerFastGradientClipping
):
    """Distributed (DDP) form: noise is added on rank 0 only, gradients are all-reduced."""

    refusals_across_ranks = True
