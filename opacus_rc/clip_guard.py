"""The clip guard: a step releases only gradients that came through a clipped pass.

Each form's optimizer owns one :class:`ClipGuard` (``optimizer.clip_guard``), which decides
it before anything is noised, released or charged, by three mechanisms: **marks** (a
clipped pass, and ``zero_grad``, marks what it left in ``p.grad``; the step accepts these
tensors, unmodified, and nothing else), **the in-module sum** (after an unclipped pass,
``p.grad`` must equal the batch sum of the parameter's in-module gradients that the form's
hooks computed, else it was also used outside its module's forward, a use its norm missed)
and **deferred flags** (that comparison is decided on the device with the step's
non-finite checks, :data:`~opacus_rc.finite.OUTSIDE_USE`). The forms differ only in
:meth:`ClipGuard.check`: :class:`BuiltSumsGuard` (book-keeping), :class:`PerExampleGuard`.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .finite import OUTSIDE_USE

#: What a form expects of ``p.grad`` after an unclipped pass: the batch sum of its in-module
#: gradients (float32, ``p.grad``'s units), their coarsest dtype, the per-example norms (or
#: None); None: autograd computes none of it (a deferred linear layer).
Expected = Optional[Tuple[torch.Tensor, torch.dtype, Optional[torch.Tensor]]]


# --- marks ------------------------------------------------------------------------------------

def _grad_mark(grad: torch.Tensor) -> Any:
    """What identifies a gradient tensor as it is now: the object and its version
    counters (a DTensor's and its local shard's; autograd bumps them on every in-place
    accumulation)."""
    local = getattr(grad, "_local_tensor", grad)
    return weakref.ref(grad), grad._version, local._version


# --- refusals ---------------------------------------------------------------------------------

def step_refusal(what: str) -> ValueError:
    """The refusal of a step: ``what`` happened; nothing was released or charged."""
    return ValueError(
        f"optimizer.step() refused: {what}. Nothing was released or charged; call "
        "optimizer.zero_grad() before the next step"
    )


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


#: Why a gradient missed the clip (the refusal's cause; torch's DDP first, :func:`torch_ddp_cause`):
#: the two passes run from the model's output ...
_OUTPUT_PASSES_CAUSE = (
    "the loss was not computed from the model's output that the privacy engine clips "
    "at, or read a trainable weight outside its module's forward (e.g. a fused LM head: "
    "F.linear(hidden, model.lm_head.weight)): compute the loss from the model's output "
    "(its logits), or freeze that parameter"
)
#: ... a clipped pass ran ...
_ADDED_OUTSIDE_CAUSE = (
    "a gradient was added outside the clipped pass: a backward on a loss that is not the "
    "criterion returned by make_private (loss = criterion(output, target)), or a trainable "
    "weight read outside its module's forward (e.g. F.linear(hidden, model.lm_head.weight))"
)
#: ... none ran.
_NO_CLIPPED_PASS_CAUSE = (
    "no clipped pass ran: with grad_sample_mode='ghost' (two passes) the loss must come "
    "from the criterion returned by make_private (model, optimizer, criterion, "
    "data_loader = engine.make_private(...); loss = criterion(output, target); "
    "loss.backward()), not from a plain loss.backward()"
)


def complete_unused(
    params: List[torch.nn.Parameter], rows: int, has_values: Callable, zero: Callable
) -> List[torch.nn.Parameter]:
    """After a batch of ``rows`` examples, each parameter without per-example values
    (``has_values(p)`` False) gets ``zero(p)`` when unused (or the batch was empty); one with a
    gradient (used outside its module) is returned instead, for the caller to refuse."""
    unseen = []
    for p in params:
        if has_values(p):
            continue
        if p.grad is not None and rows:
            unseen.append(p)
        else:
            zero(p)
    return unseen


# --- the in-module sum ------------------------------------------------------------------------

#: Relative tolerance of the in-module gradient check, by the dtype of the output gradients
#: it came from: float32 summation-order differences over up to ~10^6 terms (B x T) stay
#: below 1e-4 of the scale; half-precision output gradients are rounded once more by
#: autograd's own layer backward.
IN_MODULE_RTOL = {torch.float64: 1e-4, torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def coarsest_dtype(dtypes: Any) -> torch.dtype:
    """The least precise of ``dtypes`` (the largest machine epsilon): the outside-use
    check's tolerance follows it."""
    return max(dtypes, key=lambda t: torch.finfo(t).eps)


