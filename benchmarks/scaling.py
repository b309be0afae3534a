"""Per-GPU memory of DP fine-tuning at Llama-3-8B shapes under FSDP2: ghost vs randomized.

    python -m benchmarks.scaling                       # the tables of docs/scaling.md
    python -m benchmarks.scaling --gpus 8 --seq-lens 8192,32768,131072 --json scaling.json

Two parts per GPU (FSDP2 over ``--gpus`` GPUs, one sequence of T tokens per GPU, bf16):

* **norm computation**: the peak extra bytes of one linear layer's per-sample norm
  computation, *counted* by :class:`~examples.profiling.PeakAllocationCounter` on the
  meta device with bf16 activations (T x d) and output gradients (T x p) of every Llama-3-8B
  linear shape, for Opacus ghost clipping (``compute_linear_norm_sample``) and for
  randomized clipping (``linear_norm_sample``, k = 32, the sketch always on). Norms are
  computed one layer at a time in the backward hooks, so the step's norm term is the
  largest layer's.
* **whole step**: that norm term plus a stated model of everything else (see
  :func:`memory_model`): the FSDP2-sharded training state, FSDP2's unsharded buffers and the
  activations autograd (and Opacus's hooks) keep for the backward pass. The peak is taken at
  the start of the backward pass, with every activation alive (an upper bound).

Nothing here runs a model: the counts are exact for the operators (meta tensors have shapes
but no data) and the rest is arithmetic.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict, dataclass
from typing import Dict, List, Sequence, Tuple

import torch
from opacus.grad_sample.linear import compute_linear_norm_sample
from torch import nn

from examples.profiling import PeakAllocationCounter
from opacus_rc.config import SketchConfig
from opacus_rc.norm_samplers import linear_norm_sample
from opacus_rc.sketch import Sketcher

logger = logging.getLogger(__name__)

METHODS = ("ghost", "hutchinson", "hutchpp")
GB = 1e9


@dataclass(frozen=True)
class DecoderShape:
    """A Llama-style decoder: vocabulary, width, layers, query / key-value heads, MLP width."""

    vocab: int = 128256
    d: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: int = 8
    ffn: int = 14336

    @property
    def d_kv(self) -> int:
        return self.d // self.heads * self.kv_heads

    def linear_shapes(self) -> Dict[str, Tuple[int, int]]:
        """(d_in, d_out) of every distinct linear layer."""
        return {
            "q_proj, o_proj": (self.d, self.d),
            "k_proj, v_proj": (self.d, self.d_kv),
            "gate_proj, up_proj": (self.d, self.ffn),
            "down_proj": (self.ffn, self.d),
            "lm_head": (self.d, self.vocab),
        }

    def layer_params(self) -> int:
        attn = 2 * self.d * self.d + 2 * self.d * self.d_kv
        return attn + 3 * self.d * self.ffn + 2 * self.d  # + two RMSNorm weights

    def params(self) -> int:
        """Untied embedding and head, final norm."""
        return 2 * self.vocab * self.d + self.layers * self.layer_params() + self.d


LLAMA3_8B = DecoderShape()


def norm_peak_bytes(method: str, d: int, p: int, seq_len: int, sketch_size: int = 32) -> int:
    """Peak extra bytes of one (d -> p) layer's per-sample norm computation, one sequence
    of ``seq_len`` bf16 tokens, counted on the meta device (inputs excluded)."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not supported; accepted values: {METHODS}")
    layer = nn.Linear(d, p, bias=False, device="meta", dtype=torch.bfloat16)
    a = torch.empty(1, seq_len, d, device="meta", dtype=torch.bfloat16)
    g = torch.empty(1, seq_len, p, device="meta", dtype=torch.bfloat16)
    sketcher = None
    if method != "ghost":
        config = SketchConfig(estimator=method, sketch_size=sketch_size, exact_when_cheaper=False)
        sketcher = Sketcher(config, seed=0)
    with PeakAllocationCounter() as counter:
        if sketcher is None:
            out = compute_linear_norm_sample(layer, [a], g)
        else:
            out = linear_norm_sample(layer, [a], g, sketcher)
    del out
    return counter.peak


