"""Optimizers for randomized clipping.

They behave exactly like Opacus's fast-gradient-clipping optimizers (the gradients they
see are already clipped by the second backward pass; they add N(0, sigma^2 C^2) noise
and average) and additionally carry the :class:`~opacus_rc.config.SketchConfig`, which
the ``rc_prv`` accountant reads in its step hook.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple, Type

import numpy as np
import torch

from opacus.optimizers import DistributedDPOptimizerFastGradientClipping, DPOptimizerFastGradientClipping
from opacus.optimizers.optimizer import _check_processed_flag, _generate_noise, _mark_as_processed
from torch.optim import Optimizer

from .clip_guard import ClipGuard
from .config import SketchConfig
from .draws import Batch, Draw, Ledger, accumulation_error
from .estimators import at_least_float32
from .finite import FORWARD_CHANGE, RANK_ERROR, NonFiniteGuard, failed_kinds
from .forward_changes import ForwardChanges, watched_model
from .noises import INDEPENDENT, NOISES, NoiseSpec, draw_step_error, take_noise_state
from .per_parameter import drop_sums, drop_wide_grads, set_grad_sample, set_summed, take_wide_grad
from .ranks import agree_values, join_failed, refused_on_another_rank
from .sketch import NOISE_STREAM, DeviceStreams, check_seed
from .units import ExampleUnits, UserIndex
from .values import EXAMPLE_UNIT, RAISE, USER_UNIT


_LEGACY_STATE_KEY = "opacus_rc"  # generator states stored by versions up to 0.1.0
#: key of ``optimizer.state_dict()`` saying the run drew its noise from ``seed=``
SEEDED_STATE_KEY = "opacus_rc_seeded"
#: the rank checks of a distributed step (:mod:`opacus_rc.ranks`), in order: its refusal flags,
#: and the released draw of a numbered noise mechanism
FLAGS_CHECK, DRAW_CHECK = "flags", "draw"
_DRAW_CHECK_WHAT = "this step's check that every rank releases the same draw"
logger = logging.getLogger(__name__)


def clipped_grads(p: torch.nn.Parameter) -> List[torch.Tensor]:
    """What a step accumulates of ``p``: ``p.grad`` and its float32 counterpart ``p.wide_grad``
    (taken), those present."""
    grads = [None if p.grad is None else p.grad.detach(), take_wide_grad(p)]
    return [g for g in grads if g is not None]


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
        noise_mechanism: the run's noise mechanism (:mod:`opacus_rc.noises`; default
            independent noise); the optimizer keeps its state.
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
        user_index: Optional[UserIndex] = None,
        noise_mechanism: NoiseSpec = INDEPENDENT,
        **kwargs,
    ) -> None:
        super().__init__(optimizer, **kwargs)
        #: the noise mechanism's state (``noise=``, :mod:`opacus_rc.noises`), where this process keeps it
        self.noise_mechanism = noise_mechanism.build()
        self.noise_mechanism.bind(self.noise_holder())
        #: mechanism steps the current (else last) release advances (the accountant charges them; a numbered
        #: mechanism: the draws since the last release, discarded ones included)
        self.mechanism_steps = 1
        self._signalled_step: Optional[int] = None  # the draw a signalling loop named (signal_draw_step)
        #: ``"example"`` or ``"user"``: what one clip bounds (see :mod:`opacus_rc.units`)
        self.privacy_unit = EXAMPLE_UNIT if isinstance(user_index, (type(None), ExampleUnits)) else USER_UNIT
        self.seeded = noise_seed is not None  # the noise stream replays from its seed
        self.accept_replayed_noise = accept_replayed_noise
        check_seed("noise_seed", noise_seed, self.secure_mode)
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
        #: the batches the plugin's loaders deliver to this optimizer, in order (:mod:`opacus_rc.draws`)
        self.ledger = Ledger()
        self._draw: Optional[Draw] = None  # the draw whose clipped sums p.summed_grad holds
        self._draw_seen = 0  # of its physical batches
        self._claimed: Optional[Batch] = None  # the last batch claimed in this step
        self._closed_draws: "weakref.WeakSet[Draw]" = weakref.WeakSet()  # released or dropped
        self._refused: Optional[ValueError] = None  # a refusal that ends the run (refuse_steps)
        self._awaiting_zero_grad = False  # a real step was taken and zero_grad() not called
        self._holders: "weakref.WeakSet[Any]" = weakref.WeakSet()  # of per-example norms
        self._grad_sample_module: Optional[Callable[[], Any]] = None  # weak: see bind_module()
        self._parameter_names: Dict[int, str] = {}
        #: whether every gradient a step would release came through the form's clip
        self.clip_guard = self.clip_guard_class(self)
        self._forward_changes: Optional[ForwardChanges] = None  # see bind_module()
        self._forward_changed: Callable[[], List[str]] = list  # what it saw: decided with the step's flags
        self._checks_due: Tuple[str, ...] = ()  # this step's rank checks not reached yet: see step()

    @property
    def accumulated_iterations(self) -> int:
        """Independent Poisson micro-batches accumulated into this step (at least 1): every
        backward pass since the last real step, whatever API accumulated it, except the physical
        batches cut from one Poisson draw (``same_draw``): ``m = passes - splits``. Averaging
        divides by ``expected_batch_size * m``; the ``rc_prv`` accountant charges ``m`` as the
        step's micro-batch multiplicity (docs/accounting.md)."""
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
        (:data:`opacus_rc.registration.PATCHES`). Any other skipped step accumulates an
        independent micro-batch (:attr:`accumulated_iterations`).
        """
        if do_skip and same_draw:
            self._draw_splits += 1
        super().signal_skip_step(do_skip)

    def signal_draw_step(self, step: int) -> None:
        """A loop that tells its draws' ends by Opacus's skip signals (the private Trainer, whose
        draws are :attr:`~opacus_rc.draws.Draw.signalled`) names the number of the cyclic Poisson
        draw the clipped sums being accumulated belong to: the next release's step of a numbered
        noise mechanism. Another draw named before that release is refused (one release, one draw)."""
        if self._signalled_step is not None and self._signalled_step != step:
            self.refuse_steps(draw_step_error(self.noise_mechanism.name))
        self._signalled_step = int(step)

    # --- one draw, one release (opacus_rc.draws) --------------------------------------------

    def claim_batches(self, batches: List[Batch]) -> None:
        """The clipped sums about to join ``p.summed_grad`` come from ``batches`` (the step's):
        they belong to their draw. A step follows one physical batch of the plugin's loaders, in
        order; a draw left incomplete when another begins is dropped (a warning says so), and a
        released or dropped draw is never claimed again."""
        self._raise_refusal()
        batches = [b for b in batches if b is not self._claimed]
        if not batches:
            return
        self._claimed = batches[-1]
        registered = [b for b in batches if not b.draw.signalled]
        if len(registered) > 1:
            self.refuse_steps(accumulation_error(len(registered)))
        if not registered:
            return
        batch = registered[0]
        if batch.draw in self._closed_draws:
            self.refuse_steps(ValueError(
                "optimizer.step() refused: a batch of a Poisson draw that was already released (or dropped) "
                "went through a forward pass again; each batch of the loader make_private returned is trained "
                "on once. Nothing was released"
            ))
        if batch.draw is not self._draw:
            self._drop_incomplete_draw()
            self._draw, self._draw_seen = batch.draw, 0
        if batch.index != self._draw_seen:
            self._closed_draws.add(batch.draw)
            self.refuse_steps(ValueError(
                f"optimizer.step() refused: physical batch {batch.index} of a draw came after {self._draw_seen} "
                "of its batches (a batch skipped or taken twice); give each batch of the loader one forward "
                "and one backward, in order. Nothing was released"
            ))
        self._draw_splits += batch.index > 0
        self._draw_seen += 1

    def refuse_steps(self, error: ValueError) -> None:
        """Drop this step and refuse every later one with ``error`` (a refusal must end the run)."""
        self._refused = error
        self._raise_refusal()

    def _raise_refusal(self) -> None:
        if self._refused is not None:
            self.drop_step()
            raise self._refused

    def _drop_incomplete_draw(self) -> None:
        if self._draw is None or self._draw_seen in (0, self._draw.batches):
            return
        self._closed_draws.add(self._draw)
        warnings.warn(
            f"a Poisson draw was left after {self._draw_seen} of its {self._draw.batches} physical batches "
            "(a loop stopped inside it, or the loader was iterated again): its clipped sums were dropped, "
            "never released", RuntimeWarning,
        )
        self._step_skip_queue.clear()
        self.backward_passes = self._draw_splits = 0
        drop_sums(self.params)  # (the current batch's clipped values are not in p.summed_grad yet)

    @property
    def draw_pending(self) -> bool:
        """The clipped sums hold part of a draw of the plugin's loaders (its next batch is due)."""
        return self._draw is not None and self._draw_seen < self._draw.batches

    @property
    def skipped_examples(self) -> int:
        """Examples dropped for a non-finite norm under ``nonfinite="skip"`` (local to this
        process: never saved). A data-dependent count, **not private**: for debugging on
        the training machine only; do not log or publish it. Reading it waits for the
        device."""
        return 0 if self._skipped is None else int(self._skipped)

    def note_skipped(self, dropped: torch.Tensor) -> None:
        """Count the examples dropped for a non-finite norm (``nonfinite="skip"``): ``dropped``,
        a bool flag or mask, is summed on the device."""
        dropped = dropped.sum()
        self._skipped = dropped if self._skipped is None else self._skipped + dropped

    def note_finite(self, kind: str, *tensors: Optional[torch.Tensor]) -> None:
        """Check that every entry of ``tensors`` is finite before this step's update (on
        the device, decided once per step; see :mod:`opacus_rc.finite`). ``kind``: one of
        ``"per-sample loss"``, ``"per-sample gradient norm"``, ``"clipped gradient"``."""
        self._nonfinite_guard.note(kind, tensors)

    def pre_step(self, closure: Optional[Callable[[], float]] = None) -> Optional[bool]:
        """Opacus's pre-step (accumulate, noise, average, accountant hook) with the step's
        refusals decided before noise is drawn (:meth:`_check_skip_next_step`); a refusal
        decided on the device for an earlier step is raised first."""
        self._raise_deferred_refusal(wait=False)
        self.check_cleared()
        self._check_forward_changes()
        self.clip_guard.check()  # first: its refusal names torch's DDP when that is the cause
        module = self.bound_module()
        batches = [] if module is None else module.take_step_batches()
        self._raise_refusal()  # an earlier refusal ends the run
        empty = None if batches else self.ledger.take_empty()
        if empty is not None and empty.draw not in self._closed_draws:
            batches = [empty]  # a step without a forward on an empty draw: still that draw's release
        if not batches and self.draw_pending and self._claimed is None:
            self.refuse_steps(ValueError(
                "optimizer.step() refused: no training forward since the last step, inside a Poisson "
                "draw of the loader make_private returned (optimizer.step() called twice for one "
                "physical batch?); follow each physical batch by exactly one step(). Nothing was released"
            ))
        self.claim_batches(batches)
        taken = super().pre_step(closure)
        self._claimed = None
        if taken:
            self.backward_passes = self._draw_splits = 0
            self._signalled_step = None
            if self._draw is not None:
                self._closed_draws.add(self._draw)
            self._draw = None
            self._awaiting_zero_grad = True
        return taken

    def check_cleared(self) -> None:
        """Opacus's refusal of a loop without ``optimizer.zero_grad()`` between steps
        (its ``_processed`` flag does not survive book-keeping's assembled sums): the
        next backward would add raw, unclipped gradients into the noised sum."""
        if self._awaiting_zero_grad:
            raise ValueError(
                "Gradients haven't been cleared since the last optimizer step: optimizer.step() was "
                "called twice for one physical batch, or optimizer.zero_grad() was not called between "
                "steps. In order to obtain privacy guarantees you must call optimizer.zero_grad() on each "
                "step (the DP optimizer's: model.zero_grad() does not clear what it accumulated)"
            )

    def zero_grad(self, set_to_none: bool = False) -> None:
        self.clip_guard.end_norm_pass()  # Opacus's zero_grad between the two passes ends one
        super().zero_grad(set_to_none)
        drop_wide_grads(self.params)  # (p.grad's float32 counterpart: zeroed with it)
        self._awaiting_zero_grad = False
        self.clip_guard.zeroed()  # zeroed in place (or None): a zero contribution

    # --- every gradient through a clipped pass --------------------------------------------

    def bind_module(self, module: Any) -> None:
        """The grad-sample module whose passes this optimizer steps (``follow_steps`` calls
        this): its per-example norms are checked and forgotten with each step, and
        refusals name its parameters; it learns the unit its passes clip and reads the batches
        this optimizer's loader delivers (:class:`~opacus_rc.draws.BatchReader`)."""
        self._grad_sample_module = weakref.ref(module)
        module.privacy_unit = self.privacy_unit
        module.read_batches_from(self)
        inner = getattr(module, "_module", module)
        self._parameter_names = {id(p): name for name, p in inner.named_parameters()}
        # the model's parameters and buffers watched across its forward passes (buffers only under
        # FSDP2, whose forward swaps the parameters' shards): the next step refuses a change
        if self._forward_changes is not None:
            self._forward_changes.remove()
        self._forward_changes = ForwardChanges(watched_model(module), outer=module)

    def _check_forward_changes(self) -> None:
        """Refuse the step (naming them) when a forward pass of the model changed a parameter,
        buffer or module attribute since the last step; nothing is released, the step's clipped
        sums are dropped. A changed value is decided with the step's device flags (agreed across
        ranks: :data:`~opacus_rc.finite.FORWARD_CHANGE`; no host synchronisation of its own)."""
        watch = self._forward_changes
        if watch is None:
            return
        structural, flag, names = watch.take()
        if structural and not self.refusals_across_ranks:
            self.drop_step()
            raise watch.refusal(names())
        if structural or flag is not None:
            self._forward_changed = names
            device = next((p.device for p in self.params), torch.device("cpu"))
            changed = torch.full((), True, device=device) if structural else flag.to(device)
            self.note_finite(FORWARD_CHANGE, torch.where(changed, float("inf"), 0.0))

    def bound_module(self) -> Any:
        """The grad-sample module this optimizer follows (:meth:`bind_module`); None if none."""
        return None if self._grad_sample_module is None else self._grad_sample_module()

    def describe_parameter(self, p: torch.Tensor) -> str:
        name = self._parameter_names.get(id(p))
        return f"parameter {name!r}" if name is not None else f"a trainable parameter of shape {tuple(p.shape)}"

    #: the guard of the form's clipped passes (:mod:`opacus_rc.clip_guard`)
    clip_guard_class: Type[ClipGuard] = ClipGuard

    def mark_clipped(self) -> None:
        """Called by a clipped pass when it has left in ``p.grad`` exactly the step's clipped
        sum so far (and by ``zero_grad``): the step accepts these tensors, unmodified, and
        nothing else (:meth:`~opacus_rc.clip_guard.ClipGuard.mark`)."""
        self.clip_guard.mark()

    def complete_batch(self, rows: int) -> List[torch.nn.Parameter]:
        """For a loop that runs its own backward passes (the private Trainer): after a
        physical batch of ``rows`` examples, a parameter the batch did not use contributes
        exact zeros; returns the parameters whose gradient no per-example hook saw (the
        caller refuses them). Two passes: the clipped sum is ``p.grad``, and the step
        refuses a gradient no clipped pass produced (:meth:`ClipGuard.check`)."""
        for p in self.params:
            if p.grad is None and getattr(p, "summed_grad", None) is None and getattr(p, "wide_grad", None) is None:
                self.clip_guard.zero(p)
        return []

    def check_refused_steps(self) -> None:
        """Raise ``FloatingPointError`` if a step was refused on the device and not yet
        reported (fused optimizers report at the next ``step()``; call this after the
        last one). Waits for the device."""
        self._raise_deferred_refusal(wait=True)

    def _raise_deferred_refusal(self, wait: bool) -> None:
        refused = self._nonfinite_guard.arrived_refusal(wait=wait)
        if refused is not None and RANK_ERROR in refused:
            raise refused_on_another_rank("an earlier step's agreement across ranks (refused on the device)")
        if refused is not None and FORWARD_CHANGE in refused:
            raise ValueError(
                "an earlier step was refused on the device: a forward pass changed a parameter or "
                "buffer in place (parameters and optimizer state were not updated by it; the "
                "privacy accountant counted it). A refusal must end the run"
            )
        outside = None if refused is None else self.clip_guard.deferred_refusal(refused)
        if outside is not None:
            raise outside
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
        skip, claimed = super()._check_skip_next_step(pop_next), self._claimed  # (a queue kept in step)
        if claimed is not None and not claimed.draw.signalled:
            skip = not claimed.last  # the draw decides (the plugin's loaders send no signals)
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
        self._reach_check(FLAGS_CHECK)
        ok, flags = guard.take(device, distributed=self.refusals_across_ranks)
        if getattr(self.original_optimizer, "_step_supports_amp_scaling", False):
            self.original_optimizer.found_inf = (~ok).float()
            guard.defer(ok, flags)
            return
        if not bool(ok):  # the step's one host synchronisation
            if RANK_ERROR in flags and not bool(flags[RANK_ERROR]):
                self.clip_guard.clear_flags()
                raise refused_on_another_rank("this step's agreement across ranks")
            outside = self.clip_guard.refusal(flags)
            if outside is not None:
                raise outside
            if FORWARD_CHANGE in flags and not bool(flags[FORWARD_CHANGE]):
                changed, self._forward_changed = self._forward_changed(), list
                raise ForwardChanges.refusal(changed)
            self.clip_guard.clear_flags()
            raise FloatingPointError(
                f"non-finite {failed_kinds(flags)} in this batch: the step is refused "
                "before noise is added; parameters and the privacy accountant are "
                "unchanged. A refusal must end the run (see nonfinite= in make_private)"
            )

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[torch.Tensor]:
        """Opacus's step. A distributed form's step reaches its rank checks in order: its refusal
        flags (:meth:`_decide_finite`) and, for a numbered noise mechanism, the released draw
        (:meth:`_release_steps`). A rank that raises before one takes part in every check it has not
        reached with a failure flag (:mod:`opacus_rc.ranks`), so the other ranks raise
        ``RefusedOnAnotherRank`` there instead of waiting for it (at the flags' check; with a fused
        optimizer, whose decision on the flags stays on the device, at the draw's check, or at their
        next step under independent noise)."""
        self._checks_due = self._step_checks() if self.refusals_across_ranks else ()
        try:
            return super().step(closure)
        except BaseException:
            self._join_due_checks()
            raise
        finally:  # a device-side refusal flag is for this step only
            self.original_optimizer.__dict__.pop("found_inf", None)
            self.clip_guard.clear_flags()
            self.forget_per_example_values()

    def _step_checks(self) -> Tuple[str, ...]:
        """The rank checks of a distributed step, in the order every rank reaches them."""
        return (FLAGS_CHECK, DRAW_CHECK) if self.noise_mechanism.numbered else (FLAGS_CHECK,)

    def _reach_check(self, check: str) -> None:
        """This step reached its rank check ``check`` (and passed the earlier ones)."""
        if check in self._checks_due:
            self._checks_due = self._checks_due[self._checks_due.index(check) + 1:]

    def _join_due_checks(self) -> None:
        """This rank raised in ``step()``: it takes part with the failure flag in every rank check
        of the step it had not reached (:func:`opacus_rc.ranks.join_failed`), in order, so that every
        rank takes part in each once."""
        due, self._checks_due = self._checks_due, ()
        for check in due:
            if check == FLAGS_CHECK:
                self._nonfinite_guard.join_failed(next((p.device for p in self.params), torch.device("cpu")))
            else:
                join_failed(lambda failed: agree_values([-1], _DRAW_CHECK_WHAT, failed))

    def forget_after_step(self, holder: Any) -> None:
        """``holder.per_sample_gradient_norms`` (Opacus's debugging copy of the last
        batch's norms) is cleared by the next ``step()``: per-example values do not
        outlive the step that used them (nor reach ``torch.save``/``deepcopy``)."""
        self._holders.add(holder)

    def forget_per_example_values(self) -> None:
        """Drop the step's per-example values: Opacus's per-sample gradients, the holders'
        norms (:meth:`forget_after_step`) and what the followed module keeps (norms a refused
        step left, the batch its forward took; a clipped step consumes them)."""
        for holder in self._holders:
            holder.per_sample_gradient_norms = None
        for p in self.params:
            set_grad_sample(p, None)  # consumed by clipping (book-keeping's exact layers)
        module = self.bound_module()
        if module is not None:
            module.forget_per_example_values()
            module.end_step()

    def drop_step(self) -> None:
        """A refused step: its clipped sums so far (``p.summed_grad``) are never released,
        and its per-example values are forgotten."""
        self.forget_per_example_values()
        drop_sums(self.params)

    def accumulate(self) -> None:
        """Move the clipped gradient into ``p.summed_grad`` without copying it (Opacus
        deep-copies): ``p.grad`` is released, so a later in-place zeroing cannot touch it; so is
        its float32 counterpart ``p.wide_grad`` (:mod:`opacus_rc.per_parameter`)."""
        for p in self.params:
            for grad in clipped_grads(p):
                if p.summed_grad is not None:
                    p.summed_grad.add_(grad)
                else:  # float32 for half-precision parameters (a copy then): the noise is added there
                    set_summed(p, at_least_float32(grad))
            p.grad = None

    def add_noise(self) -> None:
        """The step's noise added into the clipped sums (:meth:`noise_sums`), by the noise
        mechanism (:mod:`opacus_rc.noises`); a numbered one at the step's draw
        (:meth:`_release_steps`), which it advances to."""
        self.mechanism_steps = self._release_steps() if self.noise_mechanism.numbered else 1
        self.noise_sums()
        self.noise_mechanism.advance(self.mechanism_steps)

    def _release_steps(self) -> int:
        """The mechanism steps this release advances: through the number of the one draw its
        clipped sums come from (delivered by the plugin's loader, or signalled:
        :meth:`signal_draw_step`). Refused: a release of no single numbered draw, or of a draw
        already released; under several processes, ranks releasing different draws (one
        all-reduce: the union of the ranks' draws must be one draw of one part)."""
        draw, signalled = self._draw, self._signalled_step
        step = signalled if draw is None else draw.step
        name = self.noise_mechanism.name
        unnumbered = step is None or (draw is not None and signalled is not None) or self.accumulated_iterations > 1
        self._reach_check(DRAW_CHECK)
        agreed = agree_values([-1 if unnumbered else step], _DRAW_CHECK_WHAT) if self.refusals_across_ranks else None
        if unnumbered:  # (after the agreement: every rank refuses, none waits in a collective)
            self.refuse_steps(draw_step_error(name))
        if agreed is not None and agreed[0] != agreed[1]:
            self.refuse_steps(ValueError(
                f"noise={name!r} under torch.distributed: the ranks release draws {agreed[1][0]} to {agreed[0][0]} at "
                "this step; every rank must release the same draw (iterate the loader alike on every rank, and load "
                "the same checkpoint on every rank). Nothing was released"
            ))
        try:
            return self.noise_mechanism.steps_to(step)
        except ValueError as error:
            self.refuse_steps(error)

    @property
    def next_noise_step(self) -> int:
        """A numbered noise mechanism's next step (the cyclic loader numbers its draws from it); 0
        for independent noise."""
        return self.noise_mechanism.next_step

    def __getattr__(self, name: str) -> Any:
        """``optimizer.<noise>`` (e.g. ``optimizer.banded``): the noise mechanism when ``noise=<noise>``
        runs, None for another row of :data:`~opacus_rc.noises.NOISES`."""
        if name in NOISES and "noise_mechanism" in self.__dict__:
            mechanism = self.__dict__["noise_mechanism"]
            return mechanism if mechanism.name == name else None
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def noise_sums(self) -> None:
        """Opacus's Gaussian noise ``N(0, sigma^2 C^2)`` added in place into the clipped
        sum, whose buffer becomes ``p.grad`` (one parameter-sized buffer less than
        ``summed_grad + noise``). Distributed: only rank 0 adds noise, as in Opacus."""
        std = getattr(self, "_adjusted_noise_multiplier", self.noise_multiplier) * self.max_grad_norm
        for slot, p in enumerate(self.params):
            if self.adds_noise:
                _check_processed_flag(p.summed_grad)
                noise = self.step_noise(slot, std, p.summed_grad)
                _mark_as_processed(p.summed_grad)
                p.summed_grad.add_(noise)
            p.grad = self._released(p)  # noised in float32, then rounded once

    #: a DDP optimizer: the ranks' sums are all-reduced after the noise (:class:`SumsAllReducedInFloat32`)
    all_reduces_sums: bool = False

    def _released(self, p: torch.nn.Parameter) -> torch.Tensor:
        """``p.summed_grad`` (noised) as ``p.grad``, in the parameter's dtype. Under DDP a
        half-precision parameter's float32 sums are all-reduced first (and averaged under
        ``"mean"``, as Opacus's ``reduce_gradients`` does with ``p.grad``): no rank's un-noised
        clipped sum is rounded to half precision (issue 52; :class:`SumsAllReducedInFloat32`)."""
        summed = p.summed_grad
        if self.all_reduces_sums and summed.dtype != p.dtype:
            torch.distributed.all_reduce(summed, op=torch.distributed.ReduceOp.SUM)
            if self.loss_reduction == "mean":
                summed.div_(self.world_size)
        return summed.view_as(p).to(p.dtype)

    @property
    def adds_noise(self) -> bool:
        """This process draws noise (and keeps the mechanism's state): rank 0 under DDP (Opacus's)."""
        return getattr(self, "rank", 0) == 0

    def step_noise(self, slot: int, std: float, reference: torch.Tensor) -> torch.Tensor:
        """The noise of parameter ``slot`` (position in :attr:`params`) at this step, like
        ``reference``: the mechanism's step from fresh ``N(0, std^2)`` draws (independent noise:
        one; a numbered mechanism: one per mechanism step, those of draws never released
        discarded)."""
        return self.noise_mechanism.step(slot, lambda: self._noise(std, reference), self.mechanism_steps)

    def noise_generator(self, device: Any) -> torch.Generator:
        """The noise source on ``device``: the user's ``noise_generator`` (Opacus's
        ``generator``; reproducible, replays on resume) when given, else the plugin's own
        stream :attr:`noise_streams` (seeded from ``noise_seed`` or ``os.urandom``, never
        from torch's global generator)."""
        return self.generator if self.generator is not None else self.noise_streams.generator(device)

    def _noise(self, std: float, reference: torch.Tensor) -> torch.Tensor:
        """N(0, std^2) like ``reference``, from :meth:`noise_generator`; in secure mode from
        :mod:`opacus_rc.csprng` (the halved sum of 4 normals, Opacus's floating-point guard)."""
        if not self.secure_mode:
            return _generate_noise(
                std=std, reference=reference, generator=self.noise_generator(reference.device)
            )
        from .csprng import secure_noise

        return secure_noise(std, reference)

    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state; a seeded run's says so (:data:`SEEDED_STATE_KEY`,
        never the seed itself); the noise mechanism's public state (under its ``state_key``,
        e.g. banded noise's next step; its secrets, such as the kept noise vectors, are saved
        only with ``include_rng_state=True``)."""
        state = super().state_dict()
        public = self.noise_mechanism.state_dict()
        if public is not None:
            state = {**state, self.noise_mechanism.state_key: public}
        return {**state, SEEDED_STATE_KEY: True} if self.seeded else state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """The wrapped optimizer's state: :meth:`check_state_dict`, then :meth:`apply_state_dict`
        (a refused state changes nothing). Generator states are never part of it (see
        ``PrivacyEngine.save_checkpoint(..., include_rng_state=True)``)."""
        self.check_state_dict(state_dict)
        self.apply_state_dict(state_dict)

    def check_state_dict(self, state_dict: Dict[str, Any], *, secret: Optional[Dict[str, Any]] = None,
                         continues_streams: bool = False) -> None:
        """Refuse (ValueError) a state this optimizer must not continue from, before anything is
        loaded: a state of another noise mechanism (:func:`~opacus_rc.noises.take_noise_state`), a
        public state its mechanism refuses and the mechanism's ``secret`` state saved with it, if
        given (:meth:`~opacus_rc.noises.base.NoiseMechanism.check_state_dict`: banded noise's other
        bands, kept vectors of another holder or step); a seeded run's state into a seeded run (its
        streams restart from the seed: the noise is replayed) unless ``accept_replayed_noise`` or
        ``continues_streams`` (the checkpoint holds the generators' states, :mod:`opacus_rc.checkpoint`).
        torch checks the parameter groups before it loads them."""
        noise_state = take_noise_state(self.noise_mechanism, dict(state_dict))
        if noise_state is not None:
            self.noise_mechanism.check_state_dict(noise_state, secret)
        self.check_seeded_resume(bool(state_dict.get(SEEDED_STATE_KEY, False)) and not continues_streams)

    def apply_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state :meth:`check_state_dict` accepted: the wrapped optimizer's; a numbered noise
        mechanism continues its step numbering in a new run
        (:meth:`~opacus_rc.noises.base.NoiseMechanism.load_state_dict`) unless its secret state
        follows. A legacy entry holding generator states is dropped."""
        state_dict = dict(state_dict)
        if state_dict.pop(_LEGACY_STATE_KEY, None) is not None:
            logger.warning("ignored the sketch/noise generator states of a legacy optimizer state_dict")
        state_dict.pop(SEEDED_STATE_KEY, None)
        noise_state = take_noise_state(self.noise_mechanism, state_dict)
        super().load_state_dict(state_dict)
        if noise_state is not None:
            self.noise_mechanism.load_state_dict(noise_state)

    def noise_holder(self) -> Any:
        """What the noise mechanism's state is on this process: ``"full"`` where the noise is
        added (one process, DDP's rank 0), None elsewhere."""
        return "full" if self.adds_noise else None

    def check_seeded_resume(self, seeded_state: bool) -> None:
        """Refuse resuming a run that used ``seed=`` (``seeded_state``) with ``seed=`` (its
        streams restart from the seed: the noise is replayed) unless ``accept_replayed_noise``."""
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
        sketch_config: how the per-sample norms were estimated (default ``SketchConfig()``).
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


class SumsAllReducedInFloat32:
    """The DDP optimizers' all-reduce: a half-precision parameter's float32 clipped sums (rank 0's
    noised) are all-reduced before they are rounded to its dtype
    (:meth:`RandomizedClippingMixin._released`; Opacus all-reduces ``p.grad``, which would round
    the other ranks' un-noised sums to bf16); a float32 parameter's ``p.grad`` as Opacus does."""

    all_reduces_sums = True

    def reduce_gradients(self) -> None:
        """Opacus's all-reduce of ``p.grad`` (after the noise and the normaliser), for the
        parameters whose sums were not all-reduced in float32 already."""
        for p in self.params:
            if not p.requires_grad or p.summed_grad.dtype != p.dtype:
                continue
            torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.SUM)
            if self.loss_reduction == "mean":
                p.grad /= self.world_size


class RandomizedClippingOptimizer(SketchedClippingMixin, DPOptimizerFastGradientClipping):
    """:class:`~opacus.optimizers.DPOptimizerFastGradientClipping` for randomized clipping."""


class DistributedRandomizedClippingOptimizer(
    SumsAllReducedInFloat32, SketchedClippingMixin, DistributedDPOptimizerFastGradientClipping
):
    """Distributed (DDP) form: noise is added on rank 0 only, gradients are all-reduced."""

    refusals_across_ranks = True
