"""``python -m opacus_rc.audit [--quick]``: audit randomized clipping. Prints a short verdict
first (the honest rows against their bound; the controls caught), then the table, and writes a
JSON list with one object per configuration (keys ``estimator``, ``sketch_size``, ``sigma``,
``variant``, ``eps_lower``, ``eps_accounted``) to ``--json PATH`` (default ``out/audit.json``;
``--json -``: stdout, as the last line).

The sketch variants (honest, biased_low, data_dependent_sketch) run for every estimator and
sketch size; the normaliser variants (:mod:`opacus_rc.audit.normaliser`) once, with the first
estimator and sketch size, for the two-pass path; the side-path variants
(:mod:`opacus_rc.audit.paths`) once each, with the first estimator and their own sketch size
and sigma (``PATH_DEFAULTS``), the per-example ones for a fifth of the steps."""

from __future__ import annotations

import argparse
import json
import logging
import math
import pathlib
import sys
import time
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

from ..config import ESTIMATORS, SKETCHINGS
from ._broken import VARIANTS
from .experiment import AuditConfig, AuditResult, run_audit
from .normaliser import NORMALISER_VARIANTS, NormaliserAuditConfig, run_normaliser_audit
from .paths import (
    ACCUMULATION_EVERY, DRAW_BOUNDARY_VARIANTS, FORWARD_BUFFER_VARIANTS, FUSED_HEAD_VARIANTS, PARTIAL_DRAW_VARIANTS,
    PATH_DEFAULTS, PATH_VARIANTS, PER_EXAMPLE_VARIANTS, REDUCED_STEP_VARIANTS, USER_LEVEL_VARIANTS, PathAuditConfig,
    per_example_steps, run_path_audit,
)
from .reference import exact_epsilon

#: Noise multiplier per sketch size: rc_prv's one-step epsilon at delta = 1e-2 is
#: 2.21 (k = 4) and 2.62 (k = 32), where a factor-2 underestimate of the norm
#: is visible with ~1e4 trials per side.
DEFAULT_SIGMA = {4: 2.0, 32: 1.0}
QUICK_STEPS = 400
FULL_STEPS = 2000
#: the JSON results' default file (relative to the working directory)
DEFAULT_JSON = "out/audit.json"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m opacus_rc.audit", description=__doc__)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps per configuration (default {FULL_STEPS})")
    parser.add_argument("--steps", type=int, default=None, help="DP steps per configuration")
    parser.add_argument("--replicas", type=int, default=256, help="canaries (trials) per step")
    parser.add_argument("--estimators", nargs="+", default=list(ESTIMATORS), choices=ESTIMATORS)
    parser.add_argument("--sketch-sizes", nargs="+", type=int, default=sorted(DEFAULT_SIGMA))
    parser.add_argument(
        "--variants", nargs="+", default=[*VARIANTS, *NORMALISER_VARIANTS, *PATH_VARIANTS],
        choices=[*VARIANTS, *NORMALISER_VARIANTS, *PATH_VARIANTS],
    )
    for name, kind, variant, what in (
        ("micro_batches", int, "accumulation_canary", "micro-batches per step"),
        ("sample_rate", float, "accumulation_canary", "Poisson rate of each micro-batch"),
        ("episode_steps", int, "hand_built", "optimizer steps per trial"),
    ):
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=None,
            help=f"{variant}: {what} (default {PATH_DEFAULTS[variant][name]})",
        )
    parser.add_argument("--sigma", type=float, default=None, help="noise multiplier for every k (default: per k, %s)" % DEFAULT_SIGMA)
    parser.add_argument("--sketching", default="shared", choices=SKETCHINGS)
    parser.add_argument("--delta", type=float, default=1e-2)
    parser.add_argument("--alpha", type=float, default=0.05, help="the bounds hold with probability >= 1 - alpha each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=DEFAULT_JSON, metavar="PATH",
                        help=f"where the JSON results go (default {DEFAULT_JSON}; '-': stdout, last line)")
    args = parser.parse_args(argv)
    missing = [k for k in args.sketch_sizes if args.sigma is None and k not in DEFAULT_SIGMA]
    if missing:
        parser.error(f"--sigma is required for sketch sizes without a default ({missing}); defaults: {DEFAULT_SIGMA}")
    return args