def in_module_excess(
    grad: Optional[torch.Tensor], expected: torch.Tensor, dtype: torch.dtype, per_example: Optional[torch.Tensor]
) -> torch.Tensor:
    """Whether autograd's ``grad`` of a parameter differs from ``expected``, the batch sum of its
    in-module gradients (float32), beyond float rounding: ``||grad - expected|| > rtol S``
    (:data:`IN_MODULE_RTOL`), ``S = ||expected|| + ||grad|| + sum_i ||g_i||`` (``per_example``:
    the norms ``||g_i||``; the sum can cancel far below them, its rounding does not); a 0-dim
    bool tensor on the device."""
    got = torch.zeros_like(expected) if grad is None else grad.detach().float().view_as(expected)
    rtol = IN_MODULE_RTOL.get(dtype, 2e-2)
    scale = expected.norm() + got.norm()
    if per_example is not None:
        scale = scale + per_example.detach().float().sum().to(scale.device)
    return (got - expected).norm() > rtol * scale


class InModuleSums(dict):
    """The norm pass's running in-module gradient sums (``id(p)``: one float32 tensor and the
    coarsest dtype), noted by the two-pass module's hooks, taken by :meth:`ClipGuard.check_norm_pass`."""

    def add(self, param: torch.nn.Parameter, grad_sum: torch.Tensor, dtype: torch.dtype) -> None:
        """One use of ``param`` in its module contributed ``grad_sum`` (in ``p.grad``'s units);
        ``dtype``: that of the output gradient it came from (the check's tolerance)."""
        grad_sum, total = grad_sum.detach().float(), self.get(id(param))
        self[id(param)] = (grad_sum, dtype) if total is None else (
            total[0].add_(grad_sum), coarsest_dtype((dtype, total[1])))

    def take(self) -> Dict[int, Tuple[torch.Tensor, torch.dtype]]:
        """The sums noted since the last take; forgotten here."""
        sums = dict(self)
        self.clear()
        return sums


# --- the guard ----------------------------------------------------------------------------------

