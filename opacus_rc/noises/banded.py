"""``noise="banded"``: amplified banded matrix factorisation (Choquette-Choo et al., 2023) with
the banded square root's coefficients (:mod:`opacus_rc.correlated`): its mechanism
(:class:`BandedNoise`) and its row of :data:`opacus_rc.noises.NOISES` (:data:`BANDED`).

The noise of step ``t`` is the recursion over the last ``b - 1`` noise vectors

    w_t = (z_t - sum_{j=1}^{b-1} c_j w_{t-j}) / c_0,     z_t ~ N(0, sigma^2 C_clip^2 I),

that is ``w = C^-1 z`` for the lower-triangular banded Toeplitz ``C``. Over cyclic Poisson
draws (draw ``t`` from part ``t mod b`` of the units) a unit's draws are ``b`` apart, the
columns of ``C`` it touches are disjoint, and ``n`` steps are charged as ``ceil(n / b)`` DP-SGD
rounds at ``sigma / max_column_norm(C)`` and the rate inside a part (the record: ``bands = b``,
``column_norm``). The mechanism's time is the draw's number, so a draw never released still
advances the recursion and is charged.
"""

from __future__ import annotations

import collections
import math
import weakref
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence

import torch

from ..correlated import banded_sqrt_coefficients, max_column_norm
from ..values import positive_int
from .base import NoiseMechanism, NoiseSpec, state_key

BANDED_NOISE = "banded"
#: key of ``optimizer.state_dict()`` holding the banded noise's public state
BANDED_STATE_KEY = state_key(BANDED_NOISE)


def banded_spec(coefficients: Sequence[float]) -> NoiseSpec:
    """The spec of banded noise with ``C``'s coefficients ``c_0 .. c_{b-1}`` (``c_0 > 0``): cyclic
    Poisson draws over ``b`` parts, charged with ``bands = b`` and ``column_norm = ||C[:, t]||``."""
    coefficients = tuple(float(c) for c in coefficients)
    if not coefficients or not all(math.isfinite(c) for c in coefficients) or coefficients[0] <= 0:
        raise ValueError(f"band coefficients {coefficients!r}: accepted values: finite reals with c_0 > 0")
    b = len(coefficients)
    return NoiseSpec(BANDED_NOISE, BandedNoise, (coefficients,), parts=b, bands=b,
                     column_norm=max_column_norm(coefficients), fresh_each_step=False, parts_keyword="bands")


def parse_banded(given: Mapping[str, Any], most: str) -> NoiseSpec:
    """``bands=b`` (an int from 1 to ``most``): the banded square root's ``b`` coefficients."""
    bands = given.get("bands")
    if not positive_int(bands):
        raise ValueError(
            f"bands={bands!r} is invalid with noise='banded'; accepted values: an int from 1 to {most}: the "
            "noise's coefficients and the sampler's parts"
        )
    return banded_spec(banded_sqrt_coefficients(int(bands)))


