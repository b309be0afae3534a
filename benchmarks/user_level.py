"""User level against example level at the same per-person epsilon (issue 40).

Rotten Tomatoes snippets grouped by movie (``examples.text_data.load_rotten_tomatoes_by_movie``:
12,808 snippets of 508 movies, 2 to 35 each); the movie is the "user". The split is **by
movie**: a seeded 80/20 split of the movies, so the test movies are unseen in training. The
model is a zero-initialised linear head on frozen, masked-mean-pooled all-MiniLM-L6-v2
embeddings (all six layers, 64 tokens, L2-normalised per row), computed once and cached
(``--cache``). Arms, all at the same number of steps and the same expected rows per step
(``E[U] * mean_u min(k, n_u)``), Adam:

* ``user``: ``opacus_rc`` with ``clipping="randomized"``, book-keeping, ``rc_prv``,
  ``privacy_unit="user"``, ``max_examples_per_user=k``, sigma from
  ``make_private_with_epsilon`` (calibrated at ``q_u = E[U] / movies``); the reported epsilon
  is per movie, for any number of snippets.
* ``example_kmax``: example-level DP-SGD (Opacus exact flat clipping, ``prv``) on all rows,
  at ``q = 1 / len(loader)``, sigma from
  ``get_group_noise_multiplier(group_size=K_max)`` with ``K_max`` the largest training movie's
  row count: the group report (``engine.get_user_epsilon(delta, K_max)``) of every movie meets
  the same epsilon.
* ``example_k``: example level on at most ``k`` rows per movie (a seeded subset, fixed before
  training), sigma calibrated for ``group_size=k``: the group report covers every movie.
* ``nonprivate``: all rows, shuffled batches (the ceiling).

Reported: test accuracy per row and per movie (the mean over test movies of each movie's
accuracy), mean and standard deviation over seeds, sigma, q, steps, the epsilon each engine
reports, and time per step.

    python -m benchmarks.user_level          # small: 128 movies, eps 8, 1 seed (a few minutes)
    python -m benchmarks.user_level --full   # 508 movies, eps 3 and 8, 3 seeds
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import pathlib
import platform
import statistics
import sys
import time
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the examples package
from examples.text_data import load_rotten_tomatoes_by_movie, majority_accuracy  # noqa: E402

logger = logging.getLogger("benchmarks.user_level")

ARMS = ("user", "example_kmax", "example_k", "nonprivate")
MAX_LEN = 64
DEFAULT_CACHE = ROOT / "out" / "cache" / f"rt_minilm_pooled_{MAX_LEN}.pt"


@dataclasses.dataclass
class Data:
    """Pooled features, labels and movie index of the training and test rows."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    movie_train: List[int]
    x_test: torch.Tensor
    y_test: torch.Tensor
    movie_test: List[int]

    @property
    def max_rows(self) -> int:
        """K_max: the largest training movie's row count."""
        return max(_counts(self.movie_train).values())


@dataclasses.dataclass
class Result:
    arm: str
    target_epsilon: Optional[float]
    seed: int
    accuracy: float
    movie_accuracy: float
    sigma: float
    sample_rate: float
    steps: int
    rows_per_step: float
    epsilon: Optional[float]
    seconds_per_step: float
    group_size: Optional[int] = None


def _counts(movies: Sequence[int]) -> Dict[int, int]:
    counts: Dict[int, int] = {}
    for m in movies:
        counts[m] = counts.get(m, 0) + 1
    return counts


def movie_split(movies: Sequence[str], n_movies: Optional[int], test_fraction: float = 0.2,
                seed: int = 1234) -> Tuple[List[int], List[int], List[int]]:
    """Rows of the training and test movies (a seeded permutation of the sorted distinct
    names, the first ``n_movies`` of it kept, the last ``test_fraction`` for test) and the
    movie index of every row."""
    names = sorted(set(movies))
    perm = torch.randperm(len(names), generator=torch.Generator().manual_seed(seed)).tolist()
    kept = perm[:n_movies] if n_movies else perm
    n_test = max(1, round(test_fraction * len(kept)))
    test_movies = {names[i] for i in kept[:n_test]}
    train_movies = {names[i] for i in kept[n_test:]}
    index = {name: i for i, name in enumerate(names)}
    train = [r for r, m in enumerate(movies) if m in train_movies]
    test = [r for r, m in enumerate(movies) if m in test_movies]
    return train, test, [index[m] for m in movies]


