"""The private search in a plain loop (opacus_rc.tuning.private_search): only the best trial is
released and the engine reports the total; trials are bounded by what was accounted; a raising
trial counts as run; resume never replays a trial; every refusal names its parameter.

Most trials here charge their steps directly through the engine's accountant (what the
optimizer's hook does at each step) and return a score computed from their config: the
search's behaviour, not training, is under test. ``test_real_trials_train_and_report_the_total``
trains through ``make_private`` in both clipping modes.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import opacus_rc  # noqa: F401  (registers rc_prv)
from opacus_rc.accounting import RCPRVAccountant
from opacus_rc.accounting.search import TrialCount, TrialMechanism, search_epsilon
from opacus_rc.config import SketchConfig
from opacus_rc.tuning import TrialRefused, draw_trial_count, private_search
from opacus_rc.tuning.draws import SecretDraws

warnings.filterwarnings("ignore", message="Secure RNG turned off")
BASE = dict(n_trials=4, distribution="geometric", delta=1e-5, noise_multiplier=1.0, sample_rate=0.01, steps=100,
            clipping="flat")
SPACE = {"lr": [0.01, 0.03, 0.1, 0.3, 1.0]}


def charging_trial(calls, score=lambda c: c["lr"], fail=lambda c: False):
    """A trial that charges its config's steps as the optimizer's hook would, and scores ``score(config)``."""

    def trial(config, engine):
        calls.append(dict(config))
        sketch = None if config["clipping"] == "flat" else SketchConfig(
            estimator=config["estimator"], sketch_size=config["sketch_size"], sketching=config["sketching"])
        engine.accountant.step(noise_multiplier=config["noise_multiplier"], sample_rate=config["sample_rate"],
                               sketch_config=sketch, steps=config["steps"])
        if fail(config):
            raise RuntimeError("a trial failed")
        return score(config), {"model of": config["lr"]}

    return trial


def test_only_the_best_trial_is_released_and_the_engine_reports_the_total():
    calls = []
    result = private_search(charging_trial(calls), SPACE, seed=11, **BASE)
    assert result.trials_run == len(calls) >= 1
    assert result.score == max(c["lr"] for c in calls)
    assert result.result == {"model of": result.score} and result.config["lr"] == result.score
    assert result.trials is None
    expected = search_epsilon([TrialMechanism(1.0, 0.01, 100)], TrialCount("geometric", 4), 1e-5).epsilon
    assert result.epsilon == expected
    assert result.engine.get_epsilon(1e-5) == pytest.approx(expected, rel=1e-12)
    report = result.report()
    assert "trials_run" not in report and report["epsilon"] == expected
    assert report["trial_epsilon"] < expected and report["distribution"] == "geometric" and report["mean_trials"] == 4
    assert "trials_run" not in repr(result)
    assert result.report(include_secrets=True)["trials_run"] == len(calls)


def test_release_trials_returns_every_trial_and_charges_their_composition():
    calls = []
    result = private_search(charging_trial(calls), SPACE, seed=11, release_trials=True, **BASE)
    assert [c for c, _, _ in result.trials] == calls
    composed = RCPRVAccountant()
    composed.history = [(1.0, 0.01, 100, None)] * len(calls)
    assert result.epsilon == pytest.approx(composed.get_epsilon(1e-5), rel=1e-12)
    assert result.report()["trials_run"] == len(calls)
    assert "every trial released" in result.report()["composition"]


def test_a_trial_that_raises_counts_as_run_and_is_never_released():
    calls = []
    result = private_search(charging_trial(calls, fail=lambda c: c["lr"] == 1.0), SPACE, seed=5, **{**BASE, "n_trials": 10})
    assert result.trials_run == len(calls)
    assert any(c["lr"] == 1.0 for c in calls)  # this seed draws the failing setting
    assert result.score == max(c["lr"] for c in calls if c["lr"] != 1.0)


def test_what_trials_warn_or_raise_is_told_once_without_a_count(caplog):
    """A line per trial would tell K: each warning is shown once after the search, and the
    kinds of exceptions trials raised are logged once, without a number."""
    calls = []

    def trial(config, engine):
        warnings.warn("a note from every trial")
        return charging_trial(calls, fail=lambda c: c["lr"] == 1.0)(config, engine)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = private_search(trial, SPACE, seed=5, **{**BASE, "n_trials": 10})
    assert result.trials_run >= 2 and any(c["lr"] == 1.0 for c in calls)
    assert [str(w.message) for w in seen].count("a note from every trial") == 1
    raised = [r for r in caplog.records if "trials raised" in r.getMessage()]
    assert len(raised) == 1 and "RuntimeError" in raised[0].getMessage()
    assert not any(ch.isdigit() for ch in raised[0].getMessage())


def test_a_poisson_search_may_run_no_trial():
    """P(K = 0) = e^-1 at mean 1: the first seed that draws no trial releases nothing and still
    reports the search's epsilon."""
    seed = next(s for s in range(100)
                if draw_trial_count(TrialCount("poisson", 1), SecretDraws(seed=s)) == 0)
    calls = []
    result = private_search(charging_trial(calls), SPACE, seed=seed, **{**BASE, "distribution": "poisson", "n_trials": 1})
    assert calls == [] and result.config is None and result.result is None and result.engine is None
    assert result.epsilon == search_epsilon([TrialMechanism(1.0, 0.01, 100)], TrialCount("poisson", 1), 1e-5).epsilon


