"""The search space (opacus_rc.tuning.space): Hugging Face's hp_space convention and dict spaces,
random draws independent of results, the enumeration the accounting reads."""

from __future__ import annotations

import math

import numpy as np
import pytest

from opacus_rc.tuning.draws import SecretDraws
from opacus_rc.tuning.space import MAX_COMBINATIONS, Space


def hf_space(trial):
    return {
        "learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True),
        "num_train_epochs": trial.suggest_int("num_train_epochs", 1, 3),
        "per_device_train_batch_size": trial.suggest_categorical("per_device_train_batch_size", [8, 16]),
    }


def test_a_trial_function_space_draws_each_suggestion_independently():
    """2,000 draws: the categorical and integer values are uniform (each count within 4.5
    binomial standard deviations), the log-uniform float below the geometric mean of its range
    half the time (same tolerance)."""
    space = Space(hf_space)
    draws = SecretDraws(seed=3)
    configs = [space.draw(draws.uniform)[1] for _ in range(2000)]
    lr = np.array([c["learning_rate"] for c in configs])
    assert lr.min() >= 1e-4 and lr.max() <= 1e-1
    for share, p in [((lr < math.sqrt(1e-5)).mean(), 0.5),
                     (np.mean([c["num_train_epochs"] == 2 for c in configs]), 1 / 3),
                     (np.mean([c["per_device_train_batch_size"] == 8 for c in configs]), 0.5)]:
        assert abs(share - p) <= 4.5 * math.sqrt(p * (1 - p) / 2000)


def test_enumeration_covers_every_finite_value_at_both_ends_of_each_range():
    space = Space(hf_space)
    combos = list(space.enumerate())
    assert len(combos) == 3 * 2
    assert {(c[0]["num_train_epochs"], c[0]["per_device_train_batch_size"]) for _, c in combos} == {
        (e, b) for e in (1, 2, 3) for b in (8, 16)}
    assert all(sorted(x["learning_rate"] for x in configs) == [1e-4, 1e-1] for _, configs in combos)
    assert space.continuous() == ("learning_rate",)


def test_a_dict_space_keeps_constants_and_draws_lists():
    space = Space({"lr": [0.1, 0.3], "steps": 100})
    draws = SecretDraws(seed=1)
    params, config = space.draw(draws.uniform)
    assert config["steps"] == 100 and config["lr"] in (0.1, 0.3) and set(params) == {"lr"}


def test_refusals_name_what_is_wrong():
    def conditional(trial):
        kind = trial.suggest_categorical("kind", ["a", "b"])
        return {"x": trial.suggest_float("x", 0, 1)} if kind == "a" else {"y": trial.suggest_float("y", 0, 1)}

    space = Space(conditional)
    with pytest.raises(ValueError, match="conditional search spaces are not supported"):
        for _ in range(50):
            space.config({"kind": "b", "x": 0.5})
    with pytest.raises(ValueError, match="hp_space returned list"):
        Space(lambda trial: [1, 2])
    with pytest.raises(ValueError, match="hp_space=3"):
        Space(3)
    with pytest.raises(ValueError, match="suggest_float\\('x', 1, 0"):
        Space(lambda t: {"x": t.suggest_float("x", 1, 0)})
    with pytest.raises(ValueError, match="suggest_int\\('n', 0, 4, step=1, log=True"):
        Space(lambda t: {"n": t.suggest_int("n", 0, 4, log=True)})
    big = Space({f"p{i}": list(range(10)) for i in range(6)})
    with pytest.raises(ValueError, match=f"1000000 combinations.*at most {MAX_COMBINATIONS}"):
        list(big.enumerate())
