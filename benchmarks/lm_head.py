"""Memory and time of the LM head under randomized clipping: the model's own head and
loss (unchunked: the (B, T, V) logits and their gradient) against
:class:`opacus_rc.lm_head.ChunkedLMHeadLoss` (a block of positions at a time).

``python -m benchmarks.lm_head`` (small default, seconds) prints, for each form (two-pass
``ghost``, one-pass book-keeping ``hooks``) and each (T, V), the peak of live bytes
allocated by one training step's forward, backward pass(es) and clipped-gradient
assembly (:class:`examples.profiling.PeakAllocationCounter`; inputs and parameters
excluded), on the meta device (shapes only: nothing is computed, any size fits), and the
median step time on the CPU at a moderate size. Model: hidden states (B, T, d) as input,
``layers`` trainable (d x d) linear layers as the body, then the head (V x d, no bias).

``--device cpu`` measures the memory on real tensors too (small shapes only).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from examples.profiling import PeakAllocationCounter
from opacus_rc.config import SketchConfig
from opacus_rc.forms.bookkeeping import (
    DPLossBookkeeping,
    GradSampleModuleBookkeeping,
    RandomizedClippingBookkeepingOptimizer,
)
from opacus_rc.forms.two_pass import DPLossRandomizedClipping
from opacus_rc.grad_sample import GradSampleModuleRandomizedClipping
from opacus_rc.lm_head import ChunkedLMHeadLoss
from opacus_rc.optimizer import RandomizedClippingOptimizer

FORMS = ("ghost", "hooks")
HEADS = ("unchunked", "chunked")


class BodyAndHead(nn.Module):
    """``layers`` (d x d) linear layers with tanh, then ``head`` (V x d): ``forward``
    returns the final hidden states."""

    def __init__(self, d: int, vocab: int, layers: int = 1) -> None:
        super().__init__()
        self.body = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.body:
            x = torch.tanh(layer(x))
        return x


def _setup(form: str, head: str, *, batch: int, d: int, vocab: int, k: int, block: int, layers: int, device):
    with torch.device(device):
        model = BodyAndHead(d, vocab, layers)
    config = SketchConfig(sketch_size=k)
    opts = dict(noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=batch)
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)
    if form == "ghost":
        gsm = GradSampleModuleRandomizedClipping(model, sketch_config=config, sketch_seed=0, max_grad_norm=1.0)
        opt = RandomizedClippingOptimizer(sgd, sketch_config=config, noise_seed=0, **opts)
    else:
        gsm = GradSampleModuleBookkeeping(model, sketch_config=config, sketch_seed=0)
        opt = RandomizedClippingBookkeepingOptimizer(sgd, sketch_config=config, noise_seed=0, **opts)
    gsm.follow_steps(opt)
    chunked = ChunkedLMHeadLoss(model.head, block_size=block)
    if head == "chunked":
        crit = DPLossRandomizedClipping(gsm, opt, chunked, "mean") if form == "ghost" else None
    else:
        ce = nn.CrossEntropyLoss(ignore_index=-100)
        crit = (DPLossRandomizedClipping if form == "ghost" else DPLossBookkeeping)(gsm, opt, ce, "mean")

    def loss_of(x, y):
        hidden = gsm(x)
        if head == "chunked":
            return crit(hidden, y) if crit is not None else chunked(hidden, y)
        logits = model.head(hidden)
        return crit(logits.reshape(-1, vocab), y.reshape(-1), shape=logits.shape[:2])

    return gsm, opt, loss_of


def _step(form, opt, loss_of, x, y, *, full: bool):
    loss = loss_of(x, y)
    loss.backward()
    if full:
        opt.step()
    elif form == "hooks":
        opt.clip_and_accumulate()  # the assembly of the clipped sums (meta: no step)
    opt.zero_grad(set_to_none=True)
    for p in opt.params:
        p.summed_grad = None


def peak_bytes(form: str, head: str, *, batch=1, seq_len=1024, d=64, vocab=4096, k=32, block=128,
               layers=1, device="meta") -> int:
    """Peak live bytes of one step (forward, backward pass(es), clipped sums)."""
    torch.manual_seed(0)
    gsm, opt, loss_of = _setup(form, head, batch=batch, d=d, vocab=vocab, k=k, block=block, layers=layers, device=device)
    x = torch.randn(batch, seq_len, d, device=device)
    y = torch.randint(0, vocab, (batch, seq_len), device=device)
    with PeakAllocationCounter() as counter:
        _step(form, opt, loss_of, x, y, full=False)
    return counter.peak


class HeadOnly(nn.Module):
    """The head (V x d, no bias) of :class:`BodyAndHead` without a body: ``forward``
    returns its input, the final hidden states."""

    def __init__(self, d: int, vocab: int) -> None:
        super().__init__()
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


HEAD_FORMS = ("plain", "two_pass", "bookkeeping")


def head_peak_bytes(form: str, *, batch: int = 1, seq_len: int = 1024, d: int = 64, vocab: int = 4096,
                    k: int = 32, block: int = 128, device: str = "meta", autocast: bool = False) -> int:
    """Peak live bytes of :class:`ChunkedLMHeadLoss` alone in one step: its forward from
    hidden states A (B, T, d) float32, counted (created inside the count, as the body's
    output would be), its backward pass(es) and, under book-keeping, the assembly of the
    clipped head gradient. The gradient it hands the body is dropped once delivered (the
    body's backward consumes it). ``form``: ``"plain"`` (no privacy: the fused head +
    loss), ``"two_pass"`` (``grad_sample_mode="ghost"``: the criterion, two backward
    passes) or ``"bookkeeping"`` (one pass, clipped sum at ``clip_and_accumulate``);
    Hutchinson, k per-example sketch columns. ``autocast``: bf16 autocast (CPU only: the
    meta device has none), float32 weights."""
    if form not in HEAD_FORMS:
        raise ValueError(f"form={form!r} is not supported; accepted values: {HEAD_FORMS}")
    torch.manual_seed(0)
    with torch.device(device):
        model = HeadOnly(d, vocab)
    config = SketchConfig(sketch_size=k)
    opts = dict(noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=batch)
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)
    chunked = ChunkedLMHeadLoss(model.head, block_size=block)
    gsm = crit = opt = None
    if form == "two_pass":
        gsm = GradSampleModuleRandomizedClipping(model, sketch_config=config, sketch_seed=0, max_grad_norm=1.0)
        opt = RandomizedClippingOptimizer(sgd, sketch_config=config, noise_seed=0, **opts)
        crit = DPLossRandomizedClipping(gsm, opt, chunked, "mean")
    elif form == "bookkeeping":
        gsm = GradSampleModuleBookkeeping(model, sketch_config=config, sketch_seed=0)
        opt = RandomizedClippingBookkeepingOptimizer(sgd, sketch_config=config, noise_seed=0, **opts)
    if gsm is not None:
        gsm.follow_steps(opt)  # objects built by hand: the optimizer clips from this module's records
    x = torch.randn(batch, seq_len, d, device=device)
    y = torch.randint(0, vocab, (batch, seq_len), device=device)
    amp = torch.autocast(device, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with PeakAllocationCounter() as counter:
        hidden = x.clone().requires_grad_(True)  # the body's output
        hidden.register_post_accumulate_grad_hook(lambda t: setattr(t, "grad", None))  # the body consumes it
        with amp:
            out = gsm(hidden) if gsm is not None else hidden
            loss = crit(out, y) if crit is not None else chunked(out, y)
        loss.backward()
        if form == "bookkeeping":
            opt.clip_and_accumulate()
        del out, hidden
    del loss  # alive through the step, as in a training loop
    return counter.peak


def step_times(form: str, *, batch=2, seq_len=512, d=256, vocab=8192, k=32, block=128,
               layers=2, repeats=5) -> Dict[str, float]:
    """Median wall time (s) of a full CPU step (noise multiplier 0) for each head, the
    steps of the two heads interleaved (machine load hits both alike)."""
    torch.manual_seed(0)
    runs = {h: _setup(form, h, batch=batch, d=d, vocab=vocab, k=k, block=block, layers=layers, device="cpu")
            for h in HEADS}
    x = torch.randn(batch, seq_len, d)
    y = torch.randint(0, vocab, (batch, seq_len))
    times: Dict[str, List[float]] = {h: [] for h in HEADS}
    for i in range(repeats + 1):
        for h, (_, opt, loss_of) in runs.items():
            start = time.perf_counter()
            _step(form, opt, loss_of, x, y, full=True)
            if i:  # the first step warms up
                times[h].append(time.perf_counter() - start)
    return {h: statistics.median(v) for h, v in times.items()}


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="meta", help="meta (shapes only) or cpu")
    parser.add_argument("--seq-lens", default="1024,4096,16384", help="T values (memory)")
    parser.add_argument("--vocabs", default="4096,32768", help="V values (memory)")
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--time", action="store_true", help="also time CPU steps (moderate size)")
    parser.add_argument("--time-shape", default="2,512,256,8192", help="B,T,d,V of the timed steps")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=2, help="body layers of the timed model")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows: List[Dict] = []
    print(f"peak live bytes of one step, device={args.device}, B=1, d={args.d}, k={args.k}, block={args.block}")
    print(f"{'form':6} {'T':>6} {'V':>7} {'unchunked MB':>13} {'chunked MB':>11} {'logits (T x V x 4) MB':>22}")
    for vocab in [int(v) for v in args.vocabs.split(",")]:
        for t in [int(v) for v in args.seq_lens.split(",")]:
            for form in FORMS:
                peaks = {h: peak_bytes(form, h, seq_len=t, d=args.d, vocab=vocab, k=args.k, block=args.block,
                                       device=args.device) for h in HEADS}
                rows.append(dict(kind="memory", device=args.device, form=form, T=t, V=vocab, d=args.d,
                                 k=args.k, block=args.block, **{f"{h}_bytes": b for h, b in peaks.items()}))
                print(f"{form:6} {t:6d} {vocab:7d} {peaks['unchunked'] / 2**20:13.1f} "
                      f"{peaks['chunked'] / 2**20:11.1f} {t * vocab * 4 / 2**20:22.1f}")
    if args.time:
        b, t, d, vocab = (int(v) for v in args.time_shape.split(","))
        print(f"median CPU step time, B={b}, T={t}, d={d}, V={vocab}, k={args.k}, block={args.block}, "
              f"{args.layers} body layers, threads={torch.get_num_threads()}")
        for form in FORMS:
            times = step_times(form, batch=b, seq_len=t, d=d, vocab=vocab, k=args.k, block=args.block,
                               layers=args.layers, repeats=args.repeats)
            ratio = times["chunked"] / times["unchunked"]
            rows.append(dict(kind="time", form=form, B=b, T=t, d=d, V=vocab, k=args.k, block=args.block,
                             **{f"{h}_s": s for h, s in times.items()}, ratio=ratio))
            print(f"{form:6} unchunked {times['unchunked'] * 1e3:8.1f} ms  chunked {times['chunked'] * 1e3:8.1f} ms"
                  f"  ratio {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
