"""TRL's SFTTrainer with ``packing=True, packing_strategy="wrapped"`` (issue 38 item 7b): the
dataset is concatenated and cut into rows of ``max_length`` tokens, and each packed row is one
example of the Poisson draw (the privacy unit). At sigma = 0 the update equals brute-force
per-row clipping of the packed rows (:func:`tests.oracles.per_example_clipped_mean`), in the
batched form and in the per-example form. The data leave a last packed row of one token, drawn
alone in a physical batch: that crashed with ``cannot reshape tensor of 0 elements`` (its causal
shift leaves no position). Tolerance: float32 summation order."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from opacus_rc.hf import PrivacyArguments, private_trainer

from tests.models import tiny_llama
from tests.oracles import per_example_clipped_mean

from .test_trainer import char_tokenizer, recording
from .test_trainer_per_example import row_loss

C, LR, MAX_LENGTH, STEPS = 0.05, 0.5, 8, 2
TEXTS = ["abcdefghijklmnop", "bcdefg", "cdefghij"]  # 17 + 7 + 9 tokens with EOS: rows of 8, 8, 8, 8, 1
ROWS = 5


@pytest.mark.parametrize("per_device", [2, 1])  # the batched form; the per-example form
def test_wrapped_packing_sigma0_equals_brute_force_on_the_packed_rows(tmp_path, per_device, caplog):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    model = tiny_llama()
    reference = copy.deepcopy(model)
    config = trl.SFTConfig(
        output_dir=str(tmp_path / "sft"), per_device_train_batch_size=per_device, gradient_accumulation_steps=ROWS,
        max_steps=STEPS, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
        lr_scheduler_type="constant", packing=True, packing_strategy="wrapped", max_length=MAX_LENGTH,
        bf16=False, gradient_checkpointing=False,
    )
    with caplog.at_level(logging.WARNING, logger="opacus_rc.hf"):
        trainer = recording(private_trainer(trl.SFTTrainer))(
            model=model, args=config, train_dataset=datasets.Dataset.from_dict({"text": TEXTS}),
            processing_class=char_tokenizer(), optimizers=(torch.optim.SGD(model.parameters(), lr=LR), None),
            # rate 1: every packed row in every draw, split one row per physical batch
            privacy=PrivacyArguments(noise_multiplier=0.0, delta=1e-5, max_grad_norm=C, sample_rate=1.0),
        )
    assert "epsilon protects a packed row, not a dataset example" in caplog.text
    packed = [torch.tensor(r["input_ids"]) for r in trainer.train_dataset]
    assert sorted(len(r) for r in packed) == [1, 8, 8, 8, 8]
    trainer.train()

    # every draw is the packed dataset, one packed row per physical batch, as packed
    assert len(trainer.recorded) == STEPS * ROWS
    for start in range(0, len(trainer.recorded), ROWS):
        rows = [b["input_ids"][0] for b in trainer.recorded[start:start + ROWS]]
        assert all(len(b["input_ids"]) == 1 for b in trainer.recorded[start:start + ROWS])
        assert [r.tolist() for r in rows] == [r.tolist() for r in packed]
    normaliser = trainer.expected_batch_size
    for _ in range(STEPS):
        update = per_example_clipped_mean(reference, row_loss, packed, packed, C, normaliser)
        with torch.no_grad():
            for name, p in reference.named_parameters():
                p -= LR * update[name]
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=1e-5), name


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split"])
def test_bfd_packing_is_refused_naming_what_runs(tmp_path, strategy):
    """``"bfd"`` packing implies padding-free batches (one flattened row: no per-row gradient):
    refused at construction, the message naming what runs and its privacy unit."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    config = trl.SFTConfig(
        output_dir=str(tmp_path / "sft"), per_device_train_batch_size=2, max_steps=1, report_to=[],
        save_strategy="no", use_cpu=True, disable_tqdm=True, packing=True, packing_strategy=strategy,
        max_length=MAX_LENGTH, bf16=False, gradient_checkpointing=False,
    )
    with pytest.raises(ValueError, match="padding_free") as refused:
        private_trainer(trl.SFTTrainer)(
            model=tiny_llama(), args=config, train_dataset=datasets.Dataset.from_dict({"text": TEXTS}),
            processing_class=char_tokenizer(), privacy=PrivacyArguments(noise_multiplier=0.0, delta=1e-5),
        )
    message = str(refused.value)
    assert f"'{strategy}'" in message and "packing=False" in message
    assert "packing_strategy='wrapped' (the privacy unit is then the packed row" in message