def pooled_features(texts: Sequence[str], rows: Sequence[int], cache: pathlib.Path, progress: bool) -> torch.Tensor:
    """L2-normalised pooled MiniLM features of ``texts[rows]``; rows already in ``cache`` are
    read from it, the others computed and added to it."""
    from examples.models import minilm

    stored = torch.load(cache) if cache.exists() else {"max_len": MAX_LEN, "rows": torch.empty(0, dtype=torch.long),
                                                         "features": torch.empty(0, 384)}
    have = {int(r): i for i, r in enumerate(stored["rows"])}
    missing = [r for r in rows if r not in have]
    if missing:
        t0 = time.perf_counter()
        tokenizer, encoder = minilm.load_encoder()
        bar = None
        if progress:
            from tqdm import tqdm

            bar = lambda it: tqdm(it, desc=f"MiniLM on {len(missing)} rows", leave=False)  # noqa: E731
        new = minilm.pooled_embeddings([texts[r] for r in missing], encoder, tokenizer, MAX_LEN, progress=bar)
        logger.info("embedded %d rows in %.0f s", len(missing), time.perf_counter() - t0)
        stored = {"max_len": MAX_LEN, "rows": torch.cat([stored["rows"], torch.tensor(missing)]),
                  "features": torch.cat([stored["features"], new])}
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(stored, cache)
        have = {int(r): i for i, r in enumerate(stored["rows"])}
    x = stored["features"][[have[r] for r in rows]]
    return nn.functional.normalize(x, dim=1)


def load_data(n_movies: Optional[int], cache: pathlib.Path, progress: bool) -> Data:
    texts, labels, movies = load_rotten_tomatoes_by_movie()
    train, test, movie_index = movie_split(movies, n_movies)
    x = pooled_features(texts, train + test, cache, progress)
    y = torch.tensor(labels)
    return Data(x[:len(train)], y[train], [movie_index[r] for r in train],
                x[len(train):], y[test], [movie_index[r] for r in test])


def cut_rows(movies: Sequence[int], k: int, seed: int = 0) -> List[int]:
    """At most ``k`` rows per movie: a seeded uniform subset, fixed before training."""
    by_movie: Dict[int, List[int]] = {}
    for r, m in enumerate(movies):
        by_movie.setdefault(m, []).append(r)
    g = torch.Generator().manual_seed(seed)
    keep = []
    for rows in by_movie.values():
        keep += [rows[i] for i in torch.randperm(len(rows), generator=g)[:k].tolist()]
    return sorted(keep)


@torch.no_grad()
def evaluate(head: nn.Module, data: Data) -> Tuple[float, float]:
    """Accuracy per row and per movie (the mean over test movies of each one's accuracy)."""
    correct = (head(data.x_test).argmax(-1) == data.y_test).float()
    per_movie: Dict[int, List[float]] = {}
    for c, m in zip(correct.tolist(), data.movie_test):
        per_movie.setdefault(m, []).append(c)
    return float(correct.mean()), statistics.fmean(statistics.fmean(v) for v in per_movie.values())


def _head(dim: int) -> nn.Linear:
    head = nn.Linear(dim, 2)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


def _train(head, optimizer, loader, steps: int, progress: bool, desc: str) -> float:
    """``steps`` optimizer steps over ``loader`` (epoch after epoch, empty draws included);
    returns seconds per step."""
    crit = nn.CrossEntropyLoss()
    bar = range(steps)
    if progress:
        from tqdm import tqdm

        bar = tqdm(bar, desc=desc, leave=False)
    batches = _forever(loader)
    t0 = time.perf_counter()
    for _ in bar:
        x, y = next(batches)
        optimizer.zero_grad()
        crit(head(x), y).backward()
        optimizer.step()
    return (time.perf_counter() - t0) / steps


