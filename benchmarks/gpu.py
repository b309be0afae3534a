"""One-shot GPU benchmark: a Llama-3.2-1B-shaped decoder at long T, every DP mode side by side.

    bash scripts/gpu_bench.sh                          # one large GPU, at most ~10 minutes
    bash scripts/gpu_bench.sh --device cpu --tiny      # the same code paths in seconds (CI)

Model: Hugging Face ``LlamaForCausalLM`` from a config shaped like Llama-3.2-1B (d = 2048,
16 layers, 32 query / 8 key-value heads, SwiGLU 8192, vocabulary 128,256; untied head so
that every mode can run it), random weights, bf16 autocast, batch 1, T in {4096, 16384,
65536}. Modes: ``nonprivate``, ``opacus_hooks`` (per-sample gradients), ``opacus_ghost``,
``randomized`` (two passes) and ``randomized_bk`` (book-keeping), k = 32; and with activation
checkpointing (Hugging Face's, one checkpoint per decoder layer, **reentrant**:
``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})`` +
``enable_input_require_grads()``) at T in {16384, 65536, 131072}: ``nonprivate_ckpt_chunked``
and ``randomized_ckpt_chunked`` (the package's chunked LM head and loss,
:class:`opacus_rc.lm_head.ChunkedLMHeadLoss` from ``from_causal_lm(model, --block-size)`` on
``hidden_states(model, ...)``: no T x vocab logits; non-private it is a plain fused head +
loss, randomized it is the two-pass criterion, ``grad_sample_mode="ghost"``),
``nonprivate_ckpt``, ``randomized_ckpt`` (randomized clipping in its default mode,
``grad_sample_mode="hooks"``, whatever form that mode takes under checkpointing) and
``opacus_ghost_ckpt``, in that order at each T: the chunked head first, Opacus ghost (its
T x T norm term; out of memory at T = 131072 by docs/scaling.md's model) last. Each
(mode, T) gets a fresh model (built on the device), one warm-up step (its loss is recorded:
``warmup_loss``, chunked and whole heads agree) and ``--steps`` timed steps (``--long-steps``
above T = 16384); the JSON records the median step time and
``torch.cuda.max_memory_allocated``, an out-of-memory error as ``"oom"`` (the run goes on),
and, from one more untimed step at T <= ``--sync-max-seq-len``, the operations that make the
host wait (``syncing_ops_per_step``, by site: :mod:`benchmarks.host_sync`, any device) and on
CUDA the synchronisations ``torch.cuda.set_sync_debug_mode("warn")`` reports
(``host_syncs_per_step``). The optimizer is fused SGD, which skips a refused step on the
device (no host synchronisation for the non-finite check). Hugging Face's mask code
reads one value per forward pass (``find_packed_sequence_indices``), in every mode. Configurations that would
start after ``--time-budget-s``, or whose predicted duration (the same mode's last step time
scaled by (T / T_last)², attention's growth) would end past it, are recorded as skipped.

bf16 parameters (issue 48; ``--bf16-params``, default ``nonprivate_ckpt``, ``randomized_ckpt``,
``per_example_ckpt``, ``per_example_ckpt_chunked``; ``''`` for none): each of these modes also
runs, right after its float32 run at each T, on the model converted with
``.to(torch.bfloat16)`` (no float32 master weights: half the parameter and gradient memory;
the clipped sums and the noise stay float32, one gradient-sized buffer). Records carry
``"params": "float32"`` or ``"bfloat16"``.

Schedule: 30 float32 configurations and 12 bf16-parameter ones in one call of at most 600 s
(``--time-budget-s 540``; a bf16 run past the budget is recorded as skipped). Not yet
run on a GPU, so the budget is estimated (H200, about 300 TFLOP/s sustained): the
configurations up to T = 65536 in about 4-5 minutes (the five uncheckpointed modes at 65536
are expected to run out of memory within seconds), then at 131072 the two chunked-head
modes (about 40 s and 75 s), the whole-head non-private and randomized modes, and Opacus
ghost last, which runs out of memory (docs/scaling.md) or, if the budget is spent, is
recorded as skipped.

Without CUDA (and without ``--device cpu``) it says so in one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .host_sync import HostSyncCounter

logger = logging.getLogger(__name__)

PLAIN_MODES = ("nonprivate", "opacus_hooks", "opacus_ghost", "randomized", "randomized_bk")
#: the checkpointed modes in the order they run at each T: the chunked head first, Opacus
#: ghost (out of memory at the longest T) last
CKPT_MODES = ("nonprivate_ckpt_chunked", "randomized_ckpt_chunked", "per_example_ckpt_chunked", "nonprivate_ckpt",
              "randomized_ckpt", "per_example_ckpt", "opacus_ghost_ckpt")
#: the modes with the chunked LM head (opacus_rc.lm_head.ChunkedLMHeadLoss)
CHUNKED_MODES = ("nonprivate_ckpt_chunked", "randomized_ckpt_chunked", "per_example_ckpt_chunked")
#: the per-example form (one sequence per backward pass, exact clipping; the chunked head a
#: plain loss): make_private(..., per_example_backward=True)
PER_EXAMPLE_MODES = ("per_example_ckpt_chunked", "per_example_ckpt")
MODES = PLAIN_MODES + CKPT_MODES
#: the modes that also run with bf16 parameters (``model.to(torch.bfloat16)``: no float32 master
#: weights; issue 48, the set-up that crashed the per-example form), right after their float32 run
BF16_PARAM_MODES = ("nonprivate_ckpt", "randomized_ckpt", "per_example_ckpt", "per_example_ckpt_chunked")
#: positions per block of the chunked head on the full shape (one block's logits: 1024 x
#: 128,256 float32, 0.5 GB)
BLOCK_SIZE = 1024
#: where the full run writes its JSON (generated results live in docs/results/)
RESULT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "results", "gpu_bench.json")
FULL = dict(vocab=128256, d=2048, layers=16, heads=32, kv_heads=8, ffn=8192, seq_lens=(4096, 16384, 65536),
            ckpt_seq_lens=(16384, 65536, 131072), block_size=BLOCK_SIZE)
TINY = dict(vocab=512, d=64, layers=2, heads=4, kv_heads=2, ffn=128, seq_lens=(64, 128), ckpt_seq_lens=(128,),
            block_size=32)  # several blocks at T = 128
#: the grad-sample mode each private mode runs with
GRAD_SAMPLE_MODE = {"opacus_hooks": "hooks", "opacus_ghost": "ghost", "randomized": "ghost", "randomized_bk": "hooks",
                    "opacus_ghost_ckpt": "ghost", "randomized_ckpt": "hooks", "randomized_ckpt_chunked": "ghost",
                    "per_example_ckpt_chunked": "hooks", "per_example_ckpt": "hooks"}


def enable_reentrant_checkpointing(model: nn.Module) -> None:
    """Hugging Face activation checkpointing on a ``PreTrainedModel``, one checkpoint per
    decoder layer, reentrant (``activation_checkpointing_enable`` in transformers >= 5.x,
    else ``gradient_checkpointing_enable``), with ``enable_input_require_grads()``: a
    reentrant checkpoint needs an input that requires grad. Leaves the model in train mode
    (Hugging Face checkpoints only in training)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    else:  # transformers 4.x
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    model.train()


