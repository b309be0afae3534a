"""Randomized clipping under FSDP2 (Opacus's ``grad_sample_mode="ghost_fsdp"``; docs/guide.md,
"Sharded training").

* **Norms** (:class:`GradSampleModuleRandomizedClippingFSDP`): each rank computes the
  per-sample norms of its own examples in the first backward pass, as Opacus's ghost_fsdp;
  linear weights are sketched (no weight gathered; their weight-gradient matmul skipped), other
  layers exact. The second (clipped) pass is Opacus's.
* **Noise** (:class:`FSDPRandomizedClippingOptimizer`): each rank adds noise of std
  ``sigma C / world_size`` (mean loss) to the shard it owns, drawn for the full shape and
  sliced (independent across shards even under identical seeds); ``secure_mode`` draws only
  the shard, from ``os.urandom``.
* **Sketches**: shared sketches are the same on every rank (rank 0's entropy seed broadcast
  without ``sketch_seed``); per-example sketches are independent across ranks.
* **Tied weights** (grouped by hand, ``fully_shard([emb, head])``): every use adds its sketched
  per-sample gradient to a running sum and the norm is taken of the sum, as in one process
  (Opacus's per-module norms would count ``||a||^2 + ||b||^2``); uses are tracked by parameter
  name under the sharded parameter's identity, since FSDP2 swaps the parameter objects.
* **Layers applied several times** in one forward pass (a Linear called twice, an RNN cell in a
  loop, ALBERT-style shared layers): at its second use a layer becomes tied for the pass (its
  first use's inputs and count moved to the per-parameter counters) and its uses are summed as
  tied weights' are; a layer type without a tied projection is refused (``"tied_layer"``,
  :mod:`opacus_rc.refusals`). The decision is the model code's, the same on every rank.
* **Consensus**: a refused step is agreed on by all ranks (one scalar all-reduce).
* **Empty shares**: a rank whose Poisson share has no rows runs both backward passes (every
  FSDP2 collective) with empty per-example norms and contributes a zero clipped sum
  (:class:`_EmptyShareHooks`); its criterion reports a mean loss of 0.
* **User level** (``privacy_unit="user"``): the loader shards users, not rows (rank r draws users
  r, r + W, ... at ``q_u``; :class:`~opacus_rc.units.UserPoissonSampler`), so a drawn user's rows
  are all on one rank. That rank forms the user's sums in the norm pass (the two-pass form's
  regrouped sequences, :func:`~opacus_rc.units.regroup_uses`) and weights each of its rows by
  ``c_u / m_u`` in the clipped pass; FSDP2 reduce-scatters the clipped sums
  ``sum_u c_u mean_{r in u} g_r`` as at example level. No per-user value crosses ranks. Tied
  parameters and the chunked LM head take the two-pass form's per-user path: a tied use's rows
  regrouped into the rank's users before its projection, the uses' projections summed per user in
  the tied slots before the norm; the head's block sums reduced to users.

Book-keeping does not fit FSDP2's hooks and is refused (:func:`check_fsdp_mode`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from opacus.grad_sample import (
    GradSampleHooksFastGradientClippingFSDP,
    GradSampleModuleFastGradientClippingFSDP,
)
from opacus.optimizers import FSDPOptimizerFastGradientClipping
from opacus.utils.module_utils import trainable_parameters
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from ..clipped_sums import wide_dtype
from ..estimators import at_least_float32
from ..finite import local_shard
from ..grad_sample import (
    SketchingMixin, _saves_inputs, check_norms_cover_batch, head_used_twice_error, unmatched_tied_uses_error,
)
from ..norm_samplers import TIED_PROJECTIONS, is_conv1d
from ..optimizer import SketchedClippingMixin, clipped_grads
from ..per_parameter import set_norm_sample
from ..recompute import late_use_error
from ..refusals import refusal
from ..sketch import entropy_seed
from ..values import FSDP_MODE

logger = logging.getLogger(__name__)


def is_fsdp_module(module: Any) -> bool:
    """True for a module wrapped by FSDP2's ``fully_shard`` (e.g. by ``FSDP2Wrapper``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


def _contains_fsdp(module: Any) -> bool:
    return isinstance(module, nn.Module) and any(is_fsdp_module(m) for m in module.modules())


