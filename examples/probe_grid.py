"""Hyper-parameter proxy grid for the utility study: a DP linear probe on frozen MiniLM features.

A full DP arm on the 512-token speeches costs 2-6 minutes on 2 CPU cores, too much for a grid
over the usual knobs. This proxy trains only the zero-initialised linear head of the study's
model (masked-mean pool of the pretrained top layer, frozen) with exact DP-SGD (Opacus,
Poisson sampling, ``make_private_with_epsilon`` with the ``prv`` accountant, delta = 1e-5), so a
run takes about a second. It answers the questions the study's pilots could not afford: which
head learning rate, batch size and number of epochs let DP leave the majority class on 398
windows, and how far each epsilon can get. The chosen point is then confirmed on the real arms
(``docs/utility.md``).

    python examples/probe_grid.py --threads 1 --out docs/results/utility_probe_grid.json   # ~11 min on 1 core
    python examples/probe_grid.py --report docs/results/utility_probe_grid.json  # the table only
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import pathlib
import statistics
import sys
import warnings
from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import utility_study as study  # noqa: E402

logger = logging.getLogger("probe_grid")
Features = Tuple[torch.Tensor, torch.Tensor]


@torch.no_grad()
def pooled_features(prep: study.Prepared, encoder, chunk: int = 32) -> Tuple[Features, Features]:
    """(pooled, label) for train and test: the pretrained top layer on the cached frozen outputs,
    then the study's masked-mean pool (the head's input at initialisation)."""
    tail = study.minilm.build_tail(encoder, 1, mode="full").eval()
    out = []
    for h, m, y in (prep.train, prep.test):
        pooled = [tail.features(h[i:i + chunk], m[i:i + chunk]) for i in range(0, len(y), chunk)]
        out.append((torch.cat(pooled), y))
    return out[0], out[1]


def dp_probe(train: Features, test: Features, eps: float, delta: float, batch: int, epochs: int,
             lr: float, clip: float, seed: int) -> Tuple[float, float]:
    """Exact DP-SGD (Opacus) on a zero-initialised linear head with Adam; returns
    (test accuracy, noise multiplier)."""
    from opacus import PrivacyEngine

    torch.manual_seed(seed)
    head = nn.Linear(train[0].shape[1], int(train[1].max()) + 1)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*train), batch_size=batch,
                                         generator=torch.Generator().manual_seed(seed))
    engine = PrivacyEngine(accountant="prv")
    head, opt, loader = engine.make_private_with_epsilon(
        module=head, optimizer=torch.optim.Adam(head.parameters(), lr=lr), data_loader=loader,
        target_epsilon=eps, target_delta=delta, epochs=epochs, max_grad_norm=clip, poisson_sampling=True)
    crit = nn.CrossEntropyLoss()
    for _ in range(epochs):
        for x, y in loader:  # empty Poisson batches too: Opacus needs their (empty) per-sample grads
            opt.zero_grad()
            crit(head(x), y).backward()
            opt.step()
    with torch.no_grad():
        acc = float((head(test[0]).argmax(-1) == test[1]).float().mean())
    return acc, opt.noise_multiplier


def grid(train: Features, test: Features, eps_list: Sequence[float], schedules: Sequence[Tuple[int, int]],
         lrs: Sequence[float], clips: Sequence[float], seeds: Sequence[int], delta: float,
         progress: bool = True) -> List[Dict]:
    """Every (epsilon, (batch, epochs), lr, clip) point, mean and std of accuracy over seeds."""
    points = list(itertools.product(eps_list, schedules, lrs, clips))
    if progress:
        from tqdm import tqdm

        points = tqdm(points, desc="probe grid")
    rows = []
    for eps, (batch, epochs), lr, clip in points:
        results = [dp_probe(train, test, eps, delta, batch, epochs, lr, clip, s) for s in seeds]
        accs = [a for a, _ in results]
        rows.append(dict(epsilon=eps, batch=batch, epochs=epochs, lr=lr, clip=clip, seeds=len(seeds),
                         mean=statistics.fmean(accs), std=statistics.stdev(accs) if len(accs) > 1 else None,
                         noise_multiplier=results[0][1]))
    return rows


def table(rows: Sequence[Dict], majority: float) -> str:
    """Markdown: one line per (epsilon, batch, epochs, clip), one column per lr; the best
    point of each epsilon in bold."""
    lrs = sorted({r["lr"] for r in rows})
    best = {e: max(r["mean"] for r in rows if r["epsilon"] == e) for e in {r["epsilon"] for r in rows}}
    lines = [f"| ε | batch | epochs | C | σ | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |",
             "|---" * (5 + len(lrs)) + "|"]
    keys = sorted({(r["epsilon"], r["batch"], r["epochs"], r["clip"]) for r in rows})
    for eps, batch, epochs, clip in keys:
        cells = {r["lr"]: r for r in rows if (r["epsilon"], r["batch"], r["epochs"], r["clip"]) == (eps, batch, epochs, clip)}
        fmt = [("**{:.3f}**" if cells[lr]["mean"] == best[eps] else "{:.3f}").format(cells[lr]["mean"])
               if lr in cells else "–" for lr in lrs]
        sigma = next(iter(cells.values()))["noise_multiplier"]
        lines.append(f"| {eps:g} | {batch} | {epochs} | {clip:g} | {sigma:.2f} | " + " | ".join(fmt) + " |")
    return "\n".join(lines) + f"\n\nmajority class {majority:.4f}"


def _pairs(text: str) -> List[Tuple[int, int]]:
    try:
        return [tuple(int(v) for v in p.split("x")) for p in text.split(",")]  # type: ignore[misc]
    except ValueError:
        raise ValueError(f"--schedules={text!r} is invalid; accepted: a comma list of BATCHxEPOCHS, e.g. 32x3") from None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="speeches", choices=sorted(study.RECIPES))
    p.add_argument("--eps", default="1,3,8")
    p.add_argument("--schedules", default="32x3,32x5,32x10,64x5,64x10,128x10,128x30",
                   help="comma list of BATCHxEPOCHS (expected Poisson batch size x epochs)")
    p.add_argument("--lrs", default="0.01,0.03,0.1,0.3", help="head learning rates (Adam)")
    p.add_argument("--clips", default="0.5", help="max_grad_norm values")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--n-train", type=int, default=None)
    p.add_argument("--n-test", type=int, default=None)
    p.add_argument("--cache-dir", default=None, help="the utility study's cache of frozen outputs")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--report", default=None, metavar="JSON", help="only print the table of a saved grid")
    a = p.parse_args(argv)
    try:
        a.eps_list = study.eps_list(a.eps)
        a.schedule_list = _pairs(a.schedules)
        a.lr_list = study._list(a.lrs, "--lrs", float)
        a.clip_list = study._list(a.clips, "--clips", float)
        a.seed_list = study._list(a.seeds, "--seeds", int)
    except ValueError as e:
        p.error(str(e))
    return a


def main(argv=None) -> Dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    warnings.filterwarnings("ignore")
    args = parse_args(argv)
    if args.report:
        rec = json.loads(pathlib.Path(args.report).read_text())
        print(table(rec["rows"], rec["majority"]))
        return rec
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer, encoder = study.minilm.load_encoder()
    study_args = study.parse_args(["--datasets", args.dataset, "--layers", "1"] +
                                  (["--cache-dir", args.cache_dir] if args.cache_dir else []) +
                                  (["--n-train", str(args.n_train)] if args.n_train else []) +
                                  (["--n-test", str(args.n_test)] if args.n_test else []) + ["--no-progress"])
    prep = study.prepare(args.dataset, study_args, encoder, tokenizer)
    train, test = pooled_features(prep, encoder)
    rows = grid(train, test, args.eps_list, args.schedule_list, args.lr_list, args.clip_list, args.seed_list,
                args.delta, progress=not args.no_progress)
    rec = dict(command="python examples/probe_grid.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               dataset=args.dataset, majority=prep.majority, n_train=len(train[1]), rows=rows)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(rec, indent=1))
    print(table(rows, prep.majority))
    return rec


if __name__ == "__main__":
    main(sys.argv[1:])
