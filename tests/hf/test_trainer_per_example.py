"""The private Trainer in the per-example form (one row per backward pass, exact clipping):
taken automatically at ``per_device_train_batch_size=1`` (Hugging Face's long-context
recipe), or with ``PrivacyArguments(per_example_backward=True)`` for larger physical
batches, run one row at a time. At sigma = 0 the update equals brute-force per-example
clipping of the recorded rows (:func:`tests.oracles.per_example_clipped_mean`: autograd on
each row alone, then SGD), with gradient checkpointing in both forms too; the steps are
charged as exact clipping (Opacus's ``prv``). Tolerance: float32 summation order (1e-6)."""

from __future__ import annotations

import copy

import pytest
import torch
from opacus.accountants import PRVAccountant

from opacus_rc.forms.per_example import PerExampleOptimizer
from opacus_rc.hf import DPTrainer, PrivacyArguments, per_example_token_loss

from tests.models import RowDataset, tiny_llama
from tests.oracles import per_example_clipped_mean

from .test_trainer import recording, training_args

C, LR = 0.05, 0.5


def row_loss(model, ids, labels):
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    return per_example_token_loss(logits, labels, shift=True).mean()


def brute_force(model, recorded, accumulation: int, normaliser: int) -> None:
    """SGD on ``model`` with the brute-force clipped mean of every logical step's rows."""
    for start in range(0, len(recorded), accumulation):
        batches = [b for b in recorded[start:start + accumulation] if b is not None]
        ids = [r for b in batches for r in b["input_ids"]]
        labels = [r for b in batches for r in b["labels"]]
        update = per_example_clipped_mean(model, row_loss, ids, labels, C, normaliser)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p -= LR * update[name]


def train(tmp_path, per_device: int, accumulation: int, privacy=None, **args):
    model = tiny_llama()
    reference = copy.deepcopy(model)
    trainer = recording(DPTrainer)(
        model=model,
        args=training_args(tmp_path, per_device_train_batch_size=per_device,
                           gradient_accumulation_steps=accumulation, **args),
        train_dataset=RowDataset(), optimizers=(torch.optim.SGD(model.parameters(), lr=LR), None),
        privacy=PrivacyArguments(noise_multiplier=0.0, delta=1e-5, max_grad_norm=C, **(privacy or {})),
    )
    trainer.train()
    return model, reference, trainer


@pytest.mark.parametrize("per_device, accumulation, privacy, args", [
    (1, 8, None, {}),  # automatic at a physical batch of one
    (4, 2, {"per_example_backward": True}, {}),
    (2, 4, {"per_example_backward": True}, {"gradient_checkpointing": True}),
    (2, 4, {"per_example_backward": True},
     {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}}),
], ids=["batch1-auto", "batch4", "checkpointed", "checkpointed-reentrant"])
def test_equals_brute_force_per_example_clipping(tmp_path, per_device, accumulation, privacy, args):
    model, reference, trainer = train(tmp_path, per_device, accumulation, privacy, **args)
    assert isinstance(trainer._dp_optimizer, PerExampleOptimizer)
    if args.get("gradient_checkpointing"):
        reference.gradient_checkpointing_disable()
    brute_force(reference, trainer.recorded, accumulation, per_device * accumulation)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    history = trainer.accountant.history
    assert all(record.estimator is None and record.micro_batches == 1 for *_, record in history)
    prv = PRVAccountant()
    prv.history = [(0.7, 0.25, 3)]
    probe = type(trainer.accountant)()
    probe.history = [(0.7, 0.25, 3, history[0][3])]
    assert probe.get_epsilon(1e-5) == pytest.approx(prv.get_epsilon(1e-5), rel=2e-2)


def test_per_example_backward_false_keeps_the_sketched_form(tmp_path):
    _, _, trainer = train(tmp_path, 1, 8, {"per_example_backward": False})
    assert not isinstance(trainer._dp_optimizer, PerExampleOptimizer)
    assert trainer.accountant.history[0][3].estimator == "hutchinson"


def test_refused_with_flat_clipping():
    with pytest.raises(ValueError, match="per_example_backward"):
        PrivacyArguments(noise_multiplier=1.0, delta=1e-5, clipping="flat", per_example_backward=True)


