"""The table of clipping forms: what a ``make_private(..., clipping="randomized")`` call runs.

A form is one :class:`Form` entry of :data:`FORMS`: its grad-sample module (wrapping and
``wrap_model=False`` hooks form), its DP optimizer (one process, DDP), whether the module
takes the clipping bound, whether its steps are exact clipping (no sketch: the
``rc_prv`` accountant charges Opacus's ``prv``), and how Opacus's outputs become what the
script expects. The engine looks the form up here; the forms' names and
:func:`resolve_form`, the one decision rule, live here alone; :func:`form_of` tells the
plugin's objects from Opacus's. Each form is one module of this package: :mod:`.two_pass`
(the ghost criterion; its module and optimizer are the shared sketched base,
:mod:`opacus_rc.grad_sample` and :mod:`opacus_rc.optimizer`), :mod:`.bookkeeping` (both
book-keeping forms), :mod:`.output_passes`, :mod:`.fsdp` and :mod:`.per_example`.

========================== ============================================================
form                       what runs
========================== ============================================================
``two_pass``               ghost criterion: sketched norms, then the clipped pass
``bookkeeping``            one backward pass; clipped sums assembled after it
``bookkeeping_with_criterion`` book-keeping behind a ghost script's criterion
``output_passes``          two passes from the model's output (plain loss, checkpointed)
``ghost_fsdp``             two passes under FSDP2
``per_example``            one example per backward pass: exact flat clipping
========================== ============================================================
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from torch import nn

from ..draws import DrawLoader
from ..grad_sample import GradSampleHooksRandomizedClipping, GradSampleModuleRandomizedClipping
from ..optimizer import DistributedRandomizedClippingOptimizer, RandomizedClippingOptimizer
from ..recompute import is_checkpointed
from .bookkeeping import (
    DistributedRandomizedClippingBookkeepingOptimizer,
    GradSampleHooksBookkeeping,
    GradSampleModuleBookkeeping,
    RandomizedClippingBookkeepingOptimizer,
    with_criterion,
)
from .fsdp import (
    FSDPRandomizedClippingOptimizer,
    GradSampleHooksRandomizedClippingFSDP,
    GradSampleModuleRandomizedClippingFSDP,
)
from .output_passes import attach_output_passes
from .per_example import (
    DistributedPerExampleOptimizer,
    PerExampleHooks,
    PerExampleModule,
    PerExampleOptimizer,
    check_supported,
)
from ..values import BOOKKEEPING_MODE, FSDP_MODE, GHOST, HOOKS, RANDOMIZED

#: The forms' names: the keys of :data:`FORMS` (``ghost_fsdp``: Opacus's mode name).
TWO_PASS, BOOKKEEPING, BOOKKEEPING_WITH_CRITERION, OUTPUT_PASSES, PER_EXAMPLE = (
    "two_pass", "bookkeeping", "bookkeeping_with_criterion", "output_passes", "per_example"
)
#: the option that chooses (or refuses) the per-example form
PER_EXAMPLE_OPTION = "per_example_backward"
#: the option that chooses (or refuses) book-keeping
BOOKKEEPING_OPTION = "bookkeeping"


def _as_returned(out: Tuple, arguments: Mapping[str, Any]) -> Tuple:
    return out


def _with_output_passes(out: Tuple, arguments: Mapping[str, Any]) -> Tuple:
    module, optimizer, _, data_loader = out  # a plain-loss script: no criterion returned
    attach_output_passes(module, optimizer, arguments["loss_reduction"])
    return module, optimizer, data_loader


def _with_bookkeeping_criterion(out: Tuple, arguments: Mapping[str, Any]) -> Tuple:
    return with_criterion(out, arguments["criterion"], arguments["loss_reduction"])


def _one_example_per_batch(out: Tuple, arguments: Mapping[str, Any]) -> Tuple:
    """The loader split into physical batches of one example (each Poisson draw one
    logical step, as BatchMemoryManager's; every ``step()`` follows one batch and every
    forward takes the batch in hand: :class:`~opacus_rc.draws.DrawLoader`); a ghost script
    gets book-keeping's criterion (:class:`~opacus_rc.forms.bookkeeping.DPLossBookkeeping`):
    Opacus's call signature (``criterion(logits, targets, shape=(B, T))``), the same loss
    value as every other form (per-sequence reduction, then ``loss_reduction`` over the
    examples) and a plain tensor whose ``backward()`` is the one example's pass."""
    *head, data_loader = out
    optimizer = head[1]
    if len(head) == 3:  # a ghost script's 4-tuple: the two-pass criterion replaced
        head[2] = with_criterion((head[0], optimizer, data_loader), arguments["criterion"], arguments["loss_reduction"])[2]
    return (*head, DrawLoader(data_loader=data_loader, max_batch_size=1, optimizer=optimizer))


