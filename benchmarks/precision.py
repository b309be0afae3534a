"""Precision of the norms, the clip and the update in bf16 (issue 48), against float32.

    python -m benchmarks.precision                   # small: T = 512, 2048; tiny Llama, B = 8
    python -m benchmarks.precision --full --json docs/results/precision.json
    python -m benchmarks.precision --seq-lens 64 --batch 2 --no-progress     # a smoke run

Model: Hugging Face ``LlamaForCausalLM`` from a config (random weights, seeded, nothing
downloaded; :class:`benchmarks.one_sequence.CausalLM`): small, hidden 64, 2 layers, 2 heads,
intermediate 172, vocabulary 512; ``--full``: the one_sequence model (hidden 256, 4 layers,
4 heads, intermediate 688) and B = 16. Random tokens, next-token cross-entropy, mean per
sequence. For each T and each precision:

* ``bf16``: the model converted with ``.to(torch.bfloat16)``; its float32 reference is the
  same values widened (exact), so the differences are the arithmetic's only;
* ``autocast``: float32 parameters under ``torch.autocast(device, dtype=torch.bfloat16)``;
  reference: the same model without autocast.

Measured, as relative errors ``|x - x_32| / |x_32|`` (median and worst over the B sequences):

* ``exact (per-example)``: the per-example form's norm, ``||g_i||`` of one sequence's autograd
  gradient (in the parameters' dtype), reduced in float32;
* ``exact (ghost)``: the two-pass form's norms with the sketch longer than T (exact ghost norms,
  from the half-precision activations and output gradients, accumulated in float32);
* ``sketched (k)``: the two-pass form's sketched norms (k = 32, Hutchinson, one fixed
  ``seed=``: the same sketch in both runs, so the difference is the arithmetic's); the
  sketch's own error against the exact float32 norm is given beside it;
* ``update``: one step of each form at noise 0 (``per_example``, ``two_pass``, ``bookkeeping``;
  sketched norms, the same sketch in both runs) with C the median float32 exact norm (half of
  the sequences clipped): ``||Delta - Delta_32|| / ||Delta_32||`` of the released update
  ``p.grad``.

Wall time is reported, not asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .one_sequence import CausalLM, ModelSize, cpu_model

logger = logging.getLogger("benchmarks.precision")

SMALL = ModelSize(hidden=64, layers=2, heads=2, intermediate=172, vocab=512)
FULL = ModelSize()
QUICK_SEQ_LENS = (512, 2048)
SKETCH_SIZE = 32
FORMS = {
    "per_example": dict(per_example_backward=True),
    "two_pass": dict(grad_sample_mode="ghost", per_example_backward=False),
    # a plain loss the script averages is refused in half precision (the mean's 1/n rounds into every
    # example's gradient): this form's loss is summed over the sequences, its update the noisy sum
    "bookkeeping": dict(grad_sample_mode="bookkeeping", per_example_backward=False, loss_reduction="sum"),
}
PRECISIONS = ("bf16", "autocast")


def relative(x: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    return ((x.double() - reference.double()).abs() / reference.double().abs()).flatten()


def summary(errors: torch.Tensor) -> Dict[str, float]:
    return {"median": float(errors.median()), "worst": float(errors.max())}


def build(size: ModelSize, seq_len: int, dtype: torch.dtype, seed: int = 0) -> CausalLM:
    """The seeded model in ``dtype`` (a bf16 model's float32 reference: ``build(..., bf16).float()``)."""
    torch.manual_seed(seed)
    model = CausalLM(size, max_len=seq_len).to(dtype)
    model.train()
    return model


def tokens(batch: int, seq_len: int, vocab: int, seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, vocab, (batch, seq_len + 1), generator=torch.Generator().manual_seed(seed))
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _cast(autocast: bool, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()


def sequence_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Each sequence's mean token loss, averaged (``"mean"``) or summed (``"sum"``) over the sequences."""
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    per_sequence = per_token.view(targets.shape).mean(dim=1)
    return per_sequence.sum() if reduction == "sum" else per_sequence.mean()


def exact_norms(model: nn.Module, x: torch.Tensor, y: torch.Tensor, autocast: bool) -> torch.Tensor:
    """The per-example form's norms: one sequence per backward pass, ``||p.grad||`` of every
    parameter reduced in float32."""
    params = [p for p in model.parameters() if p.requires_grad]
    norms = []
    for i in range(x.shape[0]):
        with _cast(autocast, x.device):
            loss = sequence_loss(model(x[i : i + 1]), y[i : i + 1])
        grads = torch.autograd.grad(loss, params)
        norms.append(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(list(grads), dtype=torch.float32))))
    return torch.stack(norms)