def _steps(args: argparse.Namespace) -> int:
    return args.steps or (QUICK_STEPS if args.quick else FULL_STEPS)


def _sigma(args: argparse.Namespace, k: int) -> float:
    return args.sigma if args.sigma is not None else DEFAULT_SIGMA[k]


def _shared(args: argparse.Namespace) -> Dict[str, object]:
    """The fields every configuration takes from the command line."""
    return dict(delta=args.delta, alpha=args.alpha, seed=args.seed)


def configs(args: argparse.Namespace) -> List[AuditConfig]:
    """One sketch audit per requested estimator, sketch size and sketch variant."""
    return [
        AuditConfig(
            estimator=est, sketch_size=k, sigma=_sigma(args, k), variant=variant, sketching=args.sketching,
            steps=_steps(args), replicas=args.replicas, **_shared(args),
        )
        for est in args.estimators for k in args.sketch_sizes for variant in args.variants if variant in VARIANTS
    ]


def normaliser_configs(args: argparse.Namespace) -> List[NormaliserAuditConfig]:
    """One normaliser audit per requested normaliser variant (``steps`` per neighbour)."""
    k = args.sketch_sizes[0]
    return [
        NormaliserAuditConfig(
            variant=variant, sigma=_sigma(args, k), steps=max(_steps(args), 4), estimator=args.estimators[0],
            sketch_size=k, **_shared(args),
        )
        for variant in args.variants if variant in NORMALISER_VARIANTS
    ]


def path_configs(args: argparse.Namespace) -> List[PathAuditConfig]:
    """One side-path audit per requested variant: the first estimator, the variant's
    sketch size and sigma (``PATH_DEFAULTS``; ``--sigma`` overrides), ``steps`` logical
    steps (accumulation) or episodes (hand-built); the per-example and user-level variants
    fewer (:func:`~opacus_rc.audit.paths.per_example_steps`), the user-level ones at most
    their own replicas (a step's rows and the layer's outputs both grow with R)."""
    out = []
    for variant in (v for v in args.variants if v in PATH_VARIANTS):
        options = dict(PATH_DEFAULTS[variant])
        options.update({k: getattr(args, k) for k in ("sigma", "micro_batches", "sample_rate", "episode_steps")
                        if getattr(args, k) is not None})
        steps = per_example_steps(variant, _steps(args)) if variant in REDUCED_STEP_VARIANTS else _steps(args)
        out.append(PathAuditConfig(
            variant=variant, estimator=args.estimators[0], steps=steps,
            replicas=min(args.replicas, options.pop("replicas", args.replicas)),  # user level: at most 64
            sketching=options.pop("sketching", args.sketching),  # reentrant_split: per-example
            **_shared(args), **options,
        ))
    return out


#: the deliberately broken controls: the audit must flag them (eps_lower above eps_accounted)
CONTROLS = (*VARIANTS[1:], "normaliser_dataset_size", "fused_head_unchecked", "per_example_unchecked",
            "draw_boundary_unchecked", "partial_draw_carried", "forward_buffer_unchecked", "user_level_per_row")
LEGEND = (
    "verdict column: 'ok' = eps_lower (the audit's 95% lower bound) is below the accounted epsilon; "
    "'VIOLATION' = it is above, on a variant that is not a control; 'caught (control)' = a "
    "deliberately broken variant was flagged, as it must be; 'MISSED (control)' = it was not "
    "(see the verdict above the table; docs/audit.md)"
)


def verdict(variant: str, eps_lower: float, eps_accounted: float) -> str:
    """The table's verdict: controls must exceed their accounted epsilon, the rest must not."""
    flagged = eps_lower > eps_accounted
    if variant in CONTROLS:
        return "caught (control)" if flagged else "MISSED (control)"
    return "VIOLATION" if flagged else "ok"