@dataclass(frozen=True)
class Form:
    """One clipping form of the plugin.

    Attributes:
        name: its key in :data:`FORMS`.
        modules: grad-sample classes, ``(wrapping, hooks)`` (``wrap_model`` True / False).
        optimizers: DP optimizer classes, ``(one process, DDP)``.
        takes_bound: the module clips (gets ``max_grad_norm``); else the optimizer does.
        exact: exact per-example norms (no sketch; charged as Opacus's ``prv``).
        drops_examples: each example's contribution is assembled on its own, so
            ``nonfinite="skip"`` can drop a non-finite one (a two-pass backward sums them
            inside autograd).
        one_example_per_backward: each backward pass holds one example (a loop that runs
            its own passes, the private Trainer's, splits its batches into rows inside the
            module's ``one_physical_batch()``).
        per_layer: the module computes per-layer per-example values in its layers' hooks
            (a chunked LM head, :mod:`opacus_rc.lm_head`, delivers its own head's).
        honours_users: it clips per user (``privacy_unit="user"``, :mod:`opacus_rc.units`):
            a user's rows regrouped within a physical batch, or accumulated over backward
            passes; the other forms refuse the user unit.
        outputs: Opacus's ``make_private`` outputs -> what the script gets.
    """

    name: str
    modules: Tuple[type, type]
    optimizers: Tuple[type, type]
    takes_bound: bool = True
    exact: bool = False
    drops_examples: bool = False
    one_example_per_backward: bool = False
    per_layer: bool = True
    honours_users: bool = False
    outputs: Callable[[Tuple, Mapping[str, Any]], Tuple] = _as_returned

    def build_module(self, module: nn.Module, wrap_model: bool, max_grad_norm: float, **kwargs: Any) -> Any:
        """The form's grad-sample module on ``module`` (``kwargs``: batch_first,
        loss_reduction, sketch_config, sketch_seed, secure_mode)."""
        bound = {"max_grad_norm": max_grad_norm} if self.takes_bound else {}
        return self.modules[0 if wrap_model else 1](module, **kwargs, **bound)

    def optimizer_class(self, distributed: bool) -> type:
        return self.optimizers[1 if distributed else 0]


_TWO_PASS_CLASSES = dict(
    modules=(GradSampleModuleRandomizedClipping, GradSampleHooksRandomizedClipping),
    optimizers=(RandomizedClippingOptimizer, DistributedRandomizedClippingOptimizer),
    honours_users=True,
)
_BOOKKEEPING_CLASSES = dict(
    modules=(GradSampleModuleBookkeeping, GradSampleHooksBookkeeping),
    optimizers=(RandomizedClippingBookkeepingOptimizer, DistributedRandomizedClippingBookkeepingOptimizer),
    takes_bound=False,  # it clips after the pass, in the optimizer
    drops_examples=True,
    honours_users=True,
)

#: Every form, by name.
FORMS: Dict[str, Form] = {
    form.name: form
    for form in (
        Form(TWO_PASS, **_TWO_PASS_CLASSES),
        Form(OUTPUT_PASSES, **_TWO_PASS_CLASSES, outputs=_with_output_passes),
        Form(BOOKKEEPING, **_BOOKKEEPING_CLASSES),
        Form(BOOKKEEPING_WITH_CRITERION, **_BOOKKEEPING_CLASSES, outputs=_with_bookkeeping_criterion),
        Form(
            FSDP_MODE,
            modules=(GradSampleModuleRandomizedClippingFSDP, GradSampleHooksRandomizedClippingFSDP),
            optimizers=(FSDPRandomizedClippingOptimizer, FSDPRandomizedClippingOptimizer),
        ),
        Form(
            PER_EXAMPLE,
            modules=(PerExampleModule, PerExampleHooks),
            optimizers=(PerExampleOptimizer, DistributedPerExampleOptimizer),
            exact=True,
            drops_examples=True,
            one_example_per_backward=True,
            per_layer=False,
            honours_users=True,
            outputs=_one_example_per_batch,
        ),
    )
}



