"""The loss wrapper of randomized clipping: Opacus's two backward passes, plus gradient
accumulation over micro-batches.

Opacus's ghost-clipping loss zeroes the gradients between its two passes, which wipes
what earlier micro-batches accumulated (Opacus issue #683). Here the accumulated clipped
gradient is set aside before the first pass and added back after the second, the
optimizer counts the passes (its ``accumulated_iterations``, used for averaging and by
the accountant) and the sketcher learns when a pass begins.
"""

from __future__ import annotations

from opacus.utils.fast_gradient_clipping_utils import (
    DPLossFastGradientClipping,
    DPTensorFastGradientClipping,
)

_ARITHMETIC = (
    "__truediv__",
    "__mul__",
    "__rmul__",
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__neg__",
)


class DPTensorRandomizedClipping(DPTensorFastGradientClipping):
    """Per-sample loss whose ``backward()`` clips with the estimated norms and
    accumulates across micro-batches."""

    def backward(self) -> None:
        optimizer = self.optimizer
        accumulated = [
            None if p.grad is None else p.grad.detach().clone()
            for p in optimizer.params
        ] if optimizer.backward_passes > 0 else None
        self.module.sketcher.begin_pass()
        super().backward()
        if accumulated is not None:
            for p, earlier in zip(optimizer.params, accumulated):
                if earlier is not None:
                    p.grad = earlier if p.grad is None else p.grad.add_(earlier)
        optimizer.backward_passes += 1


def _keep_type(name: str):
    """Arithmetic on the loss (``loss / n``, ``w * loss``, ...) keeps this class."""
    base = getattr(DPTensorFastGradientClipping, name)

    def op(self, *args):
        out = base(self, *args)
        return DPTensorRandomizedClipping(
            out.module, out.optimizer, out.loss_per_sample, out.loss_reduction
        )

    op.__name__ = name
    return op


for _name in _ARITHMETIC:
    setattr(DPTensorRandomizedClipping, _name, _keep_type(_name))


class DPLossRandomizedClipping(DPLossFastGradientClipping):
    """Criterion wrapper returned by ``make_private(..., clipping="randomized")``; same
    call signature as Opacus's (``criterion(logits, targets, shape=...)``)."""

    def __call__(self, *args, shape=None, **kwargs) -> DPTensorRandomizedClipping:
        loss = super().__call__(*args, shape=shape, **kwargs)
        return DPTensorRandomizedClipping(
            loss.module, loss.optimizer, loss.loss_per_sample, loss.loss_reduction
        )
