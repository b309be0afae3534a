"""``python -m benchmarks``: cost of randomized clipping against Opacus.

Per layer (meta device: exact FLOPs and bytes at any size): FLOPs and peak extra memory
of the per-sample norm computation of one linear layer for Opacus ghost clipping, FGC,
Hutchinson and Hutch++ (k = 32) over T, plus the log-log slope of memory in T; the CPU
time of the same computations at moderate sizes.

Per step: a 2-block causal decoder and a 2-block Llama-style model (vocabulary 512)
trained non-privately, with Opacus hooks, Opacus ghost clipping and randomized clipping
(two-pass and book-keeping), side by side in one process (interleaved repetitions,
medians), reported as multiples of non-private training.

    python -m benchmarks                            # quick default (< 3 min on 2 loaded cores)
    python -m benchmarks --full --json docs/results/benchmarks_full.json --plot docs/benchmarks.png

Performance figures are measurements, not assertions: wall times on a shared machine
are noisy; FLOP counts and peak live bytes are the stable figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
import warnings
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from . import report
from .layers import layer_cases, measure_layer, memory_fits, time_layers
from .steps import ACCEPTED_CONFIGS, CONFIGS, StepShape, measure_steps, ratios

logger = logging.getLogger("benchmarks")


@dataclass(frozen=True)
class Preset:
    layer_shapes: str
    layer_seq_lens: str
    layer_time_shapes: str
    layer_time_seq_lens: str
    step_shapes: str
    reps: int
    rss: bool


QUICK = Preset(
    layer_shapes="1024x1024,2048x8192",
    layer_seq_lens="512,1024,2048,4096,8192,16384",
    layer_time_shapes="1024x1024",
    layer_time_seq_lens="512,1024,2048",
    step_shapes="512:128:1,1024:128:1,2048:128:1,llama:1024:128:1",
    reps=3,
    rss=False,
)
FULL = Preset(
    layer_shapes="1024x1024,2048x8192,8192x2048,4096x4096",
    layer_seq_lens="512,1024,2048,4096,8192,16384",
    layer_time_shapes="1024x1024",
    layer_time_seq_lens="512,1024,2048,4096",
    step_shapes=(
        "512:256:1,1024:256:1,2048:512:1,4096:256:2,512:768:8,"
        "llama:512:256:1,llama:1024:256:1,llama:2048:512:1,llama:4096:256:2,llama:512:768:8"
    ),
    reps=3,
    rss=True,
)


def _ints(text: str, name: str) -> List[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name}={text!r} is invalid; accepted: comma-separated integers") from None
    if any(v <= 0 for v in values):
        raise ValueError(f"{name}={text!r} is invalid: values must be positive")
    return values


def _layer_shapes(text: str, name: str) -> List[Tuple[int, int]]:
    shapes = []
    for item in (x for x in text.split(",") if x.strip()):
        try:
            d, p = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise ValueError(f"{name}: {item!r} is invalid; accepted format: DxP, e.g. 2048x8192") from None
        shapes.append((d, p))
    return shapes


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--full", action="store_true", help="full size (tens of minutes on 2 cores)")
    p.add_argument("--json", metavar="PATH", help="write all figures as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)")
    p.add_argument("--markdown", metavar="PATH", help="write the tables as Markdown")
    p.add_argument("--layer-shapes", help="DxP list for the per-layer figures, e.g. 1024x1024,2048x8192")
    p.add_argument("--layer-seq-lens", help="T list for the per-layer figures")
    p.add_argument("--layer-batch", type=int, default=1, help="batch size of the per-layer figures")
    p.add_argument("--layer-time-shapes", help="DxP list for per-layer CPU times ('' to skip)")
    p.add_argument("--layer-time-seq-lens", help="T list for per-layer CPU times ('' to skip)")
    p.add_argument("--step-shapes", help="[llama:]T:d:batch list for the per-step figures, e.g. "
                   "2048:512:1,llama:2048:512:1 ('' to skip)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"per-step configurations ({','.join(CONFIGS)})")
    p.add_argument("--reps", type=int, help="interleaved timed repetitions per configuration")
    p.add_argument("--sketch-size", type=int, default=32)
    p.add_argument("--rss", dest="rss", action="store_true", default=None,
                   help="also measure peak-RSS growth, one subprocess per configuration (default: --full only)")
    p.add_argument("--no-rss", dest="rss", action="store_false")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    preset = FULL if args.full else QUICK
    for field in ("layer_shapes", "layer_seq_lens", "layer_time_shapes", "layer_time_seq_lens", "step_shapes", "reps", "rss"):
        if getattr(args, field) is None:
            setattr(args, field, getattr(preset, field))
    if args.reps <= 0:
        p.error(f"--reps={args.reps} is invalid: must be positive")
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in ACCEPTED_CONFIGS]
    if bad or "nonprivate" not in configs:
        p.error(f"--configs={args.configs!r} is invalid; accepted: {','.join(ACCEPTED_CONFIGS)} (nonprivate required)")
    args.configs = configs
    try:
        args.layer_shapes = _layer_shapes(args.layer_shapes, "--layer-shapes")
        args.layer_seq_lens = _ints(args.layer_seq_lens, "--layer-seq-lens")
        args.layer_time_shapes = _layer_shapes(args.layer_time_shapes, "--layer-time-shapes")
        args.layer_time_seq_lens = _ints(args.layer_time_seq_lens, "--layer-time-seq-lens")
        args.step_shapes = [StepShape.parse(s) for s in args.step_shapes.split(",") if s.strip()]
    except ValueError as e:
        p.error(str(e))
    return args


class Progress:
    """A tqdm bar on stderr (or nothing); ``tick()`` advances it by one unit."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)

    def describe(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_description(text)

    def tick(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark described by ``args``; returns the JSON record."""
    torch.set_num_threads(args.threads)
    started = time.time()
    cases = layer_cases(args.layer_shapes, args.layer_seq_lens, batch=args.layer_batch, sketch_size=args.sketch_size)
    time_cases = layer_cases(args.layer_time_shapes, args.layer_time_seq_lens, batch=args.layer_batch, sketch_size=args.sketch_size)
    n_configs = len(args.configs)
    total = (
        len(cases) + len(time_cases) * (args.reps)
        + len(args.step_shapes) * n_configs * (1 + args.reps + (1 if args.rss else 0))
    )
    bar = Progress(total, not args.no_progress)
    record: dict = {
        "meta": {
            "command": "python -m benchmarks " + " ".join(sys.argv[1:]),
            "preset": "full" if args.full else "quick",
            "torch": torch.__version__, "threads": args.threads, "python": platform.python_version(),
            "machine": platform.machine(), "sketch_size": args.sketch_size, "reps": args.reps,
            "layer_batch": args.layer_batch,
        }
    }
    bar.describe("per-layer FLOPs/memory (meta)")
    layer_results = []
    for case in cases:
        layer_results.append(measure_layer(case))
        bar.tick()
    record["layers"] = [r.as_dict() for r in layer_results]
    record["layer_fits"] = memory_fits(layer_results)
    if time_cases:
        bar.describe("per-layer CPU time")
        medians = time_layers(time_cases, args.reps, tick=bar.tick)
        record["layer_times"] = [dict(vars(c), time_s=t) for c, t in zip(time_cases, medians)]
    step_results = []
    for shape in args.step_shapes:
        bar.describe(f"steps {shape.label}")
        results = measure_steps(shape, reps=args.reps, configs=args.configs, tick=bar.tick, sketch_size=args.sketch_size)
        if args.rss:
            from .rss import rss_growth_subprocess

            bar.describe(f"RSS {shape.label}")
            for r in results:
                r.rss_growth_bytes = rss_growth_subprocess(r.config, shape, steps=1, threads=args.threads)
                bar.tick()
        step_results += results
    bar.close()
    record["steps"] = [r.as_dict() for r in step_results]
    record["step_ratios"] = ratios(step_results)
    record["targets"] = report.check_targets(record)
    record["meta"]["duration_s"] = time.time() - started
    return record


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", message="Secure RNG turned off")
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    warnings.filterwarnings("ignore", message="Using a non-full backward hook")
    record = run(args)
    text = report.markdown(record)
    sys.stdout.write(text)
    sys.stdout.write(f"\n({record['meta']['duration_s']:.0f} s)\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    if args.plot:
        report.plot(record, args.plot)


if __name__ == "__main__":
    main()
