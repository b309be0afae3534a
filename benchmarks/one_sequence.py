"""One sequence per step, long context: the per-example form against the sketched forms.

    python -m benchmarks.one_sequence                       # quick: main table at T = 512, 2048
    python -m benchmarks.one_sequence --seq-lens 256 --no-progress      # a smoke run
    python -m benchmarks.one_sequence --crossover           # also the quick crossover grid (B = 1, 4; T = 256, 1024)
    python -m benchmarks.one_sequence --crossover --skip-main --batches 8 --max-t-b8 0 --reps 5   # one B only
    python -m benchmarks.one_sequence --full --json docs/results/one_sequence.json \\
        --markdown docs/results/one_sequence.md --plot docs/one_sequence_crossover.png

Model: Hugging Face ``LlamaForCausalLM`` built from a config (random weights, nothing
downloaded): hidden 256, 4 layers, 4 heads, intermediate 688, vocabulary 512, float32,
non-reentrant activation checkpointing (``gradient_checkpointing_enable(
gradient_checkpointing_kwargs={"use_reentrant": False})``, one checkpoint per decoder
layer), ``use_cache=False``, next-token cross-entropy, SGD. Random tokens (seeded).

**Main table** (one example per step, batch 1), configurations (:data:`CONFIGS`):

* ``nonprivate``: plain forward, backward, SGD step (the reference, 1.00x);
* ``exact_loop``: a hand-written DP-SGD step for batch 1 (backward, total norm of all
  ``.grad``, clip factor ``min(1, C / norm)``, Gaussian noise ``sigma C``, divide by 1, SGD);
* ``per_example``: ``make_private(clipping="randomized", per_example_backward=True)``;
* ``plugin_default``: ``make_private(clipping="randomized")`` with a loader of
  ``batch_size=1`` and no form option (asserted to pick the per-example form);
* ``bookkeeping``: ``grad_sample_mode="bookkeeping", per_example_backward=False``;
* ``two_pass``: ``grad_sample_mode="ghost", per_example_backward=False`` (the returned
  criterion, reduced per sequence);
* ``opacus_ghost``: Opacus's flat ghost clipping (``accountant="prv"``).

Time: for each T every configuration is built once in this process, takes one warm-up
step, then ``--reps`` steps interleaved (the order rotated every repetition); the median,
as a ratio to ``nonprivate``. Memory: peak-RSS growth over 2 steps (peak RSS during them
minus the RSS before them, ``/proc/self/clear_refs`` + ``VmHWM``), each configuration in a
fresh subprocess (this script's hidden ``--rss CONFIG T`` mode), as a ratio to
``nonprivate``'s growth.

**Crossover** (``--crossover``; also run by ``--full``): one logical batch of B examples:
``per_example`` (B single-example backward passes, one step) against ``bookkeeping`` and
``two_pass`` (one physical batch of B), on the same checkpointed model; per (B, T) the time
ratio of each to ``per_example``, and per B the smallest T where a sketched form is faster.
``--full`` caps B = 8 at T = 2048 (``--max-t-b8 0`` lifts the cap: about 6 more minutes on
two shared cores).

Hyper-parameters: noise_multiplier 1.0, max_grad_norm 1.0, poisson_sampling=False. Wall
times are measurements on a possibly shared machine, not assertions.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .rss import _status_kib, reset_peak_rss

logger = logging.getLogger("benchmarks.one_sequence")

CONFIGS = ("nonprivate", "exact_loop", "per_example", "plugin_default", "bookkeeping", "two_pass", "opacus_ghost")
BASELINE = "nonprivate"
CROSSOVER_CONFIGS = ("per_example", "bookkeeping", "two_pass")
SKETCHED = ("bookkeeping", "two_pass")
QUICK_SEQ_LENS = (512, 2048)
FULL_SEQ_LENS = (2048, 4096, 8192)
QUICK_GRID = ((1, 4), (256, 1024))
FULL_GRID = ((1, 2, 4, 8), (256, 512, 1024, 2048, 4096))
#: --full's cap on the crossover T for B = 8 (the full run took 27 min on 2 shared cores with it;
#: B = 8 at T = 4096 adds about 6 min at 3 repetitions)
FULL_MAX_T_B8 = 2048
SIGMA, CLIP, LR = 1.0, 1.0, 1e-3
MiB = 2**20
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class ModelSize:
    """The Llama configuration of every run."""

    hidden: int = 256
    layers: int = 4
    heads: int = 4
    intermediate: int = 688
    vocab: int = 512


SIZE = ModelSize()


# ------------------------------------------------------------------------------------------
# model and data
# ------------------------------------------------------------------------------------------
class CausalLM(nn.Module):
    """``LlamaForCausalLM`` as ``forward(tokens) -> logits`` (position ids with the batch
    dimension, so that every forward input is per example)."""

    def __init__(self, size: ModelSize, max_len: int) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
            num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.heads,
            max_position_embeddings=max_len, tie_word_embeddings=False, attn_implementation="sdpa",
            use_cache=False,
        )
        self.lm = LlamaForCausalLM(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device).repeat(tokens.shape[0], 1)
        return self.lm(input_ids=tokens, position_ids=positions, use_cache=False).logits


def build_model(seq_len: int, seed: int = 0) -> CausalLM:
    """The seeded model, non-reentrant checkpointing on, in train mode."""
    torch.manual_seed(seed)
    model = CausalLM(SIZE, max_len=seq_len)
    model.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def make_tokens(batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """(batch, T + 1) random token ids."""
    return torch.randint(0, SIZE.vocab, (batch, seq_len + 1), generator=torch.Generator().manual_seed(seed))


def _split(tokens: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    # contiguous: Opacus's ghost embedding norm sampler views the token ids
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def plain_loss(module: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    inputs, targets = _split(tokens)
    logits = module(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def per_sequence_loss(module: nn.Module, criterion: Any, tokens: torch.Tensor) -> Any:
    """A ghost script's loss: the criterion reduces token losses per sequence (as
    :func:`benchmarks.steps._per_sequence_loss`)."""
    inputs, targets = _split(tokens)
    logits = module(inputs)
    return criterion(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), shape=logits.shape[:2])


# ------------------------------------------------------------------------------------------
# configurations
# ------------------------------------------------------------------------------------------
Step = Callable[[torch.Tensor], None]


def nonprivate_step(model: nn.Module) -> Step:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def step(tokens: torch.Tensor) -> None:
        plain_loss(model, tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def exact_loop_step(model: nn.Module) -> Step:
    """DP-SGD written by hand for a batch of one: exact clipping is one norm over p.grad."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    params = [p for p in model.parameters() if p.requires_grad]

    def step(tokens: torch.Tensor) -> None:
        assert tokens.shape[0] == 1, "the hand loop clips one example per step"
        plain_loss(model, tokens).backward()
        grads = [p.grad for p in params]
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        factor = (CLIP / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(factor).add_(torch.randn_like(g), alpha=SIGMA * CLIP).div_(tokens.shape[0])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _make_private(model: nn.Module, batch: int, seq_len: int, *, accountant: str = "rc_prv",
                  **options: Any) -> Tuple:
    from opacus import PrivacyEngine

    import opacus_rc  # noqa: F401  registers clipping="randomized" and accountant="rc_prv"

    rows = make_tokens(max(4, 2 * batch), seq_len, seed=1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(rows), batch_size=batch)
    engine = PrivacyEngine(accountant=accountant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), data_loader=loader,
            noise_multiplier=SIGMA, max_grad_norm=CLIP, poisson_sampling=False, **options,
        )