def form_of(obj: Any) -> Optional[Form]:
    """The form whose grad-sample module (or hooks object) or DP optimizer ``obj`` is;
    None for anything else (Opacus's own objects, None). The one way code outside this
    package tells the plugin's objects from Opacus's: their traits are then read from the
    row and from the plugin's declared interface (:class:`~opacus_rc.optimizer.RandomizedClippingMixin`,
    :class:`~opacus_rc.grad_sample.PerExampleStore`), never by attribute sniffing. Forms
    that share classes (two passes and ``output_passes``; the book-keeping forms) share
    their traits: the first such row is returned."""
    kind = type(obj)
    for exact in (True, False):
        for form in FORMS.values():
            classes = form.modules + form.optimizers
            if (kind in classes) if exact else isinstance(obj, classes):
                return form
    return None


_logged_automatic = False


def _expected_examples(data_loader: Any, sample_rate: Optional[float]) -> Optional[float]:
    """``q N``: the expected logical batch of a loader (Opacus's Poisson rate: ``sample_rate``,
    the loader's own, else ``1 / len(data_loader)``); None when unknown."""
    try:
        n = len(data_loader.dataset)
        q = sample_rate or getattr(data_loader, "sample_rate", None) or 1.0 / len(data_loader)
    except (AttributeError, TypeError, ZeroDivisionError):
        return None
    return q * n


def _warn_automatic(data_loader: Any, sample_rate: Optional[float]) -> None:
    """Warn once (``UserWarning``: shown by a default Python set-up) that a physical batch of
    one example switched the method to the per-example form, and what a small expected
    logical batch costs."""
    global _logged_automatic
    if _logged_automatic:
        return
    _logged_automatic = True
    expected = _expected_examples(data_loader, sample_rate)
    size = "q*N examples" if expected is None else f"q*N = {expected:.4g} example(s)"
    warnings.warn(
        "the physical batch is one example (batch_size=1), so the per-example form runs: exact "
        "clipping, one backward pass per example. The expected logical batch (one Poisson draw, "
        f"one step) is {size}; with a small expected batch the noise swamps each step: accumulate "
        "a larger logical batch (a larger batch_size, with BatchMemoryManager(max_physical_batch_size=1) "
        "over the returned loader, or DPTrainer's gradient_accumulation_steps). "
        f"{PER_EXAMPLE_OPTION}=False keeps a sketched form; {PER_EXAMPLE_OPTION}=True silences this",
        UserWarning,
        stacklevel=2,
    )


def per_example_chosen(option: Optional[bool], physical_batch_size: Optional[int]) -> bool:
    """Whether a call runs the per-example form: ``per_example_backward`` when given, else
    when a physical batch holds one example (there exact clipping costs one reduction over
    ``p.grad``, less than any sketch). The physical batch: the data loader's ``batch_size``
    (``make_private``), ``per_device_train_batch_size`` (the private Trainer)."""
    return option if option is not None else physical_batch_size == 1


