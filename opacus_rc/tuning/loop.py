"""The search itself, shared by the plain loop (:func:`opacus_rc.tuning.private_search`) and the
Trainer (``DPTrainer.hyperparameter_search``): draw whether another trial runs, draw its
settings, run it under a bounded accountant, keep the best; the state between trials; the
result and its epsilon.

**What is released** (by default): the best trial's result, config and score, and the total
epsilon. Nothing else: not the number of trials run, not the other trials' scores, models or
logs, not which trial was best. With ``release_trials=True`` every trial is released and the
total is the composition of the K trials run (``rc_prv`` over their histories), not the
best-of-K bound.

**Resume** (``state_path``): before a trial runs, the state records it as started; after it,
the best so far. A state holds no K and no generator state (but with ``seed``); a resumed
search counts every trial started as run (an interrupted one is lost, never run again) and
draws its next decision afresh (:mod:`.draws`). The state is as secret as the data: it tells
how many trials have run and the best score so far.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..accounting.accountant import RCPRVAccountant
from ..accounting.search import TrialCount, TrialMechanism, search_epsilon
from .draws import SecretDraws
from .guard import TrialAccountant, TrialRefused
from .space import Space

logger = logging.getLogger(__name__)

MAXIMIZE, MINIMIZE = "maximize", "minimize"
DIRECTIONS = (MAXIMIZE, MINIMIZE)
RANDOM = "random"
#: backends that choose a trial's settings from earlier trials' scores: the theorem does not cover them
ADAPTIVE_BACKENDS = ("optuna", "ray", "wandb", "sigopt", "hyperopt", "ax", "nevergrad", "skopt", "tpe")
STATE_VERSION = 1


def check_search_options(direction: Any, backend: Any, n_trials: Any, distribution: Any, shape: Any) -> TrialCount:
    """The refusals every search makes; returns the distribution of K."""
    if not isinstance(direction, str) or direction not in DIRECTIONS:
        raise ValueError(f"direction={direction!r} is not supported; accepted values: 'maximize', 'minimize' "
                         "(one objective)")
    name = getattr(backend, "value", backend)
    if name is not None and name != RANDOM:
        why = (" is adaptive (it chooses a trial's settings from earlier trials' scores, e.g. Optuna's TPE "
               "sampler): the private search's theorem covers random search only") if str(name).lower() in ADAPTIVE_BACKENDS else ""
        raise ValueError(f"backend={name!r}{why}; accepted values: None, 'random'")
    if distribution is None:
        raise ValueError(
            f"n_trials={n_trials!r} is read as the mean of a random number of trials, and distribution=None: "
            "accepted values of distribution: 'poisson', 'logarithmic', 'geometric', 'negative_binomial' (with shape)"
        )
    return TrialCount(distribution, n_trials, shape)


def plan_mechanisms(space: Space, mechanism_of: Callable[[Dict[str, Any]], TrialMechanism]) -> Tuple[TrialMechanism, ...]:
    """Every setting a trial can run: ``mechanism_of`` over :meth:`Space.enumerate`; a continuous
    suggestion that moves a privacy-relevant setting is refused by name."""
    found = set()
    for combo, configs in space.enumerate():
        at_corners = {mechanism_of(c) for c in configs}
        if len(at_corners) > 1:
            raise ValueError(
                f"hp_space: the continuous suggestion(s) {', '.join(map(repr, space.continuous()))} change a "
                "privacy-relevant setting (noise multiplier, sampling rate, steps, sketch); accepted values: draw "
                "those settings with suggest_categorical or suggest_int (finitely many values, each accounted)"
            )
        found |= at_corners
    return tuple(sorted(found, key=repr))


@dataclasses.dataclass
class TrialOutcome:
    """What one trial returned: its score, its result (a model, a Trainer) and the engine whose
    accountant (the trial's :class:`TrialAccountant`) charged it."""

    score: Any
    result: Any
    engine: Any = None
    accountant: Optional[TrialAccountant] = None


@dataclasses.dataclass
class SearchResult:
    """The released outcome of a search: the best trial's ``config``, ``score``, ``result`` (a
    model; the Trainer's search: the trial's Trainer) and ``engine`` (``engine.get_epsilon(delta)``
    reports the total), and the accounting. ``trials_run`` is K itself: **secret** like the data
    (a measurement may record it; a release must not). ``trials`` (``release_trials=True`` only):
    every trial's ``(config, score, result)``."""

    config: Optional[Dict[str, Any]]
    score: Optional[float]
    result: Any
    engine: Any
    epsilon: float
    delta: float
    count: TrialCount
    mechanisms: Tuple[TrialMechanism, ...]
    trial_epsilon: float
    release_trials: bool
    trials_run: int
    params: Optional[Dict[str, Any]] = None
    trials: Optional[List[Tuple[Dict[str, Any], Optional[float], Any]]] = None

    def __repr__(self) -> str:  # no K, no result
        return (f"SearchResult(config={self.config!r}, score={self.score!r}, epsilon={self.epsilon:.4g}, "
                f"delta={self.delta:g}, {self.count.spec})")

    def trial_epsilon_prv(self) -> float:
        """One trial of the worst setting alone, as ``rc_prv`` (PRV) reports it: what a single
        run would report, the price of the search is the difference to :attr:`epsilon`."""
        acc = RCPRVAccountant()
        eps = 0.0
        for m in self.mechanisms:
            acc.history = [(m.noise_multiplier, m.sample_rate, m.steps, m.record)]
            eps = max(eps, float(acc.get_epsilon(self.delta)))
        return eps

    def report(self, include_secrets: bool = False) -> Dict[str, Any]:
        """The accounting as a dict: ``epsilon``, ``delta``, ``noise_multiplier``, ``sample_rate``,
        ``steps`` (a value, or the sorted values of the space), ``clipping``, ``sketch_size``,
        ``distribution``, ``mean_trials`` (and ``shape``), ``trial_epsilon`` (RDP),
        ``trial_epsilon_prv``, ``composition``, the best ``config`` and ``score``; ``trials_run``
        only with ``include_secrets`` or when every trial is released."""

        def one(values: Sequence[Any]) -> Any:
            distinct = sorted(set(values), key=lambda v: (v is None, v))
            return distinct[0] if len(distinct) == 1 else distinct

        records = [m.record for m in self.mechanisms]
        out: Dict[str, Any] = {
            "epsilon": self.epsilon, "delta": self.delta,
            "noise_multiplier": one([m.noise_multiplier for m in self.mechanisms]),
            "sample_rate": one([m.sample_rate for m in self.mechanisms]),
            "steps": one([m.steps for m in self.mechanisms]),
            "clipping": one(["randomized" if r.randomized else "flat" for r in records]),
            "sketch_size": one([r.sketch_size for r in records]),
            "sketching": one([r.sketching if r.randomized else None for r in records]),
            **self.count.spec,
            "trial_epsilon": self.trial_epsilon, "trial_epsilon_prv": self.trial_epsilon_prv(),
            "composition": "every trial released: the K trials composed" if self.release_trials
            else "best of K released (Papernot and Steinke 2022)",
            "config": self.config, "score": self.score,
        }
        if include_secrets or self.release_trials:
            out["trials_run"] = self.trials_run
        return out


def _better(score: float, best: Optional[float], direction: str) -> bool:
    if best is None:
        return True
    return score > best if direction == MAXIMIZE else score < best


def _finite_score(score: Any) -> Optional[float]:
    try:
        value = float(score)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


class SearchState:
    """The state file of a resumable search (module docstring): JSON at ``path``; the best
    trial's result beside it (``path + ".best"``) through ``save`` and ``load``."""

    def __init__(self, path: str, fingerprint: str, save: Callable[[Any, str], None], load: Callable[[str], Any]):
        self.path, self.fingerprint, self._save, self._load = os.fspath(path), fingerprint, save, load
        self.started, self.finished, self.best, self.generator = 0, False, None, None
        if os.path.exists(self.path):
            with open(self.path) as f:
                data = json.load(f)
            if data.get("version") != STATE_VERSION or data.get("fingerprint") != fingerprint:
                raise ValueError(f"state_path={self.path!r} holds another search (its distribution, delta, "
                                 "direction, space or accounted settings differ); accepted values: the state of "
                                 "this search, or a new path")
            self.started, self.finished = int(data["trials_started"]), bool(data["finished"])
            self.best, self.generator = data["best"], data["generator"]

    def write(self, draws: SecretDraws) -> None:
        data = {"version": STATE_VERSION, "fingerprint": self.fingerprint, "trials_started": self.started,
                "finished": self.finished, "best": self.best, "generator": draws.state()}
        try:
            text = json.dumps(data)
        except TypeError as e:
            raise ValueError(f"state_path needs JSON values in the trial configs ({e})") from None
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, self.path)

    def save_result(self, result: Any) -> None:
        self._save(result, self.path + ".best")

    def load_result(self) -> Any:
        return self._load(self.path + ".best")


