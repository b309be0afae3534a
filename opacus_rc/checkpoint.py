"""Checkpoints without secrets.

The sketch generators' states and seed, the noise generators' states and seed and the
Poisson generator's state are secrets: with them, a reader of a checkpoint regenerates the
noise of every step (no privacy left), the batches and the per-example sketches (the
hidden-Z analysis is void). By default
``PrivacyEngine.save_checkpoint`` stores none of them (the wrapped optimizer's state, the
module and the accountant's history only), and a resumed run draws fresh randomness and
reports the same epsilon. ``include_rng_state=True`` adds them for a bit-exact resume: such
a file is as secret as the training data.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

RNG_STATE_KEY = "opacus_rc_rng_state"


#: where ``make_private`` leaves the Poisson loader's generator on the engine
POISSON_GENERATOR_ATTR = "_opacus_rc_poisson_generator"


def rng_state(module: Any, optimizer: Optional[Any], engine: Any = None) -> Dict[str, Any]:
    """The sketch source's, the noise generators' and the Poisson generator's states
    (secrets: see module doc)."""
    if getattr(optimizer, "secure_mode", False) or getattr(getattr(module, "sketcher", None), "secure_mode", False):
        raise ValueError(
            "include_rng_state=True is not available with secure_mode=True: the secure "
            "generator's state is never exported; resume with fresh randomness instead"
        )
    state: Dict[str, Any] = {}
    sketcher = getattr(module, "sketcher", None)
    if sketcher is not None:
        state["sketcher"] = sketcher.state_dict()
    generator = getattr(optimizer, "generator", None)
    if isinstance(generator, torch.Generator):
        state["noise_generator"] = generator.get_state()
    streams = getattr(optimizer, "noise_streams", None)
    if streams is not None:
        state["noise_streams"] = streams.state_dict()
    poisson = getattr(engine, POISSON_GENERATOR_ATTR, None)
    if isinstance(poisson, torch.Generator):
        state["poisson_generator"] = poisson.get_state()
    return state


def load_rng_state(
    state: Dict[str, Any], module: Any, optimizer: Optional[Any], engine: Any = None
) -> None:
    """Restore what :func:`rng_state` saved into ``module``, ``optimizer`` and the
    engine's Poisson generator."""
    sketcher = getattr(module, "sketcher", None)
    if "sketcher" in state and sketcher is not None:
        sketcher.load_state_dict(state["sketcher"])
    generator = getattr(optimizer, "generator", None)
    if "noise_generator" in state and isinstance(generator, torch.Generator):
        generator.set_state(state["noise_generator"])
    streams = getattr(optimizer, "noise_streams", None)
    if "noise_streams" in state and streams is not None:
        streams.load_state_dict(state["noise_streams"])
    poisson = getattr(engine, POISSON_GENERATOR_ATTR, None)
    if "poisson_generator" in state and isinstance(poisson, torch.Generator):
        poisson.set_state(state["poisson_generator"])


def with_rng_state(engine: Any, include_rng_state: bool, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Opacus's ``save_checkpoint`` arguments ``kwargs``, with the generators' states in
    its ``checkpoint_dict`` when ``include_rng_state`` (default False).

    Args:
        include_rng_state: also store the sketch, noise and Poisson generators' states and
            seeds, for a bit-exact resume. Whoever reads such a file can regenerate the
            noise, the batches and the sketches: keep it as secret as the training data.
    """
    if not isinstance(include_rng_state, bool):
        raise ValueError(f"include_rng_state={include_rng_state!r}; accepted values: True, False")
    if not include_rng_state:
        return kwargs
    extra = dict(kwargs.get("checkpoint_dict") or {})
    extra[RNG_STATE_KEY] = rng_state(kwargs.get("module"), kwargs.get("optimizer"), engine)
    return {**kwargs, "checkpoint_dict": extra}


def restore_rng_state(engine: Any, checkpoint: Dict[str, Any], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The ``checkpoint`` Opacus's ``load_checkpoint(**kwargs)`` returned, without the
    generators' states, which it restores if the file has them (saved with
    ``include_rng_state=True``)."""
    state = checkpoint.pop(RNG_STATE_KEY, None)
    if state is not None:
        load_rng_state(state, kwargs.get("module"), kwargs.get("optimizer"), engine)
    return checkpoint
