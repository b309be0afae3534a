"""DP LoRA fine-tuning of a Llama-style decoder sharded with FSDP2, with randomized clipping.

    torchrun --nproc_per_node 2 examples/fsdp_finetune.py            # CPU: gloo, about 1 min
    torchrun --nproc_per_node 2 examples/fsdp_finetune.py --steps 200 --seq-len 1024   # GPUs: nccl

The backend follows the hardware: NCCL with one GPU per process when CUDA is available,
gloo on CPU otherwise. Nothing is downloaded: the decoder (Hugging Face ``LlamaForCausalLM``:
RMSNorm, rotary positions, SwiGLU, untied head) is built from a small config with random
weights, and the text is synthetic: sequences of a fixed random "grammar" (each token has 4
possible successors), so the loss can fall from ln 256 = 5.55 (uniform) towards ln 4 = 1.39.

The LoRA A/B factors (r = 8) and the LM head train. The model is sharded by Opacus's ``FSDP2Wrapper`` and made
private with ``grad_sample_mode="ghost_fsdp", clipping="randomized"``: every rank estimates
the per-sample norms of its own Poisson-sampled examples from its local activations, the
clipped gradients are reduce-scattered by FSDP2, each rank noises the shard it owns, and
every rank's ``rc_prv`` accountant is charged once per step (rank 0 prints epsilon).
"""

from __future__ import annotations

import argparse
import functools
import os
import warnings

import torch
import torch.distributed as dist
from opacus import PrivacyEngine
from opacus.utils.fsdp_utils import FSDP2Wrapper
from torch import nn

import opacus_rc  # noqa: F401  registers clipping="randomized" and accountant="rc_prv"

warnings.filterwarnings("ignore", message="Secure RNG turned off")
warnings.filterwarnings("ignore", message=".*full_backward_hook.*")
VOCAB = 256


def grammar_corpus(n: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """``n`` sequences of ``seq_len + 1`` tokens from a random sparse bigram chain (each
    token has 4 equally likely successors): learnable structure without any download."""
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, VOCAB, (VOCAB, 4), generator=gen)
    tokens = torch.empty(n, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (n,), generator=gen)
    for t in range(seq_len):
        choice = torch.randint(0, 4, (n,), generator=gen)
        tokens[:, t + 1] = successors[tokens[:, t], choice]
    return tokens


def build_model(seq_len: int, d_model: int, layers: int) -> nn.Module:
    """A Llama-style decoder with random weights, LoRA (r = 8) on its projections and a
    trainable LM head."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=d_model, intermediate_size=-(-8 * d_model // 3 // 64) * 64,
        num_hidden_layers=layers, num_attention_heads=max(1, d_model // 64),
        num_key_value_heads=max(1, d_model // 64), max_position_embeddings=seq_len,
        attn_implementation="sdpa",
        tie_word_embeddings=False,  # FSDP2Wrapper cannot shard a tied head (group it by hand)
    )
    model = LlamaForCausalLM(config)  # random init: no pretrained decoder is available offline
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "up_proj"])
    model = get_peft_model(model, lora)
    model.get_output_embeddings().weight.requires_grad_(True)  # the LM head trains too
    return model


def setup() -> tuple[int, int, torch.device]:
    """Process group from torchrun's environment: NCCL on GPUs, gloo on CPU."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        device = torch.device("cuda", local_rank)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=64, help="expected logical batch (all ranks)")
    parser.add_argument("--examples", type=int, default=2048)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--noise-multiplier", type=float, default=None,
                        help="use this sigma instead of calibrating it for --epsilon")
    parser.add_argument("--sketch-size", type=int, default=32)
    parser.add_argument("--estimator", choices=["hutchinson", "hutchpp"], default="hutchinson")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("launch with torchrun, e.g. torchrun --nproc_per_node 2 examples/fsdp_finetune.py")
    rank, world, device = setup()
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    torch.manual_seed(args.seed)  # the same initial weights on every rank; FSDP2 shards them
    model = build_model(args.seq_len, args.d_model, args.layers).to(device)
    model.train()
    model = FSDP2Wrapper(model)
    data = grammar_corpus(args.examples, args.seq_len, seed=args.seed)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=args.batch_size)
    steps_per_epoch = len(loader)
    engine = PrivacyEngine(accountant="rc_prv")
    if args.noise_multiplier is None:  # calibrate sigma for the target epsilon
        make_private = functools.partial(
            engine.make_private_with_epsilon, target_epsilon=args.epsilon, target_delta=1e-5,
            epochs=max(1, -(-args.steps // steps_per_epoch)),
        )
    else:
        make_private = functools.partial(engine.make_private, noise_multiplier=args.noise_multiplier)
    _, optimizer, criterion, loader = make_private(
        module=model,
        # fused: a step refused for a non-finite value is skipped on the device (no host
        # synchronisation in a step; see docs/robustness.md)
        optimizer=torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr, fused=True),
        criterion=nn.CrossEntropyLoss(),
        data_loader=loader,  # Poisson sampling, each rank draws from its part of the data
        max_grad_norm=1.0,
        grad_sample_mode="ghost_fsdp",
        clipping="randomized",
        estimator=args.estimator,
        sketch_size=args.sketch_size,
        wrap_model=False,  # Opacus's mode for Hugging Face models: call the model itself
    )
    if rank == 0:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print(f"{world} ranks ({dist.get_backend()}, {device.type}); {len(data)} sequences of "
              f"{args.seq_len} tokens; {trainable:,} trainable parameters (LoRA, head) sharded "
              f"over the ranks; "
              f"sigma={optimizer.noise_multiplier:.3f}"
              + ("" if args.noise_multiplier is not None else f" (calibrated for epsilon {args.epsilon})"),
              flush=True)
    step = 0
    while step < args.steps:
        for (batch,) in loader:
            # Every rank takes part in every step (FSDP2's collectives need all ranks), also
            # on an empty Poisson draw: then one public all-zero sequence with loss weight 0
            # (its norm is 0, its clipped gradient 0) stands in for it.
            weight = 1.0
            if len(batch) == 0:
                batch, weight = torch.zeros(1, args.seq_len + 1, dtype=torch.long), 0.0
            batch = batch.to(device)
            inputs, targets = batch[:, :-1].contiguous(), batch[:, 1:]
            positions = torch.arange(inputs.shape[1], device=device).repeat(inputs.shape[0], 1)
            logits = model(input_ids=inputs, position_ids=positions, use_cache=False).logits
            loss = criterion(logits.reshape(-1, VOCAB), targets.reshape(-1), shape=logits.shape[:2]) * weight
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if rank == 0 and (step % 5 == 0 or step == 1):
                print(f"step {step:4d}  loss (rank 0 batch of {len(batch)}) {loss.item():.3f}", flush=True)
            if step == args.steps:
                break
    optimizer.check_refused_steps()  # a refusal of the last step, decided on the device
    epsilon = engine.get_epsilon(1e-5)
    if rank == 0:
        print(f"final loss {loss.item():.3f} (uniform: ln 256 = 5.545, grammar: ln 4 = 1.386); "
              f"epsilon = {epsilon:.2f} at delta = 1e-5 after {step} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
