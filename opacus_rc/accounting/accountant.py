"""``rc_prv``: an Opacus accountant for DP-SGD with randomized clipping.

History entries are ``(noise_multiplier, sample_rate, steps, record)`` with a
:class:`~opacus_rc.accounting.records.StepRecord`: its sketch (``estimator``, ``sketch_size``, ``sketching``; none:
deterministic clipping; ``sketch_size`` is k, for Hutch++ the residual's count, the only
random part the analysis relies on) and ``micro_batches`` (m, default 1), the number of
independently sampled micro-batches summed into the step (gradient accumulation).
``sample_rate`` is always the rate of one micro-batch: a step with ``m > 1`` is accounted
as the mixture over ``J ~ Bin(m, q)`` appearances (:mod:`opacus_rc.accounting.multiplicity`),
never as one draw at ``q * m``. Records are plain dicts (None for a deterministic
single-batch step) only in ``state_dict()``, the checkpoint format; ``load_state_dict`` and
``get_epsilon`` also read a history assigned with dict, None or ``SketchConfig`` records.
Opacus's ``get_noise_multiplier`` writes 3-tuples ``(sigma, q, steps)``; ``get_epsilon``
reads those with its sketch keyword arguments.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from opacus.accountants.accountant import IAccountant

from ..config import SKETCHINGS, SketchConfig
from ..values import PER_EXAMPLE_SKETCH, RC_PRV, check_choice, check_count
from .multiplicity import AccumulatedStepPRV, multiplicity_weights
from .records import UNNAMED_SKETCHING, StepRecord, sketch_record
from .secant import _LogLogSecant
from .prv import (
    DEFAULT_BIN_RATIO,
    DETERMINISTIC,
    StepPRV,
    compose_epsilon,
    envelope_mixture,
)

logger = logging.getLogger(__name__)

MECHANISM = RC_PRV
#: Fraction of delta spent on the Z mass beyond the cut-off (treated as infinite loss).
TAIL_DELTA_FRACTION = 1e-3
MAX_SIGMA = 1e6
#: Coarsest-allowed Z bins for accumulated steps (each bin is a mixture over J: costlier).
MULTIPLICITY_BIN_RATIO = 0.05

def _exposure(q: float, record: StepRecord) -> float:
    """Probability that the differing example takes part in the step."""
    m = record.micro_batches
    return multiplicity_weights(m, q)[0] if m > 1 else q


def _step_prv(sigma: float, q: float, record: StepRecord, tail_mass: float, bin_ratio: float):
    """The PRV of one recorded step.

    One micro-batch: Z bins of the envelope with the accounted sketch count; hidden Z only
    for independent per-example sketches (never for a shared sketch). ``m > 1``
    micro-batches: revealed bins of the largest of the ``m`` slots' Z (union bound; also
    for per-example sketches, whose hidden-Z analysis does not cover several copies of
    one example), each a mixture over ``J ~ Bin(m, q)`` copies.
    """
    m = record.micro_batches
    mixture = DETERMINISTIC if not record.randomized else envelope_mixture(
        record.sketch_size,
        float(tail_mass),
        hidden=m == 1 and record.sketching == PER_EXAMPLE_SKETCH,
        bin_ratio=bin_ratio if m == 1 else max(bin_ratio, MULTIPLICITY_BIN_RATIO),
        draws=m,
    )
    return StepPRV(sigma, q, mixture) if m == 1 else AccumulatedStepPRV(sigma, q, m, mixture)


class RCPRVAccountant(IAccountant):
    """PRV accountant for steps with deterministic or randomized clipping.

    eps(delta) of the composition of Poisson-subsampled Gaussian mixtures over the
    sensitivity bins of each step (``opacus_rc.accounting.prv``); deterministic steps are
    ordinary subsampled Gaussians.
    """

    #: relative width of the Z bins (smaller: tighter and slower)
    bin_ratio: float = DEFAULT_BIN_RATIO

    def __init__(self) -> None:
        super().__init__()
        self._cache: Dict[Tuple, float] = {}

    # ---- IAccountant -----------------------------------------------------------------
    def step(
        self,
        *,
        noise_multiplier: float,
        sample_rate: float,
        sketch_config: Optional[SketchConfig] = None,
        micro_batches: int = 1,
        steps: int = 1,
        bands: int = 1,
        column_norm: float = 1.0,
        noise_run: Optional[int] = None,
    ) -> None:
        """Record ``steps`` steps (``micro_batches`` independently sampled micro-batches at rate
        ``sample_rate`` each; the noise mechanism's record: a unit in at most one of every
        ``bands`` steps, sensitivity ``column_norm`` C, ``steps`` the mechanism steps the release
        advanced, ``noise_run`` the mechanism's run); consecutive identical steps are merged."""
        record = StepRecord.from_config(sketch_config, micro_batches, bands, column_norm, noise_run)
        steps = check_count(steps, "steps")
        if self.history:
            sigma, q, n, last = self.entry(self.history[-1])
            if (sigma, q, last) == (noise_multiplier, sample_rate, record):
                self.history[-1] = (sigma, q, n + steps, last)
                return
        self.history.append((noise_multiplier, sample_rate, steps, record))

    def get_optimizer_hook_fn(self, sample_rate: float) -> Callable[[Any], None]:
        """Hook for the DP optimizer: like Opacus's, plus ``optim.sketch_config``, the
        micro-batches accumulated into the step as a multiplicity (Opacus charges
        ``sample_rate * accumulated_iterations``, which under-charges independently
        sampled micro-batches), and the noise mechanism's record of the release
        (``optim.noise_mechanism.record_fields(optim.mechanism_steps)``: its mechanism steps,
        ``bands``, ``column_norm`` and run; :mod:`opacus_rc.noises`). The optimizers of Opacus
        have none: independent noise, one step."""

        def hook_fn(optim: Any) -> None:
            mechanism = getattr(optim, "noise_mechanism", None)
            self.step(
                noise_multiplier=optim.noise_multiplier,
                sample_rate=sample_rate,
                sketch_config=getattr(optim, "sketch_config", None),
                micro_batches=optim.accumulated_iterations,
                **({} if mechanism is None else mechanism.record_fields(optim.mechanism_steps)),
            )

        return hook_fn

    def get_epsilon(
        self,
        delta: float,
        *,
        estimator: Optional[str] = None,
        sketch_size: Optional[int] = None,
        sketching: str = UNNAMED_SKETCHING,
        eps_error: float = 0.01,
        delta_error: Optional[float] = None,
        **kwargs: Any,
    ) -> float:
        """Epsilon spent so far at ``delta`` (an upper bound, with error ``eps_error``).

        3-tuple history entries ``(sigma, q, steps)`` are randomized-clipping steps with
        the given ``estimator``/``sketch_size``/``sketching`` when one of the first two is
        given, else deterministic; 4-tuples carry their own sketch record.
        """
        if not 0.0 < delta < 1.0:
            raise ValueError(f"delta={delta} must lie in (0, 1)")
        check_choice("sketching", sketching, SKETCHINGS)
        default = StepRecord.of(sketch_record(estimator=estimator, sketch_size=sketch_size, sketching=sketching))
        groups = self._groups(default)
        if not groups:
            return 0.0
        if any(sigma <= 0.0 and q > 0.0 for (sigma, q, _), _ in groups):
            return math.inf  # a step without noise releases its update: no PRV to build
        if delta_error is None:
            delta_error = delta / 1000.0
        key = (delta, eps_error, delta_error, self.bin_ratio, tuple(groups))
        if key in self._cache:
            return self._cache[key]
        # the Z mass beyond the cut-off costs at most TAIL_DELTA_FRACTION * delta overall
        exposure = sum(_exposure(q, record) * n for (_, q, record), n in groups)
        tail = min(0.5, TAIL_DELTA_FRACTION * delta / max(exposure, 1e-300))
        steps = [_step_prv(sigma, q, record, tail, self.bin_ratio) for (sigma, q, record), _ in groups]
        counts = [n for _, n in groups]
        eps = compose_epsilon(steps, counts, delta, eps_error=eps_error, delta_error=delta_error)
        if len(self._cache) > 64:
            self._cache.clear()
        self._cache[key] = eps
        return eps

    def __len__(self) -> int:
        return len(self.history)

    @classmethod
    def mechanism(cls) -> str:
        return MECHANISM

    def state_dict(self, destination: Any = None) -> Any:
        """Opacus's state, each record a plain dict (:meth:`stored`): loads with
        ``torch.load(weights_only=True)`` and into the dict-record versions."""
        state = super().state_dict(destination)
        state["history"] = [self.stored(e) for e in self.history]
        return state

    def load_state_dict(self, state_dict: Any) -> None:
        """Loads a state of any version (dict records, 3-tuples), each entry checked first
        (:meth:`check_state_dict`: a refused state leaves the history as it was)."""
        self.check_state_dict(state_dict)
        super().load_state_dict(state_dict)
        self.history = [self.entry(e) for e in self.history]
        self._cache = {}

    def check_state_dict(self, state_dict: Any) -> None:
        """Refuse (ValueError) a state with an entry :meth:`entry` cannot read."""
        for e in state_dict["history"]:
            self.entry(e)

    # ---- entries -----------------------------------------------------------------------
    @staticmethod
    def entry(entry: Sequence[Any], default: Optional[StepRecord] = None) -> Tuple[float, float, int, StepRecord]:
        """``(sigma, q, steps, record)`` of a stored entry; a 3-tuple (Opacus's
        ``get_noise_multiplier``) takes ``default``."""
        if len(entry) not in (3, 4):
            raise ValueError(f"history entry {entry!r} must be (noise_multiplier, sample_rate, steps[, sketch])")
        sigma, q, n, *raw = entry
        return (float(sigma), float(q), int(n), StepRecord.of(raw[0]) if raw else default or StepRecord())

    @classmethod
    def stored(cls, entry: Sequence[Any]) -> Tuple:
        """The checkpoint form of an entry: its record as a plain dict (None: deterministic)."""
        sigma, q, n, record = cls.entry(entry)
        return (sigma, q, n, record.as_dict())

    def charged(self, default: Optional[StepRecord] = None) -> List[Tuple[float, float, int, StepRecord]]:
        """What :meth:`get_epsilon` composes: each history entry reduced to DP-SGD by its record
        (:meth:`StepRecord.reduced`: ``ceil(steps / bands)`` rounds at ``sigma / column_norm``;
        consecutive entries of one record, run included, are one run)."""
        runs: List[Tuple[float, float, int, StepRecord]] = []
        for raw in self.history:
            sigma, q, n, record = self.entry(raw, default)
            if runs and (runs[-1][0], runs[-1][1], runs[-1][3]) == (sigma, q, record):
                n += runs.pop()[2]  # one run of consecutive steps written as two entries
            runs.append((sigma, q, n, record))
        charged = []
        for sigma, q, n, record in runs:
            sigma, n, record = record.reduced(sigma, n)
            charged.append((sigma, q, n, record))
        return charged

    def _groups(self, default: StepRecord) -> List[Tuple[Tuple[float, float, StepRecord], int]]:
        """History (:meth:`charged`) merged into ``((sigma, q, record), steps)`` groups."""
        merged: Dict[Tuple[float, float, StepRecord], int] = {}
        for sigma, q, n, record in self.charged(default):
            if n > 0:
                merged[(sigma, q, record)] = merged.get((sigma, q, record), 0) + n
        return sorted(merged.items(), key=lambda kv: (kv[0][0], kv[0][1], repr(kv[0][2])))


def get_noise_multiplier_rc(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    epochs: Optional[float] = None,
    steps: Optional[int] = None,
    sketch_config: Optional[SketchConfig] = None,
    epsilon_tolerance: float = 0.01,
    eps_error: float = 0.01,
    sigma_lower: Optional[float] = None,
    bands: int = 1,
    column_norm: float = 1.0,
) -> float:
    """Smallest noise multiplier (to the tolerance) with ``eps_rc <= target_epsilon``.

    Returns a sigma whose epsilon, computed with ``eps_error``, lies in
    ``[target - epsilon_tolerance, target]``, so the result always meets the target.
    Two phases of a safeguarded secant search in ``(log sigma, log eps)``: first with a
    coarse ``eps_error`` (a coarser mesh still gives a valid upper bound on epsilon, and is
    several times cheaper) to locate the root, then with ``eps_error`` starting there (two
    or three evaluations). ``sigma_lower`` (e.g. the deterministic sigma, which never
    exceeds the randomized one) is only a starting point. ``sketch_config=None``
    calibrates deterministic clipping; ``bands``/``column_norm``: a noise mechanism's record
    (e.g. banded noise's; ``sample_rate`` then the rate inside a part, :meth:`StepRecord.reduced`).
    """
    return noise_multiplier_for_record(
        target_epsilon,
        target_delta,
        sample_rate,
        epochs,
        steps,
        StepRecord.from_config(sketch_config, 1, bands, column_norm),
        epsilon_tolerance=epsilon_tolerance,
        eps_error=eps_error,
        sigma_lower=sigma_lower,
    )


def noise_multiplier_for_record(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    epochs: Optional[float],
    steps: Optional[int],
    record: StepRecord,
    *,
    epsilon_tolerance: float = 0.01,
    eps_error: float = 0.01,
    sigma_lower: Optional[float] = None,
) -> float:
    """The search of :func:`get_noise_multiplier_rc` for ``steps`` steps (or
    ``epochs / sample_rate``) of one :class:`StepRecord` (any ``micro_batches``), once the
    arguments are checked (ValueError naming the parameter)."""
    if (steps is None) == (epochs is None):
        raise ValueError("give exactly one of steps= or epochs=")
    if not target_epsilon > 0:
        raise ValueError(f"target_epsilon={target_epsilon} must be > 0")
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate={sample_rate} must lie in (0, 1]")
    if not epsilon_tolerance > 0:
        raise ValueError(f"epsilon_tolerance={epsilon_tolerance} must be > 0")
    steps = int(steps) if epochs is None else int(epochs / sample_rate)
    acc = RCPRVAccountant()

    def eps_at(sigma: float, err: float) -> float:
        acc.history = [(sigma, sample_rate, steps, record)]
        return acc.get_epsilon(target_delta, eps_error=err)

    def search(err: float, tol: float, start: float, slope: float) -> _LogLogSecant:
        solver = _LogLogSecant(target_epsilon, tol, slope)
        sigma = start
        for _ in range(200):
            if sigma > MAX_SIGMA:
                raise ValueError("The privacy budget is too low.")
            solver.update(sigma, eps_at(sigma, err))
            if solver.done():
                return solver
            sigma = solver.propose()
        raise RuntimeError("noise calibration did not converge")  # pragma: no cover

    start = float(sigma_lower) if sigma_lower and sigma_lower > 0 else 1.0
    coarse_err = min(0.1, 0.05 * target_epsilon)
    if coarse_err > 2.0 * eps_error:
        coarse = search(coarse_err, max(epsilon_tolerance, 2.0 * coarse_err), start, -1.0)
        start, slope = coarse.hi, coarse.slope
        # the fine epsilon is smaller (finer mesh): start a little below the coarse root
        start *= math.exp(-coarse_err / (target_epsilon * max(-slope, 0.25)))
    else:
        slope = -1.0
    return search(eps_error, epsilon_tolerance, start, slope).hi
