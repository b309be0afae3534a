"""Per-GPU memory of DP fine-tuning at Llama-3-8B shapes under FSDP2: ghost vs randomized.

    python -m benchmarks.scaling                       # the tables of docs/scaling.md
    python -m benchmarks.scaling --gpus 8 --seq-lens 8192,32768,131072 --json /tmp/scaling_8gpu.json

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

With activation checkpointing (``--checkpointed``, the default tables of docs/scaling.md
since issue 22) the activation term is :func:`checkpointed_terms`: what each checkpointed
decoder layer keeps (its input), the one layer recomputed at a time, the LM head's logits
and their gradient, and the norm term of each method, at Llama-3.2-1B on one GPU and
Llama-3-8B under FSDP2 on 8 GPUs (:data:`SETUPS`); the stated model is checked against the
counted peak of a small checkpointed Llama (:mod:`benchmarks.checkpointing`) in
tests/test_scaling.py. With the package's chunked LM head (``head="chunked"``:
:class:`opacus_rc.lm_head.ChunkedLMHeadLoss`, ``--block-size`` positions at a time) the logits
terms are replaced by the head's own (:func:`chunked_head_terms`), checked against the head's
counted peak (:func:`validate_chunked_head`) in the same test file and in the printed tables.

Nothing here runs a model: the counts are exact for the operators (meta tensors have shapes
but no data) and the rest is arithmetic.
"""

from __future__ import annotations

import argparse
import json
import functools
import logging
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

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
#: Llama-3.2-1B's shape with an untied head (as benchmarks/gpu.py runs it: Opacus ghost
#: clipping refuses tied weights)
LLAMA32_1B = DecoderShape(vocab=128256, d=2048, layers=16, heads=32, kv_heads=8, ffn=8192)


@functools.lru_cache(maxsize=None)
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


# ------------------------------------------------------------------------------------------
# the package's chunked LM head (opacus_rc.lm_head.ChunkedLMHeadLoss)
# ------------------------------------------------------------------------------------------
#: the head's forms: no privacy (a fused head + loss), randomized two-pass (the criterion of
#: grad_sample_mode="ghost"), randomized book-keeping
CHUNKED_HEAD_FORMS = ("plain", "two_pass", "bookkeeping")
#: the form of the chunked head each checkpointed method runs (Opacus ghost cannot use it)
CKPT_HEAD_FORM = {"nonprivate": "plain", "randomized": "two_pass", "bookkeeping": "bookkeeping", "per_example": "plain"}


def chunked_head_terms(batch: int, seq_len: int, d: int, vocab: int, block_size: int = 1024, *,
                       form: str = "two_pass", sketch_size: int = 32, hidden_bytes: int = 4,
                       compute_bytes: int = 2, per_example: bool = True) -> Dict[str, int]:
    """Bytes of :class:`opacus_rc.lm_head.ChunkedLMHeadLoss` in one step, by term (float32
    weights; ``compute_bytes`` 2 under bf16 autocast, 4 without; the hidden states in
    ``hidden_bytes``), read from its code:

    * kept from the forward to the end of the step: ``hidden`` A (B, T, d), the head's input;
      ``body_grad`` H = G W (B, T, d) in the compute dtype; ``per_position``: the
      log-sum-exp (float32), the targets (int64) and the per-position loss scale (float32),
      16 bytes per position; under privacy ``sketch`` the step's (B, V, k) float32 sketch
      (vocabulary side; (B, d, k) when d > V);
    * ``accumulator`` (forward only, reduced to (B,) norms at its end): the (B, d, k) sums
      ``Σ_b A_bᵀ(G_b P)`` ((B, V, k) on the input side);
    * ``forward_block``: one block's transients in the forward, the larger of the float32
      logits with their compute-dtype original and, at ``H_b = G_b W``, the compute-dtype
      copies of G_b and of W (V x d); under privacy, the compute-dtype rounding of G_b for
      the sketch (a rounded float32 copy next to G_b: 8 + compute bytes per logit);
    * ``backward_block``: the weight-gradient sweep (the plain backward, the two-pass
      form's second pass, book-keeping's clipped sum at ``optimizer.step()``): the float32
      (V x d) ``weight_grad`` (summed in place in float32, at every precision) and, per
      recomputed block, G_b, its rounded float32 copy and its compute-dtype copy;
      ``grad_to_body``: the gradient handed to the body (B, T, d), alive
      through that backward (absent from book-keeping's assembly).

    Under float32 compute nothing is cast or rounded (``F.linear``'s logits are the float32
    block). Left out (the tolerance of
    tests/test_scaling.py): per block O(B·c·d) casts of A and the (B, c, d) product of H,
    O(B·c) reductions (maximum, sum, picked logit), the (B, c, k) sketched block and one
    (B, d, k) partial sum.
    """
    if form not in CHUNKED_HEAD_FORMS:
        raise ValueError(f"form={form!r} is not supported; accepted values: {CHUNKED_HEAD_FORMS}")
    b, t, c, v = batch, seq_len, min(block_size, seq_len), vocab
    cb, low = compute_bytes, compute_bytes < 4
    private = form != "plain"
    output_side = vocab >= d  # opacus_rc.estimators.sketch_side(d, V, "auto")
    sketch_rows, acc_rows = (v, d) if output_side else (d, v)
    logits = b * c * v
    if low:
        forward_block = 4 * logits + max(cb * logits + cb * v * d, (4 + cb) * logits if private else 0)
        backward_block = (8 + cb) * logits
    else:
        forward_block, backward_block = 4 * logits, 4 * logits
    return {
        "hidden": b * t * d * hidden_bytes,
        "body_grad": b * t * d * cb,
        "per_position": 16 * b * t,
        "sketch": 4 * (b if per_example else 1) * sketch_rows * sketch_size if private else 0,
        "accumulator": 4 * b * acc_rows * sketch_size if private else 0,
        "forward_block": forward_block,
        "backward_block": backward_block,
        "weight_grad": 4 * v * d,
        "grad_to_body": b * t * d * hidden_bytes if form != "bookkeeping" else 0,
    }


