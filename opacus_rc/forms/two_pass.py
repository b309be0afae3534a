"""The loss wrapper of randomized clipping: Opacus's two backward passes, plus gradient
accumulation over micro-batches.

Opacus's ghost-clipping loss zeroes the gradients between its two passes, which wipes
what earlier micro-batches accumulated (Opacus issue #683). Here the accumulated clipped
gradient is set aside before the first pass and added back after the second, the
optimizer counts the passes (its ``accumulated_iterations``, used for averaging and by
the accountant as the step's micro-batch multiplicity).
"""

from __future__ import annotations

from typing import Optional

import torch
from opacus.utils.fast_gradient_clipping_utils import (
    DPLossFastGradientClipping,
    DPTensorFastGradientClipping,
)

from ..half_precision import mean_over_rows
from ..per_parameter import add_wide_grad, take_wide_grad
from ..recompute import quiet_hook_notes

_ARITHMETIC = ("__truediv__", "__mul__", "__rmul__", "__add__", "__radd__", "__sub__", "__rsub__", "__neg__")


class DPTensorRandomizedClipping(DPTensorFastGradientClipping):
    """Per-sample loss whose ``backward()`` clips with the estimated norms and
    accumulates across micro-batches."""

    def detach(self) -> torch.Tensor:
        """The loss a script reads (``loss.item()``): Opacus's reduction over this batch's rows,
        the mean (:func:`mean_over_rows`: 0 for an empty batch) or the sum."""
        if self.loss_reduction == "mean":
            return mean_over_rows(self.loss_per_sample).detach()
        return super().detach()

    def backward(self) -> None:
        """Opacus's two passes; the per-sample losses and norms join the step's
        non-finite check, decided in ``optimizer.step()`` without a host
        synchronisation here (see :mod:`opacus_rc.finite`). The float32 clipped sums of the
        layers called in half precision (``p.wide_grad``, :mod:`opacus_rc.half_precision`) are
        set aside and kept like ``p.grad``."""
        optimizer = self.optimizer
        optimizer.check_cleared()  # before Opacus's own zero_grad between the passes
        guard = optimizer.clip_guard
        guard.check(before_pass=True)  # the earlier sums kept below must be clipped ones
        # Earlier micro-batches' clipped sums, set aside (none on a step's first pass): the norm
        # pass then leaves only its own gradient in p.grad, checked by ClipGuard.check_norm_pass.
        carried = optimizer.backward_passes > 0
        earlier = [None if p.grad is None or not carried else p.grad.detach() for p in optimizer.params]
        earlier_wide = [take_wide_grad(p) for p in optimizer.params]  # (p.grad's float32 counterpart)
        if not carried:
            earlier_wide = [None] * len(earlier_wide)
        for p in optimizer.params:
            if guard.accepts(p):  # (an unclipped one stays: the norm pass refuses it)
                p.grad = None
        shown, self.loss_reduction = self.loss_reduction, self.module.loss_reduction  # the backward's: the module's
        try:
            with guard.norm_pass(self.module), quiet_hook_notes():
                try:
                    super().backward()
                finally:
                    self.loss_reduction = shown
            passed = self.module.take_clipped_sums()
        except BaseException:
            # Drop whatever this pass left (possibly unclipped) and keep the earlier sums.
            self.module.forget_clipped_sums()
            for p, e, w in zip(optimizer.params, earlier, earlier_wide):
                p.grad = e
                _add_wide(p, w)
            guard.mark()
            raise
        for p, e, w in zip(optimizer.params, earlier, earlier_wide):
            if e is not None:
                p.grad = e if p.grad is None else p.grad.add_(e)
            _add_wide(p, w)
        for p, total in passed:
            add_wide_grad(p, total)
        guard.mark()  # p.grad (and p.wide_grad) is now exactly the step's clipped sum so far
        optimizer.count_backward_pass()
        optimizer.note_finite("per-sample loss", self.loss_per_sample)
        optimizer.note_finite("per-sample gradient norm", getattr(self.module, "per_sample_gradient_norms", None))
        optimizer.forget_after_step(self.module)


def _add_wide(p: torch.nn.Parameter, total: Optional[torch.Tensor]) -> None:
    """``p.wide_grad += total`` unless ``total`` is None."""
    if total is not None:
        add_wide_grad(p, total)


def _randomized(loss: DPTensorFastGradientClipping) -> DPTensorRandomizedClipping:
    return DPTensorRandomizedClipping(loss.module, loss.optimizer, loss.loss_per_sample, loss.loss_reduction)


def _keep_type(name: str):
    """Arithmetic on the loss (``loss / n``, ``w * loss``, ...) keeps this class."""
    base = getattr(DPTensorFastGradientClipping, name)

    def op(self, *args):
        return _randomized(base(self, *args))

    op.__name__ = name
    return op


for _name in _ARITHMETIC:
    setattr(DPTensorRandomizedClipping, _name, _keep_type(_name))


class DPLossRandomizedClipping(DPLossFastGradientClipping):
    """Criterion wrapper returned by ``make_private(..., clipping="randomized")``; same
    call signature as Opacus's (``criterion(logits, targets, shape=...)``). Its module may run at
    ``loss_reduction="sum"`` under ``"mean"`` (:attr:`opacus_rc.forms.Form.sums_losses`): the
    backward passes sum the per-example losses, the optimizer divides by the public batch size."""

    def __init__(self, module, optimizer, criterion, loss_reduction: str = "mean") -> None:
        backward, module.loss_reduction = module.loss_reduction, loss_reduction  # (Opacus's equality check)
        try:
            super().__init__(module, optimizer, criterion, loss_reduction)
        finally:
            module.loss_reduction = backward

    def __call__(self, *args, shape=None, **kwargs) -> DPTensorRandomizedClipping:
        return _randomized(super().__call__(*args, shape=shape, **kwargs))