@pytest.mark.parametrize("reentrant", [False, True])
def test_chunked_head_with_checkpointing_in_the_per_example_form(tmp_path, reentrant):
    """lm_head_block_size: the loss through ChunkedLMHeadLoss (4 positions a block), with
    gradient checkpointing on; equals brute force on the model's own logits."""
    model, reference, trainer = train(
        tmp_path, 1, 8, {"lm_head_block_size": 4}, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": reentrant},
    )
    reference.gradient_checkpointing_disable()
    brute_force(reference, trainer.recorded, 8, 8)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_chunked_head_with_checkpointing_by_bookkeeping(tmp_path):
    """A sketched form with the chunked head and checkpointing on: book-keeping (the
    refusal of the two passes from the output does not reach the Trainer); it trains."""
    model, reference, trainer = train(
        tmp_path, 4, 2, {"lm_head_block_size": 4, "per_example_backward": False}, gradient_checkpointing=True,
    )
    assert type(trainer._dp_optimizer).__name__ == "RandomizedClippingBookkeepingOptimizer"
    moved = [not torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters())]
    assert all(moved) and all(torch.isfinite(p).all() for p in model.parameters())


def test_lm_head_block_size_is_validated():
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="lm_head_block_size"):
            PrivacyArguments(noise_multiplier=1.0, delta=1e-5, lm_head_block_size=bad)


def test_two_gloo_ranks_per_example_equal_one_process_on_the_union(tmp_path):
    """torchrun --nproc_per_node 2, one row per backward pass on each rank (DPDDP: no
    all-reduce before the clip), sigma = 0: both ranks end with the one-process exact update
    on the union of their batches; charged as exact clipping."""
    from .test_trainer import assert_equals_one_process_on_the_union, run_two_ranks

    ranks = run_two_ranks(tmp_path, 0.0, clipping="per_example")
    assert_equals_one_process_on_the_union(ranks)
    assert ranks[0]["history"] == ranks[1]["history"]
    assert ranks[0]["history"][0][3].estimator is None


def test_private_sft_trainer_at_a_physical_batch_of_one(tmp_path):
    """TRL's SFTTrainer (its defaults: bf16 autocast, non-reentrant gradient checkpointing)
    at per_device_train_batch_size=1: the per-example form, automatically; the update equals
    brute force on the recorded rows (padding and masks as collated; the oracle's loss is the
    Trainer's per-row loss under the same bf16 autocast), up to bf16 rounding (2% of the update)."""
    import trl
    from opacus_rc.hf import private_trainer

    from .test_trainer import char_tokenizer, sft_dataset

    model = tiny_llama()
    reference, initial = copy.deepcopy(model), copy.deepcopy(model)
    config = trl.SFTConfig(
        output_dir=str(tmp_path / "sft"), per_device_train_batch_size=1, gradient_accumulation_steps=8,
        max_steps=2, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
        lr_scheduler_type="constant",
    )
    trainer = recording(private_trainer(trl.SFTTrainer))(
        model=model, args=config, train_dataset=sft_dataset(), processing_class=char_tokenizer(),
        optimizers=(torch.optim.SGD(model.parameters(), lr=LR), None),
        privacy=PrivacyArguments(noise_multiplier=0.0, delta=1e-5, max_grad_norm=C),
    )
    trainer.train()
    assert isinstance(trainer._dp_optimizer, PerExampleOptimizer)
    reference.gradient_checkpointing_disable()

    def loss_of(m, row, _):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return trainer.per_example_loss(m, row).mean()

    for start in range(0, len(trainer.recorded), 8):
        rows = [{k: v[i:i + 1] for k, v in b.items()} for b in trainer.recorded[start:start + 8] if b is not None
                for i in range(len(b["input_ids"]))]
        index = torch.arange(len(rows))  # the oracle takes tensors: row i is index i
        update = per_example_clipped_mean(reference, lambda m, i, y: loss_of(m, rows[int(i)], y), index,
                                          index, C, 8)
        with torch.no_grad():
            for name, p in reference.named_parameters():
                p -= LR * update[name]
    for (name, p), q, p0 in zip(model.named_parameters(), reference.parameters(), initial.parameters()):
        assert (p - q).norm() <= 0.02 * (q - p0).norm() + 1e-7, name