def build_model(cfg: Dict[str, Any], max_len: int, device: torch.device, checkpointing: bool = False,
                bf16_params: bool = False) -> nn.Module:
    """``LlamaForCausalLM`` with random weights (float32 master weights; bf16 autocast);
    ``checkpointing``: one reentrant checkpoint per decoder layer; ``bf16_params``: converted
    with ``.to(torch.bfloat16)`` (the same values, rounded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=cfg["vocab"], hidden_size=cfg["d"], intermediate_size=cfg["ffn"],
        num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"], max_position_embeddings=max_len,
        tie_word_embeddings=False, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs (no 6 GB host init and copy per configuration)
        model = LlamaForCausalLM(config)
    if bf16_params:
        model.to(torch.bfloat16)
    if checkpointing:
        enable_reentrant_checkpointing(model)
    return model


class Runner:
    """One mode on one model: ``step(tokens)`` runs forward, backward(s) and the optimizer."""

    def __init__(self, mode: str, model: nn.Module, batch: torch.Tensor, device: torch.device,
                 block_size: int = BLOCK_SIZE) -> None:
        self.mode, self.model, self.device = mode, model, device
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, fused=True)  # device-side skip: no host sync
        self.criterion = self.head_loss = None
        if mode in CHUNKED_MODES:  # labels aligned with the positions (targets = tokens[:, 1:])
            from opacus_rc.lm_head import from_causal_lm

            self.head_loss = from_causal_lm(model, block_size, shift_labels=False)
        if mode in ("nonprivate", "nonprivate_ckpt", "nonprivate_ckpt_chunked"):
            self.module, self.optimizer = model, optimizer
            return
        from opacus import PrivacyEngine

        import opacus_rc  # noqa: F401  registers clipping="randomized" and accountant="rc_prv"

        randomized = mode.startswith(("randomized", "per_example"))
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(batch.cpu()), batch_size=len(batch))
        # batch 1 would choose the per-example form by itself: the sketched modes ask for theirs
        extra = {"clipping": "randomized", "sketch_size": 32, "per_example_backward": mode in PER_EXAMPLE_MODES} if randomized else {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = PrivacyEngine(accountant="rc_prv" if randomized else "prv").make_private(
                module=model, optimizer=optimizer, criterion=self.head_loss or nn.CrossEntropyLoss(), data_loader=loader,
                noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False,
                grad_sample_mode=GRAD_SAMPLE_MODE[mode], wrap_model=False, **extra,
            )
        self.module, self.optimizer = model, out[1]
        if len(out) == 4:
            self.criterion = out[2]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One step; returns the loss, detached (reading it is left to the caller)."""
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        positions = torch.arange(inputs.shape[1], device=self.device).repeat(inputs.shape[0], 1)
        if self.head_loss is not None:  # the chunked head: hidden states in, no T x vocab logits
            from opacus_rc.lm_head import hidden_states

            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                hidden = hidden_states(self.model, input_ids=inputs, position_ids=positions, use_cache=False)
                loss = (self.criterion or self.head_loss)(hidden, targets)
            del hidden
            return self._finish(loss)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            logits = self.model(input_ids=inputs, position_ids=positions, use_cache=False).logits
        flat = logits.reshape(-1, logits.shape[-1])  # bf16: no float32 copy of T x vocab
        if self.criterion is not None:  # ghost modes: per-sequence loss, two passes
            loss = self.criterion(flat, targets.reshape(-1), shape=logits.shape[:2])
        else:
            loss = F.cross_entropy(flat, targets.reshape(-1))
        del logits, flat
        return self._finish(loss)

    def _finish(self, loss) -> torch.Tensor:
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def count_syncs(runner: Runner, tokens: torch.Tensor, device: torch.device) -> Dict[str, Any]:
    """One more, untimed step: the syncing operations the dispatcher sees, by site (any
    device; :mod:`benchmarks.host_sync`) and, on CUDA, the synchronisations
    ``torch.cuda.set_sync_debug_mode("warn")`` reports."""
    cuda = device.type == "cuda"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with HostSyncCounter() as ops:
                runner.step(tokens)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    out: Dict[str, Any] = {"syncing_ops_per_step": ops.by_site()}
    if cuda:
        out["host_syncs_per_step"] = sum("synchroniz" in str(w.message).lower() for w in caught)
    return out


