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
import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from opacus.grad_sample import (
    GradSampleHooks,
    GradSampleHooksFastGradientClipping,
    GradSampleModule,
    GradSampleModuleFastGradientClipping,
)
from opacus.utils.module_utils import requires_grad, trainable_parameters
from torch import nn

from .bookkeeping import (
    Record,
    as_sequence,
    clipped_bias,
    clipped_embedding,
    clipped_linear_weight,
    linear_forward_deferring_weight_grad,
)
from .config import SketchConfig
from .norm_samplers import RANDOMIZED_NORM_SAMPLERS, TIED_PROJECTIONS, register_model_layers
from .recompute import (
    NON_REENTRANT,
    current_saved_tensors_hooks,
    forward_replay,
    late_use_error,
    missing_per_sample_error,
    resolve_last,
    save_inputs,
)
from .sketch import Sketcher


class _SketcherOwner:
    """Owns the run's sketcher and the layers whose ``forward`` it replaced.

    Args (besides Opacus's grad-sample arguments, passed on):
        sketch_config: estimator, sketch size, sketching.
        sketch_seed: seed of the sketch generator (``None``: from ``os.urandom``).
        secure_mode: draw every sketch from ``os.urandom``.
    """

    _opacus_options: Dict[str, Any] = {}

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
        self.sketch_config = sketch_config
        self._clocked: List[nn.Parameter] = []  # parameters carrying the step clock
        self._sketcher = Sketcher(sketch_config, seed=sketch_seed, secure_mode=secure_mode)
        self._sketcher.bind_step_clock(self._optimizer_steps)
        self._awaiting_forward = True
        self._patched: List[nn.Module] = []
        self._setup()  # defined by each mixin

    @property
    def sketcher(self) -> Sketcher:
        """The run's sketch source (its freshness follows this module's step clock)."""
        return self._sketcher

    @sketcher.setter
    def sketcher(self, sketcher: Sketcher) -> None:
        sketcher.bind_step_clock(self._optimizer_steps)
        self._sketcher = sketcher

    def _optimizer_steps(self) -> Optional[int]:
        """Steps taken by the randomized-clipping optimizer over these parameters (it
        counts them on the parameters), or None if no such optimizer holds them. Read at
        every sketch lookup: the parameters carrying the count are found once."""
        if not self._clocked:
            self._clocked = [p for p in self._module.parameters() if hasattr(p, "_rc_steps_taken")]
            if not self._clocked:
                return None
        return max(p._rc_steps_taken for p in self._clocked)

    def _start_pass(self, module: nn.Module) -> None:
        """The first hooked layer of a training forward pass starts a sketch pass."""
        if self._awaiting_forward and self.hooks_enabled and module.training and torch.is_grad_enabled():
            self.sketcher.begin_pass()
            self._awaiting_forward = False
            self._on_pass_start()

    def _on_pass_start(self) -> None:
        """Per-pass state of a mixin is reset here."""

    def _capture(self, module: nn.Module, forward_input: Sequence[torch.Tensor], capture: Callable[[], None]) -> None:
        """Every activation-capture hook runs its body ``capture()`` (which appends the
        layer's inputs to ``module.activations``, or not) through this.

        * A replay by ``checkpoint(use_reentrant=False)`` captures nothing: its original
          call was captured (:mod:`opacus_rc.recompute`).
        * A reentrant checkpoint's replay is captured but starts no sketch pass (one
          sketch per layer and step).
        * Under saved-tensors hooks (inside a non-reentrant checkpoint region) the
          captured inputs are saved through them, not kept: checkpointing frees them
          and the backward hook gets them recomputed. The replay saves them again at
          the same point (checkpointing matches saved tensors by order), then drops
          them.
        """
        replay = forward_replay()
        hooks = current_saved_tensors_hooks() if _saves_inputs(module) else None
        if replay == NON_REENTRANT:
            if hooks is not None:
                save_inputs(forward_input, hooks)
            return
        if replay is None:
            self._start_pass(module)
        elif self.hooks_enabled:
            self._refuse_use_after_its_norm(module)
        entries = len(getattr(module, "activations", ()))
        capture()
        if hooks is not None:
            saved = save_inputs(forward_input, hooks)
            if len(getattr(module, "activations", ())) > entries:
                module.activations[-1] = saved

    def _refuse_use_after_its_norm(self, module: nn.Module) -> None:
        """Called for a use of ``module`` captured during the backward pass (a reentrant
        checkpoint's replay): raise if a parameter of it already got its per-sample norm
        in this pass, i.e. it is also used after the region (its norm would miss this
        use)."""

    def rearrange_grad_samples(self, *, module, backprops, loss_reduction, batch_first):
        """Opacus's rearrangement, after unpacking inputs saved by :meth:`_capture`."""
        resolve_last(module)
        return super().rearrange_grad_samples(
            module=module, backprops=backprops, loss_reduction=loss_reduction, batch_first=batch_first
        )

    def _defer_weight_grads(self, layers: List[nn.Module], wanted=None) -> None:
        """Linear layers whose backward computes parameter gradients only if ``wanted()``."""
        for m in layers:
            options = {} if wanted is None else {"wanted": wanted}
            m.forward = functools.partial(linear_forward_deferring_weight_grad, m, **options)
            self._patched.append(m)

    def cleanup(self) -> None:
        for m in self._patched:
            m.__dict__.pop("forward", None)
        super().cleanup()


