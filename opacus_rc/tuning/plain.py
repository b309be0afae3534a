"""The private search in a plain training loop: :func:`private_search`."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..accounting.records import StepRecord
from ..accounting.search import TrialMechanism, search_noise_multiplier
from ..config import SketchConfig
from ..integration import PrivacyEngine
from ..options import DEFAULTS
from ..values import FLAT, RANDOMIZED, RC_PRV, SKETCHINGS, check_choice
from .draws import SecretDraws
from .guard import TrialAccountant, TrialRefused
from .loop import SearchResult, SearchState, TrialOutcome, check_search_options, fingerprint, plan_mechanisms, run_search
from .space import HpSpace, Space

#: the keys of a trial's config that fix what its accountant charges (given to
#: :func:`private_search` or drawn by ``hp_space``, never both)
PRIVACY_KEYS = ("noise_multiplier", "sample_rate", "steps", "clipping", "estimator", "sketch_size", "sketching")
CLIPPINGS = (RANDOMIZED, FLAT)
#: the noise multiplier the settings are enumerated with before sigma is calibrated
_PLACEHOLDER_SIGMA = 1.0

TrialFunction = Callable[[Dict[str, Any], PrivacyEngine], Tuple[Any, Any]]


def _mechanism(config: Dict[str, Any]) -> TrialMechanism:
    """The trial mechanism of a config holding every key of :data:`PRIVACY_KEYS`."""
    sigma, q, steps = config["noise_multiplier"], config["sample_rate"], config["steps"]
    for name, value, ok in (("noise_multiplier", sigma, lambda v: v > 0), ("sample_rate", q, lambda v: 0 < v <= 1),
                            ("steps", steps, lambda v: v >= 1 and int(v) == v)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
            raise ValueError(f"{name}={value!r}; accepted values: noise_multiplier > 0, sample_rate in (0, 1], "
                             "steps an integer >= 1")
    check_choice("clipping", config["clipping"], CLIPPINGS)
    record = StepRecord()
    if config["clipping"] == RANDOMIZED:
        check_choice("sketching", config["sketching"], SKETCHINGS)
        record = StepRecord.from_config(SketchConfig(estimator=config["estimator"], sketch_size=config["sketch_size"],
                                                     sketching=config["sketching"]))
    return TrialMechanism(float(sigma), float(q), int(steps), record)


def private_search(
    trial_fn: TrialFunction,
    hp_space: HpSpace,
    *,
    n_trials: float,
    distribution: Optional[str] = None,
    shape: Optional[float] = None,
    delta: float,
    target_epsilon: Optional[float] = None,
    noise_multiplier: Optional[float] = None,
    sample_rate: Optional[float] = None,
    steps: Optional[int] = None,
    clipping: Optional[str] = RANDOMIZED,
    estimator: Optional[str] = DEFAULTS["estimator"],
    sketch_size: Optional[int] = DEFAULTS["sketch_size"],
    sketching: Optional[str] = DEFAULTS["sketching"],
    direction: str = "maximize",
    secure_mode: bool = False,
    seed: Optional[int] = None,
    state_path: Optional[str] = None,
    release_trials: bool = False,
    backend: Optional[str] = None,
) -> SearchResult:
    """A private random search: K trials (K drawn from ``distribution`` with mean ``n_trials``,
    never chosen by the caller), each ``trial_fn(config, engine) -> (score, result)`` training
    with ``engine.make_private(...)`` from ``config``; only the best trial is released, and the
    total epsilon is that of releasing the best of K (Papernot and Steinke 2022; docs/tuning.md).

    ``config``: the hyperparameters ``hp_space`` drew (Hugging Face's convention: a function of a
    trial using ``suggest_float``/``suggest_int``/``suggest_categorical``, or a dict of lists),
    with the privacy settings :data:`PRIVACY_KEYS` (each given here or drawn by ``hp_space`` from
    finitely many values; ``noise_multiplier`` calibrated when ``target_epsilon``, the search's
    total, is given). ``engine``: a fresh ``opacus_rc.PrivacyEngine(accountant="rc_prv")`` whose
    accountant refuses any step the search did not account (:mod:`.guard`). ``score``: computed
    on data outside the training set, or privately (it chooses what is released); ``direction``
    says whether larger is better. A trial that raises counts as run; a trial whose score is not
    a finite number is never the best.

    Returns a :class:`~opacus_rc.tuning.loop.SearchResult`: the best ``config``, ``score``,
    ``result`` and ``engine`` (``engine.get_epsilon(delta)`` is the total), ``epsilon``,
    ``report()``. ``state_path``: a file keeping the search between runs (resume; :mod:`.loop`).
    ``release_trials=True``: every trial is returned (``trials``) and the total is their
    composition. ``seed``: reproducible draws (then as secret as the data). Refused:
    ``distribution=None``, an adaptive ``backend`` (``"optuna"``, ...), ``target_epsilon`` with
    ``noise_multiplier``, a privacy setting both given and drawn.
    """
    count = check_search_options(direction, backend, n_trials, distribution, shape)
    if not (isinstance(delta, float) and 0.0 < delta < 1.0):
        raise ValueError(f"delta={delta!r}; accepted values: a float in (0, 1)")
    if not callable(trial_fn):
        raise ValueError(f"trial_fn={trial_fn!r}; accepted values: a function (config, engine) -> (score, result)")
    if state_path is not None and release_trials:
        raise ValueError("state_path with release_trials=True is not supported; accepted values: one of them")
    if target_epsilon is not None and noise_multiplier is not None:
        raise ValueError("target_epsilon and noise_multiplier are both given; accepted values: exactly one of them "
                         "(or noise_multiplier drawn by hp_space)")
    space = Space(hp_space)
    given = dict(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=steps, clipping=clipping,
                 estimator=estimator, sketch_size=sketch_size, sketching=sketching)
    fixed = {k: v for k, v in given.items() if v is not None}
    if target_epsilon is not None:
        fixed["noise_multiplier"] = _PLACEHOLDER_SIGMA

    def merged(config: Dict[str, Any]) -> Dict[str, Any]:
        both = sorted(set(config) & set(fixed) & set(PRIVACY_KEYS))
        if both:
            raise ValueError(f"{', '.join(both)} given to private_search and drawn by hp_space; accepted values: one "
                             "of the two (target_epsilon calibrates noise_multiplier: do not draw it then)")
        out = {**fixed, **config}
        missing = [k for k in ("noise_multiplier", "sample_rate", "steps") if k not in out]
        if missing:
            raise ValueError(f"{', '.join(missing)}: neither given nor drawn by hp_space; accepted values: a value "
                             "(sample_rate: the Poisson rate the trial's loader draws at; steps: its optimizer steps)")
        return out

    mechanisms = plan_mechanisms(space, lambda c: _mechanism(merged(c)))
    if target_epsilon is not None:
        fixed["noise_multiplier"] = search_noise_multiplier(target_epsilon, delta, count, mechanisms)
        mechanisms = plan_mechanisms(space, lambda c: _mechanism(merged(c)))

    def run_trial(params: Dict[str, Any], config: Dict[str, Any], accountant: TrialAccountant, index: int) -> TrialOutcome:
        engine = PrivacyEngine(accountant=RC_PRV, secure_mode=secure_mode)
        engine.accountant = accountant
        returned = trial_fn(merged(config), engine)
        if not (isinstance(returned, tuple) and len(returned) == 2):
            raise TrialRefused(f"trial_fn returned {type(returned).__name__}; accepted values: a tuple (score, result)")
        return TrialOutcome(score=returned[0], result=returned[1], engine=engine)

    def restore(result: Any, accountant: TrialAccountant) -> TrialOutcome:
        engine = PrivacyEngine(accountant=RC_PRV, secure_mode=secure_mode)
        engine.accountant = accountant
        return TrialOutcome(score=None, result=result, engine=engine)

    state = None
    if state_path is not None:
        state = SearchState(state_path, fingerprint(count, delta, direction, space, mechanisms, release_trials),
                            save=lambda obj, path: torch.save(obj, path),
                            load=lambda path: torch.load(path, weights_only=False))
    draws = SecretDraws(secure_mode, seed, None if state is None else state.generator)
    result = run_search(
        space=space, count=count, delta=delta, direction=direction, mechanisms=mechanisms,
        mechanism_of=lambda c: _mechanism(merged(c)), run_trial=run_trial, draws=draws,
        release_trials=release_trials, state=state, restore=restore,
    )
    if result.config is not None:
        result.config = merged(result.config)
    if result.trials is not None:
        result.trials = [(merged(c), s, r) for c, s, r in result.trials]
    return result


__all__ = ["PRIVACY_KEYS", "private_search"]
