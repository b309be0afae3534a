"""Peak memory of one DP step with activation checkpointing, against the context length T.

    python -m benchmarks.checkpointing                 # small default: meta device, T = 1K, 2K, 4K (seconds)
    python -m benchmarks.checkpointing --full --json docs/results/checkpointing.json --plot docs/checkpointing.png
    python -m benchmarks.checkpointing --cpu-seq-lens 4096,8192 --cpu-only --json /tmp/checkpointing_cpu.json   # real CPU run

Model: a Llama-style ``LlamaForCausalLM`` (:class:`~examples.models.llama.LlamaLM`: RMSNorm,
rotary, SwiGLU, untied head; d = 256, 4 layers, 4 heads, vocabulary 512 by default), batch 1,
float32, SGD, next-token loss. Checkpointing is Hugging Face's, one checkpoint per decoder
layer, **reentrant** (``gradient_checkpointing_enable(gradient_checkpointing_kwargs=
{"use_reentrant": True})`` + ``enable_input_require_grads()``): it works in every randomized
mode and in Opacus ghost clipping (non-reentrant checkpointing is not measured here).

(``activation_checkpointing_enable(activation_checkpointing_kwargs=...)`` in transformers 5, the
same call under its new name.)

Configurations (:data:`CONFIGS`):

* ``nonprivate``: no checkpointing, plain training (the reference without checkpointing);
* ``nonprivate_ckpt``: checkpointing, plain training;
* ``ghost_ckpt``: checkpointing, Opacus ghost clipping (two backward passes);
* ``randomized_ckpt``: checkpointing, randomized clipping, two-pass form
  (``grad_sample_mode="ghost"``; Hutchinson, k = 32, per-example sketches);
* ``randomized_bk_ckpt``: checkpointing, randomized clipping by book-keeping
  (``grad_sample_mode="hooks"``, today's default: it keeps every linear layer's input and
  output gradient until ``optimizer.step()``, recomputed ones included).

Peak memory is the peak of live bytes allocated during one whole step (forward,
backward(s), optimizer step), counted operator by operator by
:class:`~examples.profiling.PeakAllocationCounter`; ``norm_peak_bytes`` is the largest single
per-layer norm computation of the step (:class:`~examples.profiling.NormSamplerMemory`). The
sweep runs on the **meta device** (shapes only, no arithmetic: T = 16K costs the same as
T = 1K) under :func:`meta_patches`; the counts equal a real CPU run's (tested at small T).
The input embedding is frozen in every configuration of the meta sweep (Opacus ghost's
embedding norm calls ``torch.unique``, which has no meta kernel); the CPU run trains it.
With ``--cpu-seq-lens`` the same configurations also run for real on the CPU: median step
time, counted peak and peak-RSS growth (a fresh subprocess per configuration).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import pathlib
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence

import torch
import torch.nn.functional as F

from examples.profiling import NormSamplerMemory, PeakAllocationCounter

from .gpu import enable_reentrant_checkpointing
from .steps import StepShape, Trainer, build_model, make_tokens, make_trainer

logger = logging.getLogger(__name__)

CONFIGS = ("nonprivate", "nonprivate_ckpt", "ghost_ckpt", "randomized_ckpt", "randomized_bk_ckpt")
#: the :mod:`benchmarks.steps` configuration each one trains with
STEP_CONFIG = {
    "nonprivate": "nonprivate", "nonprivate_ckpt": "nonprivate", "ghost_ckpt": "ghost",
    "randomized_ckpt": "randomized", "randomized_bk_ckpt": "randomized_bk",
}
BASELINE = "nonprivate_ckpt"
DEFAULT_SEQ_LENS = (1024, 2048, 4096)
FULL_SEQ_LENS = (1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384)
MiB = 2**20


def default_shape(seq_len: int, d_model: int = 256, n_layers: int = 4, vocab: int = 512) -> StepShape:
    return StepShape(seq_len, d_model, 1, n_layers=n_layers, vocab=vocab, arch="llama")


# ------------------------------------------------------------------------------------------
# the meta device
# ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def meta_patches() -> Iterator[None]:
    """What a step on the meta device needs, for meta tensors only (others untouched):

    * ``scaled_dot_product_attention`` goes to the CPU flash kernel (what the CPU dispatcher
      picks for these inputs; the meta dispatcher would pick the math path, which
      materialises the T x T attention matrix a CPU or GPU run never holds);
    * Hugging Face's packed-sequence check reads a value (``.all()``): our position ids are
      ``arange(T)`` per row, never packed, so it answers "not packed" (None) directly;
    * the randomized optimizer's non-finite decision (a value read; it allocates nothing)
      is skipped, and its noise comes from the default generator (meta has none).
    """
    import transformers.masking_utils as masking

    import opacus_rc.optimizer as rc_optimizer

    sdpa = F.scaled_dot_product_attention
    packed = masking.find_packed_sequence_indices

    def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if q.device.type != "meta" or enable_gqa:
            return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]

    def find_packed(position_ids):
        return None if position_ids.device.type == "meta" else packed(position_ids)

    saved = []
    for cls in vars(rc_optimizer).values():
        if not isinstance(cls, type):
            continue
        for name in ("_decide_finite", "noise_generator"):
            if name in vars(cls):
                saved.append((cls, name, vars(cls)[name]))
    decide = {cls: f for cls, name, f in saved if name == "_decide_finite"}
    noise = {cls: f for cls, name, f in saved if name == "noise_generator"}

    def on_meta(self) -> bool:
        return any(p.device.type == "meta" for p in self.params)

    def patched_decide(original):
        return lambda self: None if on_meta(self) else original(self)

    def patched_noise(original):
        return lambda self, device: None if torch.device(device).type == "meta" else original(self, device)

    F.scaled_dot_product_attention = attention
    masking.find_packed_sequence_indices = find_packed
    for cls, f in decide.items():
        cls._decide_finite = patched_decide(f)
    for cls, f in noise.items():
        cls.noise_generator = patched_noise(f)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa
        masking.find_packed_sequence_indices = packed
        for cls, name, f in saved:
            setattr(cls, name, f)


# ------------------------------------------------------------------------------------------
# one configuration
# ------------------------------------------------------------------------------------------
def enable_checkpointing(model: torch.nn.Module) -> None:
    """Hugging Face checkpointing of a :class:`~examples.models.llama.LlamaLM`, one
    checkpoint per decoder layer, reentrant (:func:`benchmarks.gpu.enable_reentrant_checkpointing`)."""
    enable_reentrant_checkpointing(model.lm)


def build_trainer(config: str, shape: StepShape, device: str = "cpu", *,
                  freeze_embedding: Optional[bool] = None) -> tuple:
    """(trainer, tokens) for ``config`` on ``device`` (``"meta"`` or ``"cpu"``)."""
    if config not in CONFIGS:
        raise ValueError(f"config={config!r} is not supported; accepted values: {CONFIGS}")
    if freeze_embedding is None:
        freeze_embedding = device == "meta"
    with torch.device(device):
        model = build_model(shape)
    if config.endswith("_ckpt"):
        enable_checkpointing(model)
    if freeze_embedding:
        model.lm.model.embed_tokens.weight.requires_grad_(False)
    tokens = make_tokens(shape).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make_trainer(STEP_CONFIG[config], model, tokens)
    return trainer, tokens


def _norm_memory(trainer: Trainer):
    return NormSamplerMemory(trainer.module) if getattr(trainer.module, "NORM_SAMPLERS", None) else contextlib.nullcontext()


def measure_peak(config: str, shape: StepShape, device: str = "meta", *, warmup: bool = True,
                 freeze_embedding: Optional[bool] = None) -> Dict[str, Any]:
    """Counted peak of one step and the largest per-layer norm computation in it."""
    patches = meta_patches() if device == "meta" else contextlib.nullcontext()
    with patches, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer, tokens = build_trainer(config, shape, device, freeze_embedding=freeze_embedding)
        if warmup:
            trainer.step(tokens)  # lazy state (sketch buffers, optimizer) out of the count
        norms = _norm_memory(trainer)
        with norms, PeakAllocationCounter() as counter:
            trainer.step(tokens)
    norm_peak = norms.peak if isinstance(norms, NormSamplerMemory) else None
    del trainer, tokens
    gc.collect()
    return {"config": config, "seq_len": shape.seq_len, "d_model": shape.d_model, "n_layers": shape.n_layers,
            "vocab": shape.vocab, "device": device, "peak_bytes": counter.peak, "norm_peak_bytes": norm_peak}


def sweep(seq_lens: Sequence[int], configs: Sequence[str] = CONFIGS, *, d_model: int = 256, n_layers: int = 4,
          vocab: int = 512, progress: bool = True) -> List[Dict[str, Any]]:
    """:func:`measure_peak` on the meta device for every (T, configuration)."""
    jobs = [(t, c) for t in seq_lens for c in configs]
    if progress:
        from tqdm import tqdm

        jobs = tqdm(jobs, desc="meta sweep", unit="step")
    return [measure_peak(c, default_shape(t, d_model, n_layers, vocab), "meta") for t, c in jobs]


# ------------------------------------------------------------------------------------------
# analysis
# ------------------------------------------------------------------------------------------
def series(rows: Iterable[Dict[str, Any]], config: str, key: str = "peak_bytes") -> List[tuple]:
    return sorted((r["seq_len"], r[key]) for r in rows if r["config"] == config and r.get(key) is not None)


def loglog_slope(points: Sequence[tuple]) -> float:
    """Least-squares slope of log(y) against log(T)."""
    xs = [math.log(t) for t, _ in points]
    ys = [math.log(y) for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def fit_linear(points: Sequence[tuple]) -> tuple:
    """(a, b) of y = a + b T, least squares."""
    ts = [float(t) for t, _ in points]
    ys = [float(y) for _, y in points]
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    b = sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / sum((t - mt) ** 2 for t in ts)
    return my - b * mt, b


def slopes(rows: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, float]]:
    """Per configuration: the log-log slope of the step peak over all T and over the two
    largest T (the asymptote), and the bytes per token of a linear fit."""
    out = {}
    for config in dict.fromkeys(r["config"] for r in rows):
        pts = series(rows, config)
        if len(pts) < 2:
            continue
        _, per_token = fit_linear(pts)
        out[config] = {"loglog_slope": loglog_slope(pts), "loglog_slope_last": loglog_slope(pts[-2:]),
                       "bytes_per_token": per_token}
    return out


def crossover(rows: Sequence[Dict[str, Any]], term: str = "ghost_ckpt", against: str = BASELINE) -> Dict[str, Any]:
    """Where ghost's T² norm term overtakes the checkpointed step: the T at which the
    largest per-layer norm computation (``norm_peak_bytes`` of ``term``, fitted as c T²)
    equals the checkpointed non-private step (``peak_bytes`` of ``against``, fitted as
    a + b T), and the first measured T where it is larger."""
    norm = series(rows, term, "norm_peak_bytes")
    base = dict(series(rows, against))
    if len(norm) < 2 or len(base) < 2:
        return {}
    c = statistics.fmean(y / t**2 for t, y in norm[-2:])  # the T² coefficient at the largest T
    a, b = fit_linear(sorted(base.items()))
    t_cross = (b + math.sqrt(b * b + 4 * c * a)) / (2 * c) if c > 0 else math.inf
    first = next((t for t, y in norm if t in base and y > base[t]), None)
    return {"t_fit": t_cross, "first_measured_t": first, "norm_t2_coef": c,
            "activations_intercept": a, "activations_per_token": b}


def ratios(rows: Sequence[Dict[str, Any]], baseline: str = BASELINE, key: str = "peak_bytes") -> List[Dict[str, Any]]:
    base = {r["seq_len"]: r[key] for r in rows if r["config"] == baseline and r.get(key)}
    return [{"config": r["config"], "seq_len": r["seq_len"], "ratio": r[key] / base[r["seq_len"]]}
            for r in rows if r["seq_len"] in base and r.get(key) is not None]


# ------------------------------------------------------------------------------------------
# the real CPU run: time, counted peak, peak-RSS growth
# ------------------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def cpu_worker(config: str, shape: StepShape, steps: int) -> Dict[str, Any]:
    """In this process: peak-RSS growth over a warm-up step and ``steps`` more (as
    :mod:`benchmarks.rss`: from the RSS before the first step, so that the allocator's cache
    of the first step does not hide the peak), the median time of the ``steps`` steps, then
    one counted step."""
    trainer, tokens = build_trainer(config, shape, "cpu")
    gc.collect()
    baseline = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS mark (VmHWM)
    trainer.step(tokens)  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.step(tokens)
        times.append(time.perf_counter() - t0)
    growth = (_status_kib("VmHWM") - baseline) * 1024
    with PeakAllocationCounter() as counter:
        trainer.step(tokens)
    return {"config": config, "seq_len": shape.seq_len, "d_model": shape.d_model, "n_layers": shape.n_layers,
            "vocab": shape.vocab, "device": "cpu", "peak_bytes": counter.peak, "rss_growth_bytes": growth,
            "median_step_s": statistics.median(times), "step_times_s": times}


def cpu_run(seq_lens: Sequence[int], configs: Sequence[str], *, steps: int = 1, threads: int = 2,
            d_model: int = 256, n_layers: int = 4, vocab: int = 512, progress: bool = True,
            timeout: float = 1200) -> List[Dict[str, Any]]:
    """:func:`cpu_worker` in a fresh interpreter per (T, configuration)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    jobs = [(t, c) for t in seq_lens for c in configs]
    if progress:
        from tqdm import tqdm

        jobs = tqdm(jobs, desc="CPU run", unit="config")
    out = []
    for t, c in jobs:
        cmd = [sys.executable, "-m", "benchmarks.checkpointing", "--worker", c, "--cpu-seq-lens", str(t),
               "--steps", str(steps), "--threads", str(threads), "--d-model", str(d_model),
               "--layers", str(n_layers), "--vocab", str(vocab)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=root)
        if proc.returncode != 0:
            raise RuntimeError(f"CPU worker {c} T={t} failed: {' | '.join(proc.stderr.strip().splitlines()[-3:])}")
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


