"""Main demo: DP training of a small causal decoder with randomized clipping.

An ordinary Opacus ghost-clipping loop; the only change is
``clipping="randomized"`` (and the ``rc_prv`` accountant). Prints the loss, epsilon and
the memory of the per-sample norm computation against Opacus ghost clipping on the same
model and batch (bytes counted operator by operator, see examples/profiling.py).

    python examples/demo.py            # T = 512, batch 16, 40 steps (times: README)
    python examples/demo.py --full     # T = 1024, 60 steps: 105 s on 2 idle CPU cores
    python examples/demo.py --steps 10 --seq-len 2048
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import pathlib
import sys
import time
import warnings

import torch
from opacus import PrivacyEngine
from torch import nn

import opacus_rc  # noqa: F401  registers clipping="randomized" and accountant="rc_prv"

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # repository root: the examples package
from examples import one_thread_unless_set  # noqa: E402
from examples.models import TinyDecoder, markov_text  # noqa: E402
from examples.profiling import NormSamplerMemory  # noqa: E402

# Opacus's notice that secure_mode is off (the default; the README says what it means)
warnings.filterwarnings("ignore", message="Secure RNG turned off", category=UserWarning)
# torch warns when a hooked module's inputs need no gradient (the embedding's token ids):
# Opacus's hooks read only the gradient of the module's output, so it does not apply
warnings.filterwarnings(
    "ignore", category=UserWarning,
    message="Full backward hook is firing when gradients are computed with respect to module outputs since no inputs require gradients",
)


def private_setup(model, data, *, clipping: str, accountant: str, args):
    engine = PrivacyEngine(accountant=accountant)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size)
    extra = {"sketch_size": args.sketch_size, "sketch_seed": args.seed} if clipping == "randomized" else {}
    module, optimizer, criterion, loader = engine.make_private(
        module=model,
        optimizer=optimizer,
        criterion=nn.CrossEntropyLoss(),
        data_loader=loader,
        noise_multiplier=args.noise_multiplier,
        max_grad_norm=1.0,
        grad_sample_mode="ghost",
        clipping=clipping,  # the one flag: "flat" (Opacus ghost) or "randomized"
        **extra,
    )
    return engine, module, optimizer, criterion, loader


def lm_loss(module, criterion, batch):
    # contiguous: Opacus's ghost embedding norm sampler views the token ids.
    inputs, targets = batch[:, :-1].contiguous(), batch[:, 1:]
    logits = module(inputs)
    # Per-sequence privacy unit: Opacus reduces the token losses per sequence.
    return criterion(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), shape=logits.shape[:2])


def norm_memory(model, data, clipping: str, accountant: str, args) -> int:
    """Peak bytes of one layer's per-sample norm computation on one batch."""
    _, module, _, criterion, _ = private_setup(copy.deepcopy(model), data, clipping=clipping, accountant=accountant, args=args)
    batch = data.tensors[0][: args.batch_size]
    with NormSamplerMemory(module) as mem:
        lm_loss(module, criterion, batch).backward()
    return mem.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="default 40 (--full: 60)")
    parser.add_argument("--seq-len", type=int, default=None, help="default 512 (--full: 1024)")
    parser.add_argument("--full", action="store_true", help="the full size: T = 1024, 60 steps")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--dataset-size", type=int, default=1024)
    parser.add_argument("--sketch-size", type=int, default=32)
    parser.add_argument("--noise-multiplier", type=float, default=0.6)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    one_thread_unless_set()  # unless OMP_NUM_THREADS is set: a second thread only waits under load
    args.steps = args.steps or (60 if args.full else 40)
    args.seq_len = args.seq_len or (1024 if args.full else 512)
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(args.seed)

    vocab = 128
    model = TinyDecoder(vocab=vocab, d_model=64, n_layers=2, n_heads=4, max_len=args.seq_len)
    data = torch.utils.data.TensorDataset(
        markov_text(args.dataset_size, args.seq_len, vocab, branching=4, seed=args.seed)
    )

    ghost_bytes = norm_memory(model, data, "flat", "prv", args)
    rc_bytes = norm_memory(model, data, "randomized", "rc_prv", args)

    engine, module, optimizer, criterion, loader = private_setup(
        model, data, clipping="randomized", accountant="rc_prv", args=args
    )
    print(f"DP training, randomized clipping (Hutchinson, k={args.sketch_size}), T={args.seq_len}, "
          f"batch {args.batch_size}, sigma={args.noise_multiplier}")
    print(f"the text is a Markov chain with 4 equally likely next tokens: loss starts near "
          f"ln {vocab} = {math.log(vocab):.2f} (guessing) and cannot go below ln 4 = {math.log(4):.3f}")
    step, start = 0, time.perf_counter()
    while step < args.steps:
        for (batch,) in loader:
            # an empty Poisson batch is a step too (charged; it releases pure noise): skipping
            # it would make the number of updates depend on the draw
            loss = lm_loss(module, criterion, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if len(batch) and (step % 5 == 0 or step == 1):
                print(f"step {step:3d}  loss {loss.item():.3f}  ({time.perf_counter() - start:.0f}s)", flush=True)
            if step == args.steps:
                break
    eps = engine.get_epsilon(delta=1e-5)
    print(f"epsilon = {eps:.2f} at delta = 1e-5 (rc_prv accountant, {step} steps, "
          f"sample rate {1 / len(loader):.4f})")
    print(f"per-sample norm computation, peak memory of one layer on a batch of {args.batch_size} x {args.seq_len}: "
          f"Opacus ghost {ghost_bytes / 2**20:.1f} MiB, randomized {rc_bytes / 2**20:.2f} MiB "
          f"({ghost_bytes / max(rc_bytes, 1):.0f}x less, {100 * (1 - rc_bytes / ghost_bytes):.1f}% saved)")


if __name__ == "__main__":
    main()