def fingerprint(count: TrialCount, delta: float, direction: str, space: Space, mechanisms: Sequence[TrialMechanism],
                release_trials: bool) -> str:
    """What a resumed search must share with the saved one."""
    return repr((count.spec, float(delta), direction, sorted(map(repr, space.suggestions.values())),
                 [repr(m) for m in mechanisms], bool(release_trials)))


def run_search(
    *,
    space: Space,
    count: TrialCount,
    delta: float,
    direction: str,
    mechanisms: Tuple[TrialMechanism, ...],
    mechanism_of: Callable[[Dict[str, Any]], TrialMechanism],
    run_trial: Callable[[Dict[str, Any], Dict[str, Any], TrialAccountant, int], TrialOutcome],
    draws: SecretDraws,
    release_trials: bool = False,
    state: Optional[SearchState] = None,
    restore: Optional[Callable[[Any, TrialAccountant], TrialOutcome]] = None,
) -> SearchResult:
    """Run the search (module docstring). ``run_trial(params, config, accountant, index)`` runs
    one trial charged by ``accountant`` (a :class:`TrialAccountant` bounded by the trial's
    settings; ``index``: 1-based, for folder names only when every trial is released);
    ``restore(result, accountant)`` rebuilds the best trial's outcome from a state (its
    accountant holds its history)."""
    best: Optional[Tuple[float, Dict[str, Any], Dict[str, Any], TrialOutcome]] = None
    released: List[Tuple[Dict[str, Any], Optional[float], Any]] = []
    histories: List[Any] = []
    k = 0
    finished = False
    # what the trials warned and raised, each kind once and without counts (a line per trial
    # would tell the number of trials)
    notes: Dict[Tuple[type, str], None] = {}
    failures: Dict[str, None] = {}
    if state is not None:
        k, finished = state.started, state.finished
        if state.best is not None:
            saved = state.best
            config = saved["config"]
            accountant = TrialAccountant(mechanism_of(config))
            accountant.history = [RCPRVAccountant.entry(e) for e in saved["history"]]
            accountant.close()
            outcome = restore(state.load_result(), accountant)
            outcome.accountant = accountant
            best = (float(saved["score"]), saved["params"], config, outcome)
    while not finished:
        if not draws.runs(count, k + 1):
            finished = True
            if state is not None:
                state.finished = True
                state.write(draws)
            break
        params, config = space.draw(draws.uniform)
        mechanism = mechanism_of(config)
        if mechanism not in mechanisms:
            raise ValueError(f"a trial's settings {mechanism!r} are not among those the search accounted: hp_space "
                             "must draw the same suggestions on every call")
        k += 1
        if state is not None:  # the trial counts as run from here on, whatever happens to it
            state.started = k
            state.write(draws)
        accountant = TrialAccountant(mechanism)
        caught: List[Any] = []
        try:
            with warnings.catch_warnings(record=True) as caught:  # shown once each after the search
                warnings.simplefilter("always")
                outcome = run_trial(params, config, accountant, k)
        except TrialRefused:
            raise
        except Exception as e:  # a trial that raises counts as run; nothing of it is released
            failures.setdefault(type(e).__name__, None)
            outcome = None
        finally:
            accountant.close()
            histories.extend(accountant.history)
            for w in caught:
                notes.setdefault((w.category, str(w.message)), None)
        if outcome is None:
            continue
        outcome.accountant = accountant
        score = _finite_score(outcome.score)
        if score is not None and accountant.steps_charged == 0:
            raise TrialRefused("a trial returned a score but charged no step: train it with the engine it is "
                               "given (make_private), whose accountant the search bounds")
        if release_trials:
            released.append((config, score, outcome.result))
        if score is not None and _better(score, None if best is None else best[0], direction):
            best = (score, params, config, outcome)
            if state is not None:
                state.save_result(outcome.result)
                state.best = {"score": score, "params": params, "config": config,
                              "history": [list(RCPRVAccountant.stored(e)) for e in accountant.history]}
                state.write(draws)
    for category, message in notes:
        warnings.warn(message, category)
    if failures:
        logger.warning("trials raised %s: each counts as run, nothing of it is released", ", ".join(failures))
    accounted = search_epsilon(mechanisms, count, delta)
    if release_trials:
        composed = RCPRVAccountant()
        composed.history = list(histories)
        total: Callable[[float], float] = lambda d: float(composed.get_epsilon(d))  # noqa: E731
    else:
        total = lambda d: search_epsilon(mechanisms, count, d).epsilon  # noqa: E731
    if best is not None:
        best[3].accountant.close(total)
    return SearchResult(
        config=None if best is None else dict(best[2]), score=None if best is None else best[0],
        result=None if best is None else best[3].result, engine=None if best is None else best[3].engine,
        epsilon=total(delta), delta=delta, count=count, mechanisms=mechanisms, trial_epsilon=accounted.trial_epsilon,
        release_trials=release_trials, trials_run=k, params=None if best is None else dict(best[1]),
        trials=released if release_trials else None,
    )


__all__ = ["DIRECTIONS", "SearchResult", "SearchState", "TrialOutcome", "check_search_options", "plan_mechanisms",
           "run_search"]
