"""One step's PRV on the domain's cells: the pmf, mean matching."""

from __future__ import annotations

import logging
import math
from typing import Tuple

import numpy as np

from .domain import _Domain
from .prvs import PRVStep

logger = logging.getLogger(__name__)

def _discretise(step: PRVStep, direction: str, dom: _Domain) -> Tuple[np.ndarray, float, float]:
    """Cell-centred pmf on the domain, mean shift, and the step's mass at infinity.

    Mass below the first edge is dropped and the rest renormalised (moves mass up);
    mass above the last edge, and any finite mass the cells do not account for (float
    rounding, underflow), goes to infinity. The grid is shifted so that the discrete
    mean equals the continuous (truncated, renormalised) mean, as in Gopi et al.
    """
    dt = dom.dt
    edges = (dom.i0 + np.arange(dom.n + 1) - 0.5) * dt
    pmf, below, _ = step.cell_masses(direction, edges)
    inside = float(pmf.sum())
    # finite weight of the renormalised pmf: inside + below (below is moved up); all
    # the rest of the unit mass is infinite loss (never less than the exact pm_inf)
    pm_inf_total = max(1.0 - (inside + below), step.pm_inf(direction))
    mean_c = step.partial_mean(direction, float(edges[0]), float(edges[-1])) / max(inside, 1e-300)
    pmf /= inside
    mean_d = float(np.dot(dom.centres, pmf))
    shift = mean_c - mean_d
    if abs(shift) >= dt / 2:
        logger.warning("mean shift %.3g exceeds half the mesh %.3g; clipped", shift, dt / 2)
        shift = math.copysign(dt / 2 * (1 - 1e-9), shift)
    return pmf, shift, min(pm_inf_total, 1.0)