def _forever(loader):
    while True:
        yield from loader


def plan(data: Data, args) -> Dict[str, float]:
    """The shared schedule: q_u, steps, and the expected rows per step of the user arm."""
    counts = _counts(data.movie_train)
    q_u = args.users_per_step / len(counts)
    rows_per_step = args.users_per_step * statistics.fmean(min(args.k, n) for n in counts.values())
    return dict(q_u=q_u, steps=int(args.user_epochs / q_u), rows_per_step=rows_per_step, movies=len(counts))


def run_arm(arm: str, eps: Optional[float], seed: int, data: Data, args) -> Result:
    """Train one arm at one seed and evaluate it."""
    from opacus import PrivacyEngine

    import opacus_rc  # noqa: F401  registers clipping="randomized" and accountant="rc_prv"
    from opacus_rc.accounting import get_group_noise_multiplier
    from opacus_rc.units import user_epoch_draws

    sched = plan(data, args)
    steps, batch = sched["steps"], max(1, round(sched["rows_per_step"]))
    torch.manual_seed(seed)
    head = _head(data.x_train.shape[1])
    opt = torch.optim.Adam(head.parameters(), lr=args.lr)
    desc = f"{arm} eps={eps} seed={seed}"
    if arm == "nonprivate":
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data.x_train, data.y_train),
                                             batch_size=batch, shuffle=True,
                                             generator=torch.Generator().manual_seed(seed))
        per_step = _train(head, opt, loader, steps, args.progress, desc)
        acc, movie_acc = evaluate(head, data)
        return Result(arm, None, seed, acc, movie_acc, 0.0, batch / len(data.y_train), steps, batch, None, per_step)
    if arm == "user":
        engine = PrivacyEngine(accountant="rc_prv")
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data.x_train, data.y_train),
                                             batch_size=args.users_per_step)
        head, opt, loader = engine.make_private_with_epsilon(
            module=head, optimizer=opt, data_loader=loader, target_epsilon=eps, target_delta=args.delta,
            # calibrated for the `steps` _train runs (epochs x round(1 / q_u) draws of the loader)
            epochs=steps / user_epoch_draws(sched["q_u"]), privacy_unit="user", user_ids=data.movie_train,
            max_examples_per_user=args.k, max_grad_norm=args.clip, clipping="randomized",
            grad_sample_mode="bookkeeping", per_example_backward=False, poisson_sampling=True, seed=seed)
        per_step = _train(head, opt, loader, steps, args.progress, desc)
        spent, group = engine.get_epsilon(args.delta), None
    else:
        rows = list(range(len(data.y_train))) if arm == "example_kmax" else cut_rows(data.movie_train, args.k)
        group = data.max_rows if arm == "example_kmax" else min(args.k, data.max_rows)
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(data.x_train[rows], data.y_train[rows]), batch_size=batch)
        q = 1.0 / len(loader)  # the rate Opacus's Poisson loader samples at and charges
        sigma = get_group_noise_multiplier(eps, args.delta, sample_rate=q, group_size=group, steps=steps)
        engine = PrivacyEngine(accountant="prv")  # exact per-example clipping (Opacus flat)
        head, opt, loader = engine.make_private(module=head, optimizer=opt, data_loader=loader,
                                                noise_multiplier=sigma, max_grad_norm=args.clip, poisson_sampling=True)
        per_step = _train(head, opt, loader, steps, args.progress, desc)
        spent = engine.get_user_epsilon(args.delta, group)
        sched = dict(sched, rows_per_step=q * len(rows))
    acc, movie_acc = evaluate(head, data)
    history = engine.accountant.history
    return Result(arm, eps, seed, acc, movie_acc, float(opt.noise_multiplier), float(history[0][1]),
                  sum(int(h[2]) for h in history), sched["rows_per_step"],
                  spent, per_step, group)