class ClipGuard:
    """Whether every gradient the step of ``optimizer`` (its owner) would release came through
    the form's clipped pass; this class: the two-pass forms (clipped sums left in ``p.grad``)."""

    def __init__(self, optimizer: Any) -> None:
        self._owner = weakref.ref(optimizer)
        self._marks: Dict[int, Any] = {}  # per parameter: its gradient as a clipped pass left it
        self._norm_pass_module: Any = None  # set while the criterion's norm pass runs
        self._flags: List[Tuple[List[torch.Tensor], torch.Tensor]] = []  # (parameters, device flags)
        self._elsewhere_cache: Any = None  # (module, ids): see _used_elsewhere()
        self._fresh = True  # p.grad holds only the passes since the last zero_grad()

    @property
    def optimizer(self) -> Any:
        return self._owner()

    # --- marks ------------------------------------------------------------------------------

    def mark(self) -> None:
        """What every ``p.grad`` holds now is the step's clipped sum so far (a clipped pass
        left it, or ``zero_grad``): accepted by :meth:`check` while unmodified."""
        for p in self.optimizer.params:
            if p.grad is not None:
                self._marks[id(p)] = _grad_mark(p.grad)

    def accepts(self, p: torch.Tensor) -> bool:
        """``p.grad`` is what the last clipped pass (or ``zero_grad``) left, unmodified."""
        mark, grad = self._marks.get(id(p)), p.grad
        return grad is not None and mark is not None and mark[0]() is grad and mark[1:] == _grad_mark(grad)[1:]

    def zero(self, p: torch.Tensor) -> None:
        """``p``'s contribution is exact zeros (unused, or an empty batch), accepted as clipped."""
        p.grad = torch.zeros_like(p)
        self._marks[id(p)] = _grad_mark(p.grad)

    def zeroed(self) -> None:
        """``zero_grad`` ran: its zeros (or None) are a zero contribution."""
        self.mark()
        self._fresh = True

    def unaccepted(self) -> List[torch.Tensor]:
        """The parameters whose gradient is not what a clipped pass left."""
        return [p for p in self.optimizer.params if p.grad is not None and not self.accepts(p)]

    # --- the step ---------------------------------------------------------------------------

    def check(self, *, before_pass: bool = False) -> None:
        """Refuse (ValueError) unless each ``p.grad`` is what the last clipped pass (or
        ``zero_grad``) left, unmodified, and no per-example norm waits for its clipped pass. Run
        by every ``step()`` and, with ``before_pass``, by each clipped pass before it keeps the
        step's earlier sums. A refusal forgets the per-example values of the pass."""
        optimizer = self.optimizer
        module = optimizer.bound_module()
        pending = module is not None and module.norm_pass_pending()
        unclipped = [] if before_pass and optimizer.backward_passes == 0 else self.unaccepted()
        # a step with no gradient at all and no clipped pass (main: an internal AttributeError)
        nothing = not before_pass and optimizer.backward_passes == 0 and all(p.grad is None for p in optimizer.params)
        if pending or unclipped or nothing:
            self._refuse_unclipped(unclipped, pending or nothing, module)

    def _refuse_unclipped(self, unclipped: List[torch.Tensor], pending: bool, module: Any, outside: bool = False) -> None:
        """Refuse the step: ``unclipped`` parameters' gradients (else per-example norms ``pending``
        without their clipped pass, or no clipped pass at all) missed the clipped pass; the cause
        named is torch's DDP (:func:`torch_ddp_cause`), else the most likely for what ran."""
        optimizer = self.optimizer
        if unclipped:
            what = self._gradient_of(unclipped)
        elif pending and optimizer.backward_passes > 0:
            what = "the per-example norms of a backward pass (their clipped pass never ran)"
        else:
            what = "the step's update (no clipped pass ran since the last step)"
        output_passes = module is not None and module.output_passes is not None
        ran = outside or (optimizer.backward_passes > 0 and not pending)  # else: no clipped pass at all
        cause = torch_ddp_cause(optimizer) or (
            _OUTPUT_PASSES_CAUSE if output_passes else _ADDED_OUTSIDE_CAUSE if ran else _NO_CLIPPED_PASS_CAUSE
        )
        optimizer.forget_per_example_values()
        raise step_refusal(f"{what} did not come through the clipped pass of this step ({cause})")

    def _gradient_of(self, params: List[torch.Tensor]) -> str:
        return "the gradient of " + ", ".join(self.optimizer.describe_parameter(p) for p in params)

    # --- the norm pass (two passes) ---------------------------------------------------------

    @contextlib.contextmanager
    def norm_pass(self, module: Any) -> Iterator[None]:
        """The criterion's two passes on ``module`` run inside (see :meth:`end_norm_pass`)."""
        self._norm_pass_module = module
        try:
            yield
        finally:
            self._norm_pass_module = None

    def end_norm_pass(self) -> None:
        """Called by ``zero_grad``: one between the two passes checks the norm pass."""
        module, self._norm_pass_module = self._norm_pass_module, None
        if module is not None:
            self.check_norm_pass(module)

    def check_norm_pass(self, module: Any) -> None:
        """After the criterion's norm pass, refuse a parameter also used outside its modules'
        forward (docs/accounting.md, "Parameters used outside their module"): any gradient of
        a deferred layer (a linear one, or one called in half precision: they compute none in
        it) is refused here; every other noted parameter's ``p.grad`` must equal its in-module
        batch sum (:meth:`flag_outside_uses`)."""
        patched = module.deferred_layers
        elsewhere = self._used_elsewhere(module, patched)
        unclipped = [
            p for m in patched for p in m.parameters(recurse=False)
            if p.requires_grad and id(p) not in elsewhere and p.grad is not None and not self.accepts(p)
        ]
        if unclipped:
            self._refuse_unclipped(unclipped, False, module, outside=True)
        sums = module.in_module_sums
        noted = {} if sums is None else sums.take()
        mean = getattr(module, "loss_reduction", "mean") == "mean"  # the backward's reduction: the module's
        expected = []
        for p in self.optimizer.params:
            if id(p) in noted:
                norms = getattr(p, "_norm_sample", None)  # the pass's per-example norms
                if norms is not None and mean:
                    norms = norms / max(1, norms.shape[0])  # p.grad is of the mean loss
                expected.append((p, (*noted[id(p)], norms)))
        self.flag_outside_uses(expected)

    def _used_elsewhere(self, module: Any, patched: Any) -> set:
        """Ids of the parameters also owned by a layer that is not a deferred one (a weight tied to
        an embedding gets its gradient there); computed once per grad-sample module and set of
        deferred layers (the layers called in half precision join them)."""
        ids = frozenset(id(m) for m in patched)
        cached = self._elsewhere_cache
        if cached is None or cached[0] is not module or cached[1] != ids:
            inner = getattr(module, "_module", module)
            found = {id(p) for m in inner.modules() if id(m) not in ids for p in m.parameters(recurse=False)}
            cached = self._elsewhere_cache = (module, ids, found)
        return cached[2]

    # --- the in-module sum, decided with the step's device flags ----------------------------

    def take_fresh(self) -> bool:
        """Whether ``p.grad`` holds only the passes since the last ``zero_grad`` (not also an
        earlier physical batch's, after a skipped step): asked once per clip."""
        fresh, self._fresh = self._fresh, False
        return fresh

    def flag_outside_uses(self, expected: Sequence[Tuple[torch.Tensor, Expected]]) -> None:
        """Compare each ``p.grad`` with what the form expects of it (``(p, e)``, :data:`Expected`);
        a difference beyond float rounding (:func:`in_module_excess`; for ``e`` None: any nonzero
        entry) is flagged on the device with the step's non-finite checks (:meth:`refusal`)."""
        if not expected:
            return
        excess = [p.grad.detach().ne(0).any() if e is None else in_module_excess(p.grad, *e) for p, e in expected]
        flags = torch.stack([x.to(excess[0].device) for x in excess])
        self._flags.append(([p for p, _ in expected], flags))
        self.optimizer.note_finite(OUTSIDE_USE, torch.where(flags, float("inf"), 0.0))

    def refusal(self, flags: Dict[str, torch.Tensor]) -> Optional[ValueError]:
        """The refusal of a step whose device ``flags`` failed, when the in-module check
        failed here, naming the parameters (reads the device flags: a refusal path)."""
        if OUTSIDE_USE not in flags or bool(flags[OUTSIDE_USE]):
            return None
        outside = []
        for params, flags in self._flags:
            outside += [p for p, e in zip(params, flags.tolist()) if e and p not in outside]
        self._flags = []
        what = self._gradient_of(outside) if outside else "the gradient of a parameter (on another rank)"
        return step_refusal(
            f"{what} did not come through the clipped pass of this step (it was used outside its "
            "module's forward as well as inside it, e.g. h @ model.emb.weight.T or "
            "F.layer_norm(h, ..., weight=model.norm.weight) beside the layer itself: the "
            "per-example norms miss that use). Use the parameter only through its module, or "
            "freeze it"
        )

    def clear_flags(self) -> None:
        """The step's flags are decided: forget the parameters they name."""
        self._flags = []

    @staticmethod
    def deferred_refusal(refused: str) -> Optional[ValueError]:
        """The refusal of an earlier step decided on the device (``refused``: its failed
        kinds) when the in-module check failed; None otherwise."""
        if OUTSIDE_USE not in refused:
            return None
        return ValueError(
            "an earlier step was refused on the device: the gradient of a parameter did not "
            "come through the clipped pass (it was used outside its module's forward as well "
            "as inside it; parameters and optimizer state were not updated by it; the privacy "
            "accountant counted it). A refusal must end the run"
        )