def run_one(mode: str, cfg: Dict[str, Any], seq_len: int, steps: int, device: torch.device,
            count_host_syncs: bool = True, block_size: int = BLOCK_SIZE, params: str = "float32") -> Dict[str, Any]:
    """Median step time, peak allocated memory and host syncs of one (mode, T), with
    ``params`` "float32" (master weights, bf16 autocast) or "bfloat16" (the model converted)."""
    checkpointing = mode in CKPT_MODES
    record: Dict[str, Any] = {"mode": mode, "seq_len": seq_len, "checkpointing": "reentrant" if checkpointing else None,
                              "head": "chunked" if mode in CHUNKED_MODES else "whole", "params": params}
    if mode in CHUNKED_MODES:
        record["block_size"] = block_size
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    runner = None
    try:
        gen = torch.Generator().manual_seed(seq_len)
        tokens = torch.randint(0, cfg["vocab"], (1, seq_len + 1), generator=gen).to(device)
        model = build_model(cfg, seq_len + 1, device, checkpointing, bf16_params=params == "bfloat16")
        runner = Runner(mode, model, tokens, device, block_size)
        del model
        record["warmup_loss"] = float(runner.step(tokens))  # warm-up (the read waits for it, untimed)
        times: List[float] = []
        for _ in range(steps):
            start = time.perf_counter()
            runner.step(tokens)
            _sync(device)
            times.append(time.perf_counter() - start)
        record.update(status="ok", median_step_s=statistics.median(times), step_times_s=times)
        if count_host_syncs:
            record.update(count_syncs(runner, tokens, device))
    except (RuntimeError, torch.cuda.OutOfMemoryError) as error:
        if not _is_oom(error):
            raise
        record.update(status="oom", error=str(error).splitlines()[0][:200])
    finally:
        del runner
        gc.collect()
        if device.type == "cuda":
            record["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
            torch.cuda.empty_cache()
    return record


def schedule(modes: Sequence[str], plain_lens: Sequence[int], ckpt_lens: Sequence[int]) -> List[tuple]:
    """(T, mode) in the order they run: T ascending; at each T the modes in ``modes`` order,
    the checkpointed ones at ``ckpt_lens``, the others at ``plain_lens``."""
    out = []
    for seq_len in sorted(set(plain_lens) | set(ckpt_lens)):
        for mode in modes:
            if seq_len in (ckpt_lens if mode in CKPT_MODES else plain_lens):
                out.append((seq_len, mode))
    return out


def predicted_seconds(last: Optional[tuple], seq_len: int, steps: int) -> float:
    """Seconds ``steps`` steps at ``seq_len`` would take from the same mode's last measured
    step (T_last, s): scaled by (T / T_last)², attention's growth (an upper bound for the
    linear layers); 0 without a measurement."""
    if last is None:
        return 0.0
    t_last, seconds = last
    return steps * seconds * (seq_len / t_last) ** 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny model and T (CI, CPU)")
    parser.add_argument("--seq-lens", default=None, help="comma-separated T of the modes without checkpointing")
    parser.add_argument("--ckpt-seq-lens", default=None, help="comma-separated T of the checkpointed modes")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--steps", type=int, default=3, help="timed steps per (mode, T), after one warm-up")
    parser.add_argument("--long-steps", type=int, default=1, help="timed steps above T = 16384")
    parser.add_argument("--sync-max-seq-len", type=int, default=16384,
                        help="count host syncs (one more step) only up to this T")
    parser.add_argument("--time-budget-s", type=float, default=540.0, help="start no configuration after this")
    parser.add_argument("--block-size", type=int, default=None,
                        help=f"positions per block of the chunked LM head (the *_chunked modes; default {BLOCK_SIZE}, "
                             "32 with --tiny)")
    parser.add_argument("--bf16-params", default=",".join(BF16_PARAM_MODES),
                        help="modes that also run with bf16 parameters (model.to(torch.bfloat16)), after their "
                             "float32 run at each T; '' for none")
    parser.add_argument("--out", default=None,
                        help=f"the JSON written (default {RESULT}; with --tiny, gpu_bench_tiny.json in the "
                             "temporary directory)")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = os.path.join(tempfile.gettempdir(), "gpu_bench_tiny.json") if args.tiny else RESULT
    warnings.filterwarnings("ignore", message=".*[Ff]ull backward hook.*")
    warnings.filterwarnings("ignore", message="Secure RNG turned off")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_bench: no CUDA device available (use --device cpu --tiny for the CPU form)")
        return 2
    modes = [m for m in args.modes.split(",") if m]
    bf16_modes = [m for m in args.bf16_params.split(",") if m]
    bad = [m for m in modes + bf16_modes if m not in MODES]
    if bad or args.steps < 1 or args.long_steps < 1 or (args.block_size is not None and args.block_size < 1):
        parser.error(f"--modes accepts {','.join(MODES)}; --steps, --long-steps and --block-size must be positive")
    cfg = dict(TINY if args.tiny else FULL)
    plain_lens = [int(t) for t in args.seq_lens.split(",")] if args.seq_lens else list(cfg["seq_lens"])
    ckpt_lens = [int(t) for t in args.ckpt_seq_lens.split(",")] if args.ckpt_seq_lens else list(cfg["ckpt_seq_lens"])
    cfg.pop("seq_lens"), cfg.pop("ckpt_seq_lens")
    block_size = cfg.pop("block_size") if args.block_size is None else args.block_size
    cfg.pop("block_size", None)
    device = torch.device(args.device)
    started = time.perf_counter()
    results: List[Dict[str, Any]] = []
    last: Dict[tuple, tuple] = {}  # (mode, params) -> (T, seconds per step) of its last successful run
    runs = [(t, m, p) for t, m in schedule(modes, plain_lens, ckpt_lens)
            for p in ("float32", "bfloat16") if p == "float32" or m in bf16_modes]
    for seq_len, mode, params in runs:
        elapsed = time.perf_counter() - started
        steps = args.steps if seq_len <= 16384 else args.long_steps
        count = seq_len <= args.sync_max_seq_len
        predicted = predicted_seconds(last.get((mode, params)), seq_len, steps + 1 + count)
        if elapsed > args.time_budget_s or elapsed + predicted > args.time_budget_s:
            why = "time budget" if elapsed > args.time_budget_s else f"predicted {predicted:.0f} s, over the time budget"
            results.append({"mode": mode, "seq_len": seq_len, "params": params, "status": f"skipped ({why})"})
            print(json.dumps(results[-1]), flush=True)
            continue
        record = run_one(mode, cfg, seq_len, steps, device, count_host_syncs=count, block_size=block_size,
                         params=params)
        if record["status"] == "ok":
            last[mode, params] = (seq_len, record["median_step_s"])
        results.append(record)
        print(json.dumps({k: v for k, v in record.items() if k != "step_times_s"}), flush=True)
    summary = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "model": cfg, "batch": 1, "autocast": "bfloat16", "bf16_params": bf16_modes,
        "steps": args.steps, "long_steps": args.long_steps, "checkpointing": "HF, per decoder layer, reentrant",
        "chunked_head": {"modes": list(CHUNKED_MODES), "block_size": block_size}, "wall_s": time.perf_counter() - started, "results": results,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"gpu_bench: {len(results)} configurations in {summary['wall_s']:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
