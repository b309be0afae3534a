"""Long documents: activation checkpointing and the chunked LM head, with randomized clipping.

A Hugging Face Llama-style causal LM (built from a small config: random weights, nothing
downloaded) trained with privacy on Markov-chain text. Two memory savers for long sequences,
both optional and both compatible with the plugin:

* activation checkpointing (``model.activation_checkpointing_enable()``, Hugging Face's;
  ``gradient_checkpointing_enable()`` in transformers 4): the layers' activations are
  recomputed in the backward pass instead of kept;
* the chunked LM head (:mod:`opacus_rc.lm_head`): the loss is computed a block of positions at
  a time, so the T x vocabulary logits and their gradient never exist whole.

    python examples/long_context.py                                # T = 512, 8 steps: seconds
    python examples/long_context.py --seq-len 4096 --steps 20      # longer documents
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import warnings

import torch
from opacus import PrivacyEngine

import opacus_rc  # noqa: F401  registers clipping="randomized" and accountant="rc_prv"
from opacus_rc.lm_head import from_causal_lm, hidden_states

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # repository root: the examples package
from examples import one_thread_unless_set  # noqa: E402
from examples.models import markov_text  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=128, help="positions per block of the chunked LM head")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    one_thread_unless_set()  # unless OMP_NUM_THREADS is set: a second thread only waits under load
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    vocab = 128
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=args.seq_len + 1, use_cache=False,
    ))
    model.activation_checkpointing_enable()                     # optional: recompute activations
    head_loss = from_causal_lm(model, block_size=args.block_size)  # optional: the T x V logits never exist
    data = torch.utils.data.TensorDataset(markov_text(64, args.seq_len, vocab, branching=4, seed=args.seed))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size)

    with warnings.catch_warnings():
        # Opacus's notice that secure_mode is off (the default; the README says what it means)
        warnings.filterwarnings("ignore", message="Secure RNG turned off", category=UserWarning)
        engine = PrivacyEngine(accountant="rc_prv")
    model, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), criterion=head_loss,
        data_loader=loader, noise_multiplier=0.6, max_grad_norm=1.0,
        grad_sample_mode="ghost", clipping="randomized",
    )
    print(f"T = {args.seq_len}, chunked LM head of block {args.block_size}, activation checkpointing on; "
          f"loss starts near ln {vocab} = {math.log(vocab):.2f} (guessing); the text's floor is ln 4 = {math.log(4):.2f}")
    step = 0
    while step < args.steps:
        for (batch,) in loader:
            x = batch[:, :-1]                                   # the model shifts the labels itself
            loss = criterion(hidden_states(model, input_ids=x), x)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if len(x):
                print(f"step {step:2d}  loss {loss.item():.3f}", flush=True)
            if step == args.steps:
                break
    print(f"epsilon = {engine.get_epsilon(delta=1e-5):.2f} at delta = 1e-5 ({step} steps)")


if __name__ == "__main__":
    main()