def interleaved_times(seq_len: int, configs: Sequence[str], *, reps: int = 3, d_model: int = 256,
                      n_layers: int = 4, vocab: int = 512) -> Dict[str, Any]:
    """Step time of every configuration in one process on the CPU: one warm-up step each,
    then ``reps`` rounds with the order rotated every round (load changes hit all alike);
    medians and their ratios to ``nonprivate_ckpt``."""
    shape = default_shape(seq_len, d_model, n_layers, vocab)
    trainers = {c: build_trainer(c, shape, "cpu") for c in configs}
    for trainer, tokens in trainers.values():
        trainer.step(tokens)
    times: Dict[str, List[float]] = {c: [] for c in configs}
    for rep in range(reps):
        for j in range(len(configs)):
            c = configs[(rep + j) % len(configs)]
            trainer, tokens = trainers[c]
            gc.collect()
            t0 = time.perf_counter()
            trainer.step(tokens)
            times[c].append(time.perf_counter() - t0)
    med = {c: statistics.median(v) for c, v in times.items()}
    base = med.get(BASELINE)
    return {"seq_len": seq_len, "median_s": med, "times_s": times,
            "ratio_to_nonprivate_ckpt": {c: m / base for c, m in med.items()} if base else {}}


# ------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------
def markdown(rows: Sequence[Dict[str, Any]], cpu_rows: Sequence[Dict[str, Any]] = ()) -> str:
    lines = []
    if rows:
        seq_lens = sorted({r["seq_len"] for r in rows})
        configs = list(dict.fromkeys(r["config"] for r in rows))
        peak = {(r["config"], r["seq_len"]): r["peak_bytes"] for r in rows}
        lines += ["Counted peak of one step (MiB; meta device, float32, batch 1); ratio to `nonprivate_ckpt`:", "",
                  "| config | " + " | ".join(f"T={t:,}" for t in seq_lens) + " |",
                  "|---|" + "---|" * len(seq_lens)]
        for c in configs:
            cells = []
            for t in seq_lens:
                p, b = peak.get((c, t)), peak.get((BASELINE, t))
                cells.append("" if p is None else f"{p / MiB:.1f}" + (f" ({p / b:.2f}x)" if b else ""))
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        norm = series(rows, "ghost_ckpt", "norm_peak_bytes")
        rnorm = series(rows, "randomized_ckpt", "norm_peak_bytes")
        if norm:
            lines += ["", "Largest per-layer norm computation (MiB): ghost "
                      + ", ".join(f"{y / MiB:.1f} (T={t:,})" for t, y in norm)
                      + ("; randomized " + ", ".join(f"{y / MiB:.2f}" for _, y in rnorm) if rnorm else "")]
        fits = slopes(rows)
        if fits:
            lines += ["", "| config | log-log slope (all T) | slope (two largest T) | bytes per token (linear fit) |",
                      "|---|---|---|---|"]
            for c, f in fits.items():
                lines.append(f"| {c} | {f['loglog_slope']:.2f} | {f['loglog_slope_last']:.2f} | "
                             f"{f['bytes_per_token']:,.0f} |")
        x = crossover(rows)
        if x:
            first = f"{x['first_measured_t']:,}" if x["first_measured_t"] else "none measured"
            lines += ["", f"Ghost's T² norm term overtakes the checkpointed non-private step at T ≈ {x['t_fit']:,.0f} "
                      f"(fit); first measured T where it is larger: {first}."]
    if cpu_rows:
        base = {r["seq_len"]: r for r in cpu_rows if r["config"] == BASELINE}
        lines += ["", "Real CPU run (float32, batch 1; ratios to `nonprivate_ckpt` at the same T):", "",
                  "| T | config | median step (s) | counted peak (MiB) | peak-RSS growth (MiB) |",
                  "|---|---|---|---|---|"]
        for r in cpu_rows:
            b = base.get(r["seq_len"])

            def rel(key):
                return f" ({r[key] / b[key]:.2f}x)" if b and b[key] else ""
            lines.append(f"| {r['seq_len']:,} | {r['config']} | {r['median_step_s']:.1f}{rel('median_step_s')} | "
                         f"{r['peak_bytes'] / MiB:.1f}{rel('peak_bytes')} | "
                         f"{r['rss_growth_bytes'] / MiB:.1f}{rel('rss_growth_bytes')} |")
    return "\n".join(lines) + "\n"


