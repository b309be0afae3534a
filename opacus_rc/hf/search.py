"""``DPTrainer.hyperparameter_search``: the private search (:mod:`opacus_rc.tuning`) in the Trainer
and TRL, with Hugging Face's method name and conventions (``hp_space``, ``compute_objective``,
``n_trials``, ``direction``, ``backend``; a :class:`~transformers.trainer_utils.BestRun` back).

Each trial is a new Trainer of the same class, built from the constructor's arguments with a
fresh model (``model_init``), the trial's ``TrainingArguments`` and ``PrivacyArguments``
(its drawn values set as Hugging Face's ``_hp_search_setup`` sets them), trained, then
evaluated on ``eval_dataset``; its objective is ``compute_objective(metrics)``. Its optimizer
charges a :class:`~opacus_rc.tuning.guard.TrialAccountant` bounded by the trial's settings.
Unless ``release_trials=True``, trials report to nothing, save no checkpoint, log nothing and
run without the caller's callbacks (their logs would reveal the trials). The best trial's
Trainer is ``best_run.run_summary.result``; its ``get_epsilon()`` is the search's total.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import os
from typing import Any, Callable, Dict, Optional, Tuple

from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.trainer_utils import BestRun, IntervalStrategy, SaveStrategy, default_compute_objective

from ..accounting.search import TrialMechanism, search_noise_multiplier
from ..tuning.draws import SecretDraws
from ..tuning.guard import TrialAccountant
from ..tuning.loop import SearchResult, TrialOutcome, check_search_options, plan_mechanisms, run_search
from ..tuning.space import SampledTrial, Space

#: PrivacyArguments fields a search space may not draw (what the search itself fixes)
FIXED_PRIVACY = ("target_epsilon", "delta", "stop_at_epsilon", "secure_mode", "noise", "bands", "privacy_unit",
                 "user_column")
#: the keyword arguments of hyperparameter_search beyond Hugging Face's named ones
SEARCH_KWARGS = ("distribution", "shape", "seed", "release_trials", "model_init")
#: what evaluate()'s metrics carry that is no metric (the private Trainer's log adds it)
_NOT_METRICS = ("epsilon", "privacy_unit")
_PLACEHOLDER_SIGMA = 1.0


class SearchMixin:
    """Keeps the constructor's arguments (each trial is a new Trainer built from them) and adds
    :meth:`hyperparameter_search`; a base of :class:`~opacus_rc.hf.trainer.DPTrainerMixin`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._dp_search_init = (args, dict(kwargs))
        super().__init__(*args, **kwargs)

    def hyperparameter_search(
        self,
        hp_space: Optional[Callable[[Any], Dict[str, Any]]] = None,
        compute_objective: Optional[Callable[[Dict[str, float]], float]] = None,
        n_trials: float = 20,
        direction: str = "minimize",
        backend: Any = None,
        hp_name: Optional[Callable[[Any], str]] = None,
        **kwargs: Any,
    ) -> BestRun:
        """A private random search over ``hp_space`` (Hugging Face's convention: a function of a
        trial using ``suggest_float``/``suggest_int``/``suggest_categorical``): K trials, K drawn
        from ``distribution`` (``"poisson"``, ``"logarithmic"``, ``"geometric"``,
        ``"negative_binomial"`` with ``shape``) of mean ``n_trials``; only the best is released
        (docs/tuning.md). ``PrivacyArguments.target_epsilon`` is the search's total (sigma is
        calibrated for it), or ``noise_multiplier`` is given. The objective is computed on
        ``eval_dataset``, which must be held out from ``train_dataset``.

        Keyword arguments: ``distribution``, ``shape``, ``seed`` (reproducible draws, as secret
        as the data), ``release_trials`` (every trial kept, their composition charged),
        ``model_init`` (a fresh model per trial, when the Trainer was not given one; TRL).
        ``hp_name`` is not used (trials have no run folders). Refused: an adaptive ``backend``
        (``"optuna"``: its TPE sampler; ``"ray"``, ...), ``distribution=None``, several
        processes, a Trainer that has trained. Returns ``BestRun(run_id="best", objective,
        hyperparameters, run_summary=SearchResult)``."""
        return trainer_search(self, hp_space, compute_objective, n_trials, direction, backend, **kwargs)


def _init_kwargs(trainer: Any) -> Dict[str, Any]:
    """The constructor's arguments by name (positional ones bound to the Trainer class's signature)."""
    args, kwargs = trainer._dp_search_init
    base = next(c for c in type(trainer).__mro__ if "__init__" in c.__dict__ and not issubclass(c, SearchMixin))
    bound = inspect.signature(base.__init__).bind(None, *args, **kwargs).arguments
    out: Dict[str, Any] = {}
    for name, value in list(bound.items())[1:]:
        kind = inspect.signature(base.__init__).parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise ValueError("hyperparameter_search: the Trainer was built with extra positional arguments; "
                                 "accepted values: keyword arguments")
        else:
            out[name] = value
    return out


