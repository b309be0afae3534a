"""Cost of user-level clipping against example-level at the same rows per step (issue 40).

A step holds ``m`` rows of ``T`` tokens (sample rate 1, so every step holds exactly these
rows); at user level the ``m`` rows are one user's (``max_examples_per_user=m``), at example
level ``m`` independent rows. Model: a small Llama (``transformers.LlamaForCausalLM``,
**random init**, hidden 64, MLP 128, 2 layers, 4 heads, vocabulary 256, SDPA attention),
next-token loss, SGD, ``clipping="randomized"``, sigma 1. Two forms:

* ``per_example`` (``per_example_backward=True``): one row per backward pass. Example
  level clips each row's gradient and adds it to the sum; user level adds each row's
  gradient to one user buffer and clips the mean once at the user's last row. Expected:
  user-level memory exceeds example-level by at most one gradient-sized buffer (the
  parameters' size), whatever ``m``.
* ``bookkeeping`` (``grad_sample_mode="bookkeeping"``, one backward pass over the ``m``
  rows): user level regroups the user's rows into one sequence of ``m T`` tokens, so the
  per-layer records are the same ``m T`` tokens (O(m) per layer, no more) and one sketch
  per user replaces ``m`` per-row sketches.

Step time: the median of ``--reps`` steps after a warm-up step (a step iterates the
loader's physical batches until the optimizer steps). Peak memory: the peak of live bytes
allocated by operators during one step (:class:`examples.profiling.PeakAllocationCounter`, a
``TorchDispatchMode`` that counts tensor storages; not ``tracemalloc``, which does not see
PyTorch's allocations). The parameters' size (one gradient-sized buffer) is printed with
the table.

    python -m benchmarks.user_level_cost          # rows 1,4,16 at T=256 (about a minute)
    python -m benchmarks.user_level_cost --full   # rows 1,4,16,64 at T=256,1024,2048
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import platform
import statistics
import sys
import time
import warnings
from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from examples.profiling import PeakAllocationCounter  # noqa: E402

logger = logging.getLogger("benchmarks.user_level_cost")

FORMS = ("per_example", "bookkeeping")
UNITS = ("example", "user")
VOCAB = 256


class TokenLM(nn.Module):
    """``(B, T)`` ids -> ``(B, T, vocab)`` logits of a Hugging Face causal LM (no cache)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, use_cache=False).logits


def small_llama(max_len: int, seed: int = 0) -> TokenLM:
    """A random-init Llama: hidden 64, MLP 128, 2 layers, 4 heads, vocabulary 256."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=max_len,
                      attn_implementation="sdpa")
    return TokenLM(LlamaForCausalLM(cfg))


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def make_trainer(form: str, unit: str, rows: int, tokens: int, seed: int = 0):
    """(module, optimizer, loader) of one configuration over ``rows`` random rows of
    ``tokens`` tokens, sample rate 1 (every step holds all rows)."""
    from opacus import PrivacyEngine

    import opacus_rc  # noqa: F401  registers clipping="randomized" and accountant="rc_prv"

    model = small_llama(tokens + 1, seed)
    ids = torch.randint(0, VOCAB, (rows, tokens + 1), generator=torch.Generator().manual_seed(seed))
    data = torch.utils.data.TensorDataset(ids)
    options = dict(per_example_backward=True) if form == "per_example" else dict(
        grad_sample_mode="bookkeeping", per_example_backward=False)
    if unit == "user":
        options.update(privacy_unit="user", user_ids=[0] * rows, max_examples_per_user=rows)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        return PrivacyEngine(accountant="rc_prv").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
            data_loader=torch.utils.data.DataLoader(data, batch_size=1 if unit == "user" else rows),
            noise_multiplier=1.0, max_grad_norm=1.0, clipping="randomized", sample_rate=1.0,
            expected_batch_size=1 if unit == "user" else rows, poisson_sampling=True, seed=seed, **options)


def one_step(module, optimizer, loader) -> int:
    """Train on the loader's physical batches until the optimizer steps; returns the rows used."""
    used = 0
    for (ids,) in loader:
        used += len(ids)
        _loss(module, ids).backward()
        optimizer.step()
        optimizer.zero_grad()
        if not optimizer._is_last_step_skipped:
            return used
    raise RuntimeError("the loader ended before a step was taken")


