"""Book-keeping step time of two revisions of ``opacus_rc``, side by side in one run.

``python -m benchmarks.revisions --old e8eb7d9 [--new WORKTREE] [--issue-size] [--json PATH]``

Each revision's ``opacus_rc/`` is copied into a temporary folder (``git archive REV
opacus_rc``; ``WORKTREE``: a copy of the work tree's package, taken at the start). One
worker process per revision imports *that* package (its folder is the worker's working
directory and first on ``PYTHONPATH``; the worker checks ``opacus_rc.__file__``) and *this*
checkout's :mod:`benchmarks.steps` and :mod:`examples`, so both run the same timing code:
a :class:`~examples.models.TinyDecoder` (2 blocks, vocabulary 512) trained non-privately
and with ``make_private(..., clipping="randomized", grad_sample_mode="bookkeeping")``
(Hutchinson, k = 32; :func:`benchmarks.steps.make_trainer`'s ``randomized_bk``).

The workers stay up for the whole run and take turns: each round, one worker times one
step of each configuration (their order rotated every round), then the other; which
revision goes first alternates every round, so load on a shared machine hits both alike
and only one worker computes at a time. Each step is timed on two clocks: the worker's CPU
time (``time.process_time``: with one thread, the figure to trust on a shared machine, as
it leaves out the time the worker waited for a core) and wall time. After ``--warmup``
discarded rounds, per revision and clock:
the median step time of the non-private and book-keeping steps, the ratio of the medians
(the headline), of the minima (the least disturbed steps) and the median (and quartiles) of
the per-round ratios; then new against old: the ratio
of the two revisions' ratios, with a 95% bootstrap interval over the rounds.

Sizes: the default, T = 1024, d = 256, batch 1 (a few minutes on 2 cores); ``--issue-size``:
T = 2048, d = 512, batch 1, the book-keeping target shape of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import logging
import os
import pathlib
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import IO, Dict, Iterator, List, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]  # this checkout: benchmarks/ and examples/
WORKTREE = "WORKTREE"
CONFIGS = ("nonprivate", "randomized_bk")
#: CPU time of the worker process (``time.process_time``; not counting time the process
#: waited for a core, the bulk of the noise on a shared machine) and wall time.
CLOCKS = ("cpu", "wall")
DEFAULT_SHAPE = "1024:256:1"
ISSUE_SHAPE = "2048:512:1"

logger = logging.getLogger("benchmarks.revisions")


# ---------------------------------------------------------------------------- worker side


def worker(shape_spec: str, threads: int, sketch_size: int) -> None:
    """Worker loop (run under a revision's ``opacus_rc``): build both trainers, warm them
    up, answer ``ready``; then per ``step`` line on stdin, time one step of each
    configuration and answer with a JSON line; stop at ``quit`` or end of input."""
    import torch

    from benchmarks.steps import StepShape, build_model, make_tokens, make_trainer

    answer = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # nothing else may write to the protocol stream
    sys.stdout = sys.stderr
    warnings.filterwarnings("ignore", message="Secure RNG turned off")
    warnings.filterwarnings("ignore", message=".*backward hook.*")
    torch.set_num_threads(threads)
    import opacus_rc

    shape = StepShape.parse(shape_spec)
    tokens = make_tokens(shape)
    base = build_model(shape)
    trainers = [make_trainer(c, copy.deepcopy(base), tokens, sketch_size=sketch_size) for c in CONFIGS]
    for trainer in trainers:
        trainer.step(tokens)  # lazy initialisation, first-call overheads
    answer.write(json.dumps({"ready": True, "opacus_rc": opacus_rc.__file__, "torch": torch.__version__}) + "\n")
    round_number = 0
    while sys.stdin.readline().strip() == "step":
        times: Dict[str, Dict[str, float]] = {clock: {} for clock in CLOCKS}
        for j in range(len(trainers)):
            trainer = trainers[(round_number + j) % len(trainers)]
            gc.collect()
            cpu = time.process_time()
            times["wall"][trainer.name] = trainer.step(tokens)["total"]
            times["cpu"][trainer.name] = time.process_time() - cpu
        answer.write(json.dumps({"times": times}) + "\n")
        round_number += 1


# ---------------------------------------------------------------------------- parent side


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def export_package(revision: str, into: pathlib.Path) -> str:
    """Put ``revision``'s ``opacus_rc/`` (``WORKTREE``: the work tree's) under ``into``;
    returns the revision's label (short commit, or ``WORKTREE`` plus HEAD's and a dirty mark)."""
    into.mkdir(parents=True)
    if revision == WORKTREE:
        shutil.copytree(ROOT / "opacus_rc", into / "opacus_rc", ignore=shutil.ignore_patterns("__pycache__"))
        dirty = " (modified)" if _git("status", "--porcelain", "--", "opacus_rc") else ""
        return f"{WORKTREE} at {_git('rev-parse', '--short', 'HEAD')}{dirty}"
    commit = _git("rev-parse", "--verify", f"{revision}^{{commit}}")
    archive = subprocess.run(["git", "archive", commit, "opacus_rc"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return commit[:7]


@dataclass
class Worker:
    """A running worker process for one revision, and the step times it has reported."""

    name: str
    revision: str
    label: str
    folder: pathlib.Path
    process: subprocess.Popen
    log: IO[str]
    info: dict = field(default_factory=dict)
    rounds: List[Dict[str, Dict[str, float]]] = field(default_factory=list)

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            self.log.flush()
            tail = pathlib.Path(self.log.name).read_text().strip().splitlines()[-15:]
            raise RuntimeError(f"worker {self.name} ({self.label}) stopped:\n" + "\n".join(tail))
        return json.loads(line)

    def wait_ready(self) -> None:
        """Wait for the worker's set-up; check that it imported its own ``opacus_rc``."""
        self.info = self._read()
        loaded = pathlib.Path(self.info["opacus_rc"]).resolve()
        if not loaded.is_relative_to(self.folder.resolve()):
            raise RuntimeError(f"worker {self.name} imported {loaded}, not the package under {self.folder}")

    def step(self) -> Dict[str, Dict[str, float]]:
        """One round: one timed step of each configuration (clock -> config -> seconds)."""
        self.process.stdin.write("step\n")
        self.process.stdin.flush()
        return self._read()["times"]

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.process.stdin.write("quit\n")
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def start_worker(name: str, revision: str, scratch: pathlib.Path, args: argparse.Namespace) -> Worker:
    """Export ``revision``'s package and start its worker (without waiting for it)."""
    folder = scratch / name
    label = export_package(revision, folder)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), str(ROOT)]))
    env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    log = open(scratch / f"{name}.log", "w")
    cmd = [sys.executable, "-m", "benchmarks.revisions", "--worker", "--shape", args.shape,
           "--threads", str(args.threads), "--sketch-size", str(args.sketch_size)]
    # cwd = the exported package's folder: ``python -m`` puts it first on sys.path
    process = subprocess.Popen(cmd, cwd=folder, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=log, text=True)
    logger.info("worker %s: %s in %s (pid %d)", name, label, folder, process.pid)
    return Worker(name, revision, label, folder, process, log)


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


