"""Deliberately broken sketchers and batch check, for the audit only (never reached from
make_private): ``biased_low`` divides the estimate by 4, ``data_dependent_sketch`` draws every
sketch orthogonal to the batch's gradients (the canary is estimated as 0, not clipped),
:func:`unchecked_batches` lets the per-example form clip two examples as one,
:func:`unchecked_draw_boundary` lets a ``step()`` follow several physical batches of a draw,
:func:`carried_partial_draw` carries a draw left incomplete into the next one's release, and
:func:`per_row_clipping` clips each row of a user alone at ``privacy_unit="user"``.
See docs/audit.md, "Broken variants (audit-only)".
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..draws import Batch, Draw
from ..estimators import as_sequences, sketch_side
from ..sketch import Sketcher
from ..units import RowUnits
from .checks import check_choices

VARIANTS = ("honest", "biased_low", "data_dependent_sketch")
BIAS_FACTOR = 4.0


class BiasedLowSketcher(Sketcher):
    """Sketcher whose estimate is biased low: ``n_hat / 4``."""

    def estimate(self, activations: torch.Tensor, backprops: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return super().estimate(activations, backprops, *args, **kwargs) / BIAS_FACTOR


def data_support_mask(activations: torch.Tensor, backprops: torch.Tensor) -> torch.Tensor:
    """(rows,) float mask on the sketched side: 0 where some per-sample gradient
    ``M_i = A_i^T G_i`` has mass (``> 1e-12`` of the largest), 1 elsewhere."""
    a, g = as_sequences(activations, backprops)
    per_sample = torch.matmul(a.transpose(1, 2), g)  # (B, d, p)
    side = sketch_side(a.shape[-1], g.shape[-1], "auto")
    energy = per_sample.pow(2).sum(dim=(0, 1) if side == "output" else (0, 2))
    return (energy <= 1e-12 * energy.max().clamp(min=1e-300)).to(torch.float32)


class DataDependentSketcher(Sketcher):
    """Sketcher whose sketches depend on the data: zero on the rows (sketched-side
    coordinates) where the batch's gradients live, i.e. orthogonal to them."""

    _mask: Optional[torch.Tensor] = None

    def estimate(self, activations: torch.Tensor, backprops: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._mask = data_support_mask(activations, backprops)
        try:
            return super().estimate(activations, backprops, *args, **kwargs)
        finally:
            self._mask = None

    def gaussian(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        sketch = super().gaussian(*args, **kwargs)
        if self._mask is None:
            return sketch
        return sketch * self._mask.to(sketch.device)[:, None]  # rows are dim -2


_SKETCHERS = {"biased_low": BiasedLowSketcher, "data_dependent_sketch": DataDependentSketcher}


def broken_sketcher(variant: str, like: Sketcher) -> Sketcher:
    """A broken sketcher of the given variant with ``like``'s configuration and seed."""
    check_choices(("variant", variant, tuple(_SKETCHERS)))
    return _SKETCHERS[variant](like.config, seed=like.seed)


def install_sketcher(module: Any, sketcher: Sketcher) -> None:
    """Make a randomized-clipping grad-sample module use ``sketcher``.

    The module's norm samplers read ``module.sketcher`` at every call (see
    :class:`opacus_rc.grad_sample.SketchingMixin`), so replacing it is enough.
    """
    if not hasattr(module, "sketcher") or not hasattr(module, "NORM_SAMPLERS"):
        raise ValueError(
            f"module={type(module).__name__} is not a randomized-clipping grad-sample module"
        )
    module.sketcher = sketcher  # binds the module's step clock: fresh sketches each step


def unchecked_batches(module: Any) -> None:
    """Switch the per-example form's batch check off on ``module`` (a
    :class:`~opacus_rc.forms.per_example.PerExampleClipping`, followed by its optimizer):
    every outermost forward pass counts as one example, whatever its batch (its units: its
    first row's), so the backward pass of a physical batch of several examples is clipped
    once, as one example's gradient (the clip bounds their sum)."""
    check = module._pre_forward  # reads the batch from the forward's arguments

    def as_one_example(m: Any, args: Any, kwargs: Any) -> None:
        first = lambda v: v[:1] if isinstance(v, torch.Tensor) else v  # noqa: E731
        return check(m, tuple(map(first, args)), {k: first(v) for k, v in kwargs.items()})

    optimizer = module._bound_optimizer()
    module.remove_hooks()
    module._pre_forward = as_one_example
    module._setup_clipping(module.max_grad_norm)  # the hooks again, with the check off
    module.follow_steps(optimizer)
    take = module.take_batch
    module.take_batch = lambda batch: take(Batch(batch.draw, batch.index, batch.units.rows(0, 1)))


def unchecked_draw_boundary(optimizer: Any) -> None:
    """The pre-fix behaviour (issue 38 item 1): the loader queues one of Opacus's skip signals per
    physical batch (``same_draw``) and each ``step()`` pops one, whatever batches it followed; the
    draws no longer decide. A release can then hold the tail of one draw and the head of the next,
    charged as the one draw whose end it holds."""
    deliver = optimizer.ledger.deliver

    def signalled(data: Any, batch: Batch, source: Any = None) -> None:
        optimizer.signal_skip_step(do_skip=not batch.last, same_draw=True)
        deliver(data, Batch(Draw(1, signalled=True), 0, batch.units), source)

    optimizer.ledger.deliver = signalled


def carried_partial_draw(optimizer: Any) -> None:
    """Carry the clipped sums of a draw left incomplete into the next draw's release (issue 46,
    path 1: a loop stopped inside a draw, then the loader iterated again), charged as the one
    draw whose end it holds (the micro-batch count restarts, the sums do not)."""

    def carry() -> None:
        optimizer.backward_passes = optimizer._draw_splits = 0

    optimizer._drop_incomplete_draw = carry


def per_row_clipping(optimizer: Any) -> None:
    """Make a user-level book-keeping ``optimizer`` (and the module it follows) clip each row
    alone: each batch's units replaced by its rows (no regrouping of a user's rows, a clip per
    row), while the accountant still charges each step per user at q_u. A user of m rows then
    moves the release by up to m C, charged as C."""
    module = optimizer.bound_module()
    take = module.take_batch
    module.take_batch = lambda batch: take(Batch(batch.draw, batch.index, RowUnits.singletons(len(batch.units))))
