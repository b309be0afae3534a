"""The table of clipping forms: what a ``make_private(..., clipping="randomized")`` call runs.

A form is one :class:`Form` entry of :data:`FORMS` (its classes and traits, docs/forms.md).
The engine looks the form up here; :func:`resolve_form`, the one decision rule, lives here
alone; :func:`form_of` tells the plugin's objects from Opacus's. Each form is one module of
this package (:mod:`.two_pass`'s module and optimizer are the shared sketched base,
:mod:`opacus_rc.grad_sample` and :mod:`opacus_rc.optimizer`).

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

from ..draws import split_draws
from ..grad_sample import GradSampleHooksRandomizedClipping, GradSampleModuleRandomizedClipping
from ..optimizer import DistributedRandomizedClippingOptimizer, RandomizedClippingOptimizer
from ..recompute import is_checkpointed
from .bookkeeping import (
    DistributedRandomizedClippingBookkeepingOptimizer,
    GradSampleHooksBookkeeping,
    GradSampleModuleBookkeeping,
    RandomizedClippingBookkeepingOptimizer,
    bookkeeping_criterion,
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
#: the loss reduction of a form's module whose criterion sums the losses in its backward passes
SUM = "sum"


def _as_returned(out: Tuple, arguments: Mapping[str, Any]) -> Tuple:
    return out


def _with_output_passes(out: Tuple, arguments: Mapping[str, Any]) -> Tuple:
    module, optimizer, _, data_loader = out  # a plain-loss script: no criterion returned
    attach_output_passes(module, optimizer, arguments["loss_reduction"])
    return module, optimizer, data_loader


def _with_bookkeeping_criterion(out: Tuple, arguments: Mapping[str, Any]) -> Tuple:
    """Opacus's book-keeping 3-tuple as the ghost 4-tuple ``(module, optimizer, criterion, data_loader)``."""
    module, optimizer, data_loader = out
    return module, optimizer, bookkeeping_criterion(module, optimizer, arguments), data_loader


def _one_example_per_batch(out: Tuple, arguments: Mapping[str, Any]) -> Tuple:
    """The loader split into physical batches of one example (:func:`~opacus_rc.draws.split_draws`);
    a ghost script's criterion replaced by book-keeping's (its ``backward()``: the one example's pass)."""
    *head, data_loader = out
    if len(head) == 3:  # a ghost script's 4-tuple
        head[2] = bookkeeping_criterion(head[0], head[1], arguments)
    return (*head, split_draws(data_loader=data_loader, max_batch_size=1, optimizer=head[1]))