def quartiles(values: Sequence[float]) -> List[float]:
    """Lower quartile, median, upper quartile (medians of the halves)."""
    ordered = sorted(values)
    half = len(ordered) // 2
    return [median(ordered[:max(half, 1)]), median(ordered), median(ordered[-max(half, 1):])]


def summarise(rounds: Sequence[Dict[str, Dict[str, float]]], clock: str) -> dict:
    """Medians of the step times on ``clock``, the ratio of the medians and the quartiles
    of the per-round ratios."""
    private, plain = ([r[clock][c] for r in rounds] for c in ("randomized_bk", "nonprivate"))
    per_round = [p / n for p, n in zip(private, plain)]
    return {
        "nonprivate_s": median(plain),
        "bookkeeping_s": median(private),
        "ratio": median(private) / median(plain),
        "ratio_of_minima": min(private) / min(plain),
        "ratio_per_round_quartiles": quartiles(per_round),
    }


def bootstrap_interval(old: Sequence[dict], new: Sequence[dict], clock: str,
                       resamples: int = 2000, seed: int = 0) -> List[float]:
    """95% bootstrap interval of new's book-keeping ratio (of medians) over old's, resampling
    the rounds (the same rounds for both revisions: they ran side by side)."""
    rng = random.Random(seed)
    n = len(old)
    estimates = []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        estimates.append(summarise([new[i] for i in picks], clock)["ratio"]
                         / summarise([old[i] for i in picks], clock)["ratio"])
    estimates.sort()
    return [estimates[int(0.025 * resamples)], estimates[int(0.975 * resamples) - 1]]


def run(args: argparse.Namespace) -> dict:
    """Start both workers, alternate the rounds, return the JSON record."""
    started = time.time()
    record: dict = {"meta": {
        "command": "python -m benchmarks.revisions " + " ".join(sys.argv[1:]),
        "shape": args.shape, "threads": args.threads, "sketch_size": args.sketch_size,
        "rounds": args.rounds, "warmup": args.warmup, "python": platform.python_version(),
        "machine": platform.machine(), "load_average_start": os.getloadavg(),
    }}
    with tempfile.TemporaryDirectory(prefix="revisions-") as scratch_dir:
        scratch = pathlib.Path(scratch_dir)
        workers = []
        try:
            for name, revision in (("old", args.old), ("new", args.new)):
                workers.append(start_worker(name, revision, scratch, args))
            for w in workers:
                w.wait_ready()
            total = args.warmup + args.rounds
            for r in _progress(range(total), args.no_progress):
                for w in (workers if r % 2 == 0 else workers[::-1]):
                    times = w.step()
                    if r >= args.warmup:
                        w.rounds.append(times)
        finally:
            for w in workers:
                w.stop()
    record["meta"]["load_average_end"] = os.getloadavg()
    record["meta"]["torch"] = workers[0].info.get("torch")
    record["meta"]["duration_s"] = time.time() - started
    for w in workers:
        record[w.name] = {"revision": w.revision, "label": w.label, "opacus_rc": w.info["opacus_rc"],
                          "rounds": w.rounds, **{clock: summarise(w.rounds, clock) for clock in CLOCKS}}
    record["new_over_old"] = {clock: compare(record["old"], record["new"], clock) for clock in CLOCKS}
    return record