LABELS = {
    "nonprivate": "non-private, no checkpointing",
    "nonprivate_ckpt": "non-private, checkpointed",
    "ghost_ckpt": "Opacus ghost, checkpointed",
    "randomized_ckpt": "randomized two-pass, checkpointed",
    "randomized_bk_ckpt": "randomized book-keeping, checkpointed",
}


def plot(rows: Sequence[Dict[str, Any]], path: Optional[str] = None, ax=None):
    """Log-log peak memory against T, one line per configuration, plus ghost's norm term."""
    import matplotlib

    if path is not None and ax is None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(7.5, 5))
    fits = slopes(rows)
    for c in dict.fromkeys(r["config"] for r in rows):
        pts = series(rows, c)
        t, y = zip(*pts)
        slope = f" (slope {fits[c]['loglog_slope_last']:.2f})" if c in fits else ""
        ax.loglog(t, [v / MiB for v in y], "o-", base=2, label=LABELS.get(c, c) + slope,
                  ls="--" if c == "nonprivate" else "-")
    norm = series(rows, "ghost_ckpt", "norm_peak_bytes")
    if norm:
        t, y = zip(*norm)
        ax.loglog(t, [v / MiB for v in y], "k:", base=2, label="ghost's largest norm term (T²)")
    x = crossover(rows)
    if x and math.isfinite(x["t_fit"]):
        ax.axvline(x["t_fit"], color="grey", lw=0.8)
        ax.annotate(f"T² term = checkpointed step\nT ≈ {x['t_fit']:,.0f}", (x["t_fit"], ax.get_ylim()[1]),
                    xytext=(4, -28), textcoords="offset points", fontsize=8)
    r0 = rows[0]
    ax.set_title(f"Peak memory of one step, Llama-style d={r0['d_model']}, {r0['n_layers']} layers "
                 "(meta device, float32)", fontsize=9)
    ax.set_xlabel("context length T")
    ax.set_ylabel("peak live bytes of one step (MiB)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", lw=0.3)
    if fig is not None and path is not None:
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    return ax


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help=f"T = {','.join(map(str, FULL_SEQ_LENS))}")
    parser.add_argument("--seq-lens", default=None, help="comma-separated T of the meta sweep")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--cpu-seq-lens", default="", help="also run these T for real on the CPU")
    parser.add_argument("--cpu-configs", default=",".join(CONFIGS[:2] + CONFIGS[3:]),
                        help="configurations of the CPU run (default: all but ghost_ckpt)")
    parser.add_argument("--cpu-only", action="store_true", help="skip the meta sweep")
    parser.add_argument("--time-seq-lens", default="",
                        help="also time the CPU configurations interleaved in this process at these T")
    parser.add_argument("--reps", type=int, default=3, help="rounds of --time-seq-lens")
    parser.add_argument("--steps", type=int, default=1, help="timed CPU steps per configuration")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help="write the log-log plot (PNG)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    try:
        seq_lens = [int(t) for t in args.seq_lens.split(",")] if args.seq_lens else \
            list(FULL_SEQ_LENS if args.full else DEFAULT_SEQ_LENS)
        cpu_seq_lens = [int(t) for t in args.cpu_seq_lens.split(",") if t]
    except ValueError:
        parser.error("--seq-lens and --cpu-seq-lens take comma-separated integers, e.g. 1024,4096")
    configs = [c for c in args.configs.split(",") if c]
    cpu_configs = [c for c in args.cpu_configs.split(",") if c]
    bad = [c for c in configs + cpu_configs + ([args.worker] if args.worker else []) if c not in CONFIGS]
    if bad or min(seq_lens + cpu_seq_lens, default=1) < 1 or args.steps < 1:
        parser.error(f"configurations: {','.join(CONFIGS)}; T and --steps must be positive")
    if args.worker:
        shape = default_shape(cpu_seq_lens[0], args.d_model, args.layers, args.vocab)
        sys.stdout.write(json.dumps(cpu_worker(args.worker, shape, args.steps)) + "\n")
        return
    size = dict(d_model=args.d_model, n_layers=args.layers, vocab=args.vocab, progress=not args.no_progress)
    started = time.perf_counter()
    rows = [] if args.cpu_only else sweep(seq_lens, configs, **size)
    cpu_rows = cpu_run(cpu_seq_lens, cpu_configs, steps=args.steps, threads=args.threads, **size) \
        if cpu_seq_lens else []
    time_lens = [int(t) for t in args.time_seq_lens.split(",") if t]
    timings = [interleaved_times(t, cpu_configs, reps=args.reps, d_model=args.d_model, n_layers=args.layers,
                                 vocab=args.vocab) for t in time_lens]
    print(markdown(rows, cpu_rows), end="")
    for x in timings:
        print(f"\nInterleaved CPU step time at T={x['seq_len']:,} (median of {args.reps}; ratio to nonprivate_ckpt): "
              + ", ".join(f"{c} {m:.2f} s ({x['ratio_to_nonprivate_ckpt'].get(c, float('nan')):.2f}x)"
                          for c, m in x["median_s"].items()))
    if args.plot and rows:
        plot(rows, args.plot)
    if args.json:
        record = {"model": {"arch": "llama", "d_model": args.d_model, "layers": args.layers, "vocab": args.vocab,
                            "batch": 1, "dtype": "float32", "checkpointing": "HF, per decoder layer, reentrant"},
                  "rows": rows, "cpu_rows": cpu_rows, "timings": timings, "slopes": slopes(rows) if rows else {},
                  "crossover": crossover(rows) if rows else {}, "wall_s": time.perf_counter() - started,
                  "command": "python -m benchmarks.checkpointing " + " ".join(sys.argv[1:] if argv is None else argv)}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
