"""The protocol every noise mechanism follows (:data:`opacus_rc.noises.NOISES` lists them).

A mechanism is two objects:

* its :class:`NoiseSpec`, parsed once from ``noise=`` and the row's keywords: public and
  hashable (what :class:`~opacus_rc.options.Options` and the private Trainer's arguments hold).
  It says what the rest of the package needs of it: the sampler (``parts``: cyclic Poisson
  draws over that many parts of the units, each draw numbered; None: plain Poisson draws),
  the rate the accountant charges, the record it charges (``bands``, ``column_norm``) and
  whether each step's noise is fresh (the spectral denoiser assumes it);
* its :class:`NoiseMechanism`, built by the optimizer from the spec: the per-parameter state,
  its public part (:meth:`NoiseMechanism.state_dict`, in ``optimizer.state_dict()``) and its
  secret part (:attr:`NoiseMechanism.secret`, saved only with ``include_rng_state=True``), and
  the step: the noise added to one parameter's clipped sum given fresh Gaussian draws and the
  mechanism steps the release advances.

The accountant reads the record, never the mechanism: a step of a run in which a unit takes
part in at most one of every ``b`` consecutive steps, with sensitivity ``zeta C``, is charged as
``ceil(n / b)`` DP-SGD rounds at ``sigma / zeta`` (:meth:`~opacus_rc.accounting.records.StepRecord.reduced`;
independent noise: ``b = 1``, ``zeta = 1``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple, Type

import torch

from ..values import INDEPENDENT_NOISE


@dataclass(frozen=True)
class NoiseSpec:
    """The public parameters of one run's noise mechanism (hashable).

    Attributes:
        name: its row of :data:`~opacus_rc.noises.NOISES` (the value of ``noise=``).
        mechanism: the class of its per-optimizer state, built as ``mechanism(*params)``.
        params: its public parameters (banded noise: the coefficients ``c_0 .. c_{b-1}``).
        parts: the sampler it needs: cyclic Poisson draws over ``parts`` parts of the units,
            draw ``t`` from part ``t mod parts``, each numbered (the mechanism's time); None:
            plain Poisson draws, unnumbered.
        bands: the accountant's ``b``: a unit takes part in at most one of every ``bands``
            consecutive steps of one run.
        column_norm: the accountant's ``zeta``: one participation moves the released sequence
            by at most ``zeta C`` (``zeta >= 1`` never below the exact value).
        fresh_each_step: each step's noise is fresh and independent of the other steps' (the
            spectral denoiser assumes it; a mechanism without it refuses ``denoise=``).
        parts_keyword: the keyword that sets ``parts`` (messages name it), or None.
    """

    name: str
    mechanism: Type["NoiseMechanism"]
    params: Tuple[Any, ...] = ()
    parts: Optional[int] = None
    bands: int = 1
    column_norm: float = 1.0
    fresh_each_step: bool = True
    parts_keyword: Optional[str] = None

    def build(self) -> "NoiseMechanism":
        """A fresh state of this mechanism (one per optimizer)."""
        return self.mechanism(*self.params)

    def charged_rate(self, sample_rate: float) -> float:
        """The rate the accountant charges a step sampled at ``sample_rate``: ``parts x q``, the
        rate inside a part of the cyclic sampler (each part holds ``1 / parts`` of the units)."""
        return sample_rate * (self.parts or 1)

    def record_fields(self) -> Dict[str, Any]:
        """The accountant's record fields (:class:`~opacus_rc.accounting.records.StepRecord`)."""
        return {"bands": self.bands, "column_norm": self.column_norm}

    def check_sampling(self, *, poisson_sampling: bool, draws: int, sample_rate: float, draws_are: str,
                       hint: str = "") -> None:
        """Refuse (ValueError naming the parameter) a sampling this mechanism's sampler cannot
        serve: cyclic draws need Poisson sampling and at most ``draws`` (the draws of an epoch,
        ``draws_are``) parts, each sampled at ``parts x sample_rate <= 1``."""
        if self.parts is None:
            return
        if not poisson_sampling:
            raise ValueError(
                f"noise={self.name!r} needs poisson_sampling=True: the loader make_private returns samples cyclic "
                f"Poisson draws (draw t from part t mod {self.parts}), which keeps a unit's draws {self.parts} steps apart"
            )
        if self.parts > draws or self.parts * sample_rate > 1.0:
            given = f"{self.parts_keyword}={self.parts}" if self.parts_keyword else f"noise={self.name!r} ({self.parts} parts)"
            accepted = f"1 <= {self.parts_keyword} <= {draws}" if self.parts_keyword else "a lower sample rate"
            raise ValueError(
                f"{given} is above the {draws} {draws_are} of an epoch (sample rate {sample_rate:.6g}): each of "
                f"the {self.parts} parts would be sampled at a rate above 1; accepted values: {accepted}{hint}"
            )


def new_run_id() -> int:
    """A fresh identifier of a run of a mechanism (63 bits from ``os.urandom``; public)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


class NoiseMechanism:
    """One noise mechanism's state in one optimizer; this base is independent Gaussian noise
    (DP-SGD: ``w_t = z_t``, no state, no time).

    A *numbered* mechanism (its spec has ``parts``) is served by the cyclic Poisson sampler:
    its time is the draw's number (:attr:`next_step`), and its state lives in *runs*, one
    recursion over consecutive steps with one partition of the units
    (:class:`~opacus_rc.units.CyclicPoissonSampler` serves a run: :meth:`restart`,
    :attr:`run_id`, :attr:`started`). The accountant charges each run apart (the record's
    ``noise_run``).

    Args:
        spec: its public parameters (:class:`NoiseSpec`).
    """

    def __init__(self, spec: NoiseSpec) -> None:
        self.spec = spec
        #: the next mechanism step: the cyclic sampler's next draw to release (numbered mechanisms)
        self.next_step = 0
        self.run_id, self.run_start = new_run_id(), 0
        #: what its state is on this process (``"full"``; FSDP2: ``(rank, world_size)``; None where
        #: no noise is added: DDP's ranks but 0); set by the optimizer (:meth:`bind`)
        self.holder: Any = "full"

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def numbered(self) -> bool:
        """Its time is the number of the draw each release trains on (cyclic Poisson draws)."""
        return self.spec.parts is not None

    @property
    def state_key(self) -> str:
        """Key of ``optimizer.state_dict()`` holding its public state (:meth:`state_dict`)."""
        return state_key(self.name)

    def bind(self, holder: Any) -> None:
        """Where its state lives on this process (the optimizer's ``noise_holder()``)."""
        self.holder = holder

    # --- the step -------------------------------------------------------------------------

    def steps_to(self, step: int) -> int:
        """Mechanism steps from :attr:`next_step` through draw ``step`` (> 1 when draws between
        were never released: their noise is drawn and discarded). ValueError for a draw before
        :attr:`next_step`: its noise was already released."""
        if step < self.next_step:
            raise ValueError(
                f"noise={self.name!r}: draw {step} of the cyclic Poisson sampler came after draw {self.next_step - 1} "
                "was released; each draw is released at most once and in order (train on the loader make_private "
                "returned, one pass over each batch). Nothing was released"
            )
        return step - self.next_step + 1

    def step(self, slot: int, draw: Callable[[], torch.Tensor], steps: int) -> torch.Tensor:
        """The noise added to parameter ``slot``'s clipped sum at this release: ``draw()`` gives a
        fresh ``z ~ N(0, sigma^2 C^2 I)`` shaped like the sum (the caller may overwrite it);
        ``steps``: the mechanism steps the release advances. Independent noise: ``w = z``."""
        return draw()

    def advance(self, steps: int) -> None:
        """The release advanced ``steps`` mechanism steps (every slot was stepped)."""
        if self.numbered:
            self.next_step += steps

    def record_fields(self, steps: int) -> Dict[str, Any]:
        """What the accountant records of a release that advanced ``steps`` mechanism steps:
        the spec's record, and the run of a numbered mechanism (runs are charged apart)."""
        return {"steps": steps, **self.spec.record_fields(), "noise_run": self.run_id if self.numbered else None}

    # --- runs -----------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        """The current run released a step (its partition of the units is in use)."""
        return self.next_step > self.run_start

    def restart(self) -> None:
        """A new run from :attr:`next_step`: a new :attr:`run_id` (charged apart, served by a
        partition of its own); a mechanism with state drops it here."""
        self.run_id, self.run_start = new_run_id(), self.next_step

    # --- public and secret state ------------------------------------------------------------

    def state_dict(self) -> Optional[Dict[str, Any]]:
        """The public state (``optimizer.state_dict()[state_key]``; no secret); None: nothing to
        save (independent noise). A numbered mechanism saves its next step."""
        return {"next_step": self.next_step} if self.numbered else None

    def check_state_dict(self, state: Dict[str, Any], secret: Optional[Dict[str, Any]] = None) -> None:
        """Refuse (ValueError) a checkpoint's public ``state`` (:meth:`state_dict`) this mechanism
        must not continue from, and its ``secret`` state saved with it, if given (:attr:`secret`'s
        ``state_dict``), before anything is loaded (:mod:`opacus_rc.checkpoint`). The base refuses
        nothing."""

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue a checkpoint's step numbering in a new run (:meth:`restart`); the secret
        state, if the checkpoint has it, follows (:attr:`secret`, restored after this).
        :meth:`check_state_dict` first."""
        self.check_state_dict(state)
        self.next_step = int(state["next_step"])
        self.restart()

    #: the secret part of its state (an object with ``state_dict``/``load_state_dict``), saved
    #: and restored only with the generators' states (:mod:`opacus_rc.checkpoint`; checked with
    #: the public state by :meth:`check_state_dict` before anything is loaded); None: none
    secret: Any = None

    @property
    def buffer_bytes(self) -> int:
        """Memory its per-parameter state holds."""
        return 0


def state_key(name: str) -> str:
    """The key of ``optimizer.state_dict()`` holding mechanism ``name``'s public state."""
    return f"opacus_rc_{name}_noise"


class IndependentNoise(NoiseMechanism):
    """DP-SGD's independent Gaussian noise: fresh ``N(0, sigma^2 C^2)`` at every step."""

    def __init__(self) -> None:
        super().__init__(INDEPENDENT)


#: independent noise's spec (the default)
INDEPENDENT = NoiseSpec(INDEPENDENT_NOISE, IndependentNoise)


def draw_step_error(name: str) -> ValueError:
    """The refusal of a release of numbered noise ``name`` whose clipped sums do not come from
    one draw of the cyclic Poisson loader (its draw carries the noise's time)."""
    return ValueError(
        f"noise={name!r}: optimizer.step() released clipped sums that no draw of the cyclic Poisson loader "
        "make_private returned delivered (data built by hand, accumulation over several draws, or a loader "
        f"of your own); noise={name!r} needs each step to train on that loader's batches (BatchMemoryManager "
        "over it is fine), so that a unit's draws stay a cycle of the sampler's parts apart. Nothing was released"
    )


__all__ = ["INDEPENDENT", "IndependentNoise", "NoiseMechanism", "NoiseSpec", "draw_step_error", "new_run_id", "state_key"]
