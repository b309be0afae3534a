"""The accountant of one trial: ``rc_prv`` that refuses a step outside what the search accounted.

Each trial's engine gets a :class:`TrialAccountant` bounded by the trial's
:class:`~opacus_rc.accounting.search.TrialMechanism`. A step is charged only if it is no
worse than the bound: noise multiplier at least the bound's, rate at most its rate (the
subsampled Gaussian's RDP grows with q and falls with sigma), the same sketch or exact
clipping (Z = 1), one micro-batch, independent noise, and at most the bound's steps in
all. Any other step raises :class:`TrialRefused` in the optimizer's hook, after the noise
and before the parameter update: nothing of it is applied. When the trial ends the
accountant is closed (every later step refused); the best trial's then reports the search's
total epsilon.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ..accounting.accountant import RCPRVAccountant
from ..accounting.records import StepRecord
from ..accounting.search import TrialMechanism
from ..config import SketchConfig

#: relative slack of the sigma and rate comparisons (float noise of a rate computed two ways)
_SLACK = 1e-9


class TrialRefused(ValueError):
    """A trial stepped outside the settings its search accounted (or after the search): the
    search stops; the trials run so far are spent."""


class TrialAccountant(RCPRVAccountant):
    """``rc_prv`` bounded by ``bound`` (module docstring)."""

    def __init__(self, bound: TrialMechanism) -> None:
        super().__init__()
        self.bound = bound
        self._closed = False
        self._total: Optional[Callable[[float], float]] = None

    def _covered(self, record: StepRecord) -> bool:
        if record.micro_batches != 1 or not record.dp_sgd:
            return False
        if not record.randomized:
            return True  # exact clipping: Z = 1, below any envelope
        b = self.bound.record
        return b.randomized and (record.sketch_size, record.sketching) == (b.sketch_size, b.sketching)

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
        """Charge the step(s) if covered by the bound; else raise :class:`TrialRefused`."""
        b = self.bound
        if self._closed:
            raise TrialRefused(
                "this trial has ended: its optimizer releases no more steps (the search accounted it as run); "
                "train further with a new make_private, a new charge"
            )
        record = StepRecord.from_config(sketch_config, micro_batches, bands, column_norm, noise_run)
        charged = sum(int(entry[2]) for entry in self.history) + int(steps)
        problems = [
            f"noise_multiplier={noise_multiplier!r} below the accounted {b.noise_multiplier!r}"
            if noise_multiplier < b.noise_multiplier * (1 - _SLACK) else "",
            f"sample_rate={sample_rate!r} above the accounted {b.sample_rate!r}"
            if sample_rate > b.sample_rate * (1 + _SLACK) else "",
            f"step record {record.as_dict()!r} not covered by the accounted {b.record.as_dict()!r}"
            if not self._covered(record) else "",
            f"{charged} steps, more than the accounted {b.steps}" if charged > b.steps else "",
        ]
        problems = [p for p in problems if p]
        if problems:
            raise TrialRefused(
                "a trial stepped outside what its search accounted: " + "; ".join(problems) + ". Nothing of this "
                "step was applied; the search stops. Pass the trial's config to make_private (noise_multiplier, "
                "sample_rate or the loader's batch size, the sketch) and stop at its steps"
            )
        super().step(noise_multiplier=noise_multiplier, sample_rate=sample_rate, sketch_config=sketch_config,
                     micro_batches=micro_batches, steps=steps, bands=bands, column_norm=column_norm,
                     noise_run=noise_run)

    @property
    def steps_charged(self) -> int:
        return int(sum(int(entry[2]) for entry in self.history))

    def close(self, total: Optional[Callable[[float], float]] = None) -> None:
        """End the trial: later steps are refused; with ``total``, :meth:`get_epsilon` reports it."""
        self._closed = True
        if total is not None:
            self._total = total

    def get_epsilon(self, delta: float, **kwargs: Any) -> float:
        """The search's total epsilon at ``delta`` once the search set it (the best trial's
        engine), else this trial's own."""
        if self._total is not None:
            return float(self._total(delta))
        return super().get_epsilon(delta, **kwargs)


__all__ = ["TrialAccountant", "TrialRefused"]
