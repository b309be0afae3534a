"""The compatibility matrix's cells of the private Trainer (docs/compatibility.md, issue 53): a
Trainer (``"trainer"``: DPTrainer; ``"sft"``: TRL's SFTTrainer made private, float32; ``"packed"``:
the same with ``padding_free=True``) in a clipping form (book-keeping, the two passes from the output
on a checkpointed model, the per-example form) at a privacy unit (a row, or a user with up to K of
their rows) with a noise (independent, or banded: cyclic Poisson draws, draw t from part t mod b of
the units). Each cell trains 2 logical steps at sigma 0 and learning rate 0, and every release
equals brute-force clipping (per row, or per user: :mod:`tests.oracles`, autograd on each row alone)
of exactly the rows the sampler drew, over the public B
(:func:`tests.hf.test_trainer_banded.check_releases`); one process, and two gloo ranks (the union
of the ranks' draws). Every norm is exact: a unit's tokens (at most K x 16) are no more than the
sketch (k = 64). Tiny Llama from a config, generated data; nothing downloaded."""

from __future__ import annotations

import pytest
import torch
from transformers import default_data_collator

from opacus_rc.hf import DPTrainer, PrivacyArguments, private_trainer

from tests.models import RowDataset, tiny_llama

from .test_trainer import char_tokenizer, sft_dataset, training_args
from .test_trainer_banded import DDP_C, check_releases, recorded, release_recording
from .test_trainer_users import K, owners, user_dataset

#: form -> (per_example_backward, gradient_checkpointing): the options that choose it in the Trainer
FORM_OPTIONS = {"bookkeeping": (False, False), "output_passes": (False, True), "per_example": (True, False)}
PER_DEVICE, ACCUM, BANDS, STEPS = 2, 2, 2, 2
#: (entry, form, unit, noise): the cells of one process shown here (the others: their modules' tests)
CELLS = [
    *(("trainer", form, unit, "banded") for form in FORM_OPTIONS for unit in ("example", "user")),
    ("sft", "output_passes", "example", "independent"), ("sft", "output_passes", "example", "banded"),
    ("sft", "output_passes", "user", "independent"), ("sft", "output_passes", "user", "banded"),
    *(("packed", form, unit, "banded") for form in FORM_OPTIONS for unit in ("example", "user")),
    ("packed", "per_example", "user", "independent"),
]
#: the cells of two gloo ranks shown here, in one spawn (tests/hf/trainer_ddp_worker.py "cells")
DDP_CELLS = (
    ("trainer", "per_example", "example", "banded"), ("trainer", "bookkeeping", "user", "banded"),
    ("sft", "bookkeeping", "example", "independent"), ("sft", "bookkeeping", "user", "independent"),
    ("sft", "bookkeeping", "user", "banded"),
)


def sample_rate(unit: str, noise: str) -> float:
    """Banded: 1 / b, the rate 1 inside a part (draw t is all of part t mod b: one of the b draws
    holds at least a b-th of the units, whatever the secret partition, and a part of two units or
    more has units on both ranks). Independent: 1/2 of the 24 rows; 0.9 of the 6 users (on two
    ranks, each with 3 users, no step with users on both: about 1 run in 250,000)."""
    return 1 / BANDS if noise == "banded" else 0.9 if unit == "user" else 0.5


def cell_trainer(out, entry: str, form: str, unit: str, noise: str, seed: int = 0):
    """The :func:`~tests.hf.test_trainer_banded.release_recording` Trainer of a cell (the public B
    of units a logical step: 2 x 2, on two ranks 2 x 2 x 2), SGD at learning rate 0; the model
    seeded with ``seed`` (under DDP rank 0's is broadcast)."""
    per_example, checkpointing = FORM_OPTIONS[form]
    model = tiny_llama(seed)
    users = dict(privacy_unit="user", user_column="author", max_examples_per_user=K) if unit == "user" else {}
    noises = dict(noise="banded", bands=BANDS) if noise == "banded" else {}
    privacy = PrivacyArguments(noise_multiplier=0.0, delta=1e-5, max_grad_norm=DDP_C, sketch_size=64,
                               sample_rate=sample_rate(unit, noise), per_example_backward=per_example,
                               **users, **noises)
    common = dict(model=model, optimizers=(torch.optim.SGD(model.parameters(), lr=0.0), None), privacy=privacy)
    schedule = dict(per_device_train_batch_size=PER_DEVICE, gradient_accumulation_steps=ACCUM, max_steps=STEPS,
                    gradient_checkpointing=checkpointing)
    if entry == "trainer":
        data = dict(train_dataset=user_dataset(), data_collator=default_data_collator) if users else \
            dict(train_dataset=RowDataset())
        return release_recording(DPTrainer)(args=training_args(out, remove_unused_columns=not users, **schedule),
                                            **data, **common)
    import trl

    config = trl.SFTConfig(output_dir=str(out / "sft"), report_to=[], save_strategy="no", use_cpu=True,
                           disable_tqdm=True, bf16=False, lr_scheduler_type="constant", padding_free=entry == "packed",
                           max_length=None, **schedule)
    data = sft_dataset().add_column("author", owners()) if users else sft_dataset()
    return release_recording(private_trainer(trl.SFTTrainer))(
        args=config, train_dataset=data, processing_class=char_tokenizer(), **common)


def cell_run(out, entry: str, form: str, unit: str, noise: str, seed: int = 0) -> dict:
    """A cell's run of :data:`STEPS` logical steps: what it recorded
    (:func:`~tests.hf.test_trainer_banded.recorded`)."""
    trainer = cell_trainer(out, entry, form, unit, noise, seed)
    trainer.train()
    return recorded(trainer)


def check_cell(ranks, form: str, unit: str, noise: str) -> None:
    """The ranks ran the cell (its form, unit and noise) and released brute force on their draws."""
    assert ranks[0]["form"] == form and ranks[0]["unit"] == unit
    assert ranks[0]["bands"] == (BANDS if noise == "banded" else None)
    check_releases(ranks, 0, STEPS, accumulation=ACCUM)


@pytest.mark.parametrize("entry, form, unit, noise", CELLS)
def test_trainer_cell_equals_brute_force(tmp_path, entry, form, unit, noise):
    """One process: each release of the cell is brute-force clipping of exactly the rows drawn
    (banded: from part t mod b of the secret partition) over B."""
    check_cell([cell_run(tmp_path, entry, form, unit, noise)], form, unit, noise)


@pytest.mark.slow
def test_two_gloo_ranks_cells_equal_brute_force_on_the_union(tmp_path):
    """torchrun --nproc_per_node 2, every cell of :data:`DDP_CELLS` in one launch: both ranks
    release brute-force clipping of the union of their draws over B (rows or users disjoint; banded:
    one partition, draws numbered alike), rank 0 alone drawing the noise; one history."""
    from .test_trainer import run_two_ranks

    ranks = run_two_ranks(tmp_path, 0.0, "cells")
    for cell in DDP_CELLS:
        runs = [r[cell] for r in ranks]
        assert all(r["optimizer"].startswith("Distributed") for r in runs), cell
        check_cell(runs, *cell[1:])
