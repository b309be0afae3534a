"""Private hyperparameter search, accounted (Papernot and Steinke, ICLR 2022).

A random number K of trials (drawn by the search from its secret generator, never by the
caller: ``n_trials`` is the mean of ``distribution``), each with settings drawn at random from
the search space independently of earlier results, each a DP training run; only the best
trial is released, and the total epsilon is that of releasing the best of K, computed from one
trial's Rényi DP curve (:mod:`opacus_rc.accounting.search`; equal to dp_accounting's
``RepeatAndSelectDpEvent`` for deterministic clipping)::

    from opacus_rc.tuning import private_search

    def trial(config, engine):
        model, optimizer, loader = engine.make_private(..., noise_multiplier=config["noise_multiplier"], ...)
        ...                                     # train config["steps"] steps at lr=config["learning_rate"]
        return held_out_accuracy(model), model  # a score on data outside the training set

    result = private_search(trial, {"learning_rate": [0.03, 0.1, 0.3]}, n_trials=5, distribution="poisson",
                            delta=1e-5, target_epsilon=3.0, sample_rate=0.01, steps=1000)
    result.result, result.config, result.engine.get_epsilon(1e-5)   # the best model; the total epsilon

The Trainer's search is ``DPTrainer.hyperparameter_search`` (:mod:`opacus_rc.hf.search`).
What is released, how the score must be computed, resume: docs/tuning.md.
"""

from ..accounting.search import DISTRIBUTIONS, TrialCount, TrialMechanism, search_epsilon, search_noise_multiplier
from .draws import SecretDraws, continue_probability, draw_trial_count
from .guard import TrialAccountant, TrialRefused
from .loop import SearchResult
from .plain import PRIVACY_KEYS, private_search
from .space import Space

__all__ = [
    "DISTRIBUTIONS", "PRIVACY_KEYS", "SearchResult", "SecretDraws", "Space", "TrialAccountant", "TrialCount",
    "TrialMechanism", "TrialRefused", "continue_probability", "draw_trial_count", "private_search",
    "search_epsilon", "search_noise_multiplier",
]