def per_example_step(model: nn.Module, batch: int, seq_len: int, *, automatic: bool = False) -> Step:
    """The per-example form: one backward pass per example, one step per logical batch."""
    options = {} if automatic else {"per_example_backward": True}
    module, optimizer, _ = _make_private(model, batch, seq_len, clipping="randomized", **options)
    if automatic:
        assert type(optimizer).__name__ == "PerExampleOptimizer", type(optimizer).__name__

    def step(tokens: torch.Tensor) -> None:
        n = tokens.shape[0]
        for i in range(n):
            plain_loss(module, tokens[i:i + 1]).backward()
            if i < n - 1:
                optimizer.signal_skip_step(do_skip=True, same_draw=True)
            optimizer.step()
            optimizer.zero_grad()

    return step


def bookkeeping_step(model: nn.Module, batch: int, seq_len: int) -> Step:
    module, optimizer, _ = _make_private(model, batch, seq_len, clipping="randomized",
                                         grad_sample_mode="bookkeeping", per_example_backward=False)

    def step(tokens: torch.Tensor) -> None:
        plain_loss(module, tokens).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def ghost_script_step(model: nn.Module, batch: int, seq_len: int, *, opacus: bool = False) -> Step:
    """A ghost script (4-tuple, per-sequence criterion): the randomized two-pass form, or
    Opacus's flat ghost clipping (``opacus=True``)."""
    options = ({"accountant": "prv", "clipping": "flat"} if opacus
               else {"clipping": "randomized", "per_example_backward": False})
    module, optimizer, criterion, _ = _make_private(model, batch, seq_len, grad_sample_mode="ghost",
                                                    criterion=nn.CrossEntropyLoss(), **options)

    def step(tokens: torch.Tensor) -> None:
        per_sequence_loss(module, criterion, tokens).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def build_step(config: str, seq_len: int, batch: int = 1) -> Step:
    """A fresh seeded model trained by ``config``; ``batch``: the logical batch size."""
    model = build_model(seq_len)
    if config == "nonprivate":
        return nonprivate_step(model)
    if config == "exact_loop":
        return exact_loop_step(model)
    if config in ("per_example", "plugin_default"):
        return per_example_step(model, batch, seq_len, automatic=config == "plugin_default")
    if config == "bookkeeping":
        return bookkeeping_step(model, batch, seq_len)
    if config in ("two_pass", "opacus_ghost"):
        return ghost_script_step(model, batch, seq_len, opacus=config == "opacus_ghost")
    raise ValueError(f"config={config!r} is not supported; accepted values: {CONFIGS}")


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


