"""The sketch source: independent Gaussian sketches, never derived from data.

A :class:`Sketcher` owns the random generators that draw every sketch of a run: fresh,
independent sketches every logical step (one per layer; shared by the step's micro-batches and
tied uses; per-example sketches belong to one pass), whoever built the objects: it reads a
*step clock* (the optimizer steps counted by the grad-sample module's ``follow_steps`` hook)
and, with no optimizer followed, starts new sketches every pass. Every stream (sketch, noise,
Poisson) is derived from one seed through :class:`numpy.random.SeedSequence` with a domain tag,
the device and, where ranks must differ, the rank (:class:`DeviceStreams`); in ``secure_mode``
every sketch comes from :mod:`opacus_rc.csprng`. Seeds and generator states are secrets, kept
out of every ``state_dict`` unless asked for (:meth:`Sketcher.state_dict`). Why:
docs/accounting.md ("What the guarantee assumes").
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional

import numpy as np
import torch

from .config import SketchConfig
from .estimators import hutchinson_sq_norms, hutchpp_sq_norms, sketch_rows
from .values import HUTCHINSON, PER_EXAMPLE_SKETCH


def entropy_seed() -> int:
    """A 63-bit seed from the operating system's cryptographic source."""
    return int.from_bytes(os.urandom(8), "little") >> 1


#: Spawn-key tag of the sketch streams ("sketch" in ASCII): no other stream uses it.
SKETCH_STREAM = 0x736B65746368
#: Spawn-key tag of the optimizer's noise streams ("noise" in ASCII).
NOISE_STREAM = 0x6E6F697365
#: Spawn-key tag of the Poisson batch-mask streams ("poisson" in ASCII).
POISSON_STREAM = 0x706F6973736F6E


def stream_seed(root: np.random.SeedSequence, *key: int) -> int:
    """A 63-bit generator seed for the stream ``key`` of ``root`` (SeedSequence hashing:
    distinct keys give independent seeds, unrelated to the root's integer)."""
    child = np.random.SeedSequence(root.entropy, spawn_key=(*root.spawn_key, *key))
    return int(child.generate_state(1, np.uint64)[0]) >> 1