class BuiltSumsGuard(ClipGuard):
    """A form that builds every clipped sum itself (book-keeping: from its records or
    Opacus's per-sample gradients, refusing a parameter with neither) never releases
    ``p.grad`` (Opacus's ``add_noise`` replaces it): nothing to check at the step; an outside
    use is found by the in-module sum (:meth:`ClipGuard.flag_outside_uses`)."""

    def check(self, *, before_pass: bool = False) -> None:
        """Nothing: the released sums are built from the form's own records."""


class PerExampleGuard(ClipGuard):
    """The per-example form's guard."""

    def check(self, *, before_pass: bool = False) -> None:
        """Refuse the step when a backward pass broke the premise (recorded by the module:
        ``take_refusal()``; two examples in it, no optimizer followed) or a gradient did not
        come through a clip; the step's clipped sums so far are dropped."""
        optimizer = self.optimizer
        module = optimizer.bound_module()
        refusal = None if module is None else module.take_refusal()
        unclipped = self.unaccepted()
        if module is None:
            refusal = "the model is not followed by this optimizer (call module.follow_steps(optimizer))"
        if refusal is None and unclipped:
            cause = torch_ddp_cause(optimizer) or "set by hand, or its backward pass never reached the model's output"
            refusal = f"{self._gradient_of(unclipped)} did not come through a clipped backward pass ({cause})"
        if refusal is not None:
            optimizer.drop_step()
            raise step_refusal(refusal)