# ------------------------------------------------------------------------------------------
# time: interleaved, in this process
# ------------------------------------------------------------------------------------------
def interleaved_times(steps: Dict[str, Step], tokens: torch.Tensor, reps: int,
                      tick: Callable[[], None] = lambda: None) -> Tuple[Dict[str, List[float]], Dict[str, str]]:
    """One warm-up step each, then ``reps`` rounds with the order rotated every round.
    A configuration that raises is dropped, its error recorded."""
    errors: Dict[str, str] = {}
    for name in list(steps):
        try:
            steps[name](tokens)
        except Exception as e:  # recorded: e.g. a form that rejects the checkpointing
            logger.warning("%s failed at its warm-up step: %s", name, _error_text(e))
            errors[name] = _error_text(e)
            del steps[name]
        tick()
    names = list(steps)
    times: Dict[str, List[float]] = {c: [] for c in names}
    for rep in range(reps):
        for j in range(len(names)):
            c = names[(rep + j) % len(names)]
            gc.collect()
            t0 = time.perf_counter()
            steps[c](tokens)
            times[c].append(time.perf_counter() - t0)
            tick()
    return times, errors


def build_all(configs: Iterable[str], seq_len: int, batch: int) -> Tuple[Dict[str, Step], Dict[str, str]]:
    steps, errors = {}, {}
    for c in configs:
        try:
            steps[c] = build_step(c, seq_len, batch)
        except Exception as e:
            logger.warning("%s could not be built: %s", c, _error_text(e))
            errors[c] = _error_text(e)
    return steps, errors


def time_configs(configs: Sequence[str], seq_len: int, batch: int, reps: int,
                 tick: Callable[[], None]) -> List[Dict[str, Any]]:
    """Rows ``{config, seq_len, batch, time_s, times_s, error}`` for one (T, B)."""
    steps, errors = build_all(configs, seq_len, batch)
    times, step_errors = interleaved_times(steps, make_tokens(batch, seq_len), reps, tick)
    errors.update(step_errors)
    del steps
    gc.collect()
    return [{"config": c, "seq_len": seq_len, "batch": batch,
             "time_s": statistics.median(times[c]) if c in times else None,
             "time_min_s": min(times[c]) if c in times else None,
             "times_s": times.get(c, []), "error": errors.get(c)} for c in configs]