def _process_rank() -> int:
    """This process's rank in the default torch.distributed group (0 without one)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class DeviceStreams:
    """One stream's torch generators, one per device, all derived from ``root`` (the run's
    seed sequence; ``SeedSequence(None)``: 128 bits of OS entropy): the ``i``-th device's is
    seeded with ``stream_seed(root, tag, i, r)``, ``tag`` the stream's domain tag, ``r = rank +
    1`` with ``per_rank`` (read when the generator is first made, after ``torch.distributed`` is
    initialised) else ``0``: streams of distinct tags or ranks are independent."""

    def __init__(self, root: np.random.SeedSequence, tag: int, *, per_rank: bool = False) -> None:
        self.root = root
        self.tag = tag
        self.per_rank = per_rank
        self._generators: Dict[str, torch.Generator] = {}

    def generator(self, device: Any = "cpu") -> torch.Generator:
        """The generator for ``device`` (made on first use)."""
        key = str(torch.device(device))
        if key not in self._generators:
            rank = _process_rank() + 1 if self.per_rank else 0
            seed = stream_seed(self.root, self.tag, len(self._generators), rank)
            self._generators[key] = torch.Generator(device=key).manual_seed(seed)
        return self._generators[key]

    def state_dict(self) -> Dict[str, Any]:
        """Root entropy and generator states (secrets: whoever holds them replays the stream)."""
        return {
            "seed": self.root.entropy,
            "generators": {key: g.get_state() for key, g in self._generators.items()},
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.root = np.random.SeedSequence(state["seed"])
        self._generators = {
            key: torch.Generator(device=key).set_state(gen_state) for key, gen_state in state["generators"].items()
        }


def check_seed(name: str, seed: Any, secure_mode: bool = False) -> Optional[int]:
    """``seed`` if it is None or a non-negative int (a SeedSequence entropy), else a ValueError;
    under ``secure_mode`` only None (its randomness comes from ``os.urandom``)."""
    if secure_mode and seed is not None:
        raise ValueError(f"{name} must be None when secure_mode=True: secure randomness comes from os.urandom")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"{name}={seed!r} is invalid; accepted values: a non-negative int or None")
    return seed


class Sketcher:
    """Draws sketches and applies the configured estimator.

    Args:
        config: estimator, sketch size and sketching (shared or per example).
        seed: seed of the sketch generator; ``None`` draws one from ``os.urandom``.
        secure_mode: draw every sketch from :mod:`opacus_rc.csprng` (``seed`` is then refused).
    """

    def __init__(self, config: SketchConfig, *, seed: Optional[int] = None, secure_mode: bool = False) -> None:
        check_seed("sketch_seed", seed, secure_mode)
        self.config = config
        self.secure_mode = secure_mode
        # seed None: 128 bits from the OS; the integer is never used as a generator seed
        self._streams = DeviceStreams(
            np.random.SeedSequence(seed), SKETCH_STREAM, per_rank=config.sketching == PER_EXAMPLE_SKETCH
        )
        self._step_sketches: Dict[Any, torch.Tensor] = {}
        self._clock: Callable[[], Optional[int]] = lambda: None
        self._passes = 0
        self._cache_token: Any = None

    @property
    def seed(self) -> Any:
        """The root entropy of the sketch streams (a secret; for reproducible copies)."""
        return self._streams.root.entropy

    def generator(self, device: torch.device) -> torch.Generator:
        """The generator for ``device`` (one per device, seeded from the run's seed; the rank
        folded in for per-example sketches, while shared ones agree across ranks)."""
        return self._streams.generator(device)

    def bind_step_clock(self, clock: Callable[[], Optional[int]]) -> None:
        """``clock()`` returns the number of optimizer steps taken (None: no
        randomized-clipping optimizer attached, every pass then gets new sketches)."""
        self._clock = clock

    def begin_pass(self) -> None:
        """Start of a pass (a forward with hooks on): per-example sketches, which belong to one
        pass, are dropped (shared ones live for the logical step; docs/accounting.md)."""
        self._passes += 1
        if self.config.sketching == PER_EXAMPLE_SKETCH:
            self._step_sketches.clear()

    def _refresh(self) -> None:
        """Drop the cached sketches when a new logical step (or, without a step clock, a
        new pass) has begun since they were drawn."""
        steps = self._clock()
        token = ("pass", self._passes) if steps is None else ("step", steps)
        if token != self._cache_token:
            self._step_sketches.clear()
            self._cache_token = token

    def gaussian(self, batch: int, rows: int, cols: int, device: torch.device, key: Any = None) -> torch.Tensor:
        """A (rows, cols) sketch, or (batch, rows, cols) for per-example sketching, with
        i.i.d. N(0, 1/cols) entries (float32).

        With a ``key`` (a layer or parameter) the sketch is drawn once per step (per pass
        for per-example sketching) and returned again for the same key: the uses of a
        tied parameter and the micro-batches of one step share it.
        """
        if key is None:
            return self._draw(batch, rows, cols, device)
        self._refresh()
        cache_key = (key, rows, cols)
        sketch = self._step_sketches.get(cache_key)
        if sketch is None or (sketch.dim() == 3 and sketch.shape[0] != batch):
            sketch = self._step_sketches[cache_key] = self._draw(batch, rows, cols, device)
        return sketch

    def _draw(self, batch: int, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        shape = (batch, rows, cols) if self.config.sketching == PER_EXAMPLE_SKETCH else (rows, cols)
        if torch.device(device).type == "meta":  # shape-only runs (memory/FLOP counting)
            return torch.empty(shape, device=device, dtype=torch.float32)
        if self.secure_mode:  # AES-256-CTR keystream keyed from os.urandom, no pseudo-random generator
            from .csprng import secure_standard_normal

            sketch = secure_standard_normal(shape, device)
        else:
            sketch = torch.randn(shape, generator=self.generator(device), device=device, dtype=torch.float32)
        return sketch.mul_(cols**-0.5)

    def estimate(self, activations: torch.Tensor, backprops: torch.Tensor, key: Optional[Any] = None) -> torch.Tensor:
        """Estimated per-sample ``||A_i^T G_i||_F^2``: (B,). ``key`` (the layer) makes the
        micro-batches of one step share the layer's sketch (see :meth:`gaussian`)."""
        batch, device = activations.shape[0], backprops.device
        rows = sketch_rows(activations.shape[-1], backprops.shape[-1], "auto")
        k = self.config.sketch_size
        tail = self.gaussian(batch, rows, k, device, key=(key, "tail") if key is not None else None)
        if self.config.estimator == HUTCHINSON:
            return hutchinson_sq_norms(activations, backprops, tail)
        head = self.gaussian(batch, rows, k, device, key=(key, "head") if key is not None else None)
        return hutchpp_sq_norms(activations, backprops, head, tail)

    def state_dict(self) -> Dict[str, Any]:
        """Root entropy and generator states, for a bit-exact resume only: whoever holds
        them can regenerate every sketch (keep such a file as secret as the data)."""
        return self._streams.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._streams.load_state_dict(state)