def chunked_head_kept(terms: Dict[str, int]) -> int:
    """What the chunked head keeps from its forward to the end of the step."""
    return sum(terms[k] for k in ("hidden", "body_grad", "per_position", "sketch"))


def chunked_head_phase(terms: Dict[str, int], with_weight_grad: bool = True) -> int:
    """The larger of the head's forward (a block and the sketch sums) and its
    weight-gradient sweep, on top of what it keeps. ``with_weight_grad=False``: without the
    (V x d) gradient (a whole step counts it in the training state)."""
    sweep = terms["backward_block"] + terms["grad_to_body"] + (terms["weight_grad"] if with_weight_grad else 0)
    return max(terms["forward_block"] + terms["accumulator"], sweep)


def chunked_head_peak_bytes(terms: Dict[str, int]) -> int:
    """Peak of the head alone, as :func:`benchmarks.lm_head.head_peak_bytes` counts it."""
    return chunked_head_kept(terms) + chunked_head_phase(terms)


def chunked_head_omitted_bytes(batch: int, seq_len: int, d: int, vocab: int, block_size: int = 1024, *,
                               sketch_size: int = 32, compute_bytes: int = 2) -> int:
    """An upper bound of what :func:`chunked_head_terms` leaves out at any moment: per block
    the casts of A to the compute dtype and to float32, the (B, c, d) product H_b and its
    flattened cast, the (B, c, k) sketched block, one (B, d, k) partial sum and a few
    (B, c) float32 / int64 vectors; 4 KiB of scalars."""
    b, c = batch, min(block_size, seq_len)
    acc_rows = d if vocab >= d else vocab
    return b * c * ((4 + 3 * compute_bytes) * d + 4 * sketch_size + 8 * 8) + 4 * b * acc_rows * sketch_size + 4096


#: (form, B, T, d, V, block, device) points where tests/test_scaling.py and ``python -m
#: benchmarks.scaling`` check :func:`chunked_head_terms` against the counted peak: the meta
#: device in float32 at long T and Llama's vocabulary, the CPU (real tensors) under bf16
#: autocast at small shapes, including d > 2c (the H_b = G_b W moment binds the forward)
HEAD_VALIDATION_POINTS = (
    ("two_pass", 1, 131072, 2048, 128256, 1024, "meta"),
    ("two_pass", 1, 65536, 256, 128256, 1024, "meta"),
    ("two_pass", 1, 16384, 512, 32768, 128, "meta"),
    ("two_pass", 2, 8192, 256, 128256, 512, "meta"),
    ("plain", 1, 65536, 256, 128256, 1024, "meta"),
    ("bookkeeping", 1, 16384, 256, 128256, 512, "meta"),
    ("two_pass", 1, 2048, 64, 8192, 256, "cpu"),
    ("two_pass", 1, 1024, 256, 8192, 64, "cpu"),
    ("two_pass", 2, 1024, 64, 16384, 128, "cpu"),
    ("plain", 1, 2048, 64, 8192, 256, "cpu"),
    ("bookkeeping", 1, 2048, 128, 8192, 128, "cpu"),
)


