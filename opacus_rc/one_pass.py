"""One backward pass for ghost-mode scripts: ``make_private(..., grad_sample_mode="ghost",
clipping="randomized", bookkeeping=True)``.

An existing ghost-clipping script unpacks four values (the criterion among them) and calls
``criterion(logits, targets, shape=...)`` then ``loss.backward(); optimizer.step()``. With
``bookkeeping=True`` the same loop runs by book-keeping (one backward pass, the clipped
gradient assembled in ``optimizer.step()``; :class:`~opacus_rc.grad_sample.BookkeepingMixin`):
``make_private`` builds the ``grad_sample_mode="hooks"`` book-keeping module and optimizer and
returns, in the criterion's place, a :class:`DPLossBookkeeping`. It computes the per-sample
(per-sequence, with ``shape=``) losses exactly as the ghost criterion does and returns their
mean (or sum) as an ordinary tensor, whose ``backward()`` is the single pass.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
from torch import nn

OPTION = "bookkeeping"


#: What a randomized make_private call runs (see :func:`resolve_bookkeeping`).
TWO_PASS, BOOKKEEPING, BOOKKEEPING_WITH_CRITERION, OUTPUT_PASSES = (
    "two_pass", "bookkeeping", "bookkeeping_with_criterion", "output_passes"
)


def is_checkpointed(module: nn.Module) -> bool:
    """True if Hugging Face activation checkpointing is on in ``module`` (a submodule's
    ``gradient_checkpointing`` flag, set by ``gradient_checkpointing_enable()``)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in module.modules())


def resolve_bookkeeping(
    clipping: str, value: Any, grad_sample_mode: str, module: Optional[nn.Module]
) -> Tuple[str, str]:
    """What a make_private call with ``bookkeeping=value`` runs, and the grad-sample mode
    of the module that does it:

    * ``grad_sample_mode="ghost"``: two passes (``bookkeeping`` ``None``/``False``), or
      book-keeping behind the ghost criterion (``True``; mode ``"hooks"``);
    * ``grad_sample_mode="hooks"`` (a plain-loss script): book-keeping (``True``, or
      ``None`` on a model without activation checkpointing), or two passes run from the
      model's output (``False``, or ``None`` on a checkpointed model: book-keeping would
      keep the activations checkpointing frees; :mod:`opacus_rc.output_passes`; mode
      ``"ghost"``).

    Raises:
        ValueError: naming the parameter and its accepted values.
    """
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{OPTION}={value!r} is invalid; accepted values: None, True, False")
    if clipping != "randomized":
        if value is not None:
            raise ValueError(
                f"{OPTION}={value!r} only applies with clipping='randomized'; got clipping={clipping!r}"
            )
        return TWO_PASS, grad_sample_mode
    if grad_sample_mode == "hooks":
        checkpointed = module is not None and is_checkpointed(module)
        if value is True or (value is None and not checkpointed):
            return BOOKKEEPING, "hooks"  # one backward pass (3-tuple, plain loss)
        return OUTPUT_PASSES, "ghost"
    if not value:
        return TWO_PASS, grad_sample_mode
    if grad_sample_mode != "ghost":
        raise ValueError(
            f"bookkeeping=True runs a grad_sample_mode='ghost' script in one backward pass; got "
            f"grad_sample_mode={grad_sample_mode!r}; accepted values with bookkeeping=True: 'ghost', "
            "'hooks' (under FSDP2 book-keeping does not fit: use grad_sample_mode='ghost_fsdp' "
            "without it)"
        )
    return BOOKKEEPING_WITH_CRITERION, "hooks"


class DPLossBookkeeping(DPLossFastGradientClipping):
    """The criterion returned by ``make_private(..., grad_sample_mode="ghost",
    bookkeeping=True)``: the ghost criterion's call signature
    (``criterion(logits, targets, shape=...)``, ``-100`` labels ignored per sequence) and
    per-sample losses, reduced (mean or sum over the batch) to an ordinary tensor whose
    ``backward()`` is the one pass book-keeping needs."""

    def __call__(self, *args: Any, shape=None, **kwargs: Any) -> torch.Tensor:
        per_sample = super().__call__(*args, shape=shape, **kwargs).loss_per_sample
        if self.loss_reduction == "mean":
            return per_sample.mean(dim=0)
        return per_sample.sum(dim=0)


def with_criterion(out: Tuple[Any, ...], criterion: Any, loss_reduction: str) -> Tuple[Any, ...]:
    """Opacus's book-keeping 3-tuple ``(module, optimizer, data_loader)`` as the ghost
    4-tuple ``(module, optimizer, criterion, data_loader)``."""
    module, optimizer, data_loader = out
    if criterion is None:
        criterion = nn.CrossEntropyLoss()  # Opacus's make_private default
    loss = DPLossBookkeeping(module, optimizer, criterion, loss_reduction)
    return module, optimizer, loss, data_loader