class _Plan:
    """The private Trainer's public sizes (the properties of its class ``cls``) for a trial's arguments."""

    def __init__(self, cls: type, args: Any, privacy: Any, train_dataset: Any, users: Any) -> None:
        self.args, self.privacy, self.train_dataset, self._users = args, privacy, train_dataset, users
        self.expected_batch_size = cls.expected_batch_size.fget(self)
        self.sample_rate = cls.sample_rate.fget(self)
        self.steps_per_epoch = cls.steps_per_epoch.fget(self)
        self.steps = cls.planned_steps(self)

    def user_index(self) -> Any:
        return self._users


class _Overlay:
    """``base`` (TrainingArguments) with the attributes of ``changes`` replaced, read-only."""

    def __init__(self, base: Any, changes: Dict[str, Any]) -> None:
        self._base, self._changes = base, changes

    def __getattr__(self, name: str) -> Any:
        return self._changes[name] if name in self._changes else getattr(self._base, name)


def _split(trainer: Any, config: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``config`` as TrainingArguments changes (converted to the field's type, as Hugging Face's
    ``_hp_search_setup``) and PrivacyArguments changes; any other key is refused by name."""
    privacy_fields = {f.name for f in dataclasses.fields(trainer.privacy)}
    args_changes, privacy_changes = {}, {}
    for key, value in config.items():
        if key in FIXED_PRIVACY:
            raise ValueError(f"hp_space draws {key!r}; accepted values: any TrainingArguments field or a "
                             f"PrivacyArguments field but {', '.join(FIXED_PRIVACY)} (the search fixes those)")
        if key in privacy_fields:
            privacy_changes[key] = value
        elif hasattr(trainer.args, key):
            old = getattr(trainer.args, key)
            args_changes[key] = type(old)(value) if old is not None else value
        else:
            raise ValueError(f"hp_space draws {key!r}, a field of neither TrainingArguments nor PrivacyArguments; "
                             "accepted values: their fields")
    return args_changes, privacy_changes


def _silence(args: Any) -> None:
    """A trial that releases nothing: no reporting, no checkpoint, no log, no progress bar."""
    args.report_to = []
    args.save_strategy, args.eval_strategy, args.logging_strategy = SaveStrategy.NO, IntervalStrategy.NO, IntervalStrategy.NO
    args.load_best_model_at_end = False
    args.push_to_hub = False
    args.disable_tqdm = True


def _guard(trial: Any, accountant: TrialAccountant) -> None:
    """The trial's optimizer charges ``accountant`` (installed as soon as the optimizer is made)."""
    original = trial.create_optimizer

    def create_optimizer(*args: Any, **kwargs: Any) -> Any:
        optimizer = original(*args, **kwargs)
        engine = trial.privacy_engine
        if engine.accountant is not accountant:
            engine.accountant = accountant
            trial._dp_optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=trial._dp_rate))
        return optimizer

    trial.create_optimizer = create_optimizer


