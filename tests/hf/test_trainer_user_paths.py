"""The private Trainer at ``privacy_unit="user"`` measured as an attacker would (issue 46,
paths 7 and 8): at sigma = 0, q_u = 1 (every user, all their rows, in one physical batch) and
C far below every user's gradient norm, removing one user moves the released sum
``S = (theta_0 - theta_1) B / lr`` by exactly C when each row is clipped with its own user,
and by more when rows sit in other users' units. Exact norms: a user's regrouped sequence
(at most 3 rows of 8 tokens) is no longer than the sketch. Float32 sums of a few C-sized
terms: 1e-3 relative."""

from __future__ import annotations

import datasets
import pytest
import torch

from opacus_rc.hf import DPTrainer, PrivacyArguments

from tests.models import tiny_llama

from .test_trainer import training_args

C, PAD = 1e-4, 0
#: the author of each row (4 users, interleaved) and the rows' lengths (3 to 8 tokens)
AUTHORS = ["a", "b", "c", "a", "d", "c", "b", "c", "d"]
LENGTHS = [3, 8, 5, 6, 4, 7, 3, 5, 6]
FORMS = {"bookkeeping": dict(per_example_backward=False, sketch_size=64), "per_example": dict(per_example_backward=True)}


def user_rows(drop: str = "") -> datasets.Dataset:
    """The rows of every author but ``drop`` (token rows, every token supervised)."""
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(1, 64, (n,), generator=g).tolist() for n in LENGTHS]
    keep = [i for i, a in enumerate(AUTHORS) if a != drop]
    return datasets.Dataset.from_dict({"input_ids": [ids[i] for i in keep], "labels": [ids[i] for i in keep],
                                       "author": [AUTHORS[i] for i in keep]})


def pad(features):
    """Right padding to the longest row (labels -100 and attention 0 on the padding)."""
    t = max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), t), PAD)
    mask = torch.zeros((len(features), t), dtype=torch.long)
    for i, f in enumerate(features):
        ids[i, :len(f["input_ids"])], mask[i, :len(f["input_ids"])] = torch.tensor(f["input_ids"]), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def longest_first(features):
    """A collator that sorts the rows it is given, longest first (to pad less)."""
    return pad(sorted(features, key=lambda f: -len(f["input_ids"])))


def rotated(features):
    return pad(features[1:] + features[:1])


def released_sum(tmp_path, dataset, *, collator=pad, form="bookkeeping", replace=None) -> torch.Tensor:
    """The sum one logical step of all users releases at sigma = 0 (``replace``: a function of
    the dataset giving the ``train_dataset`` set after construction)."""
    model = tiny_llama()
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    trainer = DPTrainer(
        model=model, args=training_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                                        max_steps=1, remove_unused_columns=False, learning_rate=1.0),
        train_dataset=dataset, data_collator=collator, optimizers=(torch.optim.SGD(model.parameters(), lr=1.0), None),
        privacy=PrivacyArguments(noise_multiplier=0.0, delta=1e-5, max_grad_norm=C, privacy_unit="user",
                                 user_column="author", max_examples_per_user=8, sample_rate=1.0, **FORMS[form]),
    )
    if replace is not None:
        trainer.train_dataset = replace(dataset)
    trainer.train()
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return (before - after).double() * trainer.expected_batch_size


def user_effects(tmp_path, **kw):
    """||S(D) - S(D without u)|| / C for every user u."""
    full = released_sum(tmp_path, user_rows(), **kw)
    return [float((full - released_sum(tmp_path, user_rows(u), **kw)).norm()) / C for u in sorted(set(AUTHORS))]


@pytest.mark.parametrize("collator, form", [(longest_first, "bookkeeping"), (longest_first, "per_example"),
                                            (rotated, "bookkeeping")], ids=["longest_first", "longest_first_per_example", "rotated"])
def test_a_reordering_collator_keeps_each_row_with_its_user(tmp_path, collator, form):
    """Path 7: the units were attached in the sampler's row order, so after a collator that
    sorts its rows a user's rows sat in other users' units (up to 1.82 C in book-keeping;
    a rotation 1.12 C). Each collated row is now matched to the row it came from and the
    batch put back in the draw's order: every user moves the sum by C."""
    effects = user_effects(tmp_path, collator=collator, form=form)
    assert effects == pytest.approx([1.0] * len(effects), rel=1e-3), effects


def reversed_rows(dataset: datasets.Dataset) -> datasets.Dataset:
    return dataset.select(range(len(dataset) - 1, -1, -1))


def test_a_replaced_train_dataset_is_read_again(tmp_path):
    """Path 8: the user column was read once at construction, so after ``trainer.train_dataset``
    was replaced by the same rows reordered, rows belonged to whoever held their position
    before (2.0 C). The users are read from the dataset the loader is built from."""
    effects = user_effects(tmp_path, replace=reversed_rows)
    assert effects == pytest.approx([1.0] * len(effects), rel=1e-3), effects


@pytest.mark.parametrize("form", sorted(FORMS))
def test_an_order_keeping_collator_moves_the_sum_by_C(tmp_path, form):
    """The measurement's control: a collator that keeps the rows' order."""
    effects = user_effects(tmp_path, form=form)
    assert effects == pytest.approx([1.0] * len(effects), rel=1e-3), effects


def test_a_replaced_train_dataset_with_fewer_rows_trains(tmp_path):
    """A shorter replacement used to crash with an IndexError (the cached index's rows)."""
    released_sum(tmp_path, user_rows(), replace=lambda d: d.select(range(5)))


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_user_column_in_torch_format_is_read_by_value(tmp_path, form):
    """``dataset.with_format("torch")`` used to be refused with advice for plain PyTorch
    (its user column came as 0-d tensors, hashed by identity): the column's stored values are
    read (compared by value), and the run equals the plain dataset's."""
    numbered = user_rows().map(lambda row: {"author": ord(row["author"])})  # integer ids
    torch_format = released_sum(tmp_path, numbered.with_format("torch"), collator=tensor_pad, form=form)
    torch.testing.assert_close(torch_format, released_sum(tmp_path, user_rows(), form=form), rtol=1e-6, atol=1e-12)


def tensor_pad(features):
    return pad([{k: v.tolist() for k, v in f.items()} for f in features])


def test_a_dataset_replaced_between_two_trains_at_another_rate_is_refused(tmp_path):
    """The optimizer (and the rate its accountant charges) is made once, at the first train():
    a replacement with fewer users would have been drawn at 1/3 and charged at 1/4."""
    model = tiny_llama()
    trainer = DPTrainer(
        model=model, args=training_args(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=1,
                                        max_steps=1, remove_unused_columns=False),
        train_dataset=user_rows(), data_collator=pad,
        privacy=PrivacyArguments(noise_multiplier=1.0, delta=1e-5, privacy_unit="user", user_column="author"),
    )
    trainer.train()
    assert trainer.accountant.history[0][1] == pytest.approx(1 / 4)
    trainer.train_dataset = user_rows("d")
    with pytest.raises(ValueError, match=r"draws at rate 0.333.*not the charged 0.25.*train_dataset replaced"):
        trainer.train()
    assert trainer.privacy_steps() == 1