def check_fsdp_mode(module: Any, grad_sample_mode: str) -> None:
    """Refuse grad-sample modes that do not fit a model sharded by FSDP2 (book-keeping needs
    every clip factor before FSDP2 reduce-scatters during the backward pass: docs/benchmarks.md),
    and ``ghost_fsdp`` on a model that is not."""
    sharded = _contains_fsdp(module)
    if sharded and grad_sample_mode != FSDP_MODE:
        raise ValueError(
            f"clipping='randomized' with grad_sample_mode={grad_sample_mode!r} does not "
            "support a model sharded by FSDP2 (fully_shard / FSDP2Wrapper): use "
            f"grad_sample_mode={FSDP_MODE!r} (two backward passes). Book-keeping "
            "(grad_sample_mode='hooks') needs every clip factor before gradients are "
            "reduced, which FSDP2 does during the backward pass"
        )
    if grad_sample_mode == FSDP_MODE and isinstance(module, nn.Module) and not sharded:
        raise ValueError(
            f"grad_sample_mode={FSDP_MODE!r} needs a model wrapped by FSDP2 "
            "(opacus.utils.fsdp_utils.FSDP2Wrapper); for one process or DPDDP use "
            "grad_sample_mode='ghost' or 'hooks'"
        )


def shared_sketch_seed(seed: Optional[int], secure_mode: bool) -> Optional[int]:
    """The sketch seed every rank uses: ``seed``, or rank 0's entropy seed broadcast to
    all ranks (shared sketches must be one sketch for the whole logical batch). Secure
    mode draws every sketch from ``os.urandom`` and keeps ``None``."""
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if seed is not None or secure_mode or not distributed:
        return seed
    box = [entropy_seed() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


class _TiedSlot:
    """A tied parameter's state in one backward pass under FSDP2, which swaps the
    parameter objects: what one process keeps on the parameter
    (:meth:`SketchingMixin._tied_slot`), kept under the sharded parameter's identity."""

    _forward_counter = 0  # uses still to come in this backward pass
    _norm_sample: Optional[torch.Tensor] = None  # this pass's per-sample norm


class FSDPSketchingMixin(SketchingMixin):
    """Two-pass randomized clipping on Opacus's FSDP hooks: per-sample norms kept on the module
    (``module.norm_sample``, Opacus's FSDP layout), not on the parameters FSDP2 swaps."""

    sharded = True

    _notes_in_module_grads = False  # p.grad: a shard of the ranks' average, not this rank's sum

    def __init__(self, m: nn.Module, *, sketch_seed: Optional[int] = None, secure_mode: bool = False, **kwargs: Any) -> None:
        super().__init__(
            m, sketch_seed=shared_sketch_seed(sketch_seed, secure_mode), secure_mode=secure_mode, **kwargs
        )

    def _setup(self) -> None:
        owners: Dict[int, List[nn.Module]] = {}
        for m in self._module.modules():
            for p in m.parameters(recurse=False):
                if p.requires_grad:
                    owners.setdefault(id(p), []).append(m)
        # modules sharing a trainable parameter: handled per parameter (module docstring)
        tied = [m for ms in owners.values() if len(ms) > 1 for m in ms]
        layers = {self._get_module_type(m) for m in tied}
        unsupported = sorted(layer.__name__ for layer in layers if layer not in TIED_PROJECTIONS)
        if unsupported:
            raise refusal("tied_layer", layer=", ".join(unsupported), form="grad_sample_mode='ghost_fsdp'",
                          supported=", ".join(c.__name__ for c in TIED_PROJECTIONS))
        self._tied_modules = {id(m) for m in tied}
        #: each module's own parameters as the optimizer holds them (sharded: FSDP2 swaps the
        #: module's attributes for unsharded ones around its forward and backward)
        self._sharded_params: Dict[Tuple[int, str], nn.Parameter] = {
            (id(m), n): p for m in self._module.modules() for n, p in m.named_parameters(recurse=False)
        }
        self._tied_names: Dict[int, List[Tuple[str, int]]] = {id(m): self._names_and_keys(m) for m in tied}
        self._tied_slots: Dict[int, _TiedSlot] = {}  # this pass's, by sharded identity
        #: the modules tied for this pass because it applies them several times (:meth:`_tie_if_reused`)
        self._reused_modules: set = set()
        super()._setup()

    def _names_and_keys(self, module: nn.Module) -> List[Tuple[str, int]]:
        """``module``'s trainable parameters by name, each with its key: the identity of the sharded
        parameter (FSDP2 swaps the parameter objects; a grouped module's forward hook may already
        see the sharded one, a reused module's second use the unsharded one)."""
        return [
            (n, id(self._sharded_params[(id(module), n)]))
            for n, p in module.named_parameters(recurse=False) if p.requires_grad
        ]

    # --- half precision: the clipped sums reduced in float32 (opacus_rc.half_precision) -----

    def _parameter_named(self, layer: nn.Module, name: str) -> nn.Parameter:
        """The sharded parameter ``name`` of ``layer`` (whichever FSDP2 has registered now)."""
        prefix, _, leaf = name.rpartition(".")
        return self._sharded_params[(id(layer.get_submodule(prefix) if prefix else layer), leaf)]

    def _shard_clipped_sum(self, layer: nn.Module, name: str, total: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the ranks' float32 clipped sums of ``layer``'s parameter ``name``,
        averaged as FSDP2 averages gradients (``sum_ranks S_r / world``): one reduce-scatter in
        float32, never in the parameter's half precision."""
        param = self._parameter_named(layer, name)
        if not isinstance(param, DTensor):
            return total
        mesh = param.device_mesh
        reduced = DTensor.from_local(total, mesh, [Partial()] * mesh.ndim, run_check=False)
        return reduced.redistribute(mesh, param.placements).div_(mesh.size())

    def _deliver_records(self, records, factors: torch.Tensor) -> None:
        """Every parameter of every non-linear layer called in half precision, in call order (the
        same on every rank: each delivery is a collective), its recorded sum or zeros (an empty
        share records none)."""
        recorded = {(id(layer), name): (layer, name, uses) for layer, name, uses in records}
        ordered = []
        for layer in self.half_calls.layers.values():
            if self._get_module_type(layer) is nn.Linear or is_conv1d(self._get_module_type(layer)):
                continue  # (summed in the clipped pass)
            for name, p in layer.named_parameters(recurse=False):
                if p.requires_grad:
                    zero = functools.partial(_zeros_like_param, p)
                    ordered.append(recorded.get((id(layer), name), (layer, name, [zero])))
        super()._deliver_records(ordered, factors)

    def capture_activations_hook(
        self, module: nn.Module, forward_input: List[torch.Tensor], _forward_output: torch.Tensor
    ) -> None:
        """Opacus's FSDP capture (module-level counter). A layer applied several times in one
        forward pass becomes a tied layer for the pass at its second use (:meth:`_tie_if_reused`).
        Activation checkpointing's replays are told apart (:meth:`_capture`)."""
        self._capture(module, forward_input, lambda: self._capture_fsdp_activations(module, forward_input, _forward_output))

    def _refuse_use_after_its_norm(self, module: nn.Module) -> None:
        """Refuse a replayed use of a layer whose norm this pass already took (on the module,
        ``module.norm_sample``, or a tied one's in its parameters' slots)."""
        if id(module) in self._tied_modules:
            done = any(
                getattr(self._tied_slots.get(key), "_norm_sample", None) is not None
                for _, key in self._tied_names[id(module)]
            )
        else:
            done = getattr(module, "norm_sample", None) is not None
        if done:
            raise late_use_error(self._get_module_type(module).__name__)

    def _capture_fsdp_activations(
        self, module: nn.Module, forward_input: List[torch.Tensor], _forward_output: torch.Tensor
    ) -> None:
        captured = _saves_inputs(module) and self.hooks_enabled
        if captured:
            self._tie_if_reused(module)
        if id(module) in self._tied_modules:  # per-parameter use counters
            if captured:
                if not hasattr(module, "activations"):
                    module.activations = []
                module.activations.append([t.detach() for t in forward_input])
                self._count_tied_use(module)
            return
        GradSampleHooksFastGradientClippingFSDP.capture_activations_hook(
            self, module, forward_input, _forward_output
        )

    def _tie_if_reused(self, module: nn.Module) -> None:
        """A module not tied that this forward pass used already (Opacus's module-level counter)
        and uses again: for the rest of the pass its parameters are tied ones (a parameter used
        several times, as by two modules: the norm of the uses' summed projections), its earlier
        uses moved to the per-parameter counters (their inputs stay in ``module.activations``).
        Decided by the model's code alone, so alike on every rank (a refusal included: no rank
        raises alone). A layer type without a tied projection is refused (``"tied_layer"``)."""
        if id(module) in self._tied_modules or getattr(module, "_forward_counter", 0) == 0:
            return
        self.tied_projection(module, use=" applied twice in one forward pass (its parameters used twice)",
                             form=f"grad_sample_mode={FSDP_MODE!r}")
        self._tied_modules.add(id(module))
        self._tied_names[id(module)] = self._names_and_keys(module)
        self._reused_modules.add(id(module))
        for _ in range(module._forward_counter):
            self._count_tied_use(module)
        module._forward_counter = 0

    def _on_pass_start(self) -> None:
        """A layer tied for the last pass by its reuse (:meth:`_tie_if_reused`) is untied again: this
        pass decides anew."""
        super()._on_pass_start()
        for key in self._reused_modules:
            self._tied_modules.discard(key)
            self._tied_names.pop(key, None)
        self._reused_modules.clear()

    def _is_tied_use(self, module: nn.Module) -> bool:
        """Known from the setup, or from the module's second use in this pass
        (:meth:`_tie_if_reused`): FSDP2's parameter objects keep no use counts."""
        return id(module) in self._tied_modules

    def _tied_slot(self, module: nn.Module, param: nn.Parameter) -> _TiedSlot:
        """Found by the parameter's name in the module (see :meth:`_setup`)."""
        names = self._tied_names[id(module)]
        return self._tied_slots[next(key for name, key in names if getattr(module, name) is param)]

    def begin_head_use(self, layer: nn.Module, weight: nn.Parameter, bias: Optional[nn.Parameter]) -> bool:
        """A tied head counts its uses as the tied layers' hooks do (FSDP2's parameters keep no
        counters); a head applied directly earlier in this pass is tied for the pass by this use
        (:meth:`_tie_if_reused`: the two uses summed, as in one process)."""
        if self.hooks_enabled:
            self._tie_if_reused(layer)
        tied = id(layer) in self._tied_modules
        if tied:
            self._count_tied_use(layer)
        return tied

    def _store_untied_norms(self, layer: nn.Module, norms: Dict[str, torch.Tensor]) -> None:
        """On the module, as Opacus's FSDP hooks store them (``layer.norm_sample``, this
        rank's examples); a second delivery in the pass is refused."""
        if getattr(layer, "norm_sample", None) is not None:
            raise head_used_twice_error()
        layer.norm_sample = list(norms.values())

    def _count_tied_use(self, module: nn.Module) -> None:
        """One more use of the tied module's parameters in this backward pass."""
        for _, key in self._tied_names[id(module)]:
            self._tied_slots.setdefault(key, _TiedSlot())._forward_counter += 1

    def get_norm_sample(self) -> torch.Tensor:
        """Per-example norms of this rank's examples over all trainable layers (refused when a
        layer missed the batch dimension or a tied parameter's uses are unmatched)."""
        per_param = [
            (module, norm.flatten(start_dim=1).norm(2, dim=1) if norm.dim() > 1 else norm)
            for module in self.iterate_submodules(self._module)
            if id(module) not in self._tied_modules
            for norm in getattr(module, "norm_sample", [])
        ]
        slots, self._tied_slots = list(self._tied_slots.values()), {}
        pending = bool(self._tied_sums) or any(s._forward_counter != 0 for s in slots)
        self._tied_sums.clear()  # (dropped with their slots)
        per_param += [(self._module, s._norm_sample) for s in slots if s._norm_sample is not None]
        if pending:  # never clip with part of a tied parameter's norm
            raise unmatched_tied_uses_error(self.no_backward_cause())
        check_norms_cover_batch([(f"a {self._get_module_type(m).__name__}", n) for m, n in per_param])
        if per_param:
            device = per_param[0][1].device
            norms = torch.stack([n.to(device) for _, n in per_param]).norm(2, dim=0)
        else:
            norms = torch.zeros(0)
        self.forget_per_example_values()  # not kept past their use
        self.per_sample_gradient_norms = norms  # checked for finiteness by the optimizer's step
        return norms

    def norm_pass_pending(self) -> bool:
        """Per-example norms (on the modules, or in tied slots) no clipped pass consumed."""
        return any(
            getattr(m, "norm_sample", None) is not None for m in self.iterate_submodules(self._module)
        ) or bool(self._tied_sums) or any(s._norm_sample is not None for s in self._tied_slots.values())

    def forget_per_example_values(self) -> None:
        for module in self.iterate_submodules(self._module):
            module.__dict__.pop("norm_sample", None)
        for slot in self._tied_slots.values():
            set_norm_sample(slot, None)
        self._tied_sums.clear()


def _zeros_like_param(param: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """A parameter's clipped sum on a rank without its examples: float32 zeros of its full shape
    (on the clip factors' device)."""
    return torch.zeros(param.shape, dtype=wide_dtype(param.dtype), device=factors.device)


class _EmptyShareHooks:
    """Opacus's FSDP backward hook for a rank whose share of the draw has no rows (an empty
    Poisson share, while another rank has rows): the layers without a norm sampler get empty
    per-example norms (Opacus's FSDP hook reshapes their per-sample gradients to
    ``(0, -1)``, which fails). The backward pass itself (and so every FSDP2 all-gather and
    reduce-scatter) runs as on the other ranks: this rank contributes a zero clipped sum."""

    def capture_backprops_hook(
        self, module: nn.Module, _forward_input: Any, forward_output: Any, loss_reduction: str, batch_first: bool
    ) -> None:
        backprops = forward_output[0]
        batch_dim = 0 if batch_first else 1
        empty = backprops.dim() > batch_dim and backprops.shape[batch_dim] == 0
        if not (self.hooks_enabled and empty) or self._get_module_type(module) in self.NORM_SAMPLERS:
            super().capture_backprops_hook(module, _forward_input, forward_output, loss_reduction, batch_first)
            return
        self.rearrange_grad_samples(  # pops this use's activations (as Opacus's hook)
            module=module, backprops=backprops.detach(), loss_reduction=loss_reduction, batch_first=batch_first
        )
        module.norm_sample = [torch.zeros(0, device=p.device, dtype=p.dtype) for _, p in trainable_parameters(module)]
        module._forward_counter -= 1
        if len(module.activations) == 0 and hasattr(module, "max_batch_len"):
            del module.max_batch_len


class GradSampleModuleRandomizedClippingFSDP(
    FSDPSketchingMixin, _EmptyShareHooks, GradSampleModuleFastGradientClippingFSDP
):
    """Wrapping form of randomized clipping under FSDP2 (``grad_sample_mode="ghost_fsdp"``)."""


class GradSampleHooksRandomizedClippingFSDP(
    FSDPSketchingMixin, _EmptyShareHooks, GradSampleHooksFastGradientClippingFSDP
):
    """Hooks (``wrap_model=False``) form of randomized clipping under FSDP2."""

    _opacus_options: Dict[str, Any] = {}  # Opacus's FSDP hooks always use ghost clipping


class FSDPRandomizedClippingOptimizer(SketchedClippingMixin, FSDPOptimizerFastGradientClipping):
    """:class:`~opacus.optimizers.FSDPOptimizerFastGradientClipping` for randomized
    clipping: each rank noises the shard it owns (std ``sigma C / world_size`` for a
    mean loss), so every parameter element is noised once; the step and the accountant
    hook run on every rank with the same history."""

    refusals_across_ranks = True
    adds_noise = True  # every rank noises the shard it owns

    def noise_holder(self) -> Any:
        """The noise mechanism's state is this rank's shards: ``(rank, world_size)``."""
        return (self.rank, self.world_size)

    def _clipped_sums(self) -> List[Optional[torch.Tensor]]:
        return [self.grad_state[p]["summed_grad"] for p in self.params]

    def accumulate(self) -> None:
        """Move the clipped (sharded) gradient into ``grad_state`` without a copy."""
        for p in self.params:
            state = self.grad_state[p]
            for grad in clipped_grads(p):
                if state["summed_grad"] is None:  # float32 for half-precision parameters (a copy then)
                    state["summed_grad"] = at_least_float32(grad)
                else:
                    state["summed_grad"].add_(grad)

    def noise_sums(self) -> None:
        """Noise ``N(0, (sigma C / world)^2)`` (mean loss) on this rank's shard of every
        parameter (a mechanism with state, e.g. banded noise: each rank steps it on its shard,
        its buffers sharded like the parameters); Opacus's FSDP optimizer calls this under
        ``implicit_replication``."""
        std = self.noise_multiplier * self.max_grad_norm
        if self.loss_reduction == "mean":
            std /= self.world_size
        for slot, p in enumerate(self.params):
            summed = self.grad_state[p]["summed_grad"]
            if summed is None:
                summed = self.grad_state[p]["summed_grad"] = torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32))
            if self.secure_mode:
                local = local_shard(summed)
                local.add_(self.step_noise(slot, std, local))
                p.grad = summed.view_as(p).to(p.dtype)
            else:  # full-shape draw sliced to the shard (Opacus's scheme; module docstring; _noise)
                p.grad = (summed + self.step_noise(slot, std, summed)).view_as(p).to(p.dtype)

    def _noise(self, std: float, reference: torch.Tensor) -> torch.Tensor:
        """N(0, std^2) like ``reference``. For a DTensor outside secure mode: Opacus's full-shape
        draw, sliced to this rank's shard (a DTensor with the reference's placements; the slice
        is local, no collective), so that a mechanism's state (banded noise's kept vectors) is
        sharded like the parameters, not a full copy of each parameter per kept step on every rank."""
        noise = super()._noise(std, reference)
        if self.secure_mode or not isinstance(reference, DTensor) or isinstance(noise, DTensor):
            return noise
        mesh = reference.device_mesh
        replicated = DTensor.from_local(noise, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return replicated.redistribute(mesh, reference.placements)


# --- FSDP2's hooks around a chunked LM head (opacus_rc.lm_head) ----------------------------

class HeadUnit:
    """FSDP2's forward hooks on the LM head of :class:`~opacus_rc.lm_head.ChunkedLMHeadLoss` (a
    ``fully_shard`` unit, alone or grouped with its tied embedding), run around the chunked
    computation as ``nn.Module.__call__`` would run them (docs/lm_head.md); Opacus's are not."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer
        self.state = layer._get_fsdp_state()

        def owned(hook) -> bool:  # a bound method of the state, possibly under functools.wraps
            while hook is not None and getattr(hook, "__self__", None) is not self.state:
                hook = getattr(hook, "__wrapped__", None)
            return hook is not None

        self.pre, self.post = (
            [(i, h) for i, h in hooks.items() if owned(h)] for hooks in (layer._forward_pre_hooks, layer._forward_hooks)
        )
        if not (self.pre and self.post):
            raise RuntimeError(
                f"ChunkedLMHeadLoss: FSDP2's forward hooks on {type(layer).__name__} were not "
                "found (an unsupported torch version?); cannot gather the head's weight"
            )

    def pre_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Run the pre-hooks on ``(hidden,)``; the hidden states to use (FSDP2 wraps them
        in its post-backward node and may cast them to its ``param_dtype``)."""
        args, kwargs = (hidden,), {}
        for hook_id, hook in self.pre:
            if hook_id in self.layer._forward_pre_hooks_with_kwargs:
                result = hook(self.layer, args, kwargs)
                if result is not None:
                    args, kwargs = result
            else:
                result = hook(self.layer, args)
                if result is not None:
                    args = result if isinstance(result, tuple) else (result,)
        return args[0]

    def _run_post(self, hidden: torch.Tensor, output: Any, only_always: bool) -> Any:
        layer = self.layer
        for hook_id, hook in self.post:
            if only_always and hook_id not in layer._forward_hooks_always_called:
                continue
            kwargs = ({},) if hook_id in layer._forward_hooks_with_kwargs else ()
            result = hook(layer, (hidden,), *kwargs, output)
            if result is not None:
                output = result
        return output

    def post_forward(self, hidden: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
        """Run the post-hooks on the losses (B,); the losses to return."""
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        losses = self._run_post(hidden, losses, only_always=False)
        if self.state._training_state == TrainingState.FORWARD:  # partial group: unsharded until backward
            losses = self.state._register_pre_backward_hook(losses)
        return losses

    def failed_forward(self, hidden: torch.Tensor) -> None:
        """The ``always_call`` post-hooks after an exception (as ``nn.Module.__call__``)."""
        try:
            self._run_post(hidden, None, only_always=True)
        except Exception as e:  # the forward's own error is the one raised
            logger.warning("FSDP2 post-forward hook of lm_head failed after an error: %s", e)


def head_unit(layer: nn.Module, owner: Any) -> Optional[HeadUnit]:
    """The FSDP2 unit whose hooks must run around the head (None when not under FSDP2); a
    ``ValueError`` when an enclosing unit shards the head's parameters (its gather does not
    bracket the head's backward passes)."""
    if is_fsdp_module(layer):
        return HeadUnit(layer)
    if (owner is not None and owner.sharded) or any(isinstance(p, DTensor) for p in layer.parameters(recurse=False)):
        raise ValueError(
            "ChunkedLMHeadLoss under FSDP2 needs lm_head to be a fully_shard unit itself: "
            "FSDP2Wrapper shards it so; by hand, fully_shard(lm_head) (or "
            "fully_shard([embedding, lm_head]) for a tied head) before fully_shard(model); got "
            f"a {type(layer).__name__} whose parameters an enclosing unit manages"
        )
    return None