def trainer_search(trainer: Any, hp_space: Any, compute_objective: Any, n_trials: float, direction: str, backend: Any,
                   **kwargs: Any) -> BestRun:
    """:meth:`SearchMixin.hyperparameter_search` (its documentation)."""
    sampler = kwargs.pop("sampler", None)
    if sampler is not None:
        raise ValueError(f"sampler={type(sampler).__name__} is adaptive or not random search: the private search's "
                         "theorem covers random search only; accepted values: None")
    unknown = sorted(set(kwargs) - set(SEARCH_KWARGS))
    if unknown:
        raise ValueError(f"hyperparameter_search got {', '.join(unknown)}; accepted keyword arguments: "
                         f"{', '.join(SEARCH_KWARGS)}")
    count = check_search_options(direction, backend, n_trials, kwargs.get("distribution"), kwargs.get("shape"))
    if hp_space is None:
        raise ValueError("hp_space=None; accepted values: a function of a trial returning a dict (each trial's "
                         "settings; the private search has no default space)")
    init = _init_kwargs(trainer)
    model_init = kwargs.get("model_init") or trainer.model_init
    privacy, release = trainer.privacy, bool(kwargs.get("release_trials", False))
    checks = [
        (model_init is not None, "model_init=None: each trial needs a fresh model; accepted values: the Trainer's or "
                                 "hyperparameter_search's model_init (a function returning the untrained model)"),
        (init.get("eval_dataset") is not None, "eval_dataset=None: the objective is computed on held-out data; "
                                               "accepted values: a split not in train_dataset"),
        (init.get("eval_dataset") is not init.get("train_dataset"),
         "eval_dataset is train_dataset: the objective chooses what is released, so it must be computed on "
         "held-out data; accepted values: a split not in train_dataset"),
        (trainer.args.world_size == 1, "hyperparameter_search in several processes: the trials' draws would differ "
                                       "between ranks; accepted values: one process"),
        (trainer.privacy_engine is None and not trainer._dp_resumed_history,
         "hyperparameter_search on a Trainer that has trained (its epsilon is spent); accepted values: a new Trainer"),
        (privacy.stop_at_epsilon is None, "stop_at_epsilon with hyperparameter_search: a trial's steps are fixed "
                                          "by its settings; accepted values: None"),
        (tuple(init.get("optimizers") or (None, None)) == (None, None),
         "optimizers= with hyperparameter_search: each trial makes its own optimizer; accepted values: (None, None)"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    space = Space(hp_space)
    users = trainer.user_index()
    fixed: Dict[str, Any] = {}

    def trial_arguments(config: Dict[str, Any]) -> Tuple[Any, Any]:
        args_changes, privacy_changes = _split(trainer, config)
        if "noise_multiplier" in privacy_changes and privacy.target_epsilon is not None:
            raise ValueError("hp_space draws 'noise_multiplier' with PrivacyArguments.target_epsilon (the search's "
                             "total, which calibrates it); accepted values: one of the two")
        sigma = privacy_changes.pop("noise_multiplier", fixed.get("noise_multiplier", privacy.noise_multiplier))
        return args_changes, dataclasses.replace(privacy, target_epsilon=None, noise_multiplier=sigma, **privacy_changes)

    def mechanism_of(config: Dict[str, Any]) -> TrialMechanism:
        args_changes, trial_privacy = trial_arguments(config)
        args = _Overlay(trainer.args, args_changes)
        plan = _Plan(type(trainer), args, trial_privacy, init.get("train_dataset", trainer.train_dataset), users)
        record = trial_privacy.step_record(args.per_device_train_batch_size)
        return TrialMechanism(float(trial_privacy.noise_multiplier), trial_privacy.charged_rate(plan.sample_rate),
                              plan.steps, record)

    if privacy.target_epsilon is not None:
        fixed["noise_multiplier"] = _PLACEHOLDER_SIGMA
        placeholder = plan_mechanisms(space, mechanism_of)
        fixed["noise_multiplier"] = search_noise_multiplier(privacy.target_epsilon, privacy.delta, count, placeholder)
    mechanisms = plan_mechanisms(space, mechanism_of)
    objective = compute_objective or default_compute_objective

    def run_trial(params: Dict[str, Any], config: Dict[str, Any], accountant: TrialAccountant, index: int) -> TrialOutcome:
        args_changes, trial_privacy = trial_arguments(config)
        args = copy.deepcopy(trainer.args)
        for key, value in args_changes.items():
            setattr(args, key, value)
        if release:
            args.output_dir = os.path.join(args.output_dir, f"run-{index}")
        else:
            _silence(args)
        sampled = SampledTrial(params, space.suggestions)
        model = model_init() if not inspect.signature(model_init).parameters else model_init(sampled)
        built = {**init, "model": model, "args": args}
        if "model_init" in built:
            built["model_init"] = None
        if not release:
            built["callbacks"] = None
        trial = type(trainer)(**built, privacy=trial_privacy)
        if not release:
            trial.remove_callback(PrinterCallback)
            trial.remove_callback(ProgressCallback)
        _guard(trial, accountant)
        trial.train()
        metrics = trial.evaluate()
        score = objective({k: v for k, v in metrics.items() if k not in _NOT_METRICS})
        return TrialOutcome(score=score, result=trial, engine=trial.privacy_engine)

    result: SearchResult = run_search(
        space=space, count=count, delta=privacy.delta, direction=direction, mechanisms=mechanisms,
        mechanism_of=mechanism_of, run_trial=run_trial, release_trials=release,
        draws=SecretDraws(privacy.secure_mode, kwargs.get("seed")),
    )
    if result.result is not None:  # the released Trainer's logs said its trial's epsilon: the total replaces it
        for entry in result.result.state.log_history:
            if "epsilon" in entry:
                entry["epsilon"] = result.epsilon
    return BestRun(run_id="best", objective=result.score, hyperparameters=result.params or {}, run_summary=result)


__all__ = ["SearchMixin", "trainer_search"]
