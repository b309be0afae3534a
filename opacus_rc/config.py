"""Sketch configuration shared by the estimators, the grad-sample module, the optimizer
and the accountant.

``SketchConfig`` is the single record of *how* per-sample norms are estimated. The
optimizer carries it (``optimizer.sketch_config``) so that the ``rc_prv`` accountant can
read it in its step hook; the grad-sample module uses it to draw sketches.
"""

from __future__ import annotations

from dataclasses import dataclass

from .values import ESTIMATORS, HUTCHINSON, PER_EXAMPLE_SKETCH, SKETCHINGS, check_choice


@dataclass(frozen=True)
class SketchConfig:
    """How per-sample squared gradient norms of linear layers are estimated.

    Args:
        estimator: ``"hutchinson"`` or ``"hutchpp"``.
        sketch_size: ``k``, the number of Gaussian (N(0, 1/k)) sketch vectors of the
            Hutchinson part. For Hutch++ it is the size of the residual ("tail")
            sketch; the head basis has ``sketch_size`` further columns, so Hutch++ costs
            about 3x the matrix products of Hutchinson (the standard m/3 split with
            m = 3k). Only the tail is random in the accountant's sense.
        sketching: ``"per_example"`` (default: an independent sketch per example,
            memory B*k*p per layer, below the layer's own activations B*T*p whenever it is
            sketched at all (T > k); allows the tighter hidden-Z accounting) or
            ``"shared"`` (one sketch per layer and step for the whole batch, memory k*p;
            Z revealed).
    """

    # The one place of the sketch defaults: make_private's options
    # (opacus_rc.options.OPTIONS), the accountant's records and the audits read them here.
    estimator: str = HUTCHINSON
    sketch_size: int = 32
    sketching: str = PER_EXAMPLE_SKETCH
    exact_when_cheaper: bool = True

    def __post_init__(self) -> None:
        check_choice("estimator", self.estimator, ESTIMATORS)
        if isinstance(self.sketch_size, bool) or not isinstance(self.sketch_size, int) or self.sketch_size <= 0:
            raise ValueError(
                f"sketch_size={self.sketch_size!r} is invalid; accepted values: a positive integer (e.g. 32)"
            )
        check_choice("sketching", self.sketching, SKETCHINGS)