# ------------------------------------------------------------------------------------------
# memory: peak-RSS growth, a fresh process per configuration
# ------------------------------------------------------------------------------------------
def rss_worker(config: str, seq_len: int, steps: int = 2) -> Dict[str, Any]:
    """In this process: peak RSS during ``steps`` steps minus the RSS before them (bytes)."""
    try:
        step = build_step(config, seq_len)
        tokens = make_tokens(1, seq_len)
        gc.collect()
        baseline = _status_kib("VmRSS")
        reset_peak_rss()
        for _ in range(steps):
            step(tokens)
        peak = _status_kib("VmHWM")
    except Exception as e:
        return {"config": config, "seq_len": seq_len, "error": _error_text(e)}
    return {"config": config, "seq_len": seq_len, "baseline_rss": baseline * 1024, "peak_rss": peak * 1024,
            "growth": (peak - baseline) * 1024}


def rss_subprocess(config: str, seq_len: int, threads: int, timeout: float = 1800) -> Dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.one_sequence", "--rss", config, str(seq_len),
           "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return {"config": config, "seq_len": seq_len, "error": f"worker failed: {tail}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------
# the two measurements
# ------------------------------------------------------------------------------------------
def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", disable=not enabled, leave=False)


def main_table(seq_lens: Sequence[int], configs: Sequence[str], reps: int, threads: int,
               progress: bool) -> List[Dict[str, Any]]:
    """Time (interleaved) and peak-RSS growth (subprocesses) of every configuration per T."""
    rows = []
    for t in seq_lens:
        logger.info("main table, T=%d: timing %d configurations", t, len(configs))
        with _progress(len(configs) * (1 + reps), f"time T={t}", progress) as bar:
            timed = time_configs(configs, t, 1, reps, bar.update)
        with _progress(len(configs), f"memory T={t}", progress) as bar:
            for row in timed:
                mem = rss_subprocess(row["config"], t, threads)
                row["rss_growth_bytes"] = mem.get("growth")
                row["rss_error"] = mem.get("error")
                bar.update()
        rows += timed
    return with_ratios(rows, BASELINE, ("time_s", "time_min_s", "rss_growth_bytes"))


def with_ratios(rows: List[Dict[str, Any]], baseline: str, keys: Sequence[str]) -> List[Dict[str, Any]]:
    """Adds ``<key>_ratio``: the row's value over ``baseline``'s at the same (T, B)."""
    base = {(r["seq_len"], r["batch"]): r for r in rows if r["config"] == baseline}
    for r in rows:
        b = base.get((r["seq_len"], r["batch"]), {})
        for key in keys:
            ok = r.get(key) is not None and b.get(key)
            r[key.removesuffix("_s").removesuffix("_bytes") + "_ratio"] = r[key] / b[key] if ok else None
    return rows


def crossover_grid(grid: Dict[int, Sequence[int]], reps: int, progress: bool) -> List[Dict[str, Any]]:
    """Per (B, T): the time of one logical batch of B examples for each crossover form."""
    rows = []
    jobs = [(b, t) for b, ts in grid.items() for t in ts]
    with _progress(len(jobs) * len(CROSSOVER_CONFIGS) * (1 + reps), "crossover", progress) as bar:
        for b, t in jobs:
            logger.info("crossover B=%d T=%d", b, t)
            rows += time_configs(CROSSOVER_CONFIGS, t, b, reps, bar.update)
    return with_ratios(rows, "per_example", ("time_s", "time_min_s"))


def crossover_summary(rows: Sequence[Dict[str, Any]]) -> Dict[int, Dict[str, Any]]:
    """Per B: the cheapest form per T and the smallest T where a sketched form beats
    ``per_example`` (None: never on the grid)."""
    out: Dict[int, Dict[str, Any]] = {}
    for b in sorted({r["batch"] for r in rows}):
        cells = [r for r in rows if r["batch"] == b]
        cheapest = {}
        for t in sorted({r["seq_len"] for r in cells}):
            timed = [r for r in cells if r["seq_len"] == t and r["time_s"] is not None]
            cheapest[t] = min(timed, key=lambda r: r["time_s"])["config"] if timed else None
        first = next((t for t, c in cheapest.items() if c in SKETCHED), None)
        out[b] = {"cheapest": cheapest, "first_sketched_win_t": first}
    return out