def compare(old: dict, new: dict, clock: str) -> dict:
    """New against old on ``clock``: the ratio of their book-keeping ratios (with its 95%
    bootstrap interval and the quartiles of the per-round figure) and of their step times."""
    o, n = old[clock], new[clock]
    per_round = [
        (b[clock]["randomized_bk"] / b[clock]["nonprivate"]) / (a[clock]["randomized_bk"] / a[clock]["nonprivate"])
        for a, b in zip(old["rounds"], new["rounds"])
    ]
    return {
        "ratio": n["ratio"] / o["ratio"],
        "ratio_of_minima": n["ratio_of_minima"] / o["ratio_of_minima"],
        "ratio_bootstrap_95": bootstrap_interval(old["rounds"], new["rounds"], clock),
        "ratio_per_round_quartiles": quartiles(per_round),
        "bookkeeping_s": n["bookkeeping_s"] / o["bookkeeping_s"],
        "nonprivate_s": n["nonprivate_s"] / o["nonprivate_s"],
    }


def _progress(items: range, disabled: bool) -> Iterator[int]:
    if disabled:
        return iter(items)
    from tqdm import tqdm

    return iter(tqdm(items, desc="rounds (old and new)", unit="round", file=sys.stderr, dynamic_ncols=True))


def report(record: dict) -> str:
    """The run as a Markdown table."""
    meta = record["meta"]
    lines = [
        f"Book-keeping against non-private, {meta['shape']} (T:d:batch), {meta['rounds']} alternating rounds "
        f"({meta['warmup']} warm-up), {meta['threads']} thread(s), load average "
        f"{meta['load_average_start'][0]:.1f} -> {meta['load_average_end'][0]:.1f}, {meta['duration_s']:.0f} s",
        "",
        "| clock | revision | non-private step | book-keeping step | ratio of medians | ratio of minima "
        "| per-round ratio (quartiles) |",
        "|---|---|---|---|---|---|---|",
    ]
    for clock in CLOCKS:
        for name in ("old", "new"):
            r = record[name][clock]
            q = r["ratio_per_round_quartiles"]
            lines.append(f"| {clock} | {name}: {record[name]['label']} | {r['nonprivate_s']:.3f} s | "
                         f"{r['bookkeeping_s']:.3f} s | {r['ratio']:.3f}x | {r['ratio_of_minima']:.3f}x | "
                         f"{q[1]:.3f}x ({q[0]:.3f}-{q[2]:.3f}) |")
    lines.append("")
    for clock in CLOCKS:
        c = record["new_over_old"][clock]
        q, ci = c["ratio_per_round_quartiles"], c["ratio_bootstrap_95"]
        lines.append(
            f"new / old ({clock}): book-keeping ratio {c['ratio']:.3f} (95% bootstrap {ci[0]:.3f}-{ci[1]:.3f}; "
            f"per round {q[1]:.3f}, quartiles {q[0]:.3f}-{q[2]:.3f}; of minima {c['ratio_of_minima']:.3f}); book-keeping step {c['bookkeeping_s']:.3f}; "
            f"non-private step {c['nonprivate_s']:.3f}"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.revisions", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", help="git revision of the baseline (required unless --worker)")
    p.add_argument("--new", default=WORKTREE, help=f"git revision to compare, or {WORKTREE} (default)")
    p.add_argument("--issue-size", action="store_true", help=f"shape {ISSUE_SHAPE} (T = 2048) instead of {DEFAULT_SHAPE}")
    p.add_argument("--shape", help=f"[llama:]T:d:batch (default {DEFAULT_SHAPE}; {ISSUE_SHAPE} with --issue-size)")
    p.add_argument("--rounds", type=int, help="timed rounds (default 61; 31 with --issue-size)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1: steadier on a shared machine)")
    p.add_argument("--sketch-size", type=int, default=32)
    p.add_argument("--json", metavar="PATH", help="write the record (with every round's times) as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.shape is None:
        args.shape = ISSUE_SHAPE if args.issue_size else DEFAULT_SHAPE
    if args.rounds is None:
        args.rounds = 31 if args.issue_size else 61
    if args.rounds <= 0 or args.warmup < 0:
        p.error("--rounds must be positive and --warmup non-negative")
    if not args.worker and not args.old:
        p.error("--old REV is required")
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args.shape, args.threads, args.sketch_size)
        return
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    record = run(args)
    sys.stdout.write(report(record))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
