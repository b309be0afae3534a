"""Peak-RSS growth of training steps, one configuration per fresh process.

``python -m benchmarks.rss CONFIG T:d:b [--steps N] [--threads N]`` builds the
model, batch and optimizer of :mod:`benchmarks.steps`, records the resident set
size (``VmRSS``), resets the kernel's peak-RSS mark (``/proc/self/clear_refs``), runs
``N`` steps and prints one JSON line ``{"baseline_rss", "peak_rss", "growth"}`` (bytes).
Growth = peak RSS during the steps - RSS before them: what training adds on top of the
model, data and imports. Linux only (``/proc``); a fresh process per configuration keeps
one configuration's allocator cache from hiding another's peak.
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import subprocess
import sys
from typing import Dict, Optional

import torch

from .steps import CONFIGS, StepShape, build_model, make_tokens, make_trainer

_STATUS = "/proc/self/status"


def _status_kib(field: str) -> int:
    with open(_STATUS) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in {_STATUS}")


def reset_peak_rss() -> None:
    """Reset the peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure_rss_growth(config: str, shape: StepShape, steps: int = 2) -> Dict[str, int]:
    """Peak-RSS growth (bytes) over ``steps`` training steps of ``config`` in this process."""
    tokens = make_tokens(shape)
    trainer = make_trainer(config, build_model(shape), tokens)
    gc.collect()
    baseline = _status_kib("VmRSS")
    reset_peak_rss()
    for _ in range(steps):
        trainer.step(tokens)
    peak = _status_kib("VmHWM")
    return {"baseline_rss": baseline * 1024, "peak_rss": peak * 1024, "growth": (peak - baseline) * 1024}


def rss_growth_subprocess(
    config: str, shape: StepShape, *, steps: int = 2, threads: int = 2, timeout: float = 600
) -> Optional[int]:
    """Run :func:`measure_rss_growth` in a fresh interpreter; None if it failed."""
    cmd = [
        sys.executable, "-m", "benchmarks.rss", config,
        shape.spec,
        "--steps", str(steps), "--threads", str(threads),
        "--layers", str(shape.n_layers), "--vocab", str(shape.vocab),
    ]
    root = pathlib.Path(__file__).resolve().parents[1]  # the repository root: benchmarks/ and examples/ import from it
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=root)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-3:]
        raise RuntimeError(f"RSS worker for {config} {shape.label} failed: {' | '.join(tail)}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["growth"]


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", choices=CONFIGS)
    parser.add_argument("shape", help="[decoder|llama:]T:d:batch, e.g. 2048:512:1")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = StepShape.parse(args.shape, n_layers=args.layers, vocab=args.vocab)
    sys.stdout.write(json.dumps(measure_rss_growth(args.config, shape, args.steps)) + "\n")


if __name__ == "__main__":
    main()