@dataclass(frozen=True)
class Form:
    """One clipping form of the plugin.

    Attributes:
        name: its key in :data:`FORMS`.
        modules: grad-sample classes, ``(wrapping, hooks)`` (``wrap_model`` True / False).
        optimizers: DP optimizer classes, ``(one process, DDP)``.
        takes_bound: the module clips (gets ``max_grad_norm``); else the optimizer does.
        exact: exact per-example norms (no sketch; charged as Opacus's ``prv``).
        drops_examples: ``nonfinite="skip"`` can drop a non-finite example (its contribution
            is assembled on its own; a two-pass backward sums them inside autograd).
        one_example_per_backward: each backward pass holds one example (the private Trainer
            splits its batches into rows inside the module's ``one_physical_batch()``).
        per_layer: the module computes per-layer per-example values in its layers' hooks.
        honours_users: it clips per user (``privacy_unit="user"``); the others refuse it.
        sums_losses: the plugin's criterion reduces the per-example losses in every backward pass
            (a sum, whatever ``loss_reduction``: no ``1/n`` enters a gradient, which half precision
            would round with the batch's size); its module runs at ``loss_reduction="sum"`` while
            the optimizer divides by the public batch size under ``"mean"``.
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
    sums_losses: bool = False
    outputs: Callable[[Tuple, Mapping[str, Any]], Tuple] = _as_returned

    def build_module(self, module: nn.Module, wrap_model: bool, max_grad_norm: float, **kwargs: Any) -> Any:
        """The form's grad-sample module on ``module`` (``kwargs``: the engine's module options)."""
        bound = {"max_grad_norm": max_grad_norm} if self.takes_bound else {}
        if self.sums_losses:
            kwargs["loss_reduction"] = SUM
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
        Form(TWO_PASS, **_TWO_PASS_CLASSES, sums_losses=True),
        Form(OUTPUT_PASSES, **_TWO_PASS_CLASSES, outputs=_with_output_passes),
        Form(BOOKKEEPING, **_BOOKKEEPING_CLASSES),
        Form(BOOKKEEPING_WITH_CRITERION, **_BOOKKEEPING_CLASSES, outputs=_with_bookkeeping_criterion, sums_losses=True),
        Form(
            FSDP_MODE,
            modules=(GradSampleModuleRandomizedClippingFSDP, GradSampleHooksRandomizedClippingFSDP),
            optimizers=(FSDPRandomizedClippingOptimizer, FSDPRandomizedClippingOptimizer),
            honours_users=True,
            sums_losses=True,
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
    """The form whose grad-sample module (or hooks object) or DP optimizer ``obj`` is (exact
    class first, then subclass); None for anything else. Forms that share classes share their
    traits: the first such row is returned."""
    kind = type(obj)
    for exact in (True, False):
        for form in FORMS.values():
            classes = form.modules + form.optimizers
            if (kind in classes) if exact else isinstance(obj, classes):
                return form
    return None


_logged_automatic = False


def _warn_automatic(data_loader: Any, sample_rate: Optional[float]) -> None:
    """Warn once (``UserWarning``) that a physical batch of one example switched the method to
    the per-example form, with the expected logical batch ``q N`` (Opacus's Poisson rate:
    ``sample_rate``, the loader's own, else ``1 / len(data_loader)``)."""
    global _logged_automatic
    if _logged_automatic:
        return
    _logged_automatic = True
    try:
        q = sample_rate or getattr(data_loader, "sample_rate", None) or 1.0 / len(data_loader)
        size = f"q*N = {q * len(data_loader.dataset):.4g} example(s)"
    except (AttributeError, TypeError, ZeroDivisionError):
        size = "q*N examples"
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
    when a physical batch (the loader's ``batch_size``, the Trainer's
    ``per_device_train_batch_size``) holds one example."""
    return option if option is not None else physical_batch_size == 1


def _check_option(name: str, value: Any) -> None:
    """Refuse a value of a ``None``/``True``/``False`` option other than those."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is invalid; accepted values: None, True, False")


def _resolve_bookkeeping(
    clipping: str, value: Any, grad_sample_mode: str, module: Optional[nn.Module]
) -> Tuple[str, str]:
    """What a make_private call with ``bookkeeping=value`` runs, and the (Opacus)
    grad-sample mode of the module that does it:

    * ``grad_sample_mode="bookkeeping"``: book-keeping (``None``/``True``);
    * ``"ghost"``: two passes (``None``/``False``), or book-keeping behind the ghost criterion
      (``True``);
    * ``"hooks"``: book-keeping (``True``, or ``None`` without activation checkpointing), or two
      passes from the model's output (``False``, or ``None`` on a checkpointed model).

    Raises:
        ValueError: naming the parameter and its accepted values.
    """
    _check_option(BOOKKEEPING_OPTION, value)
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

    * ``per_example_backward=True``: the per-example form, for any batch size;
    * ``None`` (default) with a loader of ``batch_size=1`` and neither ``bookkeeping=`` nor
      ``ghost_fsdp``: the per-example form, with a warning once (:func:`_warn_automatic`);
    * otherwise book-keeping or two passes (:func:`_resolve_bookkeeping`).

    Raises:
        ValueError: naming the parameter and its accepted values.
    """
    _check_option(PER_EXAMPLE_OPTION, per_example)
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