def test_a_target_epsilon_calibrates_the_noise_of_the_search():
    calls = []
    result = private_search(charging_trial(calls), SPACE, seed=2, **{**BASE, "noise_multiplier": None, "target_epsilon": 3.0})
    assert 3.0 - 0.01 <= result.epsilon <= 3.0
    assert all(c["noise_multiplier"] == result.config["noise_multiplier"] for c in calls)


def test_privacy_settings_drawn_by_the_space_are_charged_at_their_worst():
    space = {"lr": [0.1, 1.0], "steps": [50, 200], "sample_rate": [0.01, 0.02]}
    base = {k: v for k, v in BASE.items() if k not in ("steps", "sample_rate")}
    result = private_search(charging_trial([]), space, seed=1, **base)
    worst = search_epsilon([TrialMechanism(1.0, q, t) for q in (0.01, 0.02) for t in (50, 200)],
                           TrialCount("geometric", 4), 1e-5).epsilon
    assert result.epsilon == worst
    assert result.report()["steps"] == [50, 200]


def _loader(n=256, batch=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch), x, y


@pytest.mark.parametrize("clipping", ["flat", "randomized"])
def test_real_trials_train_and_report_the_total(clipping):
    loader, x, y = _loader()

    def trial(config, engine):
        torch.manual_seed(0)
        model = nn.Linear(8, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
        extra = {} if clipping == "flat" else dict(sample_rate=config["sample_rate"], expected_batch_size=32)
        model, optimizer, data = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                     noise_multiplier=config["noise_multiplier"], max_grad_norm=1.0,
                                                     clipping=clipping, **extra)
        for _ in range(config["steps"] // len(loader)):
            for xb, yb in data:
                nn.functional.cross_entropy(model(xb), yb).backward()
                optimizer.step()
                optimizer.zero_grad()
        with torch.no_grad():
            return (model(x).argmax(1) == y).float().mean().item(), (model, optimizer)

    result = private_search(trial, {"lr": [0.5, 2.0]}, n_trials=2, distribution="geometric", delta=1e-5,
                            noise_multiplier=0.8, sample_rate=1 / 8, steps=16, clipping=clipping, seed=4)
    model, optimizer = result.result
    assert result.engine.accountant.steps_charged == 16
    assert result.engine.get_epsilon(1e-5) == pytest.approx(result.epsilon, rel=1e-12)
    assert result.score > 0.7  # a separable task: trained
    before = [p.detach().clone() for p in model.parameters()]
    xb, yb = next(iter(loader))
    nn.functional.cross_entropy(model(xb), yb).backward()
    with pytest.raises(TrialRefused, match="this trial has ended"):
        optimizer.step()  # the released trial takes no further step
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_step_outside_the_accounted_settings_is_refused_before_the_update():
    """A trial whose optimizer runs at a smaller noise multiplier than the one accounted: the
    first step raises in the accountant's hook, before the update, and the search stops."""
    loader, _, _ = _loader()
    models = []

    def trial(config, engine):
        model = nn.Linear(8, 2)
        models.append((model, [p.detach().clone() for p in model.parameters()]))
        model, optimizer, data = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                                     data_loader=loader, noise_multiplier=0.5, max_grad_norm=1.0)
        xb, yb = next(iter(data))
        nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()
        return 1.0, model

    with pytest.raises(TrialRefused, match="noise_multiplier=0.5 below the accounted 0.8"):
        private_search(trial, {"lr": [1.0]}, n_trials=2, distribution="geometric", delta=1e-5, noise_multiplier=0.8,
                       sample_rate=1 / 8, steps=16, clipping="flat", seed=1)
    model, before = models[0]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(TrialRefused, match="200 steps, more than the accounted 100"):
        private_search(lambda c, e: charging_trial([])({**c, "steps": 200}, e), SPACE, seed=1, **BASE)


def _seed_with_trials(at_least: int) -> int:
    for seed in range(200):
        calls = []
        result = private_search(charging_trial(calls), SPACE, seed=seed, **{**BASE, "n_trials": 6})
        if result.trials_run >= at_least:
            return seed
    raise AssertionError("no seed with enough trials")  # pragma: no cover