def validate_chunked_head(points: Sequence[tuple] = HEAD_VALIDATION_POINTS, sketch_size: int = 32) -> List[Dict]:
    """:func:`chunked_head_peak_bytes` against :func:`benchmarks.lm_head.head_peak_bytes`
    (counted live bytes; the CPU points run under bf16 autocast) at ``points``."""
    from benchmarks.lm_head import head_peak_bytes

    out = []
    for form, b, t, d, v, c, device in points:
        autocast = device == "cpu"
        cb = 2 if autocast else 4
        measured = head_peak_bytes(form, batch=b, seq_len=t, d=d, vocab=v, k=sketch_size, block=c,
                                   device=device, autocast=autocast)
        terms = chunked_head_terms(b, t, d, v, c, form=form, sketch_size=sketch_size, hidden_bytes=4,
                                   compute_bytes=cb)
        modelled = chunked_head_peak_bytes(terms)
        omitted = chunked_head_omitted_bytes(b, t, d, v, c, sketch_size=sketch_size, compute_bytes=cb)
        out.append(dict(form=form, B=b, T=t, d=d, V=v, block=c, device=device,
                        dtype="bf16 autocast" if autocast else "float32", measured_bytes=measured,
                        modelled_bytes=modelled, omitted_bound_bytes=omitted,
                        rel_error=(measured - modelled) / measured))
    return out