def _private(model: nn.Module, form: str, x: torch.Tensor, y: torch.Tensor, clip: float, sketch_size: int) -> Tuple:
    from opacus import PrivacyEngine

    import opacus_rc  # noqa: F401  (registers clipping="randomized")

    data = torch.utils.data.TensorDataset(x, y)
    return PrivacyEngine(accountant="rc_prv").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), criterion=nn.CrossEntropyLoss(),
        data_loader=torch.utils.data.DataLoader(data, batch_size=x.shape[0]), noise_multiplier=0.0,
        max_grad_norm=clip, clipping="randomized", sample_rate=1.0, sketch_size=sketch_size,
        seed=3, **FORMS[form],
    )


def _loss(module: nn.Module, criterion: Optional[Any], x: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    logits = module(x)
    if criterion is None:
        return sequence_loss(logits, y, reduction)
    return criterion(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), shape=logits.shape[:2])


def two_pass_norms(model: nn.Module, x: torch.Tensor, y: torch.Tensor, autocast: bool, sketch_size: int) -> torch.Tensor:
    """The two-pass form's per-example norms of one step (its first backward pass)."""
    module, optimizer, criterion, loader = _private(model, "two_pass", x, y, 1.0, sketch_size)
    xb, yb = next(iter(loader))
    with _cast(autocast, x.device):
        loss = _loss(module, criterion, xb, yb)
    loss.backward()
    norms = module.per_sample_gradient_norms.detach().float().clone()
    optimizer.zero_grad()
    return norms


