"""DPTrainer.hyperparameter_search and private_trainer(SFTTrainer).hyperparameter_search: the
private search with Hugging Face's conventions (tiny Llama from a config, generated rows)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from transformers import TrainerCallback, TrainingArguments

import opacus_rc  # noqa: F401
from opacus_rc.accounting import RCPRVAccountant
from opacus_rc.accounting.search import TrialCount, TrialMechanism, search_epsilon
from opacus_rc.accounting.records import StepRecord
from opacus_rc.hf import DPTrainer, PrivacyArguments, private_trainer
from tests.models import RowDataset, rows, tiny_llama

warnings.filterwarnings("ignore", message="Secure RNG turned off")
LR_SPACE = lambda t: {"learning_rate": t.suggest_categorical("learning_rate", [0.01, 0.5])}  # noqa: E731


class HeldOut(torch.utils.data.Dataset):
    """Rows of another seed than the training rows: the held-out split the objective reads."""

    def __init__(self, n: int = 8, seed: int = 2) -> None:
        self.ids, self.labels = rows(n, seed)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class Events(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.seen.append(dict(logs or {}))


def trainer_of(tmp_path, privacy=None, **kw):
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, max_steps=2, logging_steps=1, report_to=[],
                             save_strategy="steps", save_steps=1, use_cpu=True, seed=0, disable_tqdm=True)
    options = dict(model_init=lambda: tiny_llama(layers=1), args=args, train_dataset=RowDataset(),
                   eval_dataset=HeldOut(), privacy=privacy or PrivacyArguments(target_epsilon=8.0, delta=1e-5))
    options.update(kw)
    return DPTrainer(**options)


def test_trainer_search_releases_the_best_trial_only(tmp_path):
    """The total is the calibrated target; the best trial's Trainer reports it; trials wrote no
    checkpoint and no caller's callback saw a log (their logs would reveal K)."""
    events = Events()
    trainer = trainer_of(tmp_path, callbacks=[events])
    best = trainer.hyperparameter_search(hp_space=LR_SPACE, n_trials=2, distribution="geometric", seed=3)
    result = best.run_summary
    assert best.run_id == "best" and best.hyperparameters["learning_rate"] in (0.01, 0.5)
    assert best.objective == result.score and result.config == best.hyperparameters
    assert 8.0 - 0.01 <= result.epsilon <= 8.0
    assert result.result.get_epsilon() == pytest.approx(result.epsilon, rel=1e-12)
    sigma = result.report()["noise_multiplier"]
    q = 1.0 / 3  # 24 rows, logical batch 8
    assert result.epsilon == search_epsilon([TrialMechanism(sigma, q, 2, StepRecord("hutchinson", 32, "per_example"))],
                                            TrialCount("geometric", 2), 1e-5).epsilon
    assert events.seen == [] and os.listdir(tmp_path / "out") == []
    logged = [e["epsilon"] for e in result.result.state.log_history if "epsilon" in e]
    assert logged and set(logged) == {result.epsilon}  # the released Trainer's logs say the total
    assert trainer.privacy_engine is None  # the caller's Trainer is untouched


def test_trainer_search_with_every_trial_released(tmp_path):
    """release_trials=True: callbacks and checkpoints kept (one folder per trial), the best is the
    smallest eval loss of the trials, the total the composition of their histories."""
    events = Events()
    trainer = trainer_of(tmp_path, privacy=PrivacyArguments(noise_multiplier=1.0, delta=1e-5), callbacks=[events])
    best = trainer.hyperparameter_search(hp_space=LR_SPACE, n_trials=3, distribution="geometric", seed=3,
                                         release_trials=True)
    result = best.run_summary
    assert len(result.trials) == result.trials_run >= 1
    assert result.score == min(score for _, score, _ in result.trials)
    composed = RCPRVAccountant()
    composed.history = [entry for _, _, t in result.trials for entry in t.accountant.history]
    assert result.epsilon == pytest.approx(composed.get_epsilon(1e-5), rel=1e-12)
    assert sorted(os.listdir(tmp_path / "out")) == [f"run-{i}" for i in range(1, result.trials_run + 1)]
    assert any("epsilon" in e for e in events.seen)


def test_trainer_search_refusals_name_the_parameter(tmp_path):
    class TPESampler:
        pass

    trainer = trainer_of(tmp_path)
    cases = [
        (dict(backend="optuna"), "backend='optuna' is adaptive"),
        (dict(backend="ray"), "backend='ray' is adaptive"),
        (dict(sampler=TPESampler()), "sampler=TPESampler is adaptive"),
        (dict(distribution=None), "n_trials=20 is read as the mean"),
        (dict(direction=["minimize", "maximize"]), "direction="),
        (dict(state_path="x"), "got state_path; accepted keyword arguments"),
        (dict(hp_space=None), "hp_space=None"),
        (dict(hp_space=lambda t: {"warmup": t.suggest_categorical("warmup", [1])}), "'warmup', a field of neither"),
        (dict(hp_space=lambda t: {"delta": t.suggest_categorical("delta", [1e-6])}), "hp_space draws 'delta'"),
        (dict(hp_space=lambda t: {"noise_multiplier": t.suggest_categorical("noise_multiplier", [1.0])}),
         "'noise_multiplier' with PrivacyArguments.target_epsilon"),
        (dict(hp_space=lambda t: {"max_steps": int(t.suggest_float("m", 1, 4))}), "continuous suggestion.*'m'"),
    ]
    for change, message in cases:
        options = {"hp_space": LR_SPACE, "distribution": "geometric", **change}
        with pytest.raises(ValueError, match=message):
            trainer.hyperparameter_search(**options)
    for kw, message in [(dict(eval_dataset=None), "eval_dataset=None"), (dict(model_init=None, model=tiny_llama()),
                                                                         "model_init=None")]:
        with pytest.raises(ValueError, match=message):
            trainer_of(tmp_path, **kw).hyperparameter_search(hp_space=LR_SPACE, distribution="geometric")
    train = RowDataset()
    with pytest.raises(ValueError, match="eval_dataset is train_dataset"):
        trainer_of(tmp_path, train_dataset=train, eval_dataset=train).hyperparameter_search(
            hp_space=LR_SPACE, distribution="geometric")


def test_private_sft_trainer_search_with_a_model_init(tmp_path):
    """TRL's SFTTrainer has no model_init: hyperparameter_search takes one; the trials are private
    SFTTrainers built from the same arguments."""
    import datasets
    import trl

    from tests.hf.test_trainer import char_tokenizer, sft_dataset

    config = trl.SFTConfig(output_dir=str(tmp_path / "sft"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                           max_steps=2, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, bf16=False)
    texts = sft_dataset()
    held_out = datasets.Dataset.from_dict({"text": list(reversed(texts["text"]))[:8]})
    trainer = private_trainer(trl.SFTTrainer)(
        model=tiny_llama(layers=1), args=config, train_dataset=texts, eval_dataset=held_out,
        processing_class=char_tokenizer(), privacy=PrivacyArguments(noise_multiplier=1.0, delta=1e-5))
    best = trainer.hyperparameter_search(hp_space=LR_SPACE, n_trials=2, distribution="poisson", seed=7,
                                         model_init=lambda: tiny_llama(layers=1))
    result = best.run_summary
    assert result.epsilon == pytest.approx(search_epsilon(result.mechanisms, TrialCount("poisson", 2), 1e-5).epsilon)
    assert type(result.result).__name__ == "DPSFTTrainer"  # this seed runs at least one trial
    assert result.result.get_epsilon() == pytest.approx(result.epsilon, rel=1e-12)
