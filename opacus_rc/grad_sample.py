"""Grad-sample modules for randomized clipping.

They extend Opacus's fast-gradient-clipping hooks: the first backward pass computes
per-sample norms, linear layers' weights by a sketch (see :mod:`opacus_rc.norm_samplers`)
and every other trainable layer exactly; ``get_clipping_coef`` turns the norms into
``min(1, C / n_hat_i^{1/2})`` and :class:`opacus.utils.fast_gradient_clipping_utils.
DPLossFastGradientClipping` runs the second, rescaled backward pass as in ghost mode.

The module owns the run's :class:`~opacus_rc.sketch.Sketcher`: a fresh independent
sketch per layer and per step, seedable (``sketch_seed``), drawn from ``os.urandom`` in
``secure_mode``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from opacus.grad_sample import (
    GradSampleHooks,
    GradSampleHooksFastGradientClipping,
    GradSampleModuleFastGradientClipping,
)
from opacus.utils.module_utils import requires_grad, trainable_parameters
from torch import nn

from .clip_guard import InModuleSums
from .clipped_sums import clipped_embedding, clipped_grad_sample
from .config import SketchConfig
from .draws import BatchReader
from .estimators import summed_product, summed_rows
from .half_precision import (
    ClippedPassSums,
    check_no_mean_in_half,
    HalfPrecisionCalls,
    OwnerRef,
    computes_in_half,
    forward_without_in_module_grads,
    in_function_transform,
)
from .norm_samplers import RANDOMIZED_NORM_SAMPLERS, TIED_PROJECTIONS, is_conv1d, third_party_layers
from .per_parameter import count_uses, reset_uses, set_norm_sample
from .recompute import (
    NON_REENTRANT,
    current_saved_tensors_hooks,
    forward_replay,
    late_use_error,
    missing_per_sample_error,
    refuse_unpreserved_rng_replay,
    resolve_last,
    save_inputs,
)
from .refusals import refusal
from .sketch import Sketcher
from .units import in_row_slots, mean_clip_factors, per_row, regroup_uses, sum_rows_by_unit, unit_sizes


class PerExampleStore(BatchReader):
    """The base of the sketched forms' grad-sample modules: owns the run's sketcher, the
    layers whose ``forward`` it replaced and the step's per-example values, which layers
    deliver through its public methods (:meth:`start_pass`, :meth:`expect_forward`,
    :meth:`begin_head_use`, ``deliver_head``).

    Args (besides Opacus's grad-sample arguments, passed on):
        sketch_config: estimator, sketch size, sketching.
        sketch_seed: seed of the sketch generator (``None``: from ``os.urandom``).
        secure_mode: draw every sketch from ``os.urandom``.
    """

    _opacus_options: Dict[str, Any] = {}
    #: the form's parameters are FSDP2 shards (a chunked head must be a unit of its own)
    sharded: bool = False
    #: the two passes from the model's output of a plain-loss script (set by
    #: :class:`~opacus_rc.forms.output_passes.OutputPasses`; None: the criterion's passes)
    output_passes: Optional[Any] = None
    #: the norm pass's in-module gradient sums (the two-pass forms'; None: not noted)
    in_module_sums: Optional[InModuleSums] = None

    def __init__(
        self,
        m: nn.Module,
        *,
        sketch_config: SketchConfig = SketchConfig(),
        sketch_seed: Optional[int] = None,
        secure_mode: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(m, **self._opacus_options, **kwargs)
        self._steps_taken: Optional[int] = None  # the step clock: see follow_steps()
        self._step_hook: Optional[Any] = None
        self._sketcher = Sketcher(sketch_config, seed=sketch_seed, secure_mode=secure_mode)
        self._sketcher.bind_step_clock(self._optimizer_steps)
        self._awaiting_forward = True
        self._patched: List[nn.Module] = []  # the linear layers whose weight gradient is deferred
        self._half_patched: List[Tuple[nn.Module, Optional[Callable]]] = []  # the other trainable layers, forward before
        #: the layers called in half precision since the last step (:mod:`opacus_rc.half_precision`)
        self.half_calls = HalfPrecisionCalls()
        #: the float32 clipped sums of the clipped pass running (the two-pass forms, half precision)
        self.clipped_pass_sums = ClippedPassSums(self._shard_clipped_sum if self.sharded else None)
        #: tied parameters' running sums of sketched per-sample gradients in this pass, by slot
        #: (:meth:`_tied_slot`), until their last use
        self._tied_sums: Dict[Any, torch.Tensor] = {}
        self.autograd_grad_sample_hooks.extend(self.watch_batches(self._module))
        # this model's third-party layer types (HF Conv1D): their norm samplers and tied projections,
        # for this module only (the registries are not changed)
        self._third_party_samplers, self._third_party_projections = third_party_layers(self._module)
        self._setup()  # defined by each mixin

    @property
    def sketcher(self) -> Sketcher:
        """The run's sketch source (its freshness follows this module's step clock)."""
        return self._sketcher

    @sketcher.setter
    def sketcher(self, sketcher: Sketcher) -> None:
        sketcher.bind_step_clock(self._optimizer_steps)
        self._sketcher = sketcher

    def follow_steps(self, optimizer: Any) -> None:
        """Follow ``optimizer``'s steps: the sketcher draws fresh sketches after each step it
        takes (docs/accounting.md, "Fresh sketches every step"); call this once for objects built
        by hand (``make_private`` links the pair it returns). The clock is torch's step post-hook
        on the optimizer that updates the parameters (a DP optimizer's ``original_optimizer``,
        stepped only after ``pre_step()`` took the step: skipped steps do not count)."""
        if self._step_hook is not None:
            self._step_hook.remove()
        target = getattr(optimizer, "original_optimizer", optimizer)
        self._steps_taken = 0
        self._step_hook = target.register_step_post_hook(self._count_step)
        optimizer.bind_module(self)  # its steps check and forget this module's per-example norms

    @property
    def deferred_layers(self) -> Tuple[nn.Module, ...]:
        """The layers whose parameter gradients autograd never computes in the norm pass (nor, in
        book-keeping, at all): the linear layers, and every layer called in half precision since
        the last step (:mod:`opacus_rc.half_precision`). Any gradient of theirs after that pass
        is a use outside them."""
        linear = {id(m) for m in self._patched}
        return (*self._patched, *(m for m in self.half_calls.layers.values() if id(m) not in linear))

    def half_precision_call(self, layer: nn.Module, inputs: Any) -> bool:
        """Whether this call of ``layer`` (on ``inputs``) is a half-precision call of a training pass,
        whose parameter gradients autograd must not compute (:mod:`opacus_rc.half_precision`); noted
        until the step (a layer called in both precisions in one step is refused)."""
        if not (layer.training and torch.is_grad_enabled()):
            return False
        params = [p for p in layer.parameters(recurse=False) if p.requires_grad]
        return self.half_calls.note(layer, computes_in_half(params, inputs))

    def deliver_clipped_sum(self, layer: nn.Module, name: str, total: torch.Tensor) -> None:
        """The float32 clipped sum ``total`` of ``layer``'s parameter ``name`` over the examples of the
        clipped pass running (a half-precision call): kept until the pass ends."""
        self.clipped_pass_sums.deliver(layer, name, total)

    def take_clipped_sums(self) -> List[Tuple[nn.Parameter, torch.Tensor]]:
        """The clipped pass's float32 sums, ``(parameter, sum)``, once it has ended; a trainable
        parameter of a layer called in half precision without one is refused (its clipped sum
        would be missing, not zero)."""
        sums = {(id(layer), name): (self._parameter_named(layer, name), total) for layer, name, total in self.clipped_pass_sums.take()}
        missing = [
            f"{type(layer).__name__}.{name}" for layer in self.half_calls.layers.values()
            for name, p in layer.named_parameters(recurse=False) if p.requires_grad and (id(layer), name) not in sums
        ]
        if missing:
            raise ValueError(
                f"no float32 clipped sum for {', '.join(missing)} after a half-precision pass: this layer's "
                "clipped gradient is computed neither by autograd nor by the privacy engine (a layer the "
                "two-pass forms do not support in half precision); run it in float32 or use "
                "per_example_backward=True"
            )
        return list(sums.values())

    def _parameter_named(self, layer: nn.Module, name: str) -> nn.Parameter:
        """The optimizer's parameter ``name`` of ``layer`` (FSDP2: its sharded parameter)."""
        return layer.get_parameter(name)

    def _shard_clipped_sum(self, layer: nn.Module, name: str, total: torch.Tensor) -> torch.Tensor:
        """A sharded form's shard of the ranks' clipped sums (see its override)."""
        raise NotImplementedError

    def end_step(self) -> None:
        """As :class:`~opacus_rc.draws.BatchReader`'s; a forward left without its backward pass (an
        empty draw's) leaves no captured input nor use count for the next pass."""
        super().end_step()
        for m in self._module.modules():
            if getattr(m, "activations", None):
                m.activations.clear()
            m.__dict__.pop("max_batch_len", None)
        for p in self._module.parameters():
            reset_uses(p)
        self._awaiting_forward = True
        self.half_calls.clear()
        self.clipped_pass_sums.clear()

    def _count_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self._steps_taken += 1

    def _optimizer_steps(self) -> Optional[int]:
        """Steps taken by the followed optimizer (None: no optimizer followed)."""
        return self._steps_taken

    def start_pass(self, module: nn.Module) -> None:
        """The first hooked layer of a training forward pass starts a sketch pass, with gradients
        on or not: a ``checkpoint(use_reentrant=True)`` region's forward runs without them (its
        replay starts none), and when every trainable layer sits in such regions (LoRA, frozen
        embedding and head) that forward is the only sign of a new physical batch (without a
        pass there, the step's next physical batch would reuse the per-example sketches)."""
        if self._awaiting_forward and self.hooks_enabled and module.training:
            self.sketcher.begin_pass()
            self._awaiting_forward = False
            self._on_pass_start()

    def _on_pass_start(self) -> None:
        """Per-pass state of a mixin is reset here."""

    # --- the per-example store: how a layer outside Opacus's hooks (the chunked LM head,
    # opacus_rc.lm_head) delivers its per-example values; the form decides where they go

    def expect_forward(self) -> None:
        """A layer's backward ran: the next training forward starts a new pass."""
        self._awaiting_forward = True

    def begin_head_use(self, layer: nn.Module, weight: nn.Parameter, bias: Optional[nn.Parameter]) -> bool:
        """One use of ``layer``'s trainable parameters outside its forward in this pass
        (its per-example values come by :meth:`deliver_head`); returns whether the use is
        tied (the weight is trainable and used earlier in this pass or owned by another module)."""
        for p in (weight, bias):
            if p is not None and p.requires_grad:
                count_uses(p, 1)
        return weight.requires_grad and (weight._forward_counter > 1 or self._shares_parameter(layer, weight))

    def _shares_parameter(self, layer: nn.Module, weight: nn.Parameter) -> bool:
        """``weight`` is also a direct parameter of another module of the model (cached:
        the model does not change during training)."""
        cache = self.__dict__.setdefault("_shared_parameters", {})
        key = (id(layer), id(weight))
        if key not in cache:
            cache[key] = any(
                m is not layer and any(q is weight for q in m.parameters(recurse=False))
                for m in self._module.modules()
            )
        return cache[key]

    def _capture(self, module: nn.Module, forward_input: Sequence[torch.Tensor], capture: Callable[[], None]) -> None:
        """Every activation-capture hook runs its body ``capture()`` (which appends the
        layer's inputs to ``module.activations``, or not) through this: a non-reentrant
        checkpoint replay captures nothing, a reentrant one is captured but starts no sketch
        pass; inside a non-reentrant region the inputs are saved through the saved-tensors
        hooks, and its replay saves them again at the same point, then drops them
        (:mod:`opacus_rc.recompute`)."""
        replay = forward_replay()
        hooks = current_saved_tensors_hooks() if _saves_inputs(module) else None
        if replay == NON_REENTRANT:
            if hooks is not None:
                save_inputs(forward_input, hooks)
            return
        if replay is None:
            self.start_pass(module)
        elif self.hooks_enabled:
            self._refuse_use_after_its_norm(module)
        entries = len(getattr(module, "activations", ()))
        capture()
        if hooks is not None:
            saved = save_inputs(forward_input, hooks)
            if len(getattr(module, "activations", ())) > entries:
                module.activations[-1] = saved

    def tied_projection(
        self, module: nn.Module, use: str = "", form: str = ""
    ) -> Callable[..., Dict[nn.Parameter, torch.Tensor]]:
        """The projection of a use of ``module``'s tied parameters (:data:`~opacus_rc.norm_samplers.
        TIED_PROJECTIONS`, or this model's third-party layers): ``(module, [A], G, sketcher)`` to
        each trainable parameter's per-example ``P^T grad`` (``P`` its row sketch, shared by its uses).

        Raises:
            ValueError: a layer type without one (:data:`~opacus_rc.refusals.REFUSALS`, ``"tied_layer"``;
                ``use`` follows the layer's name in it, ``form`` names the form, this class's by default).
        """
        projections = {**TIED_PROJECTIONS, **self._third_party_projections}
        layer = self._get_module_type(module)
        if layer not in projections:
            raise refusal("tied_layer", layer=layer.__name__ + use, form=form or type(self).__name__,
                          supported=", ".join(c.__name__ for c in projections))
        return projections[layer]

    def regrouped(self, module: nn.Module, a: torch.Tensor, g: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """A layer's rearranged ``(A, G)`` with the batch's rows regrouped into its units
        (:func:`~opacus_rc.units.regroup_uses`: one sequence of a unit's tokens)."""
        return regroup_uses(module, a, g, self.batch.units_of(int(g.shape[0])))

    def strips_in_module_grads(self, layer: nn.Module, inputs: Any) -> bool:
        """Whether autograd computes no parameter gradient inside ``layer`` (not a linear one) in this
        call (:func:`~opacus_rc.half_precision.forward_without_in_module_grads`): a half-precision call
        (:meth:`half_precision_call`); a form may add its own."""
        return self.half_precision_call(layer, inputs)

    def _refuse_use_after_its_norm(self, module: nn.Module) -> None:
        """Called for a use of ``module`` captured during the backward pass (a reentrant
        checkpoint's replay): raise if a parameter of it already got its per-sample norm
        in this pass, i.e. it is also used after the region (its norm would miss this
        use)."""

    def rearrange_grad_samples(self, *, module, backprops, loss_reduction, batch_first):
        """Opacus's rearrangement, after unpacking inputs saved by :meth:`_capture`; a batch of
        packed rows (:attr:`~opacus_rc.draws.Batch.segments`) is first split into one row per
        segment, the layer's batch being its segments (:mod:`opacus_rc.packing`)."""
        resolve_last(module)
        segments = self.batch.segments
        if segments is not None:
            module.activations[-1] = [self._split(module, segments, t) for t in module.activations[-1]]
            backprops = self._split(module, segments, backprops)
            module.max_batch_len = len(segments)
        return super().rearrange_grad_samples(
            module=module, backprops=backprops, loss_reduction=loss_reduction, batch_first=batch_first
        )

    def _split(self, module: nn.Module, segments: Any, t: torch.Tensor) -> torch.Tensor:
        """A layer's input or output gradient over the packed rows, one row per segment; refused
        (:data:`~opacus_rc.refusals.REFUSALS`) when it is not one entry per token."""
        try:
            return segments.split(t)
        except ValueError:
            raise refusal("packed_rows_layer_input", layer=self._get_module_type(module).__name__,
                          shape=tuple(t.shape), tokens=segments.tokens) from None

    def _defer_weight_grads(self, wanted: Optional[Callable[[], bool]] = None) -> None:
        """The trainable ``nn.Linear`` layers (by their real class: FSDP2 renames it) compute
        parameter gradients in their backward only if ``wanted()`` (None: never); in a
        half-precision call, in float32, handed to :meth:`deliver_clipped_sum`. Hugging Face
        ``Conv1D`` layers do the same in a half-precision call; every other trainable layer then
        gives its parameters no gradient (:func:`~opacus_rc.half_precision.forward_without_in_module_grads`)."""
        owner = OwnerRef(self)
        for m in self._module.modules():
            if not any(p.requires_grad for p in m.parameters(recurse=False)):
                continue
            layer = self._get_module_type(m)
            if layer is nn.Linear:
                m.forward = functools.partial(linear_forward_deferring_weight_grad, m, wanted=wanted or _never, owner=owner)
                self._patched.append(m)
                continue
            original = m.__dict__.get("forward")
            if is_conv1d(layer):
                patched = functools.partial(conv1d_forward_deferring_in_half, owner, m, original, wanted or _never)
            else:
                patched = functools.partial(forward_without_in_module_grads, owner, m, original)
            patched.__signature__ = inspect.signature(m.forward)  # (what inspects it, e.g. the Trainer, sees the layer's)
            m.forward = patched
            self._half_patched.append((m, original))

    def cleanup(self) -> None:
        if self._step_hook is not None:  # the step clock of follow_steps()
            self._step_hook.remove()
            self._step_hook = None
        for m in self._patched:
            m.__dict__.pop("forward", None)
        for m, original in self._half_patched:
            m.__dict__.pop("forward", None)
            if original is not None:
                m.forward = original
        super().cleanup()


def _rows(gradient: torch.Tensor, batch_first: bool) -> int:
    """The examples an output gradient holds (its batch dimension)."""
    dim = 0 if batch_first else 1
    return int(gradient.shape[dim]) if gradient.dim() > dim else 1


def _saves_inputs(module: nn.Module) -> bool:
    """Whether a call of ``module`` has its inputs captured, or would with the hooks on
    (decided alike in a forward and in its checkpoint replay)."""
    return requires_grad(module) and module.training and torch.is_grad_enabled()


def _scaled_factors(clipped: Callable[[torch.Tensor], torch.Tensor], scale: float, factors: torch.Tensor) -> torch.Tensor:
    """``clipped(scale * c)``: a record whose per-example values are ``1 / scale`` of each row's
    gradient of its own loss (an embedding's unscaled output gradients under "mean")."""
    return clipped(factors * scale if scale != 1.0 else factors)


def half_precision_layer_error(layer: type) -> ValueError:
    """The refusal of a layer type whose clipped sum the two-pass forms cannot compute in float32
    when it is called in half precision (its norm sampler or tied projection gives no per-example
    gradient, and autograd's batch sum would be a half-precision one)."""
    return ValueError(
        f"{layer.__name__} called in half precision (half-precision parameters, inputs or autocast) is "
        "not supported by the two-pass forms: its per-example norms come from a registered norm sampler "
        "or tied projection that gives no per-example gradient, so its clipped sum cannot be summed in "
        "float32 (and autograd's would be a half-precision sum, which one example can move by more than "
        "the clipping bound). Run it in float32 (e.g. outside autocast), or use per_example_backward=True"
    )


def unmatched_tied_uses_error(cause: str) -> ValueError:
    """The refusal of a norm step while a tied parameter's running sum still waits for uses:
    clipping with part of its per-example gradient would under-estimate the norm. ``cause``:
    :meth:`~opacus_rc.draws.BatchReader.no_backward_cause`."""
    return ValueError(
        "a tied parameter's forward uses and backward hooks do not match (a forward "
        "pass without its backward pass?): refusing to clip; run forward and backward "
        f"in pairs while the privacy hooks are on. {cause}"
    )


def head_used_twice_error(bookkeeping: bool = False) -> ValueError:
    """The refusal of a second use of the chunked head in one pass, whose norm would miss a use."""
    other = (
        "any other use of lm_head in the pass is refused under book-keeping"
        if bookkeeping else "another direct use of lm_head must come before the loss (it is then summed "
        "with the loss's use, as tied uses are)"
    )
    return ValueError(
        "ChunkedLMHeadLoss was called more than once in one forward pass, or lm_head was also "
        f"applied directly after it: the head's per-example norm would miss a use. Call the loss "
        f"once per batch; {other}"
    )


def check_norms_cover_batch(norms: Sequence[Tuple[str, torch.Tensor]]) -> None:
    """Every per-sample norm covers the batch (the most examples any of them covers);
    ``norms`` pairs each with what the error calls the layer or parameter it is of."""
    batch = max((int(n.shape[0]) for _, n in norms), default=0)
    for what, n in norms:
        if n.shape[0] != batch:
            raise ValueError(
                f"per-sample norms of {what} cover {n.shape[0]} examples but the batch has "
                f"{batch}: the layer's input was broadcast over the batch (e.g. position ids "
                "of shape (1, T)); pass it with a batch dimension (e.g. position_ids of shape (B, T))"
            )


class SketchingMixin(PerExampleStore):
    """Two-pass randomized clipping: binds the randomized norm samplers to this module's
    sketcher (Opacus's hooks look up ``self.NORM_SAMPLERS``)."""

    _opacus_options = {"use_ghost_clipping": True}
    #: the norm pass's in-module gradient sums are noted and checked (not under FSDP2, whose
    #: reduce-scatter leaves only a shard of the ranks' average in p.grad)
    _notes_in_module_grads = True

    def _setup(self) -> None:
        self.NORM_SAMPLERS = {
            cls: functools.partial(self._scaled_norms, fn)
            for cls, fn in {**RANDOMIZED_NORM_SAMPLERS, **self._third_party_samplers}.items()
        }
        # Opacus's per-sample gradients of the other layers (hooks or functorch): their batch
        # sum is noted too (:meth:`note_in_module_grad`)
        self.GRAD_SAMPLERS = _SummingGradSamplers(self, type(self).GRAD_SAMPLERS)
        #: the norm pass's in-module gradient sums, checked by the optimizer's clip guard
        self.in_module_sums = InModuleSums()
        #: per (layer, parameter name): the norm pass's ``clipped(c)`` of each half-precision use
        #: of a layer that is not a linear one (:meth:`_record_clipped`)
        self._clipped_records: Dict[Tuple[int, str], Tuple[nn.Module, str, List[Callable]]] = {}
        self._unscaled_backprops = False
        # The first backward pass only needs output gradients: linear layers compute
        # their weight gradients in the second (clipped) pass only, when hooks are off.
        self._defer_weight_grads(wanted=self._in_second_pass)
        # Both backward passes recompute a checkpointed region: one that redraws its random
        # state (preserve_rng_state=False) is refused, checked at every module's call (a
        # region without trainable layers changes the gradients upstream of it too).
        self.autograd_grad_sample_hooks.extend(
            m.register_forward_pre_hook(refuse_unpreserved_rng_replay) for m in self._module.modules()
        )

    def _in_second_pass(self) -> bool:
        return not self.hooks_enabled

    def get_clipping_coef(self) -> torch.Tensor:
        """Opacus's per-example clipping factors of the second pass; at user level each
        row's factor is its user's (:func:`~opacus_rc.units.mean_clip_factors`: the mean of
        the user's rows clipped once). The clipped sums of the layers called in half precision
        that are not linear ones are computed here, in float32, from the norm pass's records."""
        records, self._clipped_records = self._clipped_records, {}
        norms = self.get_norm_sample()
        units = self.batch.units_of(norms.shape[0])
        sizes = unit_sizes(units)
        norms = norms[: len(sizes)]  # the units' summed gradients' (in_row_slots)
        factors = per_row(mean_clip_factors(norms, sizes.to(norms), self.max_grad_norm), units)
        self._deliver_records(list(records.values()), factors)
        return factors

    def _on_pass_start(self) -> None:
        """A new forward's records replace any a failed pass left."""
        self._clipped_records.clear()

    def _record_clipped(self, layer: nn.Module, name: str, clipped: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """A half-precision use of ``layer`` (not a linear one) in the norm pass: ``clipped(c)`` is
        its parameter ``name``'s clipped sum ``sum_r c_r grad_r`` over the rows, in float32, for the
        per-row clip factors ``c`` (autograd computes none: :mod:`opacus_rc.half_precision`)."""
        self._clipped_records.setdefault((id(layer), name), (layer, name, []))[2].append(clipped)

    def _deliver_records(self, records: List[Tuple[nn.Module, str, List[Callable]]], factors: torch.Tensor) -> None:
        """Each recorded parameter's clipped sum over its uses, ``sum_r c_r grad_r``, to
        :meth:`deliver_clipped_sum` (a sharded form: every half-precision parameter, in call order)."""
        for layer, name, uses in records:
            total = uses[0](factors)
            for clipped in uses[1:]:
                total = total.add_(clipped(factors))
            self.deliver_clipped_sum(layer, name, total)

    def _record_half_use(self, module: nn.Module, ids: torch.Tensor, backprops: torch.Tensor, scale: float) -> None:
        """A half-precision use of ``module`` seen by a norm sampler or tied projection: an
        embedding's clipped sum is recorded (its rows' gradients of ``l_i``: ``backprops`` times
        ``scale``); a linear-type layer's comes from its clipped pass; any other is refused."""
        layer = self._get_module_type(module)
        if layer is nn.Embedding:
            if module.weight.requires_grad:
                embedding = functools.partial(clipped_embedding, ids, backprops, layer=module)
                self._record_clipped(module, "weight", functools.partial(_scaled_factors, embedding, scale))
        elif layer is not nn.Linear and not is_conv1d(layer):
            raise half_precision_layer_error(layer)

    def get_norm_sample(self) -> torch.Tensor:
        """Per-example norms over all trainable parameters (L2 of the per-parameter norms),
        refused when a layer took no part in the backward pass or did not see the batch
        dimension, or a tied parameter's sum waits for a use (finiteness: the optimizer's step).
        The norms are consumed: a later pass never reuses them for other examples."""
        try:
            if self._tied_sums:  # a tied running sum waits for a use: its norm would miss it
                raise unmatched_tied_uses_error(self.no_backward_cause())
            named = list(trainable_parameters(self._module))
            missing = [name for name, p in named if getattr(p, "_norm_sample", None) is None]
            if missing:
                raise missing_per_sample_error(", ".join(repr(n) for n in missing), self.no_backward_cause())
            check_norms_cover_batch([(repr(name), p._norm_sample) for name, p in named])
            return super().get_norm_sample()
        finally:
            self.forget_per_example_values()

    def norm_pass_pending(self) -> bool:
        """True if a backward pass left per-example norms that no clipped pass consumed
        (a plain ``loss.backward()`` with the hooks on): the optimizer refuses the step."""
        return bool(self._tied_sums) or any(
            getattr(p, "_norm_sample", None) is not None for p in self.trainable_parameters
        )

    def forget_per_example_values(self) -> None:
        """Drop the per-example norms kept on the parameters (they would reach
        ``torch.save(model)``), the norm pass's in-module gradient sums and its half-precision
        records."""
        for p in self.trainable_parameters:
            set_norm_sample(p, None)
        self._tied_sums.clear()
        self.in_module_sums.clear()
        self.forget_clipped_sums()

    def forget_clipped_sums(self) -> None:
        """Drop the half-precision records and clipped sums of a pass that did not end (never
        released: :mod:`opacus_rc.half_precision`)."""
        self._clipped_records.clear()
        self.clipped_pass_sums.clear()

    # --- the in-module gradient of the norm pass (see opacus_rc.clip_guard.ClipGuard.check_norm_pass)

    def note_in_module_grad(self, param: nn.Parameter, grad_sum: torch.Tensor, dtype: torch.dtype) -> None:
        """One use of ``param`` inside its module in the norm pass contributed ``grad_sum``
        to the gradient autograd accumulates (:meth:`InModuleSums.add`), kept until the
        check after the norm pass."""
        if self._notes_in_module_grads and self.hooks_enabled and param.requires_grad:
            self.in_module_sums.add(param, grad_sum, dtype)

    def _backprops_scale(self, module: nn.Module) -> float:
        """The factor turning a batch sum of the (rearranged) per-example gradients into
        ``p.grad``'s units: Opacus scales the output gradients by n under "mean"."""
        n = module.max_batch_len
        return 1.0 / n if self.loss_reduction == "mean" and n > 0 else 1.0  # (an empty batch: zeros)

    def _note_embedding_use(self, module: nn.Module, activations, backprops: torch.Tensor, scale: float) -> None:
        """One use of an embedding in the norm pass: ``backprops`` times ``scale`` sum to its share of
        ``p.grad`` (noted), or, called in half precision, its clipped sum is recorded (each row's
        gradient of its own loss: ``p.grad``'s units divided by :meth:`_backprops_scale`)."""
        if module in self.half_calls:  # autograd computes none of it
            self._record_half_use(module, activations[0], backprops, scale / self._backprops_scale(module))
        elif module.weight.requires_grad:
            grad = embedding_grad_sum(activations[0], backprops, module.num_embeddings, module.padding_idx)
            self.note_in_module_grad(module.weight, grad.mul_(scale) if scale != 1.0 else grad, backprops.dtype)

    def _refuse_use_after_its_norm(self, module: nn.Module) -> None:
        if any(getattr(p, "_norm_sample", None) is not None for _, p in trainable_parameters(module)):
            raise late_use_error(self._get_module_type(module).__name__)

    def capture_activations_hook(
        self, module: nn.Module, forward_input: List[torch.Tensor], _forward_output: torch.Tensor
    ) -> None:
        """Opacus's activation capture, without ghost mode's refusal of tied parameters:
        a parameter used several times is handled by :meth:`_capture_tied_backprops`."""
        self._capture(
            module, forward_input,
            lambda: GradSampleHooks.capture_activations_hook(self, module, forward_input, _forward_output),
        )

    def capture_backprops_hook(
        self,
        module: nn.Module,
        _forward_input: torch.Tensor,
        forward_output: torch.Tensor,
        loss_reduction: str,
        batch_first: bool,
    ) -> None:
        self.expect_forward()
        passes = self.output_passes  # plain-loss scripts: opacus_rc.forms.output_passes
        if passes is not None and self.hooks_enabled:
            passes.check_inside(module)
        if self.hooks_enabled and self._is_tied_use(module):
            self._capture_tied_backprops(module, forward_output, loss_reduction, batch_first)
            return
        if self.hooks_enabled:
            check_no_mean_in_half(loss_reduction, forward_output[0], _rows(forward_output[0], batch_first))
        # The randomized norm samplers apply the "mean" factor to the norms (see
        # rearrange_grad_samples), keyed by the layer's real class (FSDP2 renames it).
        self._unscaled_backprops = self._get_module_type(module) in self.NORM_SAMPLERS
        try:
            super().capture_backprops_hook(module, _forward_input, forward_output, loss_reduction, batch_first)
        finally:
            self._unscaled_backprops = False

    def rearrange_grad_samples(self, *, module, backprops, loss_reduction, batch_first):
        """Opacus's rearrangement; for layers with a randomized norm sampler the "mean"
        factor (the batch size) is applied to the norms instead of to a copy of the
        output gradients (``||n M|| = n ||M||``), saving one (B, T, p) tensor per layer."""
        if self._unscaled_backprops:
            loss_reduction = "sum"
        return super().rearrange_grad_samples(
            module=module, backprops=backprops, loss_reduction=loss_reduction, batch_first=batch_first
        )

    def _scaled_norms(self, norm_sampler, module, activations, backprops):
        if self._get_module_type(module) is nn.Embedding:  # (backprops unscaled here)
            self._note_embedding_use(module, activations, backprops, 1.0)
        elif module in self.half_calls:  # a linear one sums in its clipped pass; others refused
            self._record_half_use(module, activations[0], backprops, 1.0)
        rows = int(backprops.shape[0])  # a unit's rows as one sequence of all its tokens
        a, g = regroup_uses(module, activations[0], backprops, self.batch.units_of(rows))
        norms = norm_sampler(module, [a], g, self.sketcher)
        norms = {p: in_row_slots(n, rows) for p, n in norms.items()}  # Opacus keeps B slots
        if self.loss_reduction == "mean":
            norms = {p: n * module.max_batch_len for p, n in norms.items()}
        return norms

    def deliver_head(self, layer: nn.Module, values: Any) -> None:
        """The chunked head's per-unit values of this pass (``values``:
        :class:`opacus_rc.lm_head.HeadValues`), in the first of the batch's row slots as every
        layer's (:func:`~opacus_rc.units.in_row_slots`): a tied use joins its parameters' running
        sums (:meth:`_add_tied_use`), an untied one's norms are the parameters' own."""
        self.expect_forward()
        contributions = {name: in_row_slots(c, values.rows) for name, c in values.contributions.items()}
        if values.tied:
            for name, contribution in contributions.items():
                self._add_tied_use(layer, getattr(layer, name), contribution)
            return
        norms = {name: c if c.dim() == 1 else c.flatten(start_dim=1).norm(2, dim=1) for name, c in contributions.items()}
        self._store_untied_norms(layer, norms)

    def _store_untied_norms(self, layer: nn.Module, norms: Dict[str, torch.Tensor]) -> None:
        """An untied layer's per-example norms, of this use alone: any other use of it in the
        pass (a use still to come, one summed as tied, one already delivered) is refused."""
        params = [getattr(layer, name) for name in norms]
        if any(p._forward_counter != 1 or p in self._tied_sums for p in params):
            raise head_used_twice_error()
        for p, norm in zip(params, norms.values()):
            set_norm_sample(p, norm)
            count_uses(p, -1)

    def _is_tied_use(self, module: nn.Module) -> bool:
        """True if one of the module's trainable parameters is used more than once in
        this forward pass (tied weights) or has a pending sum from an earlier use."""
        return any(p._forward_counter > 1 or p in self._tied_sums for _, p in trainable_parameters(module))

    def _tied_slot(self, module: nn.Module, param: nn.Parameter) -> Any:
        """What keys a tied parameter's running sum (in ``_tied_sums``), keeps its uses
        still to come in this pass (``_forward_counter``, Opacus's) and its per-sample
        norm (``_norm_sample``): in one process, the parameter itself."""
        return param

    def _capture_tied_backprops(
        self, module: nn.Module, forward_output: Any, loss_reduction: str, batch_first: bool
    ) -> None:
        """A use of tied parameters: their sketched per-unit gradients (one sketch for all uses of
        a parameter; a unit's rows regrouped into one sequence) join their running sums
        (:meth:`_add_tied_use`)."""
        activations, backprops = self.rearrange_grad_samples(
            module=module, backprops=forward_output[0].detach(),
            loss_reduction=loss_reduction, batch_first=batch_first,
        )
        rows = int(backprops.shape[0])
        a, g = self.regrouped(module, activations[0], backprops)
        for param, contribution in self.tied_projection(module)(module, [a], g, self.sketcher).items():
            self._add_tied_use(module, param, in_row_slots(contribution, rows))
        if self._get_module_type(module) is nn.Embedding:  # (backprops scaled by n under "mean")
            self._note_embedding_use(module, activations, backprops, self._backprops_scale(module))
        elif module in self.half_calls:
            self._record_half_use(module, activations[0], backprops, 1.0)
        if len(module.activations) == 0 and hasattr(module, "max_batch_len"):
            del module.max_batch_len

    def _add_tied_use(self, module: nn.Module, param: nn.Parameter, contribution: torch.Tensor) -> None:
        """One use of the tied ``param`` through ``module``: ``contribution`` joins the
        running sum; at the last use, the norm of the sum is the per-sample norm."""
        slot = self._tied_slot(module, param)
        total = self._tied_sums.pop(slot, None)
        total = contribution if total is None else total + contribution
        if count_uses(slot, -1) == 0:
            set_norm_sample(slot, total.flatten(start_dim=1).norm(2, dim=1))
        else:
            self._tied_sums[slot] = total


def embedding_grad_sum(ids: torch.Tensor, g: torch.Tensor, rows: int, padding_idx: Optional[int]) -> torch.Tensor:
    """The batch gradient of an embedding weight, ``sum_i onehot(ids_i)^T G_i`` (rows x d,
    float32): one ``index_add`` of the output gradients at the ids (padding row zero, as
    autograd's embedding backward leaves it)."""
    g = g.reshape(-1, g.shape[-1])
    out = torch.zeros(rows, g.shape[-1], dtype=torch.float32, device=g.device)
    out.index_add_(0, ids.reshape(-1), g.float())
    if padding_idx is not None:
        out[padding_idx] = 0
    return out


class _SummingGradSamplers(dict):
    """Opacus's grad samplers (``GRAD_SAMPLERS`` by layer type, else functorch's) whose
    per-sample gradients' batch sum is handed to ``owner.note_in_module_grad`` during the
    norm pass: one reduction of the per-sample gradients Opacus computes anyway."""

    def __init__(self, owner: Any, samplers: Dict[Any, Callable]) -> None:
        super().__init__(samplers)
        self._owner = owner

    def __contains__(self, layer: Any) -> bool:  # every type: functorch's too
        return True

    def __getitem__(self, layer: Any) -> Callable:
        from opacus.grad_sample.functorch import ft_compute_per_sample_gradient

        fn = dict.get(self, layer, ft_compute_per_sample_gradient)
        return functools.partial(self._summed, fn)

    def _summed(self, fn: Callable, module: nn.Module, activations: Any, backprops: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
        grad_samples = fn(module, activations, backprops)
        owner = self._owner
        half = module in owner.half_calls  # autograd computes none of it: the clipped sums are recorded
        if half:
            names = {id(p): name for name, p in module.named_parameters()}
            for param, gs in grad_samples.items():  # each row's gradient of its own loss
                if param.requires_grad:
                    owner._record_clipped(module, names[id(param)], functools.partial(clipped_grad_sample, gs))
        units = owner.batch.units_of(int(backprops.shape[0]))  # a unit's rows summed, in the first U slots
        grad_samples = {p: in_row_slots(sum_rows_by_unit(gs, units), len(units)) for p, gs in grad_samples.items()}
        scale = owner._backprops_scale(module)
        for param, gs in ([] if half else grad_samples.items()):
            total = gs.sum(dim=0)
            owner.note_in_module_grad(param, total.mul_(scale) if scale != 1.0 else total, backprops.dtype)
        return grad_samples


class GradSampleHooksRandomizedClipping(SketchingMixin, GradSampleHooksFastGradientClipping):
    """Hooks (``wrap_model=False``) form of randomized clipping.

    ``per_sample_gradient_norms`` holds the *estimated* norms of the last batch (not
    privatized: for debugging only, as in Opacus).
    """


class GradSampleModuleRandomizedClipping(SketchingMixin, GradSampleModuleFastGradientClipping):
    """Wrapping (``wrap_model=True``) form of randomized clipping."""


# --- Linear layers whose weight gradient autograd computes only when wanted ---------


class _LinearDeferredWeightGrad(torch.autograd.Function):
    """``F.linear`` whose backward computes the parameter gradients only when
    ``wanted()`` says so: book-keeping never needs them from autograd, the two-pass
    method only in its second (clipped) pass. With a ``sink`` (a half-precision call), the
    gradients are summed over the rows in float32 and handed to ``sink(name, sum)``, not to
    autograd (which would round them to a half-precision parameter's dtype). ``transposed``:
    the weight is stored (d x p), Hugging Face ``Conv1D``'s."""

    @staticmethod
    def forward(ctx, x, weight, bias, wanted: Callable[[], bool], sink: Optional[Callable] = None, transposed: bool = False):
        ctx.save_for_backward(x, weight)
        ctx.wanted, ctx.sink, ctx.transposed = wanted, sink, transposed
        ctx.has_bias = bias is not None
        return F.linear(x, weight.t() if transposed else weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        # Under autocast the forward ran in lower precision than the saved tensors: the
        # products run in the output gradient's dtype (autograd casts each gradient back
        # to its input's dtype).
        dtype = grad_out.dtype
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out.matmul(weight.to(dtype).t() if ctx.transposed else weight.to(dtype))
        grad_w = grad_b = None
        if ctx.wanted():
            g = grad_out.reshape(-1, grad_out.shape[-1])
            a = x.reshape(-1, x.shape[-1])
            wants_w, wants_b = ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]
            if ctx.sink is not None:  # sum_rows G^T A in float32, to the form (issue 52)
                if wants_w:
                    ctx.sink("weight", summed_product(a, g) if ctx.transposed else summed_product(g, a))
                if wants_b:
                    ctx.sink("bias", summed_rows(g))
                return grad_x, None, None, None, None, None
            if wants_w:
                grad_w = a.to(dtype).t().mm(g) if ctx.transposed else g.t().mm(a.to(dtype))
            if wants_b:
                grad_b = g.sum(dim=0)
        return grad_x, grad_w, grad_b, None, None, None


def _never() -> bool:
    return False


def _sink(owner: Optional[OwnerRef], layer: nn.Module, x: torch.Tensor) -> Optional[Callable]:
    """Where a linear-type layer's float32 clipped sums go in a half-precision call (None: to
    autograd, as any gradient)."""
    module = None if owner is None else owner()
    if module is None or not module.half_precision_call(layer, x):
        return None
    return functools.partial(module.deliver_clipped_sum, layer)


def linear_forward_deferring_weight_grad(
    layer: nn.Linear, x: torch.Tensor, wanted: Callable[[], bool] = _never, owner: Optional[OwnerRef] = None
) -> torch.Tensor:
    """Forward of ``layer`` whose parameter gradients autograd computes only when
    ``wanted()`` (default: never; book-keeping assembles them instead); in a half-precision
    call of ``owner``'s training pass, as float32 sums handed to it."""
    return _LinearDeferredWeightGrad.apply(x, layer.weight, layer.bias, wanted, _sink(owner, layer, x))


def conv1d_forward_deferring_in_half(
    owner: OwnerRef, layer: nn.Module, original: Optional[Callable], wanted: Callable[[], bool], x: torch.Tensor
) -> torch.Tensor:
    """Forward of Hugging Face ``Conv1D`` (``x W + b``, W (d x p)): in a half-precision call, as
    :func:`linear_forward_deferring_weight_grad` (weight transposed); otherwise its own."""
    sink = None if in_function_transform() else _sink(owner, layer, x)
    if sink is None:
        return original(x) if original is not None else type(layer).forward(layer, x)
    return _LinearDeferredWeightGrad.apply(x, layer.weight, layer.bias, wanted, sink, True)