def summarize(results: Sequence[Result]) -> List[Dict]:
    """Mean and std over seeds of each (arm, epsilon)."""
    keys = sorted({(r.arm, r.target_epsilon) for r in results}, key=lambda k: (k[1] or math.inf, ARMS.index(k[0])))
    rows = []
    for arm, eps in keys:
        rs = [r for r in results if (r.arm, r.target_epsilon) == (arm, eps)]
        rows.append(dict(
            arm=arm, target_epsilon=eps, seeds=len(rs), group_size=rs[0].group_size,
            accuracy=statistics.fmean(r.accuracy for r in rs),
            accuracy_std=statistics.stdev([r.accuracy for r in rs]) if len(rs) > 1 else 0.0,
            movie_accuracy=statistics.fmean(r.movie_accuracy for r in rs),
            movie_accuracy_std=statistics.stdev([r.movie_accuracy for r in rs]) if len(rs) > 1 else 0.0,
            sigma=rs[0].sigma, sample_rate=rs[0].sample_rate, steps=rs[0].steps, rows_per_step=rs[0].rows_per_step,
            epsilon=max((r.epsilon for r in rs if r.epsilon is not None), default=None),
            seconds_per_step=statistics.median(r.seconds_per_step for r in rs)))
    return rows


LABELS = {
    "user": "user level (`privacy_unit=\"user\"`, k = {k})",
    "example_kmax": "example level, all rows, group report k = {g} (K_max)",
    "example_k": "example level, ≤ {k} rows per movie, group report k = {g}",
    "nonprivate": "non-private (all rows)",
}


def markdown(rows: Sequence[Dict], k: int, delta: float) -> str:
    lines = ["| user-level ε (δ) | method | σ | q or q_u | steps | rows per step | test accuracy | "
             "per-movie accuracy | reported ε | time per step |", "|---" * 10 + "|"]
    for r in rows:
        eps = "—" if r["target_epsilon"] is None else f"{r['target_epsilon']:g} ({delta:g})"
        label = LABELS[r["arm"]].format(k=k, g=r["group_size"])
        rep = "—" if r["epsilon"] is None else f"{r['epsilon']:.2f}"
        lines.append(
            f"| {eps} | {label} | {r['sigma']:.3g} | {r['sample_rate']:.4f} | {r['steps']} | {r['rows_per_step']:.0f} | "
            f"{r['accuracy']:.3f} ± {r['accuracy_std']:.3f} | {r['movie_accuracy']:.3f} ± {r['movie_accuracy_std']:.3f} | "
            f"{rep} | {1000 * r['seconds_per_step']:.1f} ms |")
    return "\n".join(lines)