def _saves_inputs(module: nn.Module) -> bool:
    """Whether a call of ``module`` has its inputs captured, or would with the hooks on
    (decided alike in a forward and in its checkpoint replay)."""
    return requires_grad(module) and module.training and torch.is_grad_enabled()


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


def _trainable_linears(model: nn.Module) -> List[nn.Module]:
    return [
        m for m in model.modules()
        if type(m) is nn.Linear and any(p.requires_grad for p in m.parameters(recurse=False))
    ]


class SketchingMixin(_SketcherOwner):
    """Two-pass randomized clipping: binds the randomized norm samplers to this module's
    sketcher (Opacus's hooks look up ``self.NORM_SAMPLERS``)."""

    _opacus_options = {"use_ghost_clipping": True}

    def _setup(self) -> None:
        register_model_layers(self._module)
        self.NORM_SAMPLERS = {
            cls: functools.partial(self._scaled_norms, fn) for cls, fn in RANDOMIZED_NORM_SAMPLERS.items()
        }
        self._unscaled_backprops = False
        # The first backward pass only needs output gradients: linear layers compute
        # their weight gradients in the second (clipped) pass only, when hooks are off.
        self._defer_weight_grads(_trainable_linears(self._module), wanted=self._in_second_pass)

    def _in_second_pass(self) -> bool:
        return not self.hooks_enabled

    def get_norm_sample(self) -> torch.Tensor:
        """Per-example norms over all trainable parameters (L2 of the per-parameter
        norms), with a clear error when a layer did not see the batch dimension or took
        no part in the backward pass (their finiteness is checked by the optimizer's
        step: :mod:`opacus_rc.finite`). The norms are consumed: a later pass never
        reuses them for other examples."""
        try:
            self._check_norm_samples()
            return super().get_norm_sample()
        finally:
            for p in self.trainable_parameters:
                p._norm_sample = None

    def _check_norm_samples(self) -> None:
        """Every trainable parameter has this pass's per-sample norms, over the batch."""
        missing = [name for name, p in trainable_parameters(self._module) if getattr(p, "_norm_sample", None) is None]
        if missing:
            raise missing_per_sample_error(", ".join(repr(n) for n in missing))
        check_norms_cover_batch([(repr(name), p._norm_sample) for name, p in trainable_parameters(self._module)])

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
        self._awaiting_forward = True  # the next forward starts a new pass
        passes = getattr(self, "output_passes", None)  # plain-loss scripts: opacus_rc.output_passes
        if passes is not None and self.hooks_enabled:
            passes.check_inside(module)
        if self.hooks_enabled and self._is_tied_use(module):
            self._capture_tied_backprops(module, forward_output, loss_reduction, batch_first)
            return
        # The randomized norm samplers apply the "mean" factor to the norms (see
        # rearrange_grad_samples), keyed by the layer's real class (FSDP2 renames it).
        self._unscaled_backprops = self._get_module_type(module) in self.NORM_SAMPLERS
        try:
            super().capture_backprops_hook(
                module, _forward_input, forward_output, loss_reduction, batch_first
            )
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
        norms = norm_sampler(module, activations, backprops, self.sketcher)
        if self.loss_reduction == "mean":
            norms = {p: n * module.max_batch_len for p, n in norms.items()}
        return norms

    def _is_tied_use(self, module: nn.Module) -> bool:
        """True if one of the module's trainable parameters is used more than once in
        this forward pass (tied weights) or has a pending sum from an earlier use."""
        return any(
            p._forward_counter > 1 or getattr(p, "_tied_sketch_sum", None) is not None
            for _, p in trainable_parameters(module)
        )

    def _tied_slot(self, module: nn.Module, param: nn.Parameter) -> Any:
        """What keeps a tied parameter's running sum (``_tied_sketch_sum``), its uses
        still to come in this pass (``_forward_counter``, Opacus's) and its per-sample
        norm (``_norm_sample``): in one process, the parameter itself."""
        return param

    def _capture_tied_backprops(
        self, module: nn.Module, forward_output: Any, loss_reduction: str, batch_first: bool
    ) -> None:
        """A use of tied parameters: their sketched per-sample gradients (one sketch for
        all uses of a parameter) join their running sums (:meth:`_add_tied_use`)."""
        layer = self._get_module_type(module)
        projection = TIED_PROJECTIONS.get(layer)
        if projection is None:
            raise ValueError(
                f"parameter tying through {layer.__name__} is not supported with "
                f"clipping='randomized'; supported layers: "
                f"{', '.join(c.__name__ for c in TIED_PROJECTIONS)}"
            )
        activations, backprops = self.rearrange_grad_samples(
            module=module, backprops=forward_output[0].detach(),
            loss_reduction=loss_reduction, batch_first=batch_first,
        )
        for param, contribution in projection(module, activations, backprops, self.sketcher).items():
            self._add_tied_use(module, param, contribution)
        if len(module.activations) == 0 and hasattr(module, "max_batch_len"):
            del module.max_batch_len

    def _add_tied_use(self, module: nn.Module, param: nn.Parameter, contribution: torch.Tensor) -> None:
        """One use of the tied ``param`` through ``module``: ``contribution`` joins the
        running sum; at the last use, the norm of the sum is the per-sample norm."""
        slot = self._tied_slot(module, param)
        total = getattr(slot, "_tied_sketch_sum", None)
        slot._tied_sketch_sum = contribution if total is None else total + contribution
        slot._forward_counter -= 1
        if slot._forward_counter == 0:
            slot._norm_sample = slot._tied_sketch_sum.flatten(start_dim=1).norm(2, dim=1)
            slot._tied_sketch_sum = None


