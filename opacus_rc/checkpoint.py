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
states are one rank's (its own streams): loaded on another rank, they are refused. Every
refusal is decided before anything is loaded: a refused load leaves the module, the optimizer,
the accountant and the generators as they were.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from typing import Any, Dict, Mapping, Optional

import torch
from torch import nn

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
    secret = {} if mechanism is None else {_secret_key(mechanism): mechanism.secret}
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


def _secret_key(mechanism: Any) -> str:
    """The key of a noise mechanism's secret state among the generators' states (e.g.
    ``"banded_noise"``)."""
    return f"{mechanism.name}_noise"


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


def load_checked(
    engine: Any,
    *,
    path: Any,
    module: nn.Module,
    optimizer: Optional[Any] = None,
    noise_scheduler: Optional[Any] = None,
    grad_clip_scheduler: Optional[Any] = None,
    module_load_dict_kwargs: Optional[Dict[str, Any]] = None,
    torch_load_kwargs: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Opacus's ``load_checkpoint`` (module, accountant, optimizer, schedulers, in its order; the
    checkpoint returned without the optimizer's and schedulers' states), in two phases: the file is
    read and every refusal decided, then the states are loaded. A refused load leaves the module,
    the optimizer, the accountant and the generators as they were (Opacus's loads the module and
    the accountant before the optimizer refuses).

    Refused (nothing loaded): a module state torch would load in part (:func:`check_module_state`);
    an accountant state its accountant refuses; an optimizer state its optimizer refuses
    (:meth:`~opacus_rc.optimizer.RandomizedClippingMixin.check_state_dict`: another noise
    mechanism, a public or secret state the mechanism refuses (banded noise: other bands, kept
    vectors of another step or holder), a seeded run's state into a seeded run unless the file
    holds the generators' states, which continue the streams instead of replaying them);
    generator states of another rank; any checkpoint without the Poisson generator's state loaded
    into a run whose Poisson generator :func:`replays` (the loader's own ``generator=``, seeded
    again); a cyclic sampler's partition of other rows. The generators' states, if the file has
    them (``include_rng_state=True``), are restored last."""
    checkpoint = torch.load(path, **(torch_load_kwargs or {}), weights_only=False)
    state = checkpoint.pop(RNG_STATE_KEY, None)
    optimizer_state = checkpoint.pop("optimizer_state_dict", {})
    noise_state = checkpoint.pop("noise_scheduler_state_dict", {})
    clip_state = checkpoint.pop("grad_clip_scheduler_state_dict", {})
    sources = _sources(module, optimizer, engine)
    mechanism = getattr(optimizer, "noise_mechanism", None)
    secret_key = None if mechanism is None else _secret_key(mechanism)
    # 1. every refusal, before anything is loaded
    check_module_state(module, checkpoint["module_state_dict"], (module_load_dict_kwargs or {}).get("strict", True))
    copy.deepcopy(engine.accountant).load_state_dict(checkpoint["privacy_accountant_state_dict"])  # a dry run
    loads_optimizer = optimizer is not None and len(optimizer_state) > 0
    if loads_optimizer and hasattr(optimizer, "check_state_dict"):
        optimizer.check_state_dict(optimizer_state, secret=(state or {}).get(secret_key),
                                   continues_streams=state is not None)
    _check_rng_state(engine, state or {})
    for key, source in sources.items():
        if state is not None and key in state and hasattr(source, "check_state_dict") and key != secret_key:
            source.check_state_dict(state[key])  # (the noise's secret: checked with its public state)
    # 2. load
    module.load_state_dict(checkpoint["module_state_dict"], **(module_load_dict_kwargs or {}))
    engine.accountant.load_state_dict(checkpoint["privacy_accountant_state_dict"])
    if loads_optimizer:
        getattr(optimizer, "apply_state_dict", optimizer.load_state_dict)(optimizer_state)
    elif (optimizer is not None) ^ (len(optimizer_state) > 0):  # Opacus's warning
        warnings.warn(
            f"optimizer_state_dict has {len(optimizer_state)} items but optimizer is "
            f"{'' if optimizer else 'not'} provided."
        )
    if noise_scheduler is not None and len(noise_state) > 0:
        noise_scheduler.load_state_dict(noise_state)
    if grad_clip_scheduler is not None and len(clip_state) > 0:
        grad_clip_scheduler.load_state_dict(clip_state)
    for key, source in sources.items():
        if state is not None and key in state:
            restore = source.set_state if key.endswith("_generator") else source.load_state_dict
            restore(state[key])
    return checkpoint


def check_module_state(module: nn.Module, saved: Mapping[str, Any], strict: bool = True) -> None:
    """Refuse (RuntimeError, as torch's ``load_state_dict``) a module state that torch would load
    only in part, before it loads any: keys missing or unexpected (``strict``), a tensor of
    another shape."""
    current = module.state_dict()
    problems = []
    if strict:
        missing = [k for k in current if k not in saved]
        unexpected = [k for k in saved if k not in current]
        if missing:
            problems.append(f"Missing key(s) in state_dict: {', '.join(map(repr, missing))}")
        if unexpected:
            problems.append(f"Unexpected key(s) in state_dict: {', '.join(map(repr, unexpected))}")
    for key, value in current.items():
        other = saved.get(key)
        if isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor) and other.shape != value.shape:
            problems.append(f"size mismatch for {key}: the checkpoint's {tuple(other.shape)}, the module's "
                            f"{tuple(value.shape)}")
    if problems:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__} (nothing was loaded): " + "; ".join(problems)
        )


def _check_rng_state(engine: Any, state: Dict[str, Any]) -> None:
    """Refuse generator states of another rank, and a checkpoint without the Poisson generator's
    state for a run whose Poisson generator :func:`replays`."""
    saved_rank, rank = state.get("rank"), sketch._process_rank()
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