def _missed_reason(r: AuditResult, exact: float, shortfall: float) -> str:
    """Why a control was not flagged: its exact epsilon against the accounted one, and the
    audit's resolution at this trial count (``shortfall``: the largest ``eps_exact - eps_lower``
    of an honest row, nan without one)."""
    where = f"{r.estimator} k={r.sketch_size} {r.variant}"
    margin = exact - r.eps_accounted
    if margin <= 0:
        return (f"{where}: at these settings the control is not broken (exact epsilon {exact:.3f} <= "
                f"accounted {r.eps_accounted:.3f}): unresolvable by any number of trials")
    if math.isfinite(shortfall) and margin < shortfall:
        return (f"{where}: unresolvable at {r.trials:,} trials: its exact epsilon {exact:.3f} exceeds the "
                f"accounted {r.eps_accounted:.3f} by only {margin:.3f}, less than the audit's own shortfall "
                f"on the honest rows ({shortfall:.3f}); more trials narrow that shortfall (docs/audit.md)")
    return (f"{where}: not flagged (eps_lower {r.eps_lower:.3f}) although its exact epsilon {exact:.3f} exceeds "
            f"the accounted {r.eps_accounted:.3f} by {margin:.3f}: too few trials ({r.trials:,}) or a fault: investigate")


def summary(results: Sequence[AuditResult], exact: Sequence[float]) -> str:
    """The verdict printed first: the honest rows against their bound, then the controls
    caught n of m, each missed one with the reason it can be unresolvable."""
    rows = [(r, e, verdict(r.variant, r.eps_lower, r.eps_accounted)) for r, e in zip(results, exact)]
    honest = [(r, e, v) for r, e, v in rows if r.variant not in CONTROLS]
    controls = [(r, e, v) for r, e, v in rows if r.variant in CONTROLS]
    bad = [r for r, _, v in honest if v == "VIOLATION"]
    lines = []
    if bad:
        lines.append(f"VIOLATION: {len(bad)} of {len(honest)} honest rows exceed the accounted epsilon: "
                     + ", ".join(f"{r.estimator} k={r.sketch_size} {r.variant}" for r in bad))
    elif honest:
        lines.append(f"PASS: all {len(honest)} honest rows are within the bound (eps_lower < eps_accounted)")
    if controls:
        caught = sum(v == "caught (control)" for *_, v in controls)
        lines.append(f"controls (deliberately broken variants the audit must flag): caught {caught} of {len(controls)}")
        gaps = [e - r.eps_lower for r, e, _ in honest if math.isfinite(e)]
        shortfall = max(gaps) if gaps else float("nan")
        lines += ["  missed: " + _missed_reason(r, e, shortfall) for r, e, v in controls if v != "caught (control)"]
    return "\n".join(lines)


def write_json(results: Sequence[AuditResult], path: str) -> Optional[pathlib.Path]:
    """The JSON list of the results' contract fields, to ``path`` (its folder created), or to
    stdout for ``"-"`` (then None)."""
    text = json.dumps([{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.contract().items()} for r in results])
    if path == "-":
        print(text)
        return None
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    return out


def table(results: Sequence[AuditResult], exact: Sequence[float]) -> str:
    head = (
        f"{'estimator':<11}{'k':>4}{'sigma':>7}  {'variant':<25}{'trials':>8}"
        f"{'eps_lower':>11}{'eps_exact':>11}{'eps_accounted':>15}  verdict"
    )
    lines = [head, "-" * len(head)]
    for r, e in zip(results, exact):
        lines.append(
            f"{r.estimator:<11}{r.sketch_size:>4}{r.sigma:>7.2f}  {r.variant:<25}{r.trials:>8}"
            f"{r.eps_lower:>11.3f}{e:>11.3f}{r.eps_accounted:>15.3f}  "
            f"{verdict(r.variant, r.eps_lower, r.eps_accounted)}"
        )
    return "\n".join([*lines, LEGEND])