# ------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------
def _cell(ratio: Optional[float], error: Optional[str]) -> str:
    return "n/a" if ratio is None or error else f"{ratio:.2f}x"


def markdown_main(rows: Sequence[Dict[str, Any]], configs: Sequence[str]) -> str:
    lines = ["One sequence per step (batch 1, float32, non-reentrant checkpointing); ratio to `nonprivate` "
             "(time: median step; time (min): fastest of the timed steps, the figure least hit by other "
             "load; memory: peak-RSS growth of 2 steps, fresh process):", "",
             "| T | | " + " | ".join(f"`{c}`" for c in configs) + " |",
             "|---|---|" + "---|" * len(configs)]
    by = {(r["seq_len"], r["config"]): r for r in rows}
    for t in sorted({r["seq_len"] for r in rows}):
        cells = [by.get((t, c), {}) for c in configs]
        for label, key in ((f"| {t:,} | time", "time_ratio"), ("| | time (min)", "time_min_ratio")):
            lines.append(f"{label} | " + " | ".join(_cell(r.get(key), r.get("error")) for r in cells) + " |")
        lines.append("| | memory | " + " | ".join(
            _cell(r.get("rss_growth_ratio"), r.get("error") or r.get("rss_error")) for r in cells) + " |")
    base = [r for r in rows if r["config"] == BASELINE and r.get("time_s")]
    if base:
        lines += ["", "`nonprivate` absolute: " + "; ".join(
            f"T={r['seq_len']:,}: {r['time_s']:.2f} s, {(r.get('rss_growth_bytes') or 0) / MiB:.0f} MiB growth"
            for r in base)]
    errors = {r["config"]: r.get("error") or r.get("rss_error") for r in rows if r.get("error") or r.get("rss_error")}
    lines += ["", *(f"* `{c}` n/a: {e}" for c, e in errors.items())] if errors else []
    return "\n".join(lines) + "\n"


def _two_cells(row: Dict[str, Any]) -> str:
    """``median (min)`` ratio cell."""
    median, fastest = _cell(row.get("time_ratio"), row.get("error")), _cell(row.get("time_min_ratio"), row.get("error"))
    return median if median == "n/a" else f"{median} ({fastest})"


def markdown_crossover(rows: Sequence[Dict[str, Any]]) -> str:
    summary = crossover_summary(rows)
    lines = ["Crossover: one logical batch of B examples; time ratio to `per_example` "
             "(B single-example backward passes, one step), median (fastest step):", "",
             "| B | T | `per_example` (s) | `bookkeeping` | `two_pass` | cheapest |", "|---|---|---|---|---|---|"]
    by = {(r["batch"], r["seq_len"], r["config"]): r for r in rows}
    for b, s in summary.items():
        for t, cheapest in s["cheapest"].items():
            pe = by.get((b, t, "per_example"), {})
            pe_time = f"{pe['time_s']:.2f}" if pe.get("time_s") else "n/a"
            sk = [_two_cells(by.get((b, t, c), {})) for c in SKETCHED]
            lines.append(f"| {b} | {t:,} | {pe_time} | {sk[0]} | {sk[1]} | `{cheapest}` |")
    firsts = [f"B={b}: " + ("never (on this grid)" if s["first_sketched_win_t"] is None
                            else f"T={s['first_sketched_win_t']:,}") for b, s in summary.items()]
    lines += ["", "Smallest T where a sketched form beats `per_example`: " + "; ".join(firsts) + "."]
    return "\n".join(lines) + "\n"


