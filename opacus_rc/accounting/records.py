"""The step records of the ``rc_prv`` accountant's history (:class:`StepRecord`): what one
recorded step ran (its sketch, its accumulated micro-batches, its noise mechanism), in the form
checkpoints store (:meth:`StepRecord.as_dict`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Optional, Tuple

from ..config import ESTIMATORS, SKETCHINGS, SketchConfig
from ..values import SHARED_SKETCH, check_count

#: How a record or query that does not name its sketching is read: as one shared sketch,
#: the larger epsilon (the plugin's own records always name it; ``SketchConfig``'s default
#: is ``"per_example"``).
UNNAMED_SKETCHING = SHARED_SKETCH


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """The mechanism of one history entry, normalised once (hashable: steps group by it).

    ``sketch_size`` None: deterministic clipping; else randomized clipping with
    ``estimator``, ``sketch_size`` (k; for Hutch++ the residual's count, the only random
    part the analysis relies on) and ``sketching``. ``micro_batches``: m independently
    sampled micro-batches summed into the step. History entries hold it; checkpoints store
    it as a plain dict (:meth:`as_dict`); :meth:`of` reads any stored form.
    """

    estimator: Optional[str] = None
    sketch_size: Optional[int] = None
    sketching: str = UNNAMED_SKETCHING
    micro_batches: int = 1
    #: the noise mechanism's record (:meth:`opacus_rc.noises.NoiseSpec.record_fields`): a unit
    #: takes part in at most one of every ``bands`` consecutive steps of a run, and one
    #: participation moves the released sequence by at most ``column_norm`` C (banded noise: b
    #: and the largest column norm of its ``C``; independent noise: 1 and 1)
    bands: int = 1
    column_norm: float = 1.0
    #: the mechanism's run (:attr:`opacus_rc.noises.NoiseMechanism.run_id`); runs are charged
    #: apart (None: one run, as records of versions up to 0.1.0)
    noise_run: Optional[int] = None

    @property
    def randomized(self) -> bool:
        return self.sketch_size is not None

    @property
    def dp_sgd(self) -> bool:
        """Each step is one DP-SGD step (``bands = 1``, ``column_norm = 1``: independent noise)."""
        return self.bands == 1 and self.column_norm == 1.0

    def reduced(self, sigma: float, steps: int) -> Tuple[float, int, "StepRecord"]:
        """The record's steps as DP-SGD (amplified banded matrix factorisation, Choquette-Choo
        et al., 2023): ``steps`` consecutive steps of one run, in which a unit's draws are
        ``bands`` apart, are ``ceil(steps / bands)`` rounds at ``sigma / column_norm``, the same
        rate and sketch."""
        if self.dp_sgd:
            return sigma, steps, self
        plain = dataclasses.replace(self, bands=1, column_norm=1.0, noise_run=None)
        return sigma / self.column_norm, -(-steps // self.bands), plain

    @classmethod
    def from_config(
        cls, config: Optional[SketchConfig], micro_batches: int = 1, bands: int = 1, column_norm: float = 1.0,
        noise_run: Optional[int] = None,
    ) -> "StepRecord":
        m = check_count(micro_batches, "micro_batches")
        band = dict(bands=check_count(bands, "bands"), column_norm=_column_norm(column_norm), noise_run=_run(noise_run))
        if config is None:
            return cls(micro_batches=m, **band)
        if not isinstance(config, SketchConfig):
            raise ValueError(f"sketch_config={config!r} must be an opacus_rc.SketchConfig or None")
        return cls(config.estimator, int(config.sketch_size), config.sketching, m, **band)

    @classmethod
    def of(cls, raw: Any) -> "StepRecord":
        """From None, a :class:`SketchConfig`, a record dict (also of versions up to 0.1.0,
        whose k was ``accounting_sketch_count``) or a record."""
        if raw is None or isinstance(raw, StepRecord):
            return raw or cls()
        if isinstance(raw, SketchConfig):
            return cls.from_config(raw)
        if not isinstance(raw, dict):
            raise ValueError(f"sketch={raw!r} must be None, a dict or a SketchConfig")
        m = check_count(raw.get("micro_batches", 1), "micro_batches")
        band = dict(bands=check_count(raw.get("bands", 1), "bands"), column_norm=_column_norm(raw.get("column_norm", 1.0)),
                    noise_run=_run(raw.get("noise_run")))
        count = raw.get("sketch_size", raw.get("accounting_sketch_count"))
        if count is None:
            return cls(micro_batches=m, **band)  # deterministic clipping
        est, kind = raw.get("estimator", SketchConfig.estimator), raw.get("sketching", UNNAMED_SKETCHING)
        if est not in ESTIMATORS or kind not in SKETCHINGS:
            raise ValueError(
                f"sketch record {raw!r}: estimator must be one of {ESTIMATORS}, "
                f"sketching one of {SKETCHINGS}"
            )
        if int(count) <= 0:
            raise ValueError(f"sketch record {raw!r}: sketch_size must be positive")
        return cls(est, int(count), kind, m, **band)

    def as_dict(self) -> Optional[Dict[str, Any]]:
        """The stored form: None for a deterministic single-batch step of independent noise."""
        band = {} if self.dp_sgd else {"bands": self.bands, "column_norm": self.column_norm}
        if band and self.noise_run is not None:
            band["noise_run"] = self.noise_run
        if not self.randomized:
            if self.micro_batches == 1 and not band:
                return None
            return {**({"micro_batches": self.micro_batches} if self.micro_batches != 1 else {}), **band}
        stored = {**dataclasses.asdict(self), **band}
        for key in ("bands", "column_norm", "noise_run"):
            if key not in band:
                del stored[key]
        return stored


def _column_norm(value: Any) -> float:
    """A record's ``column_norm``: a finite real > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"column_norm={value!r}; accepted values: a finite real > 0 (the largest column norm of C)")
    return float(value)


def _run(value: Any) -> Optional[int]:
    """A record's ``noise_run``: None or an int."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"noise_run={value!r}; accepted values: None or an int (a run of the noise mechanism)")
    return value


def sketch_record(
    sketch_config: Optional[SketchConfig] = None,
    *,
    estimator: Optional[str] = None,
    sketch_size: Optional[int] = None,
    sketching: str = UNNAMED_SKETCHING,
    micro_batches: int = 1,
) -> Optional[Dict[str, Any]]:
    """Plain-dict record of a step (:meth:`StepRecord.as_dict`): its sketch (none:
    deterministic clipping) and its number of accumulated micro-batches."""
    if sketch_config is None and (estimator is not None or sketch_size is not None):
        sketch_config = SketchConfig(
            estimator=estimator or SketchConfig.estimator,
            sketch_size=SketchConfig.sketch_size if sketch_size is None else sketch_size,
            sketching=sketching,
        )
    return StepRecord.from_config(sketch_config, micro_batches).as_dict()


__all__ = ["StepRecord", "UNNAMED_SKETCHING", "sketch_record"]