def _path_note(r: AuditResult, replicas: int) -> Optional[str]:
    """What the notes line says of a side-path result (None: nothing)."""
    v = r.variant
    refused_or = lambda ran: f"refused by the plugin ({r.refusal[:60]}...)" if r.refusal else ran  # noqa: E731
    if v == "accumulation_canary":
        under = " (below eps_lower: under-charged)" if r.eps_lower > r.eps_old_charge else ""
        return (f"{v}: m={r.micro_batches} micro-batches at q={r.sample_rate}; the old q x m charge (one draw at rate "
                f"{min(1.0, r.sample_rate * r.micro_batches):g}) would report {r.eps_old_charge:.3f}{under}")
    if v == "reused_layer":
        return (f"{v}: one layer applied {PATH_DEFAULTS[v]['uses']} times per forward pass (book-keeping), one "
                f"Poisson draw at q={r.sample_rate}")
    if v == "reentrant_split":
        return (f"{v}: one draw in {r.micro_batches} physical batches, the layer in a reentrant checkpoint region, "
                "per-example sketches (fresh per physical batch)")
    if v in FUSED_HEAD_VARIANTS:
        return f"{v}: a loss reading the head's weight outside its module on a checkpointed model: " + refused_or(
            f"released (mean canary contribution {r.mean_score_in:.1f} C), charged as one step"
        )
    if v in FORWARD_BUFFER_VARIANTS:
        return f"{v}: a running sum of the inputs kept in a buffer by the forward pass: " + refused_or(
            "released exactly (the buffer with the canaries differs from the one without them)"
        )
    if v in PER_EXAMPLE_VARIANTS:
        off = "" if v == "per_example" else "; its batch check off: two examples per backward pass"
        return (f"{v}: the per-example form (exact clipping, no sketch{off}), {r.trials // replicas} steps, charged "
                f"as exact steps; the canary's shift {r.mean_score_in:.2f} C")
    if v in DRAW_BOUNDARY_VARIANTS:
        return f"{v}: step() every {ACCUMULATION_EVERY} physical batches of the per-example form's loader: " + (
            refused_or(f"released (the canary's shift {r.mean_score_in:.2f} C: two draws), charged as one draw")
        )
    if v in PARTIAL_DRAW_VARIANTS:
        what = "carried into the next release" if v == "partial_draw_carried" else "dropped"
        return (f"{v}: a loop stopped inside a draw of the per-example form's loader, then iterated again: the "
                f"stopped draw's clipped sums {what}; the canary's shift {r.mean_score_in:.2f} C, charged as one draw")
    if v in USER_LEVEL_VARIANTS:
        clip = "each row clipped alone" if v == "user_level_per_row" else "one clip of the mean of its rows"
        return (f"{v}: privacy_unit='user', a canary user of {r.user_rows} rows (all removed in the neighbour), "
                f"max_examples_per_user={r.user_rows}, book-keeping, {clip}, charged per user at q_u=1; the "
                f"canary's shift {r.mean_score_in:.2f} C")
    if v == "hand_built":
        return (f"{v}: {r.episode_steps} steps per trial, eps_exact of the sum test (Monte Carlo), eps_accounted "
                f"after {r.episode_steps} steps")
    return None


def _run(runs: Sequence[Tuple]) -> List[AuditResult]:
    """Each ``(config, run, description, steps)`` of ``runs``, under a progress bar (tqdm, if installed)."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is optional
        return [run(config) for config, run, *_ in runs]
    with tqdm(total=sum(steps for *_, steps in runs), unit="step", file=sys.stderr) as bar:
        results = []
        for config, run, description, _ in runs:
            bar.set_description(description)
            results.append(run(config, progress=bar.update))
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore", message=".*[Ss]ecure RNG.*")
    warnings.filterwarnings("ignore", message=".*backward hook.*")
    todo, todo_normaliser = configs(args), normaliser_configs(args)
    start = time.perf_counter()
    results = _run(
        [(c, run_audit, f"{c.estimator} k={c.sketch_size} {c.variant}", c.steps) for c in todo]
        + [(c, run_normaliser_audit, c.variant, 2 * c.steps) for c in todo_normaliser]
        + [(c, run_path_audit, c.variant, c.steps) for c in path_configs(args)]
    )
    exact = [
        exact_epsilon(r.estimator, r.sketch_size, r.sigma, r.variant, args.delta) if r.variant in VARIANTS
        else r.eps_exact
        for r in results
    ]
    print(summary(results, exact))
    print()
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
    notes += [n for n in (_path_note(r, args.replicas) for r in results) if n]
    print(", ".join(notes) + f", {time.perf_counter() - start:.0f} s")
    written = write_json(results, args.json)
    if written is not None:
        print(f"JSON (one object per row): {written}")
    return 0


if __name__ == "__main__":
    import torch

    # this process only: the audited steps are tiny tensors, where intra-op threads only contend
    torch.set_num_threads(1)
    sys.exit(main())
