"""``python -m opacus_rc.audit [--quick]``: audit randomized clipping, print a table and,
as the last line, a JSON list with one object per configuration (keys ``estimator``,
``sketch_size``, ``sigma``, ``variant``, ``eps_lower``, ``eps_accounted``).

The sketch variants (honest, biased_low, data_dependent_sketch) run for every estimator
and sketch size; the normaliser variants (:mod:`opacus_rc.audit.normaliser`) run once,
with the first estimator and sketch size, for the two-pass path."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings
from typing import List, Optional, Sequence

from ..config import ESTIMATORS, SKETCHINGS
from .experiment import AuditConfig, AuditResult, run_audit
from .normaliser import NORMALISER_VARIANTS, NormaliserAuditConfig, run_normaliser_audit
from .reference import exact_epsilon
from .variants import VARIANTS

#: Noise multiplier per sketch size: rc_prv's one-step epsilon at delta = 1e-2 is
#: 2.21 (k = 4) and 2.62 (k = 32), where a factor-2 underestimate of the norm
#: is visible with ~1e4 trials per side.
DEFAULT_SIGMA = {4: 2.0, 32: 1.0}
QUICK_STEPS = 400
FULL_STEPS = 2000


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m opacus_rc.audit", description=__doc__)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps per configuration (default {FULL_STEPS})")
    parser.add_argument("--steps", type=int, default=None, help="DP steps per configuration")
    parser.add_argument("--replicas", type=int, default=256, help="canaries (trials) per step")
    parser.add_argument("--estimators", nargs="+", default=list(ESTIMATORS), choices=ESTIMATORS)
    parser.add_argument("--sketch-sizes", nargs="+", type=int, default=sorted(DEFAULT_SIGMA))
    parser.add_argument(
        "--variants", nargs="+", default=[*VARIANTS, *NORMALISER_VARIANTS],
        choices=[*VARIANTS, *NORMALISER_VARIANTS],
    )
    parser.add_argument("--sigma", type=float, default=None, help="noise multiplier for every k (default: per k, %s)" % DEFAULT_SIGMA)
    parser.add_argument("--sketching", default="shared", choices=SKETCHINGS)
    parser.add_argument("--delta", type=float, default=1e-2)
    parser.add_argument("--alpha", type=float, default=0.05, help="the bounds hold with probability >= 1 - alpha each")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    missing = [k for k in args.sketch_sizes if args.sigma is None and k not in DEFAULT_SIGMA]
    if missing:
        parser.error(f"--sigma is required for sketch sizes without a default ({missing}); defaults: {DEFAULT_SIGMA}")
    return args


def configs(args: argparse.Namespace) -> List[AuditConfig]:
    steps = args.steps or (QUICK_STEPS if args.quick else FULL_STEPS)
    return [
        AuditConfig(
            estimator=est,
            sketch_size=k,
            sigma=args.sigma if args.sigma is not None else DEFAULT_SIGMA[k],
            variant=variant,
            sketching=args.sketching,
            steps=steps,
            replicas=args.replicas,
            delta=args.delta,
            alpha=args.alpha,
            seed=args.seed,
        )
        for est in args.estimators
        for k in args.sketch_sizes
        for variant in args.variants
        if variant in VARIANTS
    ]


def normaliser_configs(args: argparse.Namespace) -> List[NormaliserAuditConfig]:
    """One normaliser audit per requested normaliser variant (``steps`` per neighbour)."""
    steps = args.steps or (QUICK_STEPS if args.quick else FULL_STEPS)
    k = args.sketch_sizes[0]
    return [
        NormaliserAuditConfig(
            variant=variant,
            sigma=args.sigma if args.sigma is not None else DEFAULT_SIGMA[k],
            steps=max(steps, 4),
            estimator=args.estimators[0],
            sketch_size=k,
            delta=args.delta,
            alpha=args.alpha,
            seed=args.seed,
        )
        for variant in args.variants
        if variant in NORMALISER_VARIANTS
    ]


def table(results: Sequence[AuditResult], exact: Sequence[float]) -> str:
    head = (
        f"{'estimator':<11}{'k':>4}{'sigma':>7}  {'variant':<25}{'trials':>8}"
        f"{'eps_lower':>11}{'eps_exact':>11}{'eps_accounted':>15}  verdict"
    )
    lines = [head, "-" * len(head)]
    for r, e in zip(results, exact):
        verdict = "VIOLATION" if r.eps_lower > r.eps_accounted else "ok"
        lines.append(
            f"{r.estimator:<11}{r.sketch_size:>4}{r.sigma:>7.2f}  {r.variant:<25}{r.trials:>8}"
            f"{r.eps_lower:>11.3f}{e:>11.3f}{r.eps_accounted:>15.3f}  {verdict}"
        )
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore", message=".*[Ss]ecure RNG.*")
    warnings.filterwarnings("ignore", message=".*backward hook.*")
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is optional
        tqdm = None
    todo = configs(args)
    todo_normaliser = normaliser_configs(args)
    start = time.perf_counter()
    total = sum(c.steps for c in todo) + sum(2 * c.steps for c in todo_normaliser)
    bar = tqdm(total=total, unit="step", file=sys.stderr) if tqdm else None
    results = []
    for config in todo:
        if bar is not None:
            bar.set_description(f"{config.estimator} k={config.sketch_size} {config.variant}")
        results.append(run_audit(config, progress=bar.update if bar is not None else None))
    exact = [
        exact_epsilon(r.estimator, r.sketch_size, r.sigma, r.variant, args.delta, todo[0].canary_norm)
        for r in results
    ]
    for config in todo_normaliser:
        if bar is not None:
            bar.set_description(config.variant)
        results.append(run_normaliser_audit(config, progress=bar.update if bar is not None else None))
        exact.append(results[-1].eps_exact)
    if bar is not None:
        bar.close()
    print(table(results, exact))
    notes = [f"delta={args.delta}, alpha={args.alpha} (one-sided Clopper-Pearson, alpha/2 per rate)"]
    if todo:
        notes.append(f"{todo[0].replicas} trials/step, {todo[0].steps} steps/config")
    if todo_normaliser:
        c = todo_normaliser[0]
        notes.append(
            f"normaliser: n={c.dataset_size} vs {c.dataset_size - 1}, batch_size={c.batch_size}, "
            f"p={c.output_dim}, {c.steps} steps per neighbour"
        )
    print(", ".join(notes) + f", {time.perf_counter() - start:.0f} s")
    print(json.dumps([{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.contract().items()} for r in results]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