def validation_markdown(rows: Sequence[Dict]) -> str:
    lines = ["| form | B | T | d | V | block | device, dtype | counted MB | modelled MB | (counted − modelled) / counted |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['form']} | {r['B']} | {r['T']:,} | {r['d']} | {r['V']:,} | {r['block']} | "
                     f"{r['device']}, {r['dtype']} | {r['measured_bytes'] / 1e6:,.1f} | "
                     f"{r['modelled_bytes'] / 1e6:,.1f} | {100 * r['rel_error']:+.2f}% |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------
# with activation checkpointing (one checkpoint per decoder layer)
# ------------------------------------------------------------------------------------------
#: methods of the checkpointed tables: non-private, Opacus ghost, randomized clipping in its
#: two-pass form (the randomized default under checkpointing), and book-keeping (stated apart)
CKPT_METHODS = ("nonprivate", "ghost", "randomized", "bookkeeping", "per_example")
#: the norm computation each method runs (benchmarks.scaling.norm_peak_bytes); the
#: per-example form (one sequence per backward pass) computes none: one norm over p.grad
CKPT_NORM = {"nonprivate": None, "ghost": "ghost", "randomized": "hutchinson", "bookkeeping": "hutchinson",
             "per_example": None}
#: methods that do not run under FSDP2 (the per-example form refuses it)
ONE_GPU_METHODS = ("per_example",)


@dataclass(frozen=True)
class Setup:
    """A model on ``gpus`` GPUs (FSDP2 when more than one), one sequence per GPU."""

    name: str
    shape: DecoderShape
    gpus: int


SETUPS = (Setup("Llama-3.2-1B, 1 GPU", LLAMA32_1B, 1), Setup("Llama-3-8B, FSDP2 over 8 GPUs", LLAMA3_8B, 8))


def record_elements(shape: DecoderShape) -> int:
    """Elements per token that book-keeping records for one decoder layer: the linear
    layers' inputs (q/k/v share one, gate/up share one: 3d + ffn) and output gradients
    (q, k, v, o, gate, up, down: 3d + 2 d_kv + 2 ffn)."""
    return (3 * shape.d + shape.ffn) + (3 * shape.d + 2 * shape.d_kv + 2 * shape.ffn)


def checkpointed_terms(shape: DecoderShape, seq_len: int, gpus: int, method: str, *, elem_bytes: int = 2,
                       state_bytes_per_param: int = 16, buffer_bytes_per_param: int = 2,
                       norm_bytes: Optional[int] = None, head: str = "whole",
                       block_size: int = 1024) -> Dict[str, int]:
    """Bytes per GPU of one checkpointed step (the stated model), by term.

    * ``state``, ``buffers``: as :func:`memory_model` (``gpus > 1``: FSDP2-sharded state
      and unsharded buffers); on one GPU the state is whole and the buffers are the bf16
      copies of the weights that autocast keeps for the backward pass (2 bytes/param);
    * ``kept_inputs``: what each checkpointed decoder layer keeps for its recomputation,
      its input, layers x T x d;
    * ``recomputed_layer``: the one layer recomputed at a time in the backward pass, with
      its full activations (:func:`memory_model`'s per-layer figure, 6d + 2 d_kv + 4 ffn
      per token) and the gradients of its backward (gate and up, the hidden state:
      2 ffn + 2d per token);
    * ``head``: the LM head's logits and their gradient, 2 x T x vocab, alive together
      when the loss's backward runs, before any decoder layer is recomputed;
    * ``retained_head``: the two-pass methods (Opacus ghost, randomized two-pass) keep
      the graph for their second pass, with one T x vocab tensor of the loss (measured on
      the meta device: exactly one, tests/test_scaling.py), through the decoder layers'
      first backward;
    * ``records`` (book-keeping): every linear layer's input and output gradient, kept
      until ``optimizer.step()``: :func:`record_elements` per token and layer, plus the
      head's input and output gradient (d + vocab); checkpointing does not shrink them;
    * ``norm``: the method's largest per-layer norm computation (counted: ghost's T x T
      matrices, the sketch's B k (d + p) and chunks);
    * ``running_sum`` (the per-example form): the float32 clipped sum, 4 bytes per
      parameter, alive next to the example's gradient (in ``state``); otherwise its step
      is non-private's.

    The peak (:func:`checkpointed_step_bytes`) is the persistent terms plus the larger of
    the head phase and the layer phase.

    ``head="chunked"``: the package's :class:`opacus_rc.lm_head.ChunkedLMHeadLoss`
    (``block_size`` positions at a time; :func:`chunked_head_terms`, checked against its
    counted peak in tests/test_scaling.py) in the form the method runs it
    (:data:`CKPT_HEAD_FORM`; Opacus ghost cannot use it: refused). The logits terms go
    (``head`` and ``retained_head`` 0); ``chunked_head_kept``: what the head keeps through
    the step (A, H = G W, log-sum-exp and targets, the sketch), in the layer phase too;
    ``chunked_head_phase``: its forward block or weight-gradient sweep (the (V x d)
    gradient itself is in ``state``); the norm term is the body's layers' (the head's norm
    is the chunked head's); book-keeping's records lose the head's (d + vocab).
    """
    if method not in CKPT_METHODS:
        raise ValueError(f"method={method!r} is not supported; accepted values: {CKPT_METHODS}")
    if head not in ("whole", "chunked"):
        raise ValueError(f"head={head!r} is not supported; accepted values: 'whole', 'chunked'")
    chunked = head == "chunked"
    if chunked and method not in CKPT_HEAD_FORM:
        raise ValueError(f"method={method!r} cannot use the chunked head (Opacus ghost clipping is refused by it)")
    t, b = seq_len, elem_bytes
    if gpus > 1:
        rest = memory_model(shape, seq_len, gpus)
        state, buffers = rest["state"], rest["buffers"]
    else:
        state, buffers = state_bytes_per_param * shape.params(), buffer_bytes_per_param * shape.params()
    if norm_bytes is None:
        kind = CKPT_NORM[method]
        norm_bytes = 0 if kind is None else max(
            norm_peak_bytes(kind, d, p, seq_len) for name, (d, p) in shape.linear_shapes().items()
            if not (chunked and name == "lm_head"))
    two_pass = method in ("ghost", "randomized")
    t_logits = 0 if chunked else t
    head_kept = head_phase = 0
    if chunked:
        hterms = chunked_head_terms(1, t, shape.d, shape.vocab, block_size, form=CKPT_HEAD_FORM[method],
                                    hidden_bytes=b, compute_bytes=2 if b < 4 else 4)
        head_kept, head_phase = chunked_head_kept(hterms), chunked_head_phase(hterms, with_weight_grad=False)
    head_record = 0 if chunked else shape.d + shape.vocab
    return {
        "state": state,
        "buffers": buffers,
        "kept_inputs": t * shape.layers * shape.d * b,
        "recomputed_layer": t * b * ((6 * shape.d + 2 * shape.d_kv + 4 * shape.ffn) + (2 * shape.ffn + 2 * shape.d)),
        "head": 2 * t_logits * shape.vocab * b,
        "retained_head": t_logits * shape.vocab * b if two_pass else 0,
        "records": t * b * (shape.layers * record_elements(shape) + head_record)
        if method == "bookkeeping" else 0,
        "bookkeeping_rest": t * b * ((6 * shape.d + 2 * shape.d_kv + 4 * shape.ffn) + (2 * shape.ffn + 2 * shape.d)
                                     - record_elements(shape)) if method == "bookkeeping" else 0,
        "norm": norm_bytes,
        "chunked_head_kept": head_kept,
        "chunked_head_phase": head_phase,
        "running_sum": 4 * shape.params() if method == "per_example" else 0,
    }


def checkpointed_step_bytes(terms: Dict[str, int], method: str) -> int:
    """Peak of the checkpointed step from :func:`checkpointed_terms`: state, buffers, kept
    inputs and the norm term throughout, plus the larger of the head phase (logits and their
    gradient) and the layer phase (one recomputed layer, and the two-pass methods' retained
    loss tensor). Book-keeping's records already hold the head's gradient and every linear
    layer's input and output gradient, so it adds the logits (T x vocab) or the rest of the
    recomputed layer (``bookkeeping_rest``), the larger. With the chunked head its kept
    tensors count throughout and its block phase replaces the logits."""
    base = (terms["state"] + terms["buffers"] + terms["kept_inputs"] + terms["norm"] + terms["chunked_head_kept"]
            + terms.get("running_sum", 0))
    if method == "bookkeeping":
        return base + terms["records"] + max(terms["head"] // 2 + terms["chunked_head_phase"],
                                             terms["bookkeeping_rest"])
    return base + max(terms["head"] + terms["chunked_head_phase"], terms["recomputed_layer"] + terms["retained_head"])


def binding_terms(terms: Dict[str, int], method: str) -> List[Tuple[str, int]]:
    """The terms of the checkpointed step that count towards its peak, largest first."""
    head = "head_block" if terms["chunked_head_phase"] else "head"
    layer = "layer_phase" if terms["retained_head"] else "recomputed_layer"
    phase = {head: terms["head"] + terms["chunked_head_phase"],
             layer: terms["recomputed_layer"] + terms["retained_head"]}
    if method == "bookkeeping":
        phase = {head: terms["head"] // 2 + terms["chunked_head_phase"], "layer_phase": terms["bookkeeping_rest"]}
    names = {"state": terms["state"], "buffers": terms["buffers"], "kept_inputs": terms["kept_inputs"],
             "norm": terms["norm"], "records": terms["records"], "chunked_head_kept": terms["chunked_head_kept"],
             "running_sum": terms.get("running_sum", 0), **phase}
    return sorted(((k, v) for k, v in names.items() if v), key=lambda kv: -kv[1])


def binding_term(terms: Dict[str, int], method: str) -> str:
    """The largest single term of the checkpointed step."""
    return binding_terms(terms, method)[0][0]


@dataclass
class CkptRow:
    """One (setup, method, T) of the checkpointed tables (bytes per GPU)."""

    setup: str
    method: str
    seq_len: int
    terms: Dict[str, int]
    step_bytes: int
    binding: str


def ckpt_row(setup: Setup, method: str, seq_len: int, head: str = "whole", block_size: int = 1024) -> CkptRow:
    """``head="chunked"``: the chunked head where the method can use it (Opacus ghost keeps
    its whole logits: the chunked head refuses it)."""
    if method not in CKPT_HEAD_FORM:
        head = "whole"
    terms = checkpointed_terms(setup.shape, seq_len, setup.gpus, method, head=head, block_size=block_size)
    return CkptRow(setup.name, method, seq_len, terms, checkpointed_step_bytes(terms, method),
                   binding_term(terms, method))


def longest_fitting_ckpt(setup: Setup, method: str, budget_bytes: float, step: int = 1024,
                         limit: int = 1 << 18, head: str = "whole", block_size: int = 1024) -> int:
    """The longest checkpointed T (a multiple of ``step``, at most ``limit``: 256K by
    default) that fits ``budget_bytes`` per GPU (0 if none); bisection, the step memory
    grows with T."""
    lo, hi = 0, limit // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ckpt_row(setup, method, mid * step, head, block_size).step_bytes <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo * step


TERM_NAMES = {"state": "state", "buffers": "buffers", "kept_inputs": "kept layer inputs",
              "recomputed_layer": "recomputed layer", "head": "logits + gradient",
              "layer_phase": "recomputed layer (+ retained loss tensor)", "norm": "norm term",
              "records": "book-keeping records", "chunked_head_kept": "chunked head's kept A, H",
              "head_block": "chunked head's block", "running_sum": "running clipped sum"}


def _records_cell(x: Dict[str, int]) -> str:
    return _gb(x["records"]) if x["records"] else "-"


def _rows_tables(rows: List[CkptRow], caption: str, columns: Sequence[Tuple[str, Any]]) -> List[str]:
    """One markdown table per setup of ``rows``: T, method, ``columns`` (header, cell of
    the terms), state + buffers, whole step, what binds."""
    lines = []
    for setup in dict.fromkeys(r.setup for r in rows):
        headers = ["T", "method", *(h for h, _ in columns), "state + buffers", "whole step", "binds"]
        lines += [f"**{setup}**, checkpointing per decoder layer, {caption}bf16; GB = 1e9 bytes per GPU.",
                  "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        for r in (r for r in rows if r.setup == setup):
            x = r.terms
            cells = [f"{r.seq_len:,}", r.method, *(cell(x) for _, cell in columns),
                     _gb(x["state"] + x["buffers"]), _gb(r.step_bytes), TERM_NAMES[r.binding]]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def ckpt_markdown(rows: List[CkptRow], longest: Dict[Tuple[str, str, float], Tuple[int, str]],
                  title: str = "") -> str:
    lines = _rows_tables(rows, "one sequence per GPU, ", [
        ("norm term", lambda x: _gb(x["norm"])),
        ("kept inputs", lambda x: _gb(x["kept_inputs"])),
        ("recomputed layer (+ retained loss tensor)",
         lambda x: _gb(x["recomputed_layer"]) + (f" (+{_gb(x['retained_head'])})" if x["retained_head"] else "")),
        ("logits + gradient", lambda x: _gb(x["head"])),
        ("book-keeping records", _records_cell),
    ])
    budgets = sorted({b for _, _, b in longest})
    lines += ([title, ""] if title else []) + [
              "| setup | method | " + " | ".join(f"longest T in {b / GB:.0f} GB (largest terms just past it, GB)"
                                                for b in budgets) + " |",
              "|---|---|" + "---|" * len(budgets)]
    for setup, method in dict.fromkeys((s, m) for s, m, _ in longest):
        cells = []
        for b in budgets:
            t, bind = longest[(setup, method, b)]
            cells.append(f"{t:,} ({bind})" if t else f"none ({bind})")
        lines.append(f"| {setup} | {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def chunked_markdown(rows: List[CkptRow], block_size: int) -> str:
    """The checkpointed rows with the chunked head (no logits term): its kept tensors and
    its block phase in place of the logits."""
    lines = _rows_tables(rows, f"chunked head (block {block_size:,}), one sequence per GPU, ", [
        ("norm term", lambda x: _gb(x["norm"])),
        ("kept inputs", lambda x: _gb(x["kept_inputs"])),
        ("recomputed layer", lambda x: _gb(x["recomputed_layer"])),
        ("chunked head: kept (A, H, ...)", lambda x: _gb(x["chunked_head_kept"])),
        ("chunked head: block phase", lambda x: _gb(x["chunked_head_phase"])),
        ("book-keeping records", _records_cell),
    ])
    return "\n".join(lines) + "\n"


def describe_binding(terms: Dict[str, int], method: str, count: int = 3) -> str:
    """The largest terms, e.g. ``"logits + gradient 56.4, state 24.1, norm term 48.9"``."""
    return ", ".join(f"{TERM_NAMES.get(k, k)} {_gb(v)}" for k, v in binding_terms(terms, method)[:count])


def checkpointed_tables(seq_lens: Sequence[int], budgets: Sequence[float], head: str = "whole",
                        block_size: int = 1024, with_rows: bool = True, limit: int = 1 << 18):
    """Rows at ``seq_lens`` and the longest T (at most ``limit``) per budget for every setup
    and method; the binding terms are those of the first T past the longest (1024 more)."""
    def methods(s: Setup) -> List[str]:
        return [m for m in CKPT_METHODS if s.gpus == 1 or m not in ONE_GPU_METHODS]

    rows = [ckpt_row(s, m, t, head, block_size) for s in SETUPS for t in seq_lens for m in methods(s)] \
        if with_rows else []
    longest = {}
    for s in SETUPS:
        for m in methods(s):
            for b in budgets:
                t = longest_fitting_ckpt(s, m, b, head=head, block_size=block_size, limit=limit)
                past = ckpt_row(s, m, t + 1024, head, block_size)
                longest[(s.name, m, b)] = (t, describe_binding(past.terms, m))
    return rows, longest


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--seq-lens", default="8192,32768,131072")
    parser.add_argument("--budgets-gb", default="80,141", help="GPU memory sizes for the longest-T table")
    parser.add_argument("--sketch-size", type=int, default=32)
    parser.add_argument("--ckpt-seq-lens", default="16384,65536,131072,262144",
                        help="T of the checkpointed tables")
    parser.add_argument("--block-size", type=int, default=1024,
                        help="positions per block of the chunked LM head (opacus_rc.lm_head) in its tables")
    parser.add_argument("--chunked-limit", type=int, default=1 << 20,
                        help="largest T searched for the longest-T table with the chunked head")
    parser.add_argument("--no-checkpointed", action="store_true", help="only the table without checkpointing")
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
    ckpt_rows, ckpt_longest, chunked_rows, chunked_longest, validation = [], {}, [], {}, []
    if not args.no_checkpointed:
        ckpt_lens = [int(t) for t in args.ckpt_seq_lens.split(",") if t]
        ckpt_rows, ckpt_longest = checkpointed_tables(ckpt_lens, budgets)
        print(ckpt_markdown(ckpt_rows, ckpt_longest, "Longest T, checkpointed (logits whole, as the whole-head modes of benchmarks/gpu.py):"))
        chunked_rows, chunked_longest = checkpointed_tables(ckpt_lens, budgets, head="chunked",
                                                            block_size=args.block_size, limit=args.chunked_limit)
        chunked_rows = [r for r in chunked_rows if r.method in CKPT_HEAD_FORM]
        print(chunked_markdown(chunked_rows, args.block_size))
        print(ckpt_markdown([], chunked_longest, f"Longest T, checkpointed, with the chunked head "
                                                 f"(ChunkedLMHeadLoss, block {args.block_size:,}; at most "
                                                 f"{args.chunked_limit:,}; Opacus ghost keeps its logits whole):"))
        validation = validate_chunked_head(sketch_size=args.sketch_size)
        print("The chunked head's modelled peak (chunked_head_terms) against its counted peak "
              "(benchmarks.lm_head.head_peak_bytes):\n")
        print(validation_markdown(validation))
        print("Without activation checkpointing (the earlier model):\n")
    print(markdown(rows, longest, shape, args.gpus), end="")
    if args.json:
        record = {
            "shape": asdict(shape), "gpus": args.gpus, "sketch_size": args.sketch_size,
            "rows": [{**asdict(r), "step_bytes": r.step_bytes} for r in rows],
            "longest": [{"method": m, "budget_bytes": b, "seq_len": t} for (m, b), t in longest.items()],
            "checkpointed": {
                "setups": [{"name": s.name, "shape": asdict(s.shape), "gpus": s.gpus} for s in SETUPS],
                "rows": [asdict(r) for r in ckpt_rows],
                "longest": [{"setup": s, "method": m, "budget_bytes": b, "seq_len": t, "binds": bind}
                            for (s, m, b), (t, bind) in ckpt_longest.items()],
                "chunked_head": {
                    "block_size": args.block_size, "limit": args.chunked_limit,
                    "rows": [asdict(r) for r in chunked_rows],
                    "longest": [{"setup": s, "method": m, "budget_bytes": b, "seq_len": t, "binds": bind,
                                 "head": "chunked" if m in CKPT_HEAD_FORM else "whole"}
                                for (s, m, b), (t, bind) in chunked_longest.items()],
                    "validation": validation,
                },
            },
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
