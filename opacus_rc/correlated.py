"""Correlated noise: banded matrix factorisation (``make_private(..., noise="banded", bands=b)``).

DP-SGD releases ``x_t + z_t`` with fresh noise ``z_t`` at every step, and the model is the
running sum ``A x̂`` (A: the lower-triangular matrix of ones). A factorisation ``A = B C``
releases instead ``x̂ = x + C⁻¹ z``, so the model holds ``A x + B z``: with a good ``C`` much
of the noise cancels in the running sum. Here ``C`` is lower-triangular banded Toeplitz with
``b`` coefficients ``c_0 .. c_{b-1}``; the noise of step ``t`` is the recursion

    w_t = (z_t - sum_{j=1}^{b-1} c_j w_{t-j}) / c_0,     z_t ~ N(0, sigma^2 C_clip^2 I),

which keeps the last ``b - 1`` noise vectors (``b - 1`` buffers of the trainable parameters'
size, :class:`BandedNoise`). The default coefficients are the banded square root of ``A``
(Kalinin and Lampert, 2024): those of ``(1 - x)^(-1/2)`` cut at ``b`` terms, divided by their
norm, so every column of ``C`` has norm at most 1.

Privacy (Choquette-Choo et al., 2023, amplified BandMF): when a unit can only be drawn at
steps ``b`` apart (cyclic Poisson sampling, :class:`~opacus_rc.units.CyclicPoissonSampler`),
the columns of ``C`` it touches are disjoint and the mechanism is accounted as DP-SGD with the
rate inside a part, over the rounds a unit can take part in (``ceil(steps / b)``), with
``sigma / max_column_norm(C)`` (:mod:`opacus_rc.accounting.accountant`).

The mechanism's time is the draw's: step ``t`` of the noise is draw ``t`` of the cyclic
sampler (:attr:`opacus_rc.draws.Draw.step`), so a draw that was never released (a loop stopped
inside it) still advances the recursion and is charged: a unit's draws stay ``b`` apart in the
noise too.
"""

from __future__ import annotations

import collections
import math
import os
import sys
import weakref
from typing import Any, Deque, Dict, List, Sequence, Tuple

import torch

from .values import check_count

#: key of ``optimizer.state_dict()`` holding the banded noise's state (a secret, as the noise)
BANDED_STATE_KEY = "opacus_rc_banded_noise"


def banded_sqrt_coefficients(bands: int) -> Tuple[float, ...]:
    """The banded square root's ``b`` coefficients: ``(1 - x)^(-1/2) = sum_j c_j x^j`` with
    ``c_0 = 1, c_j = c_{j-1} (2j - 1) / (2j)``, cut at ``b`` terms and divided by their
    Euclidean norm (every column of ``C`` then has norm <= 1, the first ones exactly 1)."""
    bands = check_count(bands, "bands")
    coefficients = [1.0]
    for j in range(1, bands):
        coefficients.append(coefficients[-1] * (2 * j - 1) / (2 * j))
    norm = math.sqrt(sum(c * c for c in coefficients))
    return tuple(c / norm for c in coefficients)


def max_column_norm(coefficients: Sequence[float]) -> float:
    """``max_t ||C[:, t]||_2`` of the banded Toeplitz ``C`` (the sensitivity of ``C x`` to one
    participation of norm 1): the norm of a full column, ``sqrt(sum_j c_j^2)`` (an upper bound
    for runs shorter than ``b`` steps), rounded up by a few ulps (never below the exact norm)."""
    return math.sqrt(math.fsum(float(c) ** 2 for c in coefficients)) * (1.0 + 4.0 * sys.float_info.epsilon)


def banded_matrix(coefficients: Sequence[float], steps: int) -> torch.Tensor:
    """The ``steps x steps`` lower-triangular banded Toeplitz ``C`` (float64), for tests and docs."""
    c = torch.zeros(steps, steps, dtype=torch.float64)
    for j, value in enumerate(coefficients):
        if j < steps:
            c += torch.diag(torch.full((steps - j,), float(value), dtype=torch.float64), -j)
    return c


