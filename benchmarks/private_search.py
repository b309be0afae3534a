"""The private search's utility table (issue 54): at the same total epsilon, a private search over
the learning rate against one run at a default learning rate, and against the usual unaccounted
practice (the best of a fixed grid, reported with one run's epsilon, next to its true epsilon).

The task and the trials are ``examples/private_search.py``'s (SMS spam, hashed bag of words, a
linear classifier, DP-SGD with randomized clipping; validation split for the choice, test split
reported). Arms, each at target epsilon ``eps`` (delta 1e-5):

* ``search``: ``opacus_rc.tuning.private_search``, Poisson number of trials of mean 5, learning
  rate log-uniform in [0.3, 100]; sigma calibrated so that the whole search spends ``eps``.
* ``default``: one run at the range's geometric middle (5.5), sigma for one run at ``eps``.
* ``blind``: one run at a learning rate chosen without the data, averaged over the grid's five
  values (the grid's runs, each scored on the test split).
* ``grid``: five runs (0.3, 1.3, 5.5, 23, 100), each at the one-run sigma, the best by validation
  accuracy; reported with one run's ``eps``, while the five runs compose to the ``true_epsilon``
  shown (``rc_prv`` over their histories).

    python -m benchmarks.private_search            # epsilon 8, seed 0 (a few minutes on 2 loaded cores)
    python -m benchmarks.private_search --full     # epsilon 3 and 8, seeds 0, 1, 2: docs/results/private_search.json
    python -m benchmarks.private_search --accounting   # the accounting figures only (seconds)

``--accounting`` prints, for sigma 1, q 0.01, 1,000 steps, delta 1e-5: one run's epsilon and a
search's (each distribution, mean 5) next to dp_accounting's ``RepeatAndSelectDpEvent``, the
largest relative gap over the test grid (shapes 0, 0.5, 1, Poisson; means 1 to 20; four base
runs), and randomized clipping's search epsilon (RDP bound) next to one run's rc_prv epsilon.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the examples package
from examples import one_thread_unless_set  # noqa: E402
from examples.private_search import DELTA, LR_DEFAULT, LR_GRID, accuracy, search, sms_task, train  # noqa: E402

ARMS = ("search", "default", "blind", "grid")
MEAN_TRIALS = 5.0


def one_run_sigma(task: Any, eps: float, epochs: int, clipping: str) -> float:
    """Sigma of one run at ``eps`` (rc_prv, the run's sketch)."""
    from opacus_rc.accounting import get_noise_multiplier_rc
    from opacus_rc.config import SketchConfig

    sketch = SketchConfig() if clipping == "randomized" else None
    return get_noise_multiplier_rc(eps, DELTA, task.sample_rate, steps=task.steps(epochs), sketch_config=sketch)


def runs_epsilon(task: Any, sigma: float, runs: int, epochs: int, clipping: str) -> float:
    """Epsilon of ``runs`` runs composed (rc_prv)."""
    from opacus_rc.accounting import RCPRVAccountant
    from opacus_rc.config import SketchConfig

    acc = RCPRVAccountant()
    record = SketchConfig() if clipping == "randomized" else None
    acc.history = [(sigma, task.sample_rate, runs * task.steps(epochs), record)]
    return float(acc.get_epsilon(DELTA))


def run_arms(task: Any, eps: float, seed: int, epochs: int, clipping: str, tick: Any) -> List[Dict[str, Any]]:
    from opacus_rc.integration import PrivacyEngine

    rows = []
    start = time.time()
    result, report = search(task, epsilon=eps, distribution="poisson", mean_trials=MEAN_TRIALS, shape=None,
                            epochs=epochs, clipping=clipping, seed=seed)
    rows.append(dict(arm="search", epsilon=eps, seed=seed, reported_epsilon=report["epsilon"],
                     true_epsilon=report["epsilon"], test_accuracy=report["test_accuracy"],
                     learning_rate=report["learning_rate"], trials_run=report["trials_run"],
                     noise_multiplier=report["noise_multiplier"], seconds=round(time.time() - start, 1)))
    tick()
    sigma = one_run_sigma(task, eps, epochs, clipping)
    start = time.time()
    model = train(task, PrivacyEngine(accountant="rc_prv"), lr=LR_DEFAULT, noise_multiplier=sigma, epochs=epochs,
                  clipping=clipping, seed=1000 * seed + 500_000)
    rows.append(dict(arm="default", epsilon=eps, seed=seed, reported_epsilon=eps, true_epsilon=runs_epsilon(
        task, sigma, 1, epochs, clipping), test_accuracy=accuracy(model, task.x_test, task.y_test),
        learning_rate=LR_DEFAULT, trials_run=1, noise_multiplier=sigma, seconds=round(time.time() - start, 1)))
    tick()
    start = time.time()
    best, tests = None, []
    for i, lr in enumerate(LR_GRID):
        model = train(task, PrivacyEngine(accountant="rc_prv"), lr=lr, noise_multiplier=sigma, epochs=epochs,
                      clipping=clipping, seed=1000 * seed + 600_000 + i)
        score = accuracy(model, task.x_val, task.y_val)
        tests.append(accuracy(model, task.x_test, task.y_test))
        if best is None or score > best[0]:
            best = (score, lr, model)
    rows.append(dict(arm="blind", epsilon=eps, seed=seed, reported_epsilon=eps, true_epsilon=rows[-1]["true_epsilon"],
                     test_accuracy=statistics.mean(tests), grid_test_accuracies=tests, learning_rate=None,
                     trials_run=1, noise_multiplier=sigma, seconds=0.0))
    tick()
    rows.append(dict(arm="grid", epsilon=eps, seed=seed, reported_epsilon=eps,
                     true_epsilon=runs_epsilon(task, sigma, len(LR_GRID), epochs, clipping),
                     test_accuracy=accuracy(best[2], task.x_test, task.y_test), learning_rate=best[1],
                     trials_run=len(LR_GRID), noise_multiplier=sigma, seconds=round(time.time() - start, 1)))
    tick()
    return rows


def summarize(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per (epsilon, arm): test accuracy mean and sample std over seeds, the epsilons, the mean
    number of trials run."""
    out = []
    for eps in sorted({r["epsilon"] for r in rows}):
        for arm in ARMS:
            group = [r for r in rows if r["epsilon"] == eps and r["arm"] == arm]
            if not group:
                continue
            accs = [r["test_accuracy"] for r in group if r["test_accuracy"] is not None]
            out.append(dict(
                epsilon=eps, arm=arm, seeds=len(group), mean=statistics.mean(accs) if accs else None,
                std=statistics.stdev(accs) if len(accs) > 1 else 0.0,
                reported_epsilon=max(r["reported_epsilon"] for r in group),
                true_epsilon=max(r["true_epsilon"] for r in group),
                trials=statistics.mean(r["trials_run"] for r in group),
            ))
    return out


def markdown(summary: List[Dict[str, Any]], majority: float) -> str:
    names = {"search": "private search (Poisson, mean 5)", "default": "one run, default lr 5.5",
             "blind": "one run, lr chosen blind (mean over the grid)", "grid": "best of a 5-value grid, unaccounted"}
    lines = ["| target ε | arm | test accuracy (mean ± std) | ε reported | true ε | runs (mean) |",
             "|---|---|---|---|---|---|"]
    for r in summary:
        lines.append(f"| {r['epsilon']:g} | {names[r['arm']]} | {r['mean']:.4f} ± {r['std']:.4f} | "
                     f"{r['reported_epsilon']:.2f} | {r['true_epsilon']:.2f} | {r['trials']:.1f} |")
    lines.append(f"\nMajority class: {majority:.4f}.")
    return "\n".join(lines)


def accounting_figures() -> Dict[str, Any]:
    """The figures of ``--accounting`` (module docstring)."""
    import itertools
    import math

    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    from opacus_rc.accounting import RCPRVAccountant
    from opacus_rc.accounting.records import StepRecord
    from opacus_rc.accounting.search import TrialCount, TrialMechanism, search_epsilon

    def reference(sigma: float, q: float, steps: int, mean: float, shape: float) -> float:
        event = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
        acc = rdp.RdpAccountant()
        acc.compose(dp_accounting.dp_event.RepeatAndSelectDpEvent(event, mean, shape))
        return acc.get_epsilon(DELTA)

    names = {0.0: "logarithmic", 1.0: "geometric", math.inf: "poisson"}

    def count(shape: float, mean: float) -> TrialCount:
        return TrialCount(names[shape], mean) if shape in names else TrialCount("negative_binomial", mean, shape)

    rows, gap = [], 0.0
    for shape in (0.0, 0.5, 1.0, math.inf):
        c = count(shape, 5)
        ours = search_epsilon([TrialMechanism(1.0, 0.01, 1000)], c, DELTA).epsilon
        rows.append(dict(distribution=c.distribution, shape=shape, ours=ours, dp_accounting=reference(1.0, 0.01, 1000, 5, shape)))
    for (sigma, q, steps), shape, mean in itertools.product(
            [(1.0, 0.01, 1000), (0.8, 0.005, 3000), (2.0, 0.1, 100), (1.2, 0.02, 250)], (0.0, 0.5, 1.0, math.inf),
            (1, 2, 5, 10, 20)):
        c = count(shape, mean)
        ref = reference(sigma, q, steps, mean, shape)
        gap = max(gap, abs(search_epsilon([TrialMechanism(sigma, q, steps)], c, DELTA).epsilon - ref) / ref)
    one = search_epsilon([TrialMechanism(1.0, 0.01, 1000)], TrialCount("poisson", 5), DELTA)
    randomized = []
    for sketching in ("per_example", "shared"):
        record = StepRecord("hutchinson", 32, sketching)
        found = search_epsilon([TrialMechanism(1.0, 0.01, 1000, record)], TrialCount("poisson", 5), DELTA)
        acc = RCPRVAccountant()
        acc.history = [(1.0, 0.01, 1000, record)]
        randomized.append(dict(sketching=sketching, search=found.epsilon, trial_rdp=found.trial_epsilon,
                               trial_prv=float(acc.get_epsilon(DELTA))))
    return dict(one_run=one.trial_epsilon, searches=rows, largest_relative_gap=gap, randomized=randomized)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--full", action="store_true", help="epsilon 3 and 8, seeds 0, 1, 2")
    p.add_argument("--epsilons", default=None, help="comma-separated targets (default 8; --full: 3,8)")
    p.add_argument("--seeds", type=int, default=None, help="seeds 0..n-1 (default 1; --full: 3)")
    p.add_argument("--epochs", type=int, default=4, help="epochs a run")
    p.add_argument("--clipping", default="randomized", choices=("randomized", "flat"))
    p.add_argument("--json", default=None, help="write the rows and the table (--full: docs/results/private_search.json)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--accounting", action="store_true", help="print the accounting figures only")
    args = p.parse_args(argv)
    if args.accounting:
        figures = accounting_figures()
        print(f"sigma 1, q 0.01, 1,000 steps, delta {DELTA:g}: one run {figures['one_run']:.4f} (RDP)")
        for r in figures["searches"]:
            print(f"  search, {r['distribution']} (shape {r['shape']:g}), mean 5: {r['ours']:.6f} "
                  f"(dp_accounting {r['dp_accounting']:.6f})")
        print(f"largest relative gap to dp_accounting over the grid: {figures['largest_relative_gap']:.1e}")
        for r in figures["randomized"]:
            print(f"  randomized clipping, k 32, {r['sketching']} sketch: search {r['search']:.4f}; one trial "
                  f"{r['trial_rdp']:.4f} (RDP) / {r['trial_prv']:.4f} (rc_prv)")
        return figures
    eps_list = [float(e) for e in (args.epsilons or ("3,8" if args.full else "8")).split(",")]
    seeds = range(args.seeds or (3 if args.full else 1))
    json_path = args.json or (str(ROOT / "docs" / "results" / "private_search.json") if args.full else None)
    one_thread_unless_set()
    from tqdm import tqdm

    task = sms_task()
    bar = tqdm(total=len(eps_list) * len(seeds) * len(ARMS), unit="arm", file=sys.stderr, disable=args.no_progress)
    rows = []
    start = time.time()
    for eps in eps_list:
        for seed in seeds:
            rows += run_arms(task, eps, seed, args.epochs, args.clipping, lambda: bar.update(1))
    bar.close()
    summary = summarize(rows)
    majority = max(task.y_test.float().mean().item(), 1 - task.y_test.float().mean().item())
    table = markdown(summary, majority)
    print(table)
    record = dict(rows=rows, summary=summary, table=table, majority_accuracy=majority, epochs=args.epochs,
                  clipping=args.clipping, mean_trials=MEAN_TRIALS, delta=DELTA, seconds=round(time.time() - start, 1),
                  machine=platform.platform(), command=" ".join(["python -m benchmarks.private_search", *(argv or sys.argv[1:])]))
    if json_path:
        pathlib.Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(json_path).write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main()