def plot_crossover(rows: Sequence[Dict[str, Any]], path: str) -> None:
    """Time ratio sketched / per_example against T, one line per (form, B), log x-axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    styles = {"bookkeeping": ("-", "o"), "two_pass": ("--", "s")}
    batches = sorted({r["batch"] for r in rows})
    for form in SKETCHED:
        for k, b in enumerate(batches):
            pts = sorted((r["seq_len"], r["time_ratio"]) for r in rows
                         if r["config"] == form and r["batch"] == b and r.get("time_ratio") is not None)
            if pts:
                ls, marker = styles[form]
                ax.plot(*zip(*pts), marker=marker, ls=ls, color=f"C{k}", label=f"{form}, B={b}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ts = sorted({r["seq_len"] for r in rows})
    ax.set_xticks(ts, [f"{t:,}" for t in ts])
    ax.set_xlabel("context length T")
    ax.set_ylabel("time of a logical batch / per_example's")
    ax.set_title(f"Sketched forms against the per-example form (Llama d={SIZE.hidden}, {SIZE.layers} layers, "
                 "checkpointed, CPU)", fontsize=9)
    ax.grid(True, which="both", lw=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


# ------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------
def _ints(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", default=None, help="comma-separated T of the main table (quick: 512,2048)")
    parser.add_argument("--full", action="store_true", help="T = 2048,4096,8192 and the full crossover grid")
    parser.add_argument("--crossover", action="store_true", help="also run the crossover grid")
    parser.add_argument("--skip-main", action="store_true",
                        help="skip the main table (with --crossover: the grid only)")
    parser.add_argument("--batches", default=None, help="crossover B (quick 1,4; full 1,2,4,8)")
    parser.add_argument("--crossover-seq-lens", default=None, help="crossover T (quick 256,1024; full 256..4096)")
    parser.add_argument("--max-t-b8", type=int, default=None,
                        help=f"largest crossover T for B=8, a time cap (--full: {FULL_MAX_T_B8}; 0: none)")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--rss", nargs=2, metavar=("CONFIG", "T"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        args.seq_lens = _ints(args.seq_lens) if args.seq_lens else list(FULL_SEQ_LENS if args.full else QUICK_SEQ_LENS)
        grid = FULL_GRID if args.full else QUICK_GRID
        args.batches = _ints(args.batches) if args.batches else list(grid[0])
        args.crossover_seq_lens = _ints(args.crossover_seq_lens) if args.crossover_seq_lens else list(grid[1])
    except ValueError:
        parser.error("--seq-lens, --batches and --crossover-seq-lens take comma-separated integers")
    args.configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad or BASELINE not in args.configs:
        parser.error(f"--configs: a subset of {','.join(CONFIGS)} including {BASELINE}; got {bad or args.configs}")
    if min(args.seq_lens + args.batches + args.crossover_seq_lens + [args.reps, args.threads]) < 1:
        parser.error("T, B, --reps and --threads must be positive")
    return args


def crossover_plan(args: argparse.Namespace) -> Dict[int, List[int]]:
    """The crossover grid: every (B, T), with B = 8 capped at ``--max-t-b8``."""
    cap = args.max_t_b8 if args.max_t_b8 is not None else (FULL_MAX_T_B8 if args.full else 0)
    return {b: [t for t in args.crossover_seq_lens if b != 8 or not cap or t <= cap] for b in args.batches}


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for name in ("transformers", "opacus_rc", "opacus"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    if args.rss:
        sys.stdout.write(json.dumps(rss_worker(args.rss[0], int(args.rss[1]))) + "\n")
        return
    started, load_start = time.perf_counter(), os.getloadavg()
    progress = not args.no_progress
    run_cross = args.full or args.crossover
    rows = [] if args.skip_main else main_table(args.seq_lens, args.configs, args.reps, args.threads, progress)
    cross = crossover_grid(crossover_plan(args), args.reps, progress) if run_cross else []
    text = (markdown_main(rows, args.configs) if rows else "") + ("\n" + markdown_crossover(cross) if cross else "")
    wall = time.perf_counter() - started
    logger.info("done in %.0f s", wall)
    print(text, end="")
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.plot and cross:
        plot_crossover(cross, args.plot)
    if args.json:
        record = {"command": "python -m benchmarks.one_sequence " + " ".join(sys.argv[1:] if argv is None else argv),
                  "torch": torch.__version__, "threads": args.threads, "cpu": cpu_model(), "wall_s": wall,
                  "model": {**SIZE.__dict__, "dtype": "float32",
                            "checkpointing": "HF, per decoder layer, non-reentrant"},
                  "load_average_start": load_start, "load_average_end": os.getloadavg(),
                  "sigma": SIGMA, "max_grad_norm": CLIP, "reps": args.reps, "main": rows, "crossover": cross,
                  "crossover_summary": {str(b): s for b, s in crossover_summary(cross).items()} if cross else {}}
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