def prefix_sum_error(coefficients: torch.Tensor, steps: int) -> torch.Tensor:
    """``||A C^-1||_F^2`` for the banded Toeplitz ``C`` of ``coefficients`` over ``steps`` steps
    (differentiable, O(steps x b)): ``C^-1`` is lower-triangular Toeplitz with the inverse series
    ``d`` (``d_0 = 1 / c_0``, ``d_k = -sum_{j>=1} c_j d_{k-j} / c_0``), ``A C^-1`` with its prefix
    sums ``e``, and the squared Frobenius norm is ``sum_k (steps - k) e_k^2``."""
    b = coefficients.shape[0]
    d = [1.0 / coefficients[0]]
    for k in range(1, steps):
        terms = [coefficients[j] * d[k - j] for j in range(1, min(k, b - 1) + 1)]
        d.append(-sum(terms) / coefficients[0] if terms else coefficients.new_zeros(()))
    e = torch.cumsum(torch.stack(d), 0)
    weights = torch.arange(steps, 0, -1, dtype=coefficients.dtype)
    return (weights * e**2).sum()


def optimized_banded_coefficients(bands: int, steps: int, iterations: int = 60) -> Tuple[float, ...]:
    """Banded Toeplitz coefficients that minimise the running sum's noise ``||A C^-1||_F^2`` over
    ``steps`` steps at column norm 1 (BandMF's objective restricted to Toeplitz ``C``), by L-BFGS
    from the banded square root (float64); never worse than it."""
    start = torch.tensor(banded_sqrt_coefficients(bands), dtype=torch.float64)
    if bands == 1:
        return tuple(start.tolist())
    theta = start.clone().requires_grad_(True)
    solver = torch.optim.LBFGS([theta], max_iter=iterations, line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        solver.zero_grad()
        value = prefix_sum_error(theta / theta.norm(), steps)
        value.backward()
        return value

    solver.step(loss)
    found = (theta / theta.norm()).detach()
    if not (found[0] > 0 and prefix_sum_error(found, steps) < prefix_sum_error(start, steps)):  # (NaN: diverged)
        return tuple(start.tolist())
    return tuple(found.tolist())


class BandedNoise:
    """The state of the banded noise recursion: the next mechanism step, the current *run* and,
    per parameter slot, the last ``b - 1`` released noise vectors (``w_{t-1}, ..., w_{t-b+1}``).

    A run is one recursion over consecutive mechanism steps with one partition of the units
    (:class:`~opacus_rc.units.CyclicPoissonSampler`); the accountant charges each run apart
    (``ceil(steps / b)`` rounds each). The kept vectors are as secret as the noise: they leave
    the process only with the generators' states (``save_checkpoint(..., include_rng_state=True)``,
    :attr:`kept`). A state loaded without them starts a new run (:meth:`restart`): the released
    noise before and after are independent, and a unit's draws in either run stay ``b`` apart.

    Args:
        coefficients: ``c_0 .. c_{b-1}`` of ``C`` (``c_0 > 0``; :func:`banded_sqrt_coefficients`).
    """

    def __init__(self, coefficients: Sequence[float]) -> None:
        coefficients = tuple(float(c) for c in coefficients)
        if not coefficients or not all(math.isfinite(c) for c in coefficients) or coefficients[0] <= 0:
            raise ValueError(
                f"band coefficients {coefficients!r}: accepted values: finite reals with c_0 > 0"
            )
        self.coefficients = coefficients
        #: the noise's next mechanism step: the cyclic sampler's next draw to release
        self.next_step = 0
        self._past: Dict[int, Deque[torch.Tensor]] = {}
        self.run_id, self.run_start = new_run_id(), 0
        #: the secret part of the state (kept vectors, run), for ``include_rng_state=True`` checkpoints
        self.kept = KeptNoise(self)

    @property
    def bands(self) -> int:
        return len(self.coefficients)

    @property
    def column_norm(self) -> float:
        return max_column_norm(self.coefficients)

    @property
    def started(self) -> bool:
        """The current run released a step (its partition of the units is in use)."""
        return self.next_step > self.run_start

    def restart(self) -> None:
        """A new run from :attr:`next_step`: no kept vectors (its first noise is ``z / c_0``),
        a new :attr:`run_id` (charged apart, and served by a partition of its own)."""
        self._past = {}
        self.run_id, self.run_start = new_run_id(), self.next_step

    def steps_to(self, step: int) -> int:
        """Mechanism steps from :attr:`next_step` through ``step`` (a draw's; > 1 when draws
        between were never released: their noise is drawn and discarded). ValueError for a
        draw before :attr:`next_step`: its noise was already released."""
        if step < self.next_step:
            raise ValueError(
                f"noise='banded': draw {step} of the cyclic Poisson sampler came after draw {self.next_step - 1} was "
                "released; each draw is released at most once and in order (train on the loader make_private "
                "returned, one pass over each batch). Nothing was released"
            )
        return step - self.next_step + 1

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

    def advance(self, steps: int) -> None:
        """The recursion moved ``steps`` mechanism steps (every slot was correlated that often)."""
        self.next_step += steps

    @property
    def buffer_bytes(self) -> int:
        """Memory the kept noise vectors hold (at most ``b - 1`` per parameter)."""
        return sum(t.numel() * t.element_size() for past in self._past.values() for t in past)

    def state_dict(self) -> Dict[str, Any]:
        """The public state: the coefficients and the next step (no kept vector, no run)."""
        return {"coefficients": list(self.coefficients), "next_step": self.next_step}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue the step numbering of a checkpoint (its coefficients must be these) in a new
        run (:meth:`restart`); the kept vectors, if the checkpoint has them, follow
        (:attr:`kept`, restored after this). A legacy state's vectors (versions up to 0.1.0 kept
        them in the optimizer's state) are not used."""
        if tuple(float(c) for c in state["coefficients"]) != self.coefficients:
            raise ValueError(
                f"a checkpoint of banded noise with {len(state['coefficients'])} bands (coefficients "
                f"{state['coefficients']}) loaded into a run with bands={self.bands}: resume with the same bands="
            )
        self.next_step = int(state["next_step"])
        self.restart()


def new_run_id() -> int:
    """A fresh identifier of a run of the recursion (63 bits from ``os.urandom``; public)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


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

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue the saved run: refused when the optimizer state loaded with it is of another
        step, or the vectors are not of this process's kind (:attr:`holder`)."""
        noise = self._noise()
        holder = tuple(state["holder"]) if isinstance(state["holder"], (list, tuple)) else state["holder"]
        if holder != self.holder:
            raise ValueError(
                f"noise='banded': the checkpoint's kept noise vectors are {holder or 'absent'} where they must be "
                f"{self.holder or 'absent'} on this process (DDP: rank 0 keeps them; FSDP2: each rank its own shards, "
                "same world size): load each rank's own checkpoint"
            )
        if int(state["next_step"]) != noise.next_step:
            raise ValueError(
                f"noise='banded': the checkpoint's kept noise vectors are of step {state['next_step']}, its optimizer "
                f"state of step {noise.next_step}: load the optimizer state saved with them"
            )
        noise.run_id, noise.run_start = int(state["run_id"]), int(state["run_start"])
        noise._past = {
            int(slot): collections.deque(past, maxlen=noise.bands - 1) for slot, past in state["past"].items()
        }


def draw_step_error() -> ValueError:
    """The refusal of a banded step whose clipped sums do not come from one draw of the
    cyclic Poisson loader (its draw carries the noise's time)."""
    return ValueError(
        "noise='banded': optimizer.step() released clipped sums that no draw of the cyclic Poisson loader "
        "make_private returned delivered (data built by hand, accumulation over several draws, or a loader "
        "of your own); banded noise needs each step to train on that loader's batches (BatchMemoryManager "
        "over it is fine), so that a unit's draws stay bands= steps apart. Nothing was released"
    )


__all__: List[str] = [
    "BANDED_STATE_KEY", "BandedNoise", "KeptNoise", "banded_matrix", "banded_sqrt_coefficients", "draw_step_error", "max_column_norm",
    "new_run_id", "optimized_banded_coefficients", "prefix_sum_error",
]