def test_a_resumed_search_continues_and_never_replays_a_trial(tmp_path):
    """Seeded: a search interrupted during its 3rd trial and resumed runs exactly the trials the
    uninterrupted search runs, but the 3rd (counted as run, lost): the same K, no trial twice."""
    seed = _seed_with_trials(5)
    base = {**BASE, "n_trials": 6}
    straight = []
    full = private_search(charging_trial(straight), SPACE, seed=seed, **base)
    path = str(tmp_path / "search.json")
    first = []

    def interrupted(config, engine):
        if len(first) == 2:
            first.append(dict(config))
            raise KeyboardInterrupt
        return charging_trial(first)(config, engine)

    with pytest.raises(KeyboardInterrupt):
        private_search(interrupted, SPACE, seed=seed, state_path=path, **base)
    second = []
    resumed = private_search(charging_trial(second), SPACE, seed=seed, state_path=path, **base)
    assert first + second == straight  # trial 3 started before the interruption and is not run again
    assert len(second) == len(straight) - 3
    assert resumed.trials_run == full.trials_run
    kept = [c["lr"] for i, c in enumerate(straight) if i != 2]
    assert resumed.score == max(kept) and resumed.result == {"model of": max(kept)}
    assert resumed.engine.get_epsilon(1e-5) == pytest.approx(full.epsilon, rel=1e-12)
    again = []
    done = private_search(charging_trial(again), SPACE, seed=seed, state_path=path, **base)
    assert again == [] and done.score == resumed.score  # a finished search runs nothing


def test_the_state_holds_no_future_without_a_seed(tmp_path):
    import json

    path = tmp_path / "s.json"
    private_search(charging_trial([]), SPACE, state_path=str(path), **BASE)
    state = json.loads(path.read_text())
    assert state["generator"] is None and state["finished"] is True
    assert set(state) == {"version", "fingerprint", "trials_started", "finished", "best", "generator"}
    with pytest.raises(ValueError, match="state_path=.* holds another search"):
        private_search(charging_trial([]), SPACE, state_path=str(path), **{**BASE, "n_trials": 5})


def test_refusals_name_the_parameter(tmp_path):
    trial = charging_trial([])
    cases = [
        (dict(distribution=None), "n_trials=4 is read as the mean.*distribution=None"),
        (dict(backend="optuna"), "backend='optuna' is adaptive.*accepted values: None, 'random'"),
        (dict(direction=["maximize", "minimize"]), "direction=.*'maximize', 'minimize'"),
        (dict(target_epsilon=3.0), "target_epsilon and noise_multiplier are both given"),
        (dict(steps=None), "steps: neither given nor drawn"),
        (dict(clipping="adaptive"), "clipping='adaptive'.*'randomized', 'flat'"),
        (dict(release_trials=True, state_path=str(tmp_path / "x")), "state_path with release_trials=True"),
        (dict(secure_mode=True, seed=3), "seed=3 with secure_mode=True"),
        (dict(delta=0), "delta=0"),
        (dict(distribution="poisson", shape=2.0), "shape=2.0 is given with distribution='poisson'"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            private_search(trial, SPACE, **{**BASE, **change})
    with pytest.raises(ValueError, match="steps given to private_search and drawn by hp_space"):
        private_search(trial, {"lr": [0.1], "steps": [10, 20]}, **BASE)
    with pytest.raises(ValueError, match="continuous suggestion.*'scale'.*suggest_categorical"):
        private_search(trial, lambda t: {"lr": 0.1, "steps": int(100 * t.suggest_float("scale", 1, 2))},
                       **{k: v for k, v in BASE.items() if k != "steps"})
    with pytest.raises(TrialRefused, match="returned a score but charged no step"):
        private_search(lambda c, e: (1.0, None), SPACE, seed=0, **BASE)
    with pytest.raises(TrialRefused, match="trial_fn returned float"):
        private_search(lambda c, e: 1.0, SPACE, seed=0, **BASE)
    assert math.isfinite(private_search(trial, SPACE, backend="random", seed=0, **BASE).epsilon)


def test_a_secure_search_draws_from_the_csprng(tmp_path):
    """secure_mode=True: the draws come from the CSPRNG (no seed accepted), the trials' engines are
    secure, and a saved state keeps no generator."""
    import json

    engines = []

    def trial(config, engine):
        engines.append(engine.secure_mode)
        return charging_trial([])(config, engine)

    path = tmp_path / "secure.json"
    result = private_search(trial, SPACE, secure_mode=True, state_path=str(path), **BASE)
    assert result.trials_run == len(engines) >= 1 and all(engines)
    assert json.loads(path.read_text())["generator"] is None
