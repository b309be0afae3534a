"""Checkpoints without secrets.

The sketch generators' states and seed, the noise generators' states and seed, the Poisson
generator's state, a noise mechanism's secret state (banded noise: the kept noise vectors) and
the cyclic sampler's secret partition of the units are secrets: with them, a reader of a
checkpoint regenerates the noise of every step (no privacy left), the batches and the
per-example sketches (the hidden-Z analysis is void), or recovers the last clipped sums from
two consecutive models. By default
``PrivacyEngine.save_checkpoint`` stores none of them (the wrapped optimizer's state, the
module and the accountant's history only), and a resumed run draws fresh randomness and
reports the same epsilon. ``include_rng_state=True`` adds them for a bit-exact resume: such
a file is as secret as the training data.

A Poisson generator that a restarted script re-creates as it was (the DataLoader's own
``generator=``, or its per-rank child: :func:`reproducible`) would replay the original run's
draws on resume: a checkpoint without its state is refused (:func:`load_checked`). The
states are one rank's (its own streams): loaded on another rank, they are refused.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Optional

import torch

from . import sketch

RNG_STATE_KEY = "opacus_rc_rng_state"

#: where ``make_private`` leaves the Poisson loader's generator on the engine
POISSON_GENERATOR_ATTR = "_opacus_rc_poisson_generator"
#: where ``make_private`` leaves the cyclic Poisson sampler (its partition) of a numbered noise on the engine
CYCLIC_SAMPLER_ATTR = "_opacus_rc_cyclic_sampler"

#: the Poisson generators a restarted script seeds again (:func:`reproducible`)
_REPRODUCIBLE: "weakref.WeakSet[torch.Generator]" = weakref.WeakSet()


def reproducible(generator: torch.Generator) -> torch.Generator:
    """``generator``, marked as re-created alike by a restarted script (the DataLoader's own
    ``generator=``, or a child of it): resumed without its state, it would replay its draws."""
    _REPRODUCIBLE.add(generator)
    return generator


def replays(generator: Any) -> bool:
    """Whether ``generator`` was marked :func:`reproducible`."""
    return isinstance(generator, torch.Generator) and generator in _REPRODUCIBLE


def _sources(module: Any, optimizer: Optional[Any], engine: Any) -> Dict[str, Any]:
    """The random sources present, by their key in the saved state (in save and load order):
    torch generators (keys ``*_generator``) and objects with ``state_dict``/``load_state_dict``
    (the noise mechanism's secret state after the optimizer's, the partition of the cyclic sampler
    that serves its run after it)."""
    mechanism = getattr(optimizer, "noise_mechanism", None)
    secret = {} if mechanism is None else {f"{mechanism.name}_noise": mechanism.secret}  # e.g. "banded_noise"
    sources = {
        "sketcher": getattr(module, "sketcher", None),
        "noise_generator": getattr(optimizer, "generator", None),
        "noise_streams": getattr(optimizer, "noise_streams", None),
        "poisson_generator": getattr(engine, POISSON_GENERATOR_ATTR, None),
        **secret,
        "cyclic_partition": getattr(engine, CYCLIC_SAMPLER_ATTR, None),
    }
    return {
        key: source for key, source in sources.items()
        if (isinstance(source, torch.Generator) if key.endswith("_generator") else source is not None)
    }


def with_rng_state(engine: Any, include_rng_state: bool, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Opacus's ``save_checkpoint`` arguments ``kwargs``, with the generators' states (the
    sketch source's, the noise generators' and the Poisson generator's: secrets, see module
    doc) in its ``checkpoint_dict`` when ``include_rng_state`` (a bool; refused in secure mode)."""
    if not isinstance(include_rng_state, bool):
        raise ValueError(f"include_rng_state={include_rng_state!r}; accepted values: True, False")
    if not include_rng_state:
        return kwargs
    module, optimizer = kwargs.get("module"), kwargs.get("optimizer")
    if getattr(optimizer, "secure_mode", False) or getattr(getattr(module, "sketcher", None), "secure_mode", False):
        raise ValueError(
            "include_rng_state=True is not available with secure_mode=True: the secure "
            "generator's state is never exported; resume with fresh randomness instead"
        )
    state = {
        key: source.get_state() if key.endswith("_generator") else source.state_dict()
        for key, source in _sources(module, optimizer, engine).items()
    }
    state["rank"] = sketch._process_rank()
    return {**kwargs, "checkpoint_dict": {**(kwargs.get("checkpoint_dict") or {}), RNG_STATE_KEY: state}}


def load_checked(engine: Any, load: Any, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The checkpoint Opacus's ``load_checkpoint`` (``load(**kwargs)``) returns, without the
    generators' states, which are restored if the file has them (saved with
    ``include_rng_state=True``). The state of a seeded run loaded into a seeded optimizer is
    refused (:meth:`~opacus_rc.optimizer.RandomizedClippingMixin.check_seeded_resume`) unless
    the file has the generators' states, which continue the streams instead of replaying them.
    So is any checkpoint without the Poisson generator's state loaded into a run whose
    Poisson generator :func:`replays` (the loader's own ``generator=``, seeded again)."""
    optimizer = kwargs.get("optimizer")
    checks = hasattr(optimizer, "check_seeded_resume")
    if checks:
        optimizer.deferred_seeded_resume = False
    try:
        checkpoint = load(**kwargs)
        seeded = checks and optimizer.deferred_seeded_resume
    finally:
        if checks:
            optimizer.deferred_seeded_resume = None
    if seeded and RNG_STATE_KEY not in checkpoint:
        optimizer.check_seeded_resume(True)
    state = checkpoint.pop(RNG_STATE_KEY, {})
    saved_rank, rank = state.pop("rank", None), sketch._process_rank()
    if saved_rank is not None and saved_rank != rank:
        raise ValueError(
            f"this checkpoint holds rank {saved_rank}'s generator states (include_rng_state=True): "
            f"restored on rank {rank}, its streams (Poisson masks, per-example sketches) would repeat "
            f"rank {saved_rank}'s. Save and load one checkpoint per rank"
        )
    if replays(getattr(engine, POISSON_GENERATOR_ATTR, None)) and "poisson_generator" not in state:
        raise ValueError(
            "resuming with the DataLoader's own generator= replays the Poisson draws: the restarted "
            "script seeds it again, so the resumed steps would draw the first steps' examples (or users) "
            "again, with fresh noise, which the accountant charges as independent draws. Resume from a "
            "checkpoint saved with save_checkpoint(..., include_rng_state=True) (the draws continue), "
            "or build the resumed run's DataLoader without generator= (fresh draws from os.urandom)"
        )
    for key, source in _sources(kwargs.get("module"), optimizer, engine).items():
        if key in state:
            restore = source.set_state if key.endswith("_generator") else source.load_state_dict
            restore(state[key])
    return checkpoint