def memory_model(shape: DecoderShape, seq_len: int, gpus: int) -> Dict[str, int]:
    """Bytes per GPU of everything but the norm computation (the stated model).

    * ``state``: FSDP2-sharded fp32 parameters, fp32 gradients and AdamW's two fp32
      moments, 16 bytes per parameter over ``gpus`` (the DP optimizer keeps the clipped
      sum in the gradient buffer, no extra copy);
    * ``buffers``: FSDP2's unsharded bf16 parameters of two decoder layers (the current and
      the prefetched one) and one layer's unsharded fp32 gradient before its
      reduce-scatter, or the same for the embedding-sized LM head if larger;
    * ``activations``: per token and decoder layer, bf16: the attention block's RMSNorm
      input and output (2d), rotated q, k and v kept by flash attention (d + 2 d_kv), the
      attention output (d), the MLP block's RMSNorm input and output (2d), gate, up, SiLU(gate)
      and their product (4 ffn); plus the logits and their gradient (2 x vocab) at the head,
      which Opacus's hook receives whole. Opacus's hooks keep every trainable layer's input
      until its backward hook, so activation checkpointing would not free the linear
      layers' inputs: none is modelled, and no sequence parallelism.
    """
    per_token_layer = 2 * (6 * shape.d + 2 * shape.d_kv + 4 * shape.ffn)
    head = shape.vocab * shape.d
    return {
        "state": 16 * shape.params() // gpus,
        "buffers": max(2 * 2 * shape.layer_params() + 4 * shape.layer_params(), 2 * head + 4 * head),
        "activations": seq_len * (shape.layers * per_token_layer + 2 * 2 * shape.vocab),
    }


@dataclass
class Row:
    """One (method, T) entry of the tables (bytes per GPU)."""

    method: str
    seq_len: int
    norm_bytes: int
    norm_layer: str
    state_bytes: int
    buffer_bytes: int
    activation_bytes: int

    @property
    def step_bytes(self) -> int:
        return self.norm_bytes + self.state_bytes + self.buffer_bytes + self.activation_bytes


def row(method: str, shape: DecoderShape, seq_len: int, gpus: int, sketch_size: int = 32) -> Row:
    """The norm term (largest layer, counted) and the model terms for one (method, T)."""
    peaks = {
        name: norm_peak_bytes(method, d, p, seq_len, sketch_size)
        for name, (d, p) in shape.linear_shapes().items()
    }
    layer = max(peaks, key=peaks.get)
    rest = memory_model(shape, seq_len, gpus)
    return Row(method, seq_len, peaks[layer], layer, rest["state"], rest["buffers"], rest["activations"])


def longest_fitting(
    method: str, shape: DecoderShape, gpus: int, budget_bytes: float, step: int = 1024, limit: int = 1 << 20
) -> int:
    """The longest T (a multiple of ``step``) whose per-GPU step fits ``budget_bytes`` (0 if
    none): bisection, the step memory grows with T."""
    lo, hi = 0, limit // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if row(method, shape, mid * step, gpus).step_bytes <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo * step


def _gb(x: float) -> str:
    return f"{x / GB:.1f}"


def markdown(rows: List[Row], longest: Dict[Tuple[str, float], int], shape: DecoderShape, gpus: int) -> str:
    lines = [
        f"Llama-3-8B shapes ({shape.params() / 1e9:.2f}B parameters), FSDP2 over {gpus} GPUs, "
        "one sequence per GPU, bf16; GB = 1e9 bytes per GPU.",
        "",
        "| T | method | norm computation (largest layer) | state | FSDP2 buffers | activations | whole step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.seq_len:,} | {r.method} | {_gb(r.norm_bytes)} ({r.norm_layer}) | {_gb(r.state_bytes)} | "
            f"{_gb(r.buffer_bytes)} | {_gb(r.activation_bytes)} | {_gb(r.step_bytes)} |"
        )
    budgets = sorted({b for _, b in longest})
    lines += ["", "| method | " + " | ".join(f"longest T in {b / GB:.0f} GB" for b in budgets) + " |",
              "|---|" + "---|" * len(budgets)]
    for method in dict.fromkeys(m for m, _ in longest):
        lines.append(f"| {method} | " + " | ".join(f"{longest[(method, b)]:,}" for b in budgets) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--seq-lens", default="8192,32768,131072")
    parser.add_argument("--budgets-gb", default="80,141", help="GPU memory sizes for the longest-T table")
    parser.add_argument("--sketch-size", type=int, default=32)
    parser.add_argument("--json", default=None, help="write the rows and longest T as JSON")
    args = parser.parse_args(argv)
    try:
        seq_lens = [int(t) for t in args.seq_lens.split(",")]
        budgets = [float(b) * GB for b in args.budgets_gb.split(",")]
    except ValueError:
        parser.error("--seq-lens and --budgets-gb take comma-separated numbers, e.g. 8192,32768")
    if args.gpus < 1 or min(seq_lens) < 1 or min(budgets) <= 0:
        parser.error("--gpus, --seq-lens and --budgets-gb must be positive")
    shape = LLAMA3_8B
    rows = [row(m, shape, t, args.gpus, args.sketch_size) for t in seq_lens for m in METHODS]
    longest = {(m, b): longest_fitting(m, shape, args.gpus, b) for m in METHODS for b in budgets}
    print(markdown(rows, longest, shape, args.gpus), end="")
    if args.json:
        record = {
            "shape": asdict(shape), "gpus": args.gpus, "sketch_size": args.sketch_size,
            "rows": [{**asdict(r), "step_bytes": r.step_bytes} for r in rows],
            "longest": [{"method": m, "budget_bytes": b, "seq_len": t} for (m, b), t in longest.items()],
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