class GradSampleHooksRandomizedClipping(
    SketchingMixin, GradSampleHooksFastGradientClipping
):
    """Hooks (``wrap_model=False``) form of randomized clipping.

    ``per_sample_gradient_norms`` holds the *estimated* norms of the last batch (not
    privatized: for debugging only, as in Opacus).
    """


class GradSampleModuleRandomizedClipping(
    SketchingMixin, GradSampleModuleFastGradientClipping
):
    """Wrapping (``wrap_model=True``) form of randomized clipping."""


# --- Book-keeping: one backward pass (grad_sample_mode="hooks") ------------------------

BOOKKEPT_LAYERS = (nn.Linear, nn.Embedding)


def _bookkept(module: nn.Module) -> bool:
    """Layers book-kept exactly by type (subclasses, e.g. MultiheadAttention's output
    projection, go through Opacus's per-sample gradients)."""
    return type(module) in BOOKKEPT_LAYERS


class BookkeepingMixin(_SketcherOwner):
    """Records, for linear and embedding layers, what book-keeping needs to assemble the
    clipped gradient after the single backward pass (:mod:`opacus_rc.bookkeeping`):
    the per-sample squared norms (the same estimators as the two-pass method) and a
    closure ``c -> sum_i c_i grad_i``. Every other trainable layer gets Opacus's exact
    per-sample gradients (``p.grad_sample``). Linear layers skip their weight-gradient
    computation in the backward pass, which book-keeping replaces.
    """

    def _setup(self) -> None:
        layers = [
            m for m in self._module.modules()
            if _bookkept(m) and any(p.requires_grad for p in m.parameters(recurse=False))
        ]
        owners: Dict[int, int] = {}
        for m in layers:
            for p in m.parameters(recurse=False):
                owners[id(p)] = owners.get(id(p), 0) + 1
        if any(count > 1 for count in owners.values()):
            raise ValueError(
                "tied weights are not supported by book-keeping (grad_sample_mode='hooks') "
                "with clipping='randomized'; use grad_sample_mode='ghost'"
            )
        self._pending_uses: Dict[nn.Module, List[Any]] = {}  # this pass's uses, per layer
        self._recorded_in_pass: set = set()  # layers whose record of this pass is complete
        self._clear_queued = False  # end-of-backward reset of _recorded_in_pass queued
        self._defer_weight_grads(_trainable_linears(self._module))

    def _on_pass_start(self) -> None:
        self._recorded_in_pass.clear()
        self._clear_queued = False

    def _refuse_use_after_its_norm(self, module: nn.Module) -> None:
        """A replayed use of a layer whose record of this backward pass is already
        complete (used inside a reentrant checkpoint region and after it, or in two
        regions) would become a second record, a second clip factor for one example:
        refused. The replay runs in the user's backward, whose end clears the set."""
        if module in self._recorded_in_pass:
            raise late_use_error(type(module).__name__)
        if not self._clear_queued:
            self._clear_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_pass_start)

    def forbid_grad_accumulation(self) -> None:
        """Opacus forbids accumulation with Poisson sampling because its accountants
        cannot charge it; ``rc_prv`` accounts the micro-batches exactly (a multiplicity,
        :mod:`opacus_rc.accounting.multiplicity`), so it stays allowed."""
        self.allow_grad_accumulation()

    def capture_activations_hook(self, module, forward_input, _forward_output) -> None:
        self._capture(
            module, forward_input,
            lambda: super(BookkeepingMixin, self).capture_activations_hook(module, forward_input, _forward_output),
        )

    def capture_backprops_hook(
        self, module: nn.Module, _forward_input, forward_output, loss_reduction: str, batch_first: bool
    ) -> None:
        """Keep this use's ``(A, G)``; at the layer's last use in the pass, one record of
        the pass: the uses concatenated along the sequence (``sum_l G_l^T A_l = G^T A``
        for ``G = [G_1; ...; G_L]``, ``A = [A_1; ...; A_L]``), so a layer applied L times
        (an RNN cell, a shared block) has the per-example norm of its summed gradient and
        counts as one micro-batch, not L."""
        self._awaiting_forward = True
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
        uses = self._pending_uses.setdefault(module, [])
        uses.append((activations[0], backprops))
        for param in params:
            param._forward_counter -= 1
        if len(module.activations) == 0 and hasattr(module, "max_batch_len"):
            del module.max_batch_len
        if any(param._forward_counter > 0 for param in params):
            return  # more uses of this layer in this pass are still to come
        a, g = concatenate_uses(module, self._pending_uses.pop(module))
        self._recorded_in_pass.add(module)
        norms = RANDOMIZED_NORM_SAMPLERS[type(module)](module, [a], g, self.sketcher)
        for param, norm in norms.items():
            records = getattr(param, "_bk_records", None) or []
            records.append(Record(norm.pow(2), _clipped_sum(module, param, a, g)))
            param._bk_records = records


def concatenate_uses(module: nn.Module, uses: List[Any]) -> Any:
    """One ``(A, G)`` for the uses ``[(A_l, G_l)]`` of a layer in one pass, concatenated
    along the (flattened) sequence dimension: ``(B, sum_l T_l, d)`` and ``(B, sum_l T_l,
    p)`` (ids ``(B, sum_l T_l)`` for an embedding). A single use is returned as it is."""
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
