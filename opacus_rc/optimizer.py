"""Optimizers for randomized clipping.

They behave exactly like Opacus's fast-gradient-clipping optimizers (the gradients they
see are already clipped by the second backward pass; they add N(0, sigma^2 C^2) noise
and average) and additionally carry the :class:`~opacus_rc.config.SketchConfig`, which
the ``rc_prv`` accountant reads in its step hook.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch

from opacus.optimizers import (
    DistributedDPOptimizerFastGradientClipping,
    DPOptimizerFastGradientClipping,
)
from torch.optim import Optimizer

from .config import SketchConfig
from .sketch import Sketcher, entropy_seed

_STATE_KEY = "opacus_rc"


class RandomizedClippingMixin:
    """Adds the sketch parameters an accountant needs to an Opacus optimizer:
    ``sketch_config`` and its ``estimator``, ``sketch_size``, ``sketching``.

    Args:
        optimizer: wrapped optimizer.
        sketch_config: how the per-sample norms were estimated (default: Hutchinson,
            k = 32, one sketch shared by the batch).
        **kwargs: Opacus's optimizer arguments (noise_multiplier, max_grad_norm,
            expected_batch_size, loss_reduction, generator, secure_mode).
    """

    def __init__(
        self, optimizer: Optimizer, *, sketch_config: SketchConfig = SketchConfig(), **kwargs
    ) -> None:
        super().__init__(optimizer, **kwargs)
        self.sketch_config = sketch_config
        self.sketcher: Optional[Sketcher] = None
        self.backward_passes = 0  # micro-batches accumulated since the last step() call

    def attach_sketcher(self, sketcher: Sketcher) -> None:
        """Link the grad-sample module's sketcher: every real step starts new sketches."""
        self.sketcher = sketcher

    @property
    def accumulated_iterations(self) -> int:
        """Micro-batches (backward passes) accumulated into this step (at least 1).

        Averaging divides by ``expected_batch_size * accumulated_iterations`` and the
        accountant charges ``sample_rate * accumulated_iterations``, as Opacus's
        DPOptimizer does for accumulated per-sample gradients. Virtual steps through
        BatchMemoryManager call ``step()`` after every physical batch and so count 1.
        """
        return max(1, self.backward_passes)

    def pre_step(self, closure: Optional[Callable[[], float]] = None) -> Optional[bool]:
        """Opacus's pre-step (accumulate, noise, average, accountant hook), refusing
        non-finite clipped gradients before any noise is drawn, and starting new sketches
        after a real step. In secure mode the noise generator is re-seeded from
        ``os.urandom`` before every step."""
        self._check_finite_gradients()
        if self.secure_mode and isinstance(self.generator, torch.Generator):
            self.generator.manual_seed(entropy_seed())
        taken = super().pre_step(closure)
        self.backward_passes = 0
        if taken and self.sketcher is not None:
            self.sketcher.new_step()
        return taken

    def _check_finite_gradients(self) -> None:
        for p in self.params:
            if p.grad is not None and not torch.isfinite(p.grad).all():
                raise FloatingPointError(
                    "non-finite clipped gradient: the step is refused before noise is added; "
                    "parameters and the privacy accountant are unchanged. Call "
                    "optimizer.zero_grad() and check the loss and inputs of this batch"
                )

    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state plus the sketch generator's and (if any) the
        noise generator's state, so a resumed run draws the same sketches and noise."""
        state = dict(super().state_dict())
        extra: Dict[str, Any] = {}
        if self.sketcher is not None:
            extra["sketcher"] = self.sketcher.state_dict()
        if isinstance(self.generator, torch.Generator):
            extra["noise_generator"] = self.generator.get_state()
        state[_STATE_KEY] = extra
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop(_STATE_KEY, {})
        super().load_state_dict(state_dict)
        if "sketcher" in extra and self.sketcher is not None:
            self.sketcher.load_state_dict(extra["sketcher"])
        if "noise_generator" in extra and isinstance(self.generator, torch.Generator):
            self.generator.set_state(extra["noise_generator"])

    @property
    def estimator(self) -> str:
        return self.sketch_config.estimator

    @property
    def sketch_size(self) -> int:
        return self.sketch_config.sketch_size

    @property
    def sketching(self) -> str:
        return self.sketch_config.sketching


class RandomizedClippingOptimizer(RandomizedClippingMixin, DPOptimizerFastGradientClipping):
    """:class:`~opacus.optimizers.DPOptimizerFastGradientClipping` for randomized clipping."""


class DistributedRandomizedClippingOptimizer(
    RandomizedClippingMixin, DistributedDPOptimizerFastGradientClipping
):
    """Distributed (DDP) form: noise is added on rank 0 only, gradients are all-reduced."""
