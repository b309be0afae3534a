"""TRL's ``padding_free=True`` in the private Trainer (issue 53; before: refused at construction).

The padding-free collator packs a physical batch's rows into one row, position ids restarting at
each; each packed sequence is its own example (its user's, at user level): the layers split the
row into its sequences, the losses are per sequence. At sigma = 0 the update equals brute force
over the *unpacked* sequences (:mod:`tests.oracles`: autograd on each sequence alone, as its own
row, clipped per example or per user), in book-keeping, the two passes from the output
(checkpointing), the per-example form and through the chunked LM head; float32, every norm exact
(each unit's tokens no more than the sketch). A model whose attention crosses a restart (probed at
construction) is refused by name."""

from __future__ import annotations

import copy

import pytest
import torch

from opacus_rc.hf import PrivacyArguments, per_example_token_loss, private_trainer
from opacus_rc.packing import SEGMENTS_KEY

from tests.models import tiny_llama
from tests.oracles import per_example_clipped_mean, per_user_clipped_mean

from .test_trainer import char_tokenizer, sft_dataset

C, LR, PER_DEVICE, ACCUM, K = 0.05, 0.5, 4, 2, 2
OWNERS = [r % 9 for r in range(24)]  # 9 authors of 2 or 3 rows (K = 2: a fresh pair at each draw)
RUNS = {
    "bookkeeping": ({}, dict(gradient_checkpointing=False)),
    "output_passes": ({}, dict(gradient_checkpointing=True)),
    "per_example": (dict(per_example_backward=True), dict(gradient_checkpointing=False)),
    "chunked_head": (dict(lm_head_block_size=4), dict(gradient_checkpointing=False)),
    "user_bookkeeping": (dict(privacy_unit="user", user_column="author", max_examples_per_user=K),
                         dict(gradient_checkpointing=False)),
    "user_output_passes": (dict(privacy_unit="user", user_column="author", max_examples_per_user=K),
                           dict(gradient_checkpointing=True)),
    "user_chunked_head": (dict(privacy_unit="user", user_column="author", max_examples_per_user=K, lm_head_block_size=4),
                          dict(gradient_checkpointing=False)),
}


def trained(tmp_path, privacy: dict, args: dict):
    """A private SFTTrainer (padding_free=True, float32) after 2 steps, with every physical batch's
    unpacked sequences (and their users) recorded in order; the model's initial copy."""
    import trl

    class Recording(private_trainer(trl.SFTTrainer)):
        def training_step(self, model, inputs, num_items_in_batch=None):
            segments = inputs.get(SEGMENTS_KEY)
            units = inputs.get("__opacus_rc_row_units__")
            if segments is not None:
                rows = segments.unpacked({k: inputs[k].clone() for k in ("input_ids", "labels")})
                users = units.users.tolist() if units is not None else [None] * len(rows)
                self.sequences.append([(r["input_ids"][0], r["labels"][0], u) for r, u in zip(rows, users)])
            return super().training_step(model, inputs, num_items_in_batch)

    model = tiny_llama()
    initial = copy.deepcopy(model)
    data = sft_dataset().add_column("author", OWNERS)
    config = trl.SFTConfig(
        output_dir=str(tmp_path / "sft"), per_device_train_batch_size=PER_DEVICE, gradient_accumulation_steps=ACCUM,
        max_steps=2, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, bf16=False,
        lr_scheduler_type="constant", padding_free=True, max_length=None, **args,
    )
    trainer = Recording(
        model=model, args=config, train_dataset=data, processing_class=char_tokenizer(),
        optimizers=(torch.optim.SGD(model.parameters(), lr=LR), None),
        privacy=PrivacyArguments(noise_multiplier=0.0, delta=1e-5, max_grad_norm=C, sketch_size=64, **privacy),
    )
    trainer.sequences = []
    trainer.train()
    return model, initial, trainer


def sequence_loss(model, ids, labels):
    """The Trainer's per-row loss of one sequence alone, as its own row."""
    logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False).logits
    return per_example_token_loss(logits, labels, shift=True).mean()


@pytest.mark.parametrize("run", sorted(RUNS))
def test_padding_free_equals_brute_force_over_the_unpacked_sequences(tmp_path, run):
    privacy, args = RUNS[run]
    model, reference, trainer = trained(tmp_path, privacy, args)
    steps = [sum(trainer.sequences[i:i + ACCUM], []) for i in range(0, len(trainer.sequences), ACCUM)]
    assert len(steps) == 2 and all(len(step) >= 2 for step in steps)
    for step in steps:
        ids, labels, users = zip(*step)
        if privacy.get("privacy_unit") == "user":
            assert all(users.count(u) == min(K, OWNERS.count(u)) for u in users)
            update = per_user_clipped_mean(reference, sequence_loss, ids, labels, list(users), C, PER_DEVICE * ACCUM)
        else:
            update = per_example_clipped_mean(reference, sequence_loss, ids, labels, C, PER_DEVICE * ACCUM)
        with torch.no_grad():
            for name, p in reference.named_parameters():
                p -= LR * update[name].to(p.dtype)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_a_model_whose_attention_crosses_the_packed_sequences_is_refused(tmp_path, monkeypatch):
    """Transformers keeps packed sequences apart by finding the position ids' restarts; without
    that (as an attention implementation that ignores them) a sequence sees its neighbours: the
    construction probe finds its outputs moved and refuses, naming the reason."""
    import transformers.masking_utils as masking

    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    with pytest.raises(ValueError, match=r"packed rows \(TRL's padding_free=True\) with LlamaForCausalLM's "
                                         r"attention \(sdpa\) is not supported: .*attend across the sequence boundary"):
        trained(tmp_path, {}, dict(gradient_checkpointing=False))


def test_a_collate_that_does_not_keep_the_rows_apart_is_refused():
    """A packed row whose position ids run on across two given rows: they would be one sequence."""
    from opacus_rc.hf.packing import PackedCollate

    def merged(rows):
        ids = torch.tensor([t for r in rows for t in r["input_ids"]])[None]
        return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(ids.shape[1])[None]}

    with pytest.raises(ValueError, match="must hold each example as one run of position_ids"):
        PackedCollate(merged)([{"input_ids": [4, 5, 6]}, {"input_ids": [7, 8]}])


def test_packed_rows_outside_the_padding_free_loader_are_refused():
    """Position ids restarting inside a row without an attention mask (transformers'
    DataCollatorWithFlattening) in a batch whose examples the Trainer did not find: refused, not
    clipped as one example."""
    from opacus_rc.hf.losses import model_inputs

    ids = torch.arange(5)[None]
    with pytest.raises(ValueError, match="would be clipped as one example"):
        model_inputs(tiny_llama(), {"input_ids": ids, "labels": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1]])})
    model_inputs(tiny_llama(), {"input_ids": ids, "labels": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 0]]),
                                "attention_mask": torch.tensor([[1, 1, 1, 0, 0]])})  # padding: one example
