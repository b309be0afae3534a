"""What the plugin keeps on an ``nn.Parameter`` between a pass and its step, under Opacus's own
names (its optimizers and hooks read them there): the one module that writes them.

* ``summed_grad``: the step's clipped sum so far (float32 or wider; Opacus's name);
* ``wide_grad``: the clipped passes' float32 sum not yet accumulated into ``summed_grad``, where
  autograd computes none (half-precision calls, :mod:`opacus_rc.half_precision`): ``p.grad``'s
  float32 counterpart (``p.grad`` holds the parameter's dtype);
* ``grad_sample``: Opacus's per-sample gradients (the layers book-keeping does not keep);
* ``_norm_sample``: a sketched form's per-example norms of the pass;
* ``_forward_counter``: Opacus's count of the parameter's uses still to come in the pass.

Each is a per-example value or a sum of clipped ones: a step consumes or forgets them.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn


def set_summed(p: nn.Parameter, value: Optional[torch.Tensor]) -> None:
    """``p.summed_grad = value`` (None: the step's clipped sum dropped)."""
    p.summed_grad = value


def drop_sums(params: Iterable[nn.Parameter]) -> None:
    """Drop the clipped sums of ``params`` (never released)."""
    for p in params:
        p.summed_grad = None


def add_wide_grad(p: nn.Parameter, value: torch.Tensor) -> None:
    """``p.wide_grad += value`` (float32 or wider; ``value`` is the caller's, added into in place later)."""
    held = getattr(p, "wide_grad", None)
    p.wide_grad = value if held is None else held.add_(value)


def take_wide_grad(p: nn.Parameter) -> Optional[torch.Tensor]:
    """``p.wide_grad`` (None: none), forgotten on ``p``."""
    value = getattr(p, "wide_grad", None)
    p.wide_grad = None
    return value


def drop_wide_grads(params: Iterable[nn.Parameter]) -> None:
    """Forget the float32 clipped sums of ``params`` not yet accumulated (``zero_grad``)."""
    for p in params:
        p.wide_grad = None


def set_grad_sample(p: nn.Parameter, value: Optional[torch.Tensor]) -> None:
    """``p.grad_sample = value`` (None: consumed)."""
    p.grad_sample = value


def set_norm_sample(p: nn.Parameter, value: Optional[torch.Tensor]) -> None:
    """``p._norm_sample = value`` (None: forgotten)."""
    p._norm_sample = value


def count_uses(p: nn.Parameter, change: int) -> int:
    """Add ``change`` to the uses of ``p`` still to come in the pass; returns the count."""
    p._forward_counter += change
    return p._forward_counter


def reset_uses(p: nn.Parameter) -> None:
    """No use of ``p`` is still to come (a forward left without its backward pass)."""
    if hasattr(p, "_forward_counter"):
        p._forward_counter = 0


__all__ = [
    "add_wide_grad", "count_uses", "drop_sums", "drop_wide_grads", "reset_uses", "set_grad_sample", "set_norm_sample",
    "set_summed", "take_wide_grad",
]
