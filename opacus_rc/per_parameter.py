"""What the plugin keeps on an ``nn.Parameter`` between a pass and its step, under Opacus's own
names (its optimizers and hooks read them there): the one module that writes them.

* ``summed_grad``: the step's clipped sum so far (float32 or wider; Opacus's name);
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


__all__ = ["count_uses", "drop_sums", "reset_uses", "set_grad_sample", "set_norm_sample", "set_summed"]