def plot(rows: Sequence[Dict], path: pathlib.Path, majority: float, k: int) -> None:
    """Test accuracy (mean ± std) per arm against the user-level epsilon; the non-private
    ceiling and the majority class as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for arm in ARMS[:-1]:
        rs = [r for r in rows if r["arm"] == arm]
        if rs:
            ax.errorbar([r["target_epsilon"] for r in rs], [r["accuracy"] for r in rs],
                        yerr=[r["accuracy_std"] for r in rs], marker="o", capsize=3,
                        label=LABELS[arm].format(k=k, g=rs[0]["group_size"]).replace("`", ""))
    for r in rows:
        if r["arm"] == "nonprivate":
            ax.axhline(r["accuracy"], color="k", ls="--", lw=1, label="non-private")
    ax.axhline(majority, color="grey", ls=":", lw=1, label="majority class")
    eps = sorted({r["target_epsilon"] for r in rows if r["target_epsilon"] is not None})
    ax.set_xticks(eps, [f"{e:g}" for e in eps])
    ax.set_xlabel("per-movie ε (δ = 1e-5)")
    ax.set_ylabel("test accuracy (unseen movies)")
    ax.set_title("Rotten Tomatoes by movie: linear head on MiniLM")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="508 movies, eps 3,8, seeds 0,1,2")
    p.add_argument("--movies", type=int, default=None, help="movies kept (default 128; --full: all)")
    p.add_argument("--eps", default=None, help="comma list of user-level epsilons (default 8; --full: 3,8)")
    p.add_argument("--seeds", default=None, help="comma list (default 0; --full: 0,1,2)")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--k", type=int, default=8, help="max_examples_per_user")
    p.add_argument("--users-per-step", type=int, default=None, help="E[U] (default 16; --full: 64)")
    p.add_argument("--user-epochs", type=float, default=30.0, help="steps = user_epochs / q_u")
    p.add_argument("--lr", type=float, default=0.05, help="Adam learning rate")
    p.add_argument("--clip", type=float, default=0.5, help="max_grad_norm C")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cache", default=str(DEFAULT_CACHE), help="pooled MiniLM features (rows added as needed)")
    p.add_argument("--json", default=None, help="default: docs/results/user_level.json with --full")
    p.add_argument("--plot", default=None, help="default: docs/results/user_level.png with --full")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    a = p.parse_args(argv)
    a.movies = a.movies if a.movies is not None else (None if a.full else 128)
    a.eps_list = [float(v) for v in (a.eps or ("3,8" if a.full else "8")).split(",")]
    a.seed_list = [int(v) for v in (a.seeds or ("0,1,2" if a.full else "0")).split(",")]
    a.users_per_step = a.users_per_step or (64 if a.full else 16)
    a.arm_list = a.arms.split(",")
    bad = [x for x in a.arm_list if x not in ARMS]
    if bad:
        p.error(f"--arms: unknown {bad}; accepted: {', '.join(ARMS)}")
    if a.full:
        a.json = a.json or str(ROOT / "docs" / "results" / "user_level.json")
        a.plot = a.plot or str(ROOT / "docs" / "results" / "user_level.png")
    return a


def main(argv=None) -> Dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    warnings.filterwarnings("ignore")
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    data = load_data(args.movies, pathlib.Path(args.cache), args.progress)
    sched = plan(data, args)
    logger.info("train %d rows of %d movies (K_max %d), test %d rows of %d unseen movies; %s",
                len(data.y_train), sched["movies"], data.max_rows, len(data.y_test), len(set(data.movie_test)), sched)
    results = []
    for eps in args.eps_list:
        for arm in [a for a in args.arm_list if a != "nonprivate"]:
            for seed in args.seed_list:
                results.append(run_arm(arm, eps, seed, data, args))
                logger.info("%s", results[-1])
    if "nonprivate" in args.arm_list:
        for seed in args.seed_list:
            results.append(run_arm("nonprivate", None, seed, data, args))
    rows = summarize(results)
    majority = majority_accuracy(data.y_test.tolist())
    table = markdown(rows, args.k, args.delta)
    print(table)
    print(f"\nsplit by movie: train {len(data.y_train)} rows / {sched['movies']} movies, test {len(data.y_test)} rows / "
          f"{len(set(data.movie_test))} unseen movies; K_max = {data.max_rows}; majority class {majority:.3f}; "
          f"{time.perf_counter() - t0:.0f} s")
    record = dict(command="python -m benchmarks.user_level " + " ".join(argv if argv is not None else sys.argv[1:]),
                  machine=platform.processor() or platform.machine(), threads=torch.get_num_threads(),
                  args={k: os.path.relpath(v, ROOT) if k == "cache" else v  # no machine path in a results file
                        for k, v in vars(args).items() if k not in ("json", "plot")},
                  split=dict(train_rows=len(data.y_train), train_movies=sched["movies"], test_rows=len(data.y_test),
                             test_movies=len(set(data.movie_test)), k_max=data.max_rows, majority=majority),
                  schedule=sched, summary=rows, runs=[dataclasses.asdict(r) for r in results],
                  seconds=time.perf_counter() - t0)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(record, indent=1))
    if args.plot:
        plot(rows, pathlib.Path(args.plot), majority, args.k)
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
