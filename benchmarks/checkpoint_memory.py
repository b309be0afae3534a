"""Memory of randomized clipping under activation checkpointing (CPU, one process per case).

``python -m benchmarks.checkpoint_memory [--mode ghost|hooks] [--layers N] [--seq T]``
trains a small ``LlamaForCausalLM`` (random weights, built from a config) for two steps
with Hugging Face gradient checkpointing off, non-reentrant (the default) and reentrant,
and prints one JSON line per case:

* ``live_after_forward``: bytes of the tensors alive when the forward pass returns (the
  activations kept for the backward pass and by the privacy hooks; parameters excluded),
  counted by storage through a dispatch mode;
* ``peak_rss_growth``: peak resident set size during the two steps minus the RSS before
  them (Linux ``/proc``).
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import warnings
import weakref
from typing import Dict, List

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .rss import _status_kib, reset_peak_rss

FORMS = ("none", "non_reentrant", "reentrant")


class LiveTensors(TorchDispatchMode):
    """Remembers (weakly) every tensor an op returns; :meth:`live_bytes` sums the
    distinct storages still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: List[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.refs.append(weakref.ref(t))
        return out

    def live_bytes(self, exclude: List[torch.Tensor]) -> int:
        skip = {t.untyped_storage().data_ptr() for t in exclude}
        seen: Dict[int, int] = {}
        for ref in self.refs:
            t = ref()
            if t is None or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in skip:
                seen[ptr] = storage.nbytes()
        return sum(seen.values())


def build(layers: int) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(cfg)


def run_case(mode: str, form: str, layers: int, seq: int, batch: int = 8) -> Dict[str, object]:
    import opacus_rc  # noqa: F401
    from opacus import PrivacyEngine

    model = build(layers)
    model.train()
    if form != "none":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": form == "reentrant"}
            )
    x = torch.randint(0, 512, (2 * batch, seq), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x), batch_size=batch)
    out = PrivacyEngine(accountant="rc_prv").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        criterion=nn.CrossEntropyLoss(), noise_multiplier=1.0, max_grad_norm=1.0,
        poisson_sampling=False, grad_sample_mode=mode, clipping="randomized",
        sketch_size=32, sketch_seed=0, per_example_backward=False,  # the sketched forms, at any batch
    )
    module, opt = out[0], out[1]
    positions = torch.arange(seq).repeat(batch, 1)
    params = list(model.parameters())

    def loss_of(logits: torch.Tensor, y: torch.Tensor):
        flat = logits.reshape(-1, logits.shape[-1])
        if len(out) == 4:
            return out[2](flat, y.reshape(-1), shape=logits.shape[:2])
        return nn.functional.cross_entropy(flat, y.reshape(-1), reduction="none").view(y.shape).mean(1).mean()

    xb = x[:batch]
    gc.collect()
    baseline = _status_kib("VmRSS")
    reset_peak_rss()
    live = None
    for step in range(2):
        tracker = LiveTensors()
        with tracker:
            logits = module(input_ids=xb, position_ids=positions).logits
        gc.collect()
        if step == 1:
            live = tracker.live_bytes(params) - logits.untyped_storage().nbytes()
        del tracker
        loss_of(logits, xb.roll(-1, 1)).backward()
        del logits
        opt.step()
        opt.zero_grad()
    peak = _status_kib("VmHWM")
    return {"mode": mode, "form": form, "layers": layers, "seq": seq, "batch": batch,
            "live_after_forward": live, "peak_rss_growth": (peak - baseline) * 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="ghost", choices=["ghost", "hooks"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--form", choices=FORMS, help="one case in this process (internal)")
    args = parser.parse_args()
    if args.form:
        torch.set_num_threads(1)
        print(json.dumps(run_case(args.mode, args.form, args.layers, args.seq)))
        return
    for form in FORMS:
        cmd = [sys.executable, "-m", "benchmarks.checkpoint_memory", "--mode", args.mode,
               "--layers", str(args.layers), "--seq", str(args.seq), "--form", form]
        done = subprocess.run(cmd, capture_output=True, text=True)
        print(done.stdout.strip() or done.stderr.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