def measure(form: str, unit: str, rows: int, tokens: int, reps: int) -> Dict:
    """Median step time over ``reps`` steps (after a warm-up) and the peak live bytes of one step."""
    module, optimizer, loader = make_trainer(form, unit, rows, tokens)
    one_step(module, optimizer, loader)  # warm-up (and lazily built buffers)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        used = one_step(module, optimizer, loader)
        times.append(time.perf_counter() - t0)
    if used != rows:
        raise RuntimeError(f"a step used {used} rows, expected {rows}")
    with PeakAllocationCounter() as counter:
        one_step(module, optimizer, loader)
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    return dict(form=form, unit=unit, rows=rows, tokens=tokens, time_s=statistics.median(times), times_s=times,
                peak_bytes=counter.peak, param_bytes=params)


def ratios(results: Sequence[Dict]) -> List[Dict]:
    """User over example level, per (form, rows, tokens): time and peak ratios, the peak
    difference in parameter-sized buffers, and the peak per row."""
    out = []
    for u in [r for r in results if r["unit"] == "user"]:
        e = next(r for r in results if r["unit"] == "example" and
                 (r["form"], r["rows"], r["tokens"]) == (u["form"], u["rows"], u["tokens"]))
        out.append(dict(form=u["form"], rows=u["rows"], tokens=u["tokens"],
                        time_example_s=e["time_s"], time_user_s=u["time_s"], time_ratio=u["time_s"] / e["time_s"],
                        peak_example=e["peak_bytes"], peak_user=u["peak_bytes"],
                        peak_ratio=u["peak_bytes"] / e["peak_bytes"],
                        extra_buffers=(u["peak_bytes"] - e["peak_bytes"]) / u["param_bytes"]))
    return out


def markdown(rows: Sequence[Dict], param_bytes: int) -> str:
    mib = 2.0 ** 20
    lines = [f"parameters (one gradient-sized buffer): {param_bytes / mib:.2f} MiB",
             "", "| form | rows m | T | step time example | step time user | ratio | peak example | peak user | "
             "ratio | user − example (gradient buffers) |", "|---" * 10 + "|"]
    for r in rows:
        lines.append(
            f"| {r['form']} | {r['rows']} | {r['tokens']} | {1000 * r['time_example_s']:.0f} ms | "
            f"{1000 * r['time_user_s']:.0f} ms | {r['time_ratio']:.2f} | {r['peak_example'] / mib:.1f} MiB | "
            f"{r['peak_user'] / mib:.1f} MiB | {r['peak_ratio']:.2f} | {r['extra_buffers']:+.2f} |")
    return "\n".join(lines)


def _ints(text: str) -> List[int]:
    return [int(v) for v in text.split(",") if v]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="rows 1,4,16,64 at T=256,1024,2048")
    p.add_argument("--rows", default=None, help="comma list of rows per step (default 1,4,16)")
    p.add_argument("--tokens", default=None, help="comma list of T (default 256)")
    p.add_argument("--max-tokens-per-step", type=int, default=65536, help="skip (m, T) with m T above it")
    p.add_argument("--forms", default=",".join(FORMS))
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="default: docs/results/user_level_cost.json with --full")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    a = p.parse_args(argv)
    a.row_list = _ints(a.rows or ("1,4,16,64" if a.full else "1,4,16"))
    a.token_list = _ints(a.tokens or ("256,1024,2048" if a.full else "256"))
    a.form_list = a.forms.split(",")
    if any(f not in FORMS for f in a.form_list):
        p.error(f"--forms={a.forms!r}; accepted: {', '.join(FORMS)}")
    if a.full:
        a.json = a.json or str(ROOT / "docs" / "results" / "user_level_cost.json")
    return a


def grid(args) -> List[Tuple[str, str, int, int]]:
    return [(f, u, m, t) for t in args.token_list for m in args.row_list for f in args.form_list for u in UNITS
            if m * t <= args.max_tokens_per_step]


def main(argv=None) -> Dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    points = grid(args)
    if args.progress:
        from tqdm import tqdm

        points = tqdm(points, desc="user-level cost")
    results = [measure(f, u, m, t, args.reps) for f, u, m, t in points]
    table = ratios(results)
    print(markdown(table, results[0]["param_bytes"]))
    record = dict(command="python -m benchmarks.user_level_cost " + " ".join(argv if argv is not None else sys.argv[1:]),
                  machine=platform.processor() or platform.machine(), threads=torch.get_num_threads(),
                  memory="peak live bytes of one step, examples.profiling.PeakAllocationCounter",
                  model="LlamaForCausalLM random init: hidden 64, MLP 128, 2 layers, 4 heads, vocab 256",
                  results=results, ratios=table, seconds=time.perf_counter() - t0)
    print(f"\n{record['seconds']:.0f} s")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
