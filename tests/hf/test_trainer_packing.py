"""TRL packing (issue 38 item 7b). Every strategy is refused by name at construction:
``"wrapped"`` concatenates the dataset and cuts it into rows of ``max_length`` tokens (a row
mixes examples and removing one example shifts every later cut, so ε would protect no dataset
example), ``"bfd"`` / ``"bfd_split"`` flatten the batch into one row. ``"wrapped"`` used to
crash with ``cannot reshape tensor of 0 elements`` (its last packed row of one token, drawn
alone in a physical batch, has no position after the causal shift): the per-row loss of such a
batch is now 0 with a zero gradient."""

from __future__ import annotations

import datasets
import pytest
import torch
import trl

from opacus_rc.hf import PrivacyArguments, private_trainer
from opacus_rc.hf.losses import per_example_token_loss

from tests.models import tiny_llama

from .test_trainer import char_tokenizer

TEXTS = ["abcdefghijklmnop", "bcdefg", "cdefghij"]  # 17 + 7 + 9 tokens with EOS: rows of 8, 8, 8, 8, 1


@pytest.mark.parametrize("strategy", ["wrapped", "bfd", "bfd_split"])
def test_packing_is_refused_by_name(tmp_path, strategy):
    config = trl.SFTConfig(
        output_dir=str(tmp_path / "sft"), per_device_train_batch_size=2, max_steps=1, report_to=[],
        save_strategy="no", use_cpu=True, disable_tqdm=True, packing=True, packing_strategy=strategy,
        max_length=8, bf16=False, gradient_checkpointing=False,
    )
    with pytest.raises(ValueError, match=rf"packing=True \(packing_strategy='{strategy}'\) is not supported") as refused:
        private_trainer(trl.SFTTrainer)(
            model=tiny_llama(), args=config, train_dataset=datasets.Dataset.from_dict({"text": TEXTS}),
            processing_class=char_tokenizer(), privacy=PrivacyArguments(noise_multiplier=0.0, delta=1e-5),
        )
    assert "epsilon would protect no dataset example" in str(refused.value)
    assert "Accepted value: packing=False" in str(refused.value)


def test_a_batch_of_one_token_rows_has_zero_loss_and_gradient():
    """A causal shift leaves a one-token row no position: its loss is 0 (no supervised
    token), as for a row whose labels are all -100, and nothing flows back."""
    logits = torch.randn(3, 1, 11, requires_grad=True)
    loss = per_example_token_loss(logits, torch.randint(0, 11, (3, 1)), shift=True)
    assert loss.shape == (3,) and torch.equal(loss, torch.zeros(3))
    loss.sum().backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))
