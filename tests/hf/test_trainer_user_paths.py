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

#: every test also with the batches copied as on a device (tests/conftest.py, issue 52)
pytestmark = pytest.mark.usefixtures("dict_batches_as_on_a_device")

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
        privacy=PrivacyArguments(noise_multiplier=1.0, delta=1e-5, privacy_unit="user", user_column="author",
                                 **FORMS["bookkeeping"]),
    )
    trainer.train()
    assert trainer.accountant.history[0][1] == pytest.approx(1 / 4)
    trainer.train_dataset = user_rows("d")
    with pytest.raises(ValueError, match=r"draws at rate 0.333.*not the charged 0.25.*train_dataset replaced"):
        trainer.train()
    assert trainer.privacy_steps() == 1


# --- order_by_values: each collated row matched to the row it came from, where a collator
# carries no row position (TRL's, which drops unknown keys) ----------------------------------


def in_draw_order(rows, batch):
    """``batch`` with its rows put back in the order of ``rows`` (by :func:`order_by_values`)."""
    from opacus_rc.row_order import order_by_values

    back = torch.argsort(torch.tensor(order_by_values(rows, batch)))  # collated row back[i] came from row i
    return {k: v[back] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == len(rows) else v
            for k, v in batch.items()}


def features():
    """Three token rows; the first two have their prompt masked in labels (-100)."""
    ids = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    labels = [[-100, -100, 7, 8], [-100, 10], [11, 12, 13]]
    return [{"input_ids": i, "labels": l, "attention_mask": [1] * len(i)} for i, l in zip(ids, labels)]


def seq2seq(rows, side: str = "right"):
    """Padding of input_ids by the attention mask, labels by -100 to their own longest."""
    t = max(len(r["input_ids"]) for r in rows) + 1
    out = {"input_ids": torch.zeros(len(rows), t, dtype=torch.long), "attention_mask": torch.zeros(len(rows), t,
           dtype=torch.long), "labels": torch.full((len(rows), t + 2), -100)}
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        where = slice(0, n) if side == "right" else slice(t - n, t)
        out["input_ids"][i, where], out["attention_mask"][i, where] = torch.tensor(r["input_ids"]), 1
        out["labels"][i, :n] = torch.tensor(r["labels"])
    return out


@pytest.mark.parametrize("side", ["left", "right"])
def test_in_draw_order_puts_the_collated_rows_back(side):
    rows = features()
    reference = seq2seq(rows, side)
    for order in ([2, 0, 1], [1, 0, 2], [0, 1, 2]):
        batch = in_draw_order(rows, seq2seq([rows[i] for i in order], side))
        assert all(torch.equal(batch[k], reference[k]) for k in reference), order
    causal = {k: v[:, :v.shape[1] - (k == "labels") * 2] for k, v in reference.items()}  # labels padded as the mask
    if side == "right":
        assert torch.equal(in_draw_order(rows, {k: v[[1, 2, 0]] for k, v in causal.items()})["labels"], causal["labels"])


def test_in_draw_order_refuses_what_it_cannot_match():
    rows = features()
    masked = seq2seq(rows)
    masked["input_ids"][1, 0] = 3  # random masking (MLM) changes input_ids
    with pytest.raises(ValueError, match=r"collate function's batch cannot be matched.*its row 1 matches none"):
        in_draw_order(rows, masked)
    with pytest.raises(ValueError, match=r"passes no field"):
        in_draw_order([{"text": "a b"}, {"text": "c"}], {"input_ids": torch.ones(2, 2)})  # tokenizing collator
    twins = [dict(rows[0], completion_mask=[0, 0, 1, 1]), dict(rows[0], completion_mask=[0, 1, 1, 1])]
    with pytest.raises(ValueError, match=r"rows \[0, 1\] differ only in fields the collate does not pass on"):
        in_draw_order(twins, seq2seq(twins))
    same = [rows[0], dict(rows[0])]  # identical rows: either order is the same batch
    assert torch.equal(in_draw_order(same, seq2seq(same))["input_ids"], seq2seq(same)["input_ids"])
    labelled = [{"input_ids": [1, 2], "label": 0}, {"input_ids": [1, 2], "label": 1}]  # "label" collated as "labels"
    batch = in_draw_order(labelled, {"input_ids": torch.tensor([[1, 2], [1, 2]]), "labels": torch.tensor([1, 0])})
    assert batch["labels"].tolist() == [0, 1]


def test_a_collator_that_changes_the_rows_is_refused_by_name(tmp_path):
    """A collator whose rows cannot be matched to the rows it was given (here: random token
    masking) is refused before any step."""

    def masking(rows):
        batch = pad(rows)
        batch["input_ids"][:, 0] = 1
        return batch

    with pytest.raises(ValueError, match=r"collate function's batch cannot be matched"):
        released_sum(tmp_path, user_rows(), collator=masking)


def test_resuming_mid_epoch_names_ignore_data_skip(tmp_path):
    """A run resumed mid-epoch: the Trainer skips the epoch's first batches through a loader
    that is not the user-level one (its batches carry no users). It was refused as 'a physical
    batch came without its users'; the refusal now names the cause and ignore_data_skip=True
    (Poisson draws are fresh: nothing to skip), with which the run resumes."""

    def trainer(steps: int, **kw):
        model = tiny_llama()
        return DPTrainer(
            model=model, args=training_args(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=1,
                                            max_steps=steps, remove_unused_columns=False, save_strategy="steps",
                                            save_steps=1, **kw),
            train_dataset=user_rows(), data_collator=pad,
            privacy=PrivacyArguments(noise_multiplier=1.0, delta=1e-5, privacy_unit="user", user_column="author",
                                     **FORMS["bookkeeping"]),
        )

    trainer(1).train()  # 4 steps per epoch (q_u = 1/4): checkpoint-1 is mid-epoch
    checkpoint = str(tmp_path / "out" / "checkpoint-1")
    with pytest.raises(ValueError, match=r"resumed mid-epoch.*skips.*ignore_data_skip=True"):
        trainer(2).train(resume_from_checkpoint=checkpoint)
    resumed = trainer(2, ignore_data_skip=True)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert resumed.privacy_steps() == 2