class BandedNoise(NoiseMechanism):
    """The banded recursion's state: the next mechanism step, the current *run* and, per
    parameter slot, the last ``b - 1`` released noise vectors (``w_{t-1}, ..., w_{t-b+1}``).

    The kept vectors are as secret as the noise: they leave the process only with the
    generators' states (``save_checkpoint(..., include_rng_state=True)``, :attr:`kept`). A
    state loaded without them starts a new run (:meth:`restart`): the released noise before
    and after are independent, and a unit's draws in either run stay ``b`` apart.

    Args:
        coefficients: ``c_0 .. c_{b-1}`` of ``C`` (``c_0 > 0``; :func:`banded_sqrt_coefficients`).
    """

    def __init__(self, coefficients: Sequence[float]) -> None:
        super().__init__(banded_spec(coefficients))
        self.coefficients = self.spec.params[0]
        self._past: Dict[int, Deque[torch.Tensor]] = {}
        #: the secret part of the state (kept vectors, run), for ``include_rng_state=True`` checkpoints
        self.kept = self.secret = KeptNoise(self)

    @property
    def bands(self) -> int:
        return len(self.coefficients)

    @property
    def column_norm(self) -> float:
        return max_column_norm(self.coefficients)

    @property
    def holder(self) -> Any:
        """Where the kept vectors live (:attr:`KeptNoise.holder`)."""
        return self.kept.holder

    @holder.setter
    def holder(self, value: Any) -> None:
        if hasattr(self, "kept"):
            self.kept.holder = value

    def restart(self) -> None:
        """A new run from :attr:`next_step`: no kept vectors (its first noise is ``z / c_0``)."""
        self._past = {}
        super().restart()

    def step(self, slot: int, draw: Callable[[], torch.Tensor], steps: int) -> torch.Tensor:
        """``w_t`` of parameter ``slot``, correlated ``steps`` times (the draws never released
        since the last release: their noise is drawn and discarded)."""
        for _ in range(steps):
            noise = self.correlate(slot, draw())
        return noise

    def correlate(self, slot: int, z: torch.Tensor) -> torch.Tensor:
        """The noise of parameter ``slot`` at the next mechanism step, from fresh ``z``
        (overwritten): ``w = (z - sum_j c_j w_{t-j}) / c_0``, kept for the next steps."""
        past = self._past.setdefault(slot, collections.deque(maxlen=self.bands - 1))
        for c, previous in zip(self.coefficients[1:], past):
            z.sub_(previous, alpha=c)
        if self.coefficients[0] != 1.0:
            z.div_(self.coefficients[0])
        past.appendleft(z)
        return z

    @property
    def buffer_bytes(self) -> int:
        """Memory the kept noise vectors hold (at most ``b - 1`` per parameter)."""
        return sum(t.numel() * t.element_size() for past in self._past.values() for t in past)

    def state_dict(self) -> Dict[str, Any]:
        """The public state: the coefficients and the next step (no kept vector, no run)."""
        return {"coefficients": list(self.coefficients), "next_step": self.next_step}

    def check_state_dict(self, state: Dict[str, Any], secret: Optional[Dict[str, Any]] = None) -> None:
        """Refuse (ValueError) a checkpoint's state of other coefficients (other ``bands=``), and
        kept vectors ``secret`` saved with it that do not continue it (:meth:`KeptNoise.check_state_dict`)."""
        if tuple(float(c) for c in state["coefficients"]) != self.coefficients:
            raise ValueError(
                f"a checkpoint of banded noise with {len(state['coefficients'])} bands (coefficients "
                f"{state['coefficients']}) loaded into a run with bands={self.bands}: resume with the same bands="
            )
        if secret is not None:
            self.kept.check_state_dict(secret, int(state["next_step"]))

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue the step numbering of a checkpoint (its coefficients must be these) in a new
        run; the kept vectors, if the checkpoint has them, follow (:attr:`kept`, restored after
        this). A legacy state's vectors (versions up to 0.1.0 kept them in the optimizer's
        state) are not used."""
        super().load_state_dict(state)


class KeptNoise:
    """The secret part of a :class:`BandedNoise`: its run and kept noise vectors (saved and
    restored with the generators' states, :mod:`opacus_rc.checkpoint`)."""

    def __init__(self, noise: BandedNoise) -> None:
        self._noise = weakref.ref(noise)
        #: what the kept vectors are on this process (``"full"``, FSDP2 shards ``(rank, world)``,
        #: None where no noise is added); set by the optimizer
        self.holder: Any = "full"

    def state_dict(self) -> Dict[str, Any]:
        noise = self._noise()
        return {
            "run_id": noise.run_id, "run_start": noise.run_start, "next_step": noise.next_step, "holder": self.holder,
            "past": {slot: list(past) for slot, past in noise._past.items()},
        }

    def check_state_dict(self, state: Dict[str, Any], next_step: int) -> None:
        """Refuse (ValueError) saved vectors that are not of this process's kind (:attr:`holder`) or
        not of the step ``next_step`` of the optimizer state loaded with them."""
        holder = tuple(state["holder"]) if isinstance(state["holder"], (list, tuple)) else state["holder"]
        if holder != self.holder:
            raise ValueError(
                f"noise='banded': the checkpoint's kept noise vectors are {holder or 'absent'} where they must be "
                f"{self.holder or 'absent'} on this process (DDP: rank 0 keeps them; FSDP2: each rank its own shards, "
                "same world size): load each rank's own checkpoint"
            )
        if int(state["next_step"]) != next_step:
            raise ValueError(
                f"noise='banded': the checkpoint's kept noise vectors are of step {state['next_step']}, its optimizer "
                f"state of step {next_step}: load the optimizer state saved with them"
            )

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue the saved run (:meth:`check_state_dict` against the noise's step)."""
        noise = self._noise()
        self.check_state_dict(state, noise.next_step)
        noise.run_id, noise.run_start = int(state["run_id"]), int(state["run_start"])
        noise._past = {
            int(slot): collections.deque(past, maxlen=noise.bands - 1) for slot, past in state["past"].items()
        }


#: the keywords banded noise reads (its row of :data:`opacus_rc.noises.NOISES`)
BANDED_KEYWORDS = (("bands", None, "Optional[int]", (
    "*randomized*, with ``noise=\"banded\"``. b, the number of noise coefficients\n"
    "and of the sampler's parts (1 <= b <= the draws of an epoch); it costs b - 1\n"
    "noise buffers of the trainable parameters' size."
)),)


__all__: List[str] = [
    "BANDED_KEYWORDS", "BANDED_NOISE", "BANDED_STATE_KEY", "BandedNoise", "KeptNoise", "banded_spec", "parse_banded",
]