def released_update(model: nn.Module, form: str, x: torch.Tensor, y: torch.Tensor, autocast: bool, clip: float) -> torch.Tensor:
    """One step of ``form`` at noise 0: the released update (``p.grad``), flattened, float64."""
    module, optimizer, *rest = _private(model, form, x, y, clip, SKETCH_SIZE)
    *criterion, loader = rest
    seen: Dict[str, torch.Tensor] = {}

    def keep(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
        seen["update"] = torch.cat([p.grad.double().flatten() for p in optimizer.params])

    optimizer.original_optimizer.register_step_pre_hook(keep)
    for xb, yb in loader:
        with _cast(autocast, x.device):
            loss = _loss(module, criterion[0] if criterion else None, xb, yb, FORMS[form].get("loss_reduction", "mean"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if not optimizer._is_last_step_skipped:
            return seen["update"]
    raise RuntimeError("the loader ended before a step was taken")


def measure(size: ModelSize, seq_len: int, batch: int, precision: str, progress: Any) -> Dict[str, Any]:
    """Every figure of one (T, precision) row (module docstring)."""
    autocast = precision == "autocast"
    x, y = tokens(batch, seq_len, size.vocab)

    def pair() -> Tuple[nn.Module, nn.Module]:
        low = build(size, seq_len, torch.float32 if autocast else torch.bfloat16)
        return low, build(size, seq_len, low.lm.dtype).float()

    row: Dict[str, Any] = {"seq_len": seq_len, "batch": batch, "precision": precision}
    low, ref = pair()
    exact32 = exact_norms(ref, x, y, False)
    row["exact_per_example"] = summary(relative(exact_norms(low, x, y, autocast), exact32))
    progress.update()
    norms = {}
    for k in (seq_len, SKETCH_SIZE):  # a sketch as long as the sequence: exact ghost norms
        low, ref = pair()
        norms[k] = two_pass_norms(low, x, y, autocast, k), two_pass_norms(ref, x, y, False, k)
        progress.update()
    row["exact_ghost"] = summary(relative(*norms[seq_len]))
    row["sketched"] = summary(relative(*norms[SKETCH_SIZE]))
    row["sketch_vs_exact_float32"] = summary(relative(norms[SKETCH_SIZE][1], exact32))
    row["ghost_vs_per_example_float32"] = summary(relative(norms[seq_len][1], exact32))  # a check: both exact
    clip = float(exact32.median())
    row["clip"] = clip
    for form in FORMS:
        low, ref = pair()
        got, want = released_update(low, form, x, y, autocast, clip), released_update(ref, form, x, y, False, clip)
        row[f"update_{form}"] = float((got - want).norm() / want.norm())
        progress.update()
    return row


def markdown(rows: List[Dict[str, Any]]) -> str:
    def pct(s: Dict[str, float]) -> str:
        return f"{100 * s['median']:.2g}% / {100 * s['worst']:.2g}%"

    lines = [
        "| T | precision | exact norm, per-example | exact norm, ghost | sketched norm (k = 32) | "
        "sketch vs exact (fp32) | update: per-example / two-pass / book-keeping |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        updates = " / ".join(f"{100 * r[f'update_{f}']:.2g}%" for f in FORMS)
        lines.append(
            f"| {r['seq_len']} | {r['precision']} | {pct(r['exact_per_example'])} | {pct(r['exact_ghost'])} | "
            f"{pct(r['sketched'])} | {pct(r['sketch_vs_exact_float32'])} | {updates} |"
        )
    return "\n".join(lines) + "\n\nNorms: relative error against float32, median / worst over the sequences.\n"


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="the one_sequence model (hidden 256, 4 layers), B = 16")
    parser.add_argument("--seq-lens", default=None, help="comma-separated T (default 512,2048)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 8; --full 16)")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help=f"a subset of {','.join(PRECISIONS)}")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 holds up on a loaded machine)")
    parser.add_argument("--json", default=None, help="write the results here (e.g. docs/results/precision.json)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        args.seq_lens = [int(t) for t in args.seq_lens.split(",")] if args.seq_lens else list(QUICK_SEQ_LENS)
    except ValueError:
        parser.error("--seq-lens takes comma-separated integers")
    args.batch = args.batch or (16 if args.full else 8)
    args.precisions = [p for p in args.precisions.split(",") if p]
    if any(p not in PRECISIONS for p in args.precisions):
        parser.error(f"--precisions: a subset of {','.join(PRECISIONS)}; got {args.precisions}")
    if min(args.seq_lens + [args.batch, args.threads]) < 1:
        parser.error("T, --batch and --threads must be positive")
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    from tqdm import tqdm

    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for name in ("transformers", "opacus_rc", "opacus"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    size = FULL if args.full else SMALL
    started, load_start = time.perf_counter(), os.getloadavg()
    jobs = [(t, p) for t in args.seq_lens for p in args.precisions]
    rows = []
    with tqdm(total=len(jobs) * (3 + len(FORMS)), unit="part", disable=args.no_progress, leave=False) as progress:
        for seq_len, precision in jobs:
            progress.set_description(f"T={seq_len} {precision}")
            rows.append(measure(size, seq_len, args.batch, precision, progress))
    wall = time.perf_counter() - started
    logger.info("done in %.0f s", wall)
    text = markdown(rows)
    sys.stdout.write(text)
    if args.json:
        record = {
            "command": "python -m benchmarks.precision " + " ".join(sys.argv[1:] if argv is None else argv),
            "torch": torch.__version__, "threads": args.threads, "cpu": cpu_model(), "machine": platform.machine(),
            "wall_s": wall, "load_average_start": load_start, "load_average_end": os.getloadavg(),
            "model": size.__dict__, "sketch_size": SKETCH_SIZE, "rows": rows, "markdown": text,
        }
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
