"""Grad-sample modules for randomized clipping.

They extend Opacus's fast-gradient-clipping hooks: the first backward pass computes
per-sample norms, linear layers' weights by a sketch (see :mod:`opacus_rc.norm_samplers`)
and every other trainable layer exactly; ``get_clipping_coef`` turns the norms into
``min(1, C / n_hat_i^{1/2})`` and :class:`opacus.utils.fast_gradient_clipping_utils.
DPLossFastGradientClipping` runs the second, rescaled backward pass as in ghost mode.

The module owns the run's :class:`~opacus_rc.sketch.Sketcher`: a fresh independent
sketch per layer and per step, seedable (``sketch_seed``), re-seeded from ``os.urandom``
in ``secure_mode``.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Optional

from opacus.grad_sample import (
    GradSampleHooksFastGradientClipping,
    GradSampleModuleFastGradientClipping,
)
from torch import nn

from .config import SketchConfig
from .norm_samplers import RANDOMIZED_NORM_SAMPLERS
from .sketch import Sketcher


class SketchingMixin:
    """Binds the randomized norm samplers to this module's sketcher."""

    def _init_randomized(
        self, sketch_config: SketchConfig, sketch_seed: Optional[int], secure_mode: bool
    ) -> None:
        self.sketch_config = sketch_config
        self.sketcher = Sketcher(sketch_config, seed=sketch_seed, secure_mode=secure_mode)
        # Instance-level table: Opacus's hooks look up ``self.NORM_SAMPLERS``.
        self.NORM_SAMPLERS = {
            cls: functools.partial(fn, sketcher=self.sketcher)
            for cls, fn in RANDOMIZED_NORM_SAMPLERS.items()
        }

    def sketch_state_dict(self) -> Dict[str, Any]:
        """State of the sketch generator(s), for checkpoints."""
        return self.sketcher.state_dict()

    def load_sketch_state_dict(self, state: Dict[str, Any]) -> None:
        self.sketcher.load_state_dict(state)


class GradSampleHooksRandomizedClipping(
    SketchingMixin, GradSampleHooksFastGradientClipping
):
    """Hooks (``wrap_model=False``) form of randomized clipping.

    ``per_sample_gradient_norms`` holds the *estimated* norms of the last batch (not
    privatized: for debugging only, as in Opacus).
    """

    def __init__(
        self,
        m: nn.Module,
        *,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        strict: bool = True,
        force_functorch: bool = False,
        max_grad_norm: float = 1.0,
        sketch_config: SketchConfig = SketchConfig(),
        sketch_seed: Optional[int] = None,
        secure_mode: bool = False,
    ) -> None:
        super().__init__(
            m,
            batch_first=batch_first,
            loss_reduction=loss_reduction,
            strict=strict,
            force_functorch=force_functorch,
            max_grad_norm=max_grad_norm,
            use_ghost_clipping=True,
        )
        self._init_randomized(sketch_config, sketch_seed, secure_mode)


class GradSampleModuleRandomizedClipping(
    SketchingMixin, GradSampleModuleFastGradientClipping
):
    """Wrapping (``wrap_model=True``) form of randomized clipping."""

    def __init__(
        self,
        m: nn.Module,
        *,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        strict: bool = True,
        force_functorch: bool = False,
        max_grad_norm: float = 1.0,
        sketch_config: SketchConfig = SketchConfig(),
        sketch_seed: Optional[int] = None,
        secure_mode: bool = False,
    ) -> None:
        super().__init__(
            m,
            batch_first=batch_first,
            loss_reduction=loss_reduction,
            strict=strict,
            force_functorch=force_functorch,
            max_grad_norm=max_grad_norm,
            use_ghost_clipping=True,
        )
        self._init_randomized(sketch_config, sketch_seed, secure_mode)