def _resolve_bookkeeping(
    clipping: str, value: Any, grad_sample_mode: str, module: Optional[nn.Module]
) -> Tuple[str, str]:
    """What a make_private call with ``bookkeeping=value`` runs, and the (Opacus)
    grad-sample mode of the module that does it:

    * ``grad_sample_mode="bookkeeping"``: book-keeping (``bookkeeping`` ``None``/``True``;
      mode ``"hooks"``), also on a checkpointed model;
    * ``grad_sample_mode="ghost"``: two passes (``bookkeeping`` ``None``/``False``), or
      book-keeping behind the ghost criterion (``True``; mode ``"hooks"``);
    * ``grad_sample_mode="hooks"`` (a plain-loss script): book-keeping (``True``, or
      ``None`` on a model without activation checkpointing), or two passes run from the
      model's output (``False``, or ``None`` on a checkpointed model: book-keeping would
      keep the activations checkpointing frees; :mod:`opacus_rc.forms.output_passes`; mode
      ``"ghost"``).

    Raises:
        ValueError: naming the parameter and its accepted values.
    """
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{BOOKKEEPING_OPTION}={value!r} is invalid; accepted values: None, True, False")
    if clipping != RANDOMIZED:
        if value is not None or grad_sample_mode == BOOKKEEPING_MODE:
            given = f"{BOOKKEEPING_OPTION}={value!r}" if value is not None else f"grad_sample_mode={BOOKKEEPING_MODE!r}"
            raise ValueError(f"{given} only applies with clipping='randomized'; got clipping={clipping!r}")
        return TWO_PASS, grad_sample_mode
    if grad_sample_mode == BOOKKEEPING_MODE:
        if value is False:
            raise ValueError(
                f"bookkeeping=False contradicts grad_sample_mode={BOOKKEEPING_MODE!r}; accepted "
                "values with it: None, True"
            )
        return BOOKKEEPING, HOOKS
    if grad_sample_mode == HOOKS:
        checkpointed = module is not None and is_checkpointed(module)
        if value is True or (value is None and not checkpointed):
            return BOOKKEEPING, HOOKS  # one backward pass (3-tuple, plain loss)
        return OUTPUT_PASSES, GHOST
    if not value:
        return TWO_PASS, grad_sample_mode
    if grad_sample_mode != GHOST:
        raise ValueError(
            f"bookkeeping=True runs a grad_sample_mode='ghost' script in one backward pass; got "
            f"grad_sample_mode={grad_sample_mode!r}; accepted values with bookkeeping=True: 'ghost', "
            f"'hooks', {BOOKKEEPING_MODE!r} (under FSDP2 book-keeping does not fit: use "
            "grad_sample_mode='ghost_fsdp' without it)"
        )
    return BOOKKEEPING_WITH_CRITERION, HOOKS


def resolve_form(
    clipping: str,
    bookkeeping: Any,
    per_example: Any,
    grad_sample_mode: str,
    module: Optional[nn.Module],
    data_loader: Any,
    sample_rate: Optional[float] = None,
) -> Tuple[str, str]:
    """The form a ``make_private`` call runs and the (Opacus) grad-sample mode of its
    module; the one decision rule:

    * ``per_example_backward=True``: the per-example form, for any batch size (the
      returned loader yields one example per physical batch);
    * ``None`` (default) with a loader of ``batch_size=1`` (a physical batch of one; the
      private Trainer: ``per_device_train_batch_size=1``) and neither ``bookkeeping=`` nor
      ``ghost_fsdp``: the per-example form, with a warning once (exact clipping is cheaper
      there than any estimate, but the method changed: :func:`_warn_automatic`; the expected
      logical batch: ``sample_rate``, else the loader's, times the dataset's size);
    * otherwise book-keeping or two passes (:func:`_resolve_bookkeeping`).

    Raises:
        ValueError: naming the parameter and its accepted values.
    """
    if per_example is not None and not isinstance(per_example, bool):
        raise ValueError(f"{PER_EXAMPLE_OPTION}={per_example!r} is invalid; accepted values: None, True, False")
    if clipping != RANDOMIZED and per_example is not None:
        raise ValueError(f"{PER_EXAMPLE_OPTION}={per_example!r} only applies with clipping='randomized'; got clipping={clipping!r}")
    automatic = (
        per_example is None and clipping == RANDOMIZED and bookkeeping is None
        and grad_sample_mode != FSDP_MODE and per_example_chosen(None, getattr(data_loader, "batch_size", None))
    )
    if not (per_example or automatic):
        runs, mode = _resolve_bookkeeping(clipping, bookkeeping, grad_sample_mode, module)
        return (FSDP_MODE if mode == FSDP_MODE else runs), mode
    if bookkeeping is not None or grad_sample_mode not in (HOOKS, GHOST, BOOKKEEPING_MODE):
        raise ValueError(
            f"{PER_EXAMPLE_OPTION}=True runs one example per backward pass; it does not combine "
            f"with bookkeeping={bookkeeping!r}, grad_sample_mode={grad_sample_mode!r}; accepted "
            "values with it: bookkeeping=None and grad_sample_mode 'hooks', 'bookkeeping' or 'ghost'"
        )
    if module is not None:
        check_supported(module)
    if automatic:
        _warn_automatic(data_loader, sample_rate)
    return PER_EXAMPLE, GHOST if grad_sample_mode == GHOST else HOOKS


__all__ = [
    "Form", "FORMS", "TWO_PASS", "BOOKKEEPING", "BOOKKEEPING_WITH_CRITERION", "OUTPUT_PASSES", "PER_EXAMPLE",
    "FSDP_MODE", "PER_EXAMPLE_OPTION", "form_of", "resolve_form", "per_example_chosen",
]
