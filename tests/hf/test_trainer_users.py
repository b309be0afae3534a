"""The private Trainer at ``privacy_unit="user"`` (issue 40): Poisson over users at
``q_u = B / number of users`` (B = per-device batch x accumulation: expected users per
step), a sampled user's ``min(k, n_u)`` rows, one clip of the mean of their rows, the update
divided by B, charged at ``q_u``; the user column is read from the ``datasets.Dataset`` and
dropped before collation. At sigma = 0 one Trainer run equals brute-force per-user clipping
(:func:`tests.oracles.per_user_clipped_mean`) in book-keeping (exact norms: a user's
regrouped sequence, at most K x 16 tokens, is no longer than the sketch) and in the
per-example form. Tolerance: float32 summation order (1e-6)."""

from __future__ import annotations

import copy

import datasets
import pytest
import torch
from opacus.accountants import PRVAccountant
from transformers import default_data_collator

from opacus_rc.forms.per_example import PerExampleOptimizer
from opacus_rc.hf import DPTrainer, PrivacyArguments, is_empty_batch, per_example_token_loss, private_trainer
from opacus_rc.row_order import ROW_KEY
from opacus_rc.hf.data import take_units

from tests.models import rows, tiny_llama
from tests.oracles import per_user_clipped_mean

from .test_trainer import training_args

#: every test also with the batches copied as on a device (tests/conftest.py, issue 52)
pytestmark = pytest.mark.usefixtures("dict_batches_as_on_a_device")

C, LR, K = 0.05, 0.5, 3
COUNTS = (1, 2, 3, 4, 6, 8)  # rows of each of the 6 users (24 rows): three above K
FORMS = {
    "bookkeeping": (2, 2, dict(per_example_backward=False, sketch_size=64)),
    "per_example": (1, 4, {}),  # per_device_train_batch_size=1: the per-example form
}
#: the two-rank runs (tests/hf/trainer_ddp_worker.py "users"): 1 x 2 x 2 ranks = 4 expected users
#: of 6 (q_u = 2/3), each form at sigma = 0, and the per-example form at sigma = 0.7
USER_RUNS = {
    "bookkeeping": (1, 2, FORMS["bookkeeping"][2]),
    "per_example": (1, 2, {}),
    "per_example_noisy": (1, 2, {"noise_multiplier": 0.7}),
}


def owners() -> list:
    """The author of each row: user u owns COUNTS[u] rows, interleaved in the dataset."""
    authors = [f"user{u}" for u, n in enumerate(COUNTS) for _ in range(n)]
    order = torch.randperm(len(authors), generator=torch.Generator().manual_seed(0)).tolist()
    return [authors[i] for i in order]


def user_dataset(authors=None) -> datasets.Dataset:
    ids, labels = rows(len(owners()))
    return datasets.Dataset.from_dict(
        {"input_ids": ids.tolist(), "labels": labels.tolist(), "author": authors or owners()}
    )


def row_loss(model, ids, labels):
    logits = model(input_ids=ids, use_cache=False).logits
    return per_example_token_loss(logits, labels, shift=True).mean()


class KeysSeen:
    """A collator recording the keys of every row it collates."""

    def __init__(self) -> None:
        self.keys = set()

    def __call__(self, features):
        for f in features:
            self.keys.update(f)
        return default_data_collator(features)


def recording_units(trainer_class):
    """The trainer class recording every physical batch with the units it carries."""

    class Recording(trainer_class):
        def training_step(self, model, inputs, num_items_in_batch=None):
            self.recorded = getattr(self, "recorded", [])
            units = inputs.get("__opacus_rc_row_units__")
            batch = None if is_empty_batch(inputs) else {k: v.clone() for k, v in inputs.items()
                                                         if isinstance(v, torch.Tensor)}
            self.recorded.append((batch, units))
            return super().training_step(model, inputs, num_items_in_batch)

    return Recording


def train(tmp_path, per_device, accumulation, privacy=None, *, collator=None, trainer_class=DPTrainer, **args):
    model = tiny_llama()
    reference = copy.deepcopy(model)
    options = dict(noise_multiplier=0.0, delta=1e-5, max_grad_norm=C, privacy_unit="user", user_column="author",
                   max_examples_per_user=K)
    options.update(privacy or {})
    args.setdefault("remove_unused_columns", False)  # the private Trainer drops the user column itself
    trainer = recording_units(trainer_class)(
        model=model,
        args=training_args(tmp_path, per_device_train_batch_size=per_device,
                           gradient_accumulation_steps=accumulation, **args),
        train_dataset=user_dataset(), data_collator=collator or default_data_collator,
        optimizers=(torch.optim.SGD(model.parameters(), lr=LR), None),
        privacy=PrivacyArguments(**options),
    )
    trainer.train()
    return model, reference, trainer


def brute_force(model, recorded, accumulation: int, normaliser: int, index) -> None:
    """SGD on ``model`` with the brute-force per-user clipped mean of every logical step
    (``index``: the Trainer's UserIndex, whose numbering the recorded units use)."""
    counts = torch.bincount(index.user_of_row).tolist()
    assert sorted(counts) == list(COUNTS)
    for start in range(0, len(recorded), accumulation):
        step = recorded[start:start + accumulation]
        users = [s for b, u in step for s in u.users.tolist()]
        parts = [set(u.users.tolist()) for _, u in step]
        assert sum(map(len, parts)) == len(set(users))  # each physical batch holds whole users
        assert all(users.count(u) == min(K, counts[u]) for u in users)  # m_u rows of a sampled user
        batches = [b for b, _ in step if b is not None]
        if not batches:
            continue
        ids = torch.cat([b["input_ids"] for b in batches])
        labels = torch.cat([b["labels"] for b in batches])
        update = per_user_clipped_mean(model, row_loss, ids, labels, users, C, normaliser)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p -= LR * update[name]


@pytest.mark.parametrize("form", sorted(FORMS))
def test_update_equals_brute_force_per_user_clipping(tmp_path, form):
    per_device, accumulation, privacy = FORMS[form]
    model, reference, trainer = train(tmp_path, per_device, accumulation, privacy, max_steps=2)
    assert isinstance(trainer._dp_optimizer, PerExampleOptimizer) == (form == "per_example")
    assert trainer.sample_rate == pytest.approx(per_device * accumulation / len(COUNTS))
    assert trainer.user_index().num_users == len(COUNTS) and trainer._dp_optimizer.privacy_unit == "user"
    recorded = trainer.recorded
    assert len(recorded) == 2 * accumulation and sum(len(u) for _, u in recorded) > 0
    brute_force(reference, recorded, accumulation, per_device * accumulation, trainer.user_index())
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_user_column_never_reaches_the_collator_or_the_model(tmp_path):
    collator = KeysSeen()
    seen = []

    class Watching(DPTrainer):
        def per_example_loss(self, model, inputs):
            seen.append(set(inputs))
            return super().per_example_loss(model, inputs)

    _, _, trainer = train(tmp_path, 2, 2, FORMS["bookkeeping"][2], collator=collator, trainer_class=Watching,
                          max_steps=2)
    assert collator.keys == {"input_ids", "labels", ROW_KEY}  # (the plugin's row position: stripped after it)
    assert seen and all(keys == {"input_ids", "labels"} for keys in seen)
    assert "author" in trainer.train_dataset.column_names  # the user's dataset is unchanged


def test_epsilon_is_opacus_prv_at_the_users_rate(tmp_path):
    """Per-example form (exact clipping): epsilon after 3 steps at sigma 0.7 is Opacus's
    PRV at q_u = 4 / 6 (not at the example rate); the log names the unit."""
    _, _, trainer = train(tmp_path, 1, 4, {"noise_multiplier": 0.7}, max_steps=3, logging_steps=3)
    q_u = 4 / len(COUNTS)
    assert [entry[:3] for entry in trainer.accountant.history] == [(0.7, pytest.approx(q_u), 3)]
    prv = PRVAccountant()
    prv.history = [(0.7, q_u, 3)]
    assert trainer.get_epsilon() == pytest.approx(prv.get_epsilon(1e-5), rel=1e-6)
    logged = [h for h in trainer.state.log_history if "epsilon" in h][0]
    assert logged["privacy_unit"] == "user" and logged["epsilon"] == pytest.approx(trainer.get_epsilon())
    assert trainer.privacy_unit == "user" and trainer.privacy_engine.privacy_unit == "user"


def test_private_sft_trainer_at_user_level(tmp_path):
    """TRL's SFTTrainer made private trains at user level: the author column is kept by its
    tokenisation, read, and dropped before collation; charged at q_u."""
    import trl

    from .test_trainer import char_tokenizer, sft_dataset

    data = sft_dataset().add_column("author", owners())
    model = tiny_llama()
    initial = copy.deepcopy(model)
    config = trl.SFTConfig(
        output_dir=str(tmp_path / "sft"), per_device_train_batch_size=1, gradient_accumulation_steps=4,
        max_steps=2, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, bf16=False,
        gradient_checkpointing=False, lr_scheduler_type="constant",
    )
    trainer = private_trainer(trl.SFTTrainer)(
        model=model, args=config, train_dataset=data, processing_class=char_tokenizer(),
        optimizers=(torch.optim.SGD(model.parameters(), lr=LR), None),
        privacy=PrivacyArguments(noise_multiplier=0.5, delta=1e-5, max_grad_norm=C, privacy_unit="user",
                                 user_column="author", max_examples_per_user=K),
    )
    trainer.train()
    assert isinstance(trainer._dp_optimizer, PerExampleOptimizer)
    assert trainer.accountant.history[0][:3] == (0.5, pytest.approx(4 / len(COUNTS)), 2)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), initial.parameters()))


def test_two_gloo_ranks_at_user_level_equal_brute_force_on_the_union(tmp_path):
    """torchrun --nproc_per_node 2 (tests/hf/trainer_ddp_worker.py "users"): rank r draws its
    share of the users (r, r + 2, ...: every row of a user on one rank); at sigma = 0 both
    forms equal brute-force per-user clipping of the union of the ranks' batches of each
    logical step, divided by the expected users over both ranks (B = 4); at sigma = 0.7 the
    noise is added once (both ranks end equal) and both report Opacus's PRV epsilon at q_u."""
    from opacus_rc.units import UserIndex

    from .test_trainer import run_two_ranks

    ranks = run_two_ranks(tmp_path, 0.0, clipping="users")
    index = UserIndex(owners(), len(owners()), K)
    q_u = 4 / len(COUNTS)
    for name, (per_device, accumulation, _) in USER_RUNS.items():
        runs = [r[name] for r in ranks]
        assert all(r["expected_batch_size"] == 4 and r["sample_rate"] == pytest.approx(q_u) for r in runs)
        assert all(r["optimizer"].startswith("Distributed") for r in runs)
        assert ("PerExample" in runs[0]["optimizer"]) == name.startswith("per_example")
        for rank, run in enumerate(runs):  # rank r holds only its users, r, r + 2, ...
            users = {u for _, units in run["recorded"] for u in units.users.tolist()}
            assert users and all(u % 2 == rank for u in users), (name, rank, users)
        for p, q in zip(runs[0]["params"].values(), runs[1]["params"].values()):
            assert torch.equal(p, q), name
        assert runs[0]["history"] == runs[1]["history"] and runs[0]["epsilon"] == runs[1]["epsilon"]
        if runs[0]["history"][0][0] > 0:
            prv = PRVAccountant()
            prv.history = [(0.7, q_u, 3)]
            assert [e[:3] for e in runs[0]["history"]] == [(0.7, pytest.approx(q_u), 3)]
            assert runs[0]["epsilon"] == pytest.approx(prv.get_epsilon(1e-5), rel=1e-6)
            continue
        union = []  # a logical step: rank 0's physical batches, then rank 1's
        for start in range(0, 3 * accumulation, accumulation):
            for run in runs:
                union.extend(run["recorded"][start:start + accumulation])
        reference = tiny_llama()  # both ranks' initial weights (rank 0's are broadcast)
        brute_force(reference, union, 2 * accumulation, per_device * accumulation * 2, index)
        for (n, p), q in zip(reference.named_parameters(), runs[0]["params"].values()):
            torch.testing.assert_close(q, p.detach(), rtol=1e-5, atol=1e-6, msg=f"{name}: {n}")


# --- refusals ---------------------------------------------------------------------------

def arguments(**kw):
    return PrivacyArguments(noise_multiplier=1.0, delta=1e-5, **kw)


@pytest.mark.parametrize("kw, match", [
    (dict(privacy_unit="user"), r"user_column=None is invalid; privacy_unit='user' needs"),
    (dict(privacy_unit="user", user_column=""), r"user_column='' is invalid"),
    (dict(privacy_unit="users", user_column="author"), r"privacy_unit='users' is invalid"),
    (dict(privacy_unit="user", user_column="author", max_examples_per_user=0), r"max_examples_per_user=0"),
    (dict(user_column="author"), r"user_column only apply with privacy_unit='user'"),
    (dict(max_examples_per_user=3), r"max_examples_per_user only apply with privacy_unit='user'"),
    (dict(privacy_unit="user", user_column="author", clipping="flat"), r"clipping='flat'"),
])
def test_bad_privacy_arguments_are_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        arguments(**kw)


@pytest.mark.parametrize("dataset, match", [
    (lambda: user_dataset().remove_columns("author"), r"user_column='author' is not a column of train_dataset"),
    (lambda: user_dataset([None if i == 5 else a for i, a in enumerate(owners())]),
     r"user_column='author': user_ids\[5\]=None is invalid"),
    # issue 46: a float id other than an integral one (1.5, NaN) is refused as make_private's user_ids are
    (lambda: user_dataset([i % 6 + 0.5 for i in range(len(owners()))]),
     r"user_column='author': user_ids\[0\]=0.5 is invalid .*accepted values: an int, a str"),
    (lambda: user_dataset([float("nan") if i < 2 else float(i % 6) for i in range(len(owners()))]),
     r"user_column='author': user_ids\[0\]=nan is invalid"),
    (lambda: torch.utils.data.TensorDataset(torch.zeros(4)), r"user_column='author' needs a datasets.Dataset"),
])
def test_bad_user_column_is_refused_at_construction(tmp_path, dataset, match):
    model = tiny_llama()
    with pytest.raises(ValueError, match=match):
        DPTrainer(model=model, args=training_args(tmp_path), train_dataset=dataset(),
                  privacy=arguments(privacy_unit="user", user_column="author"))


def test_two_gloo_ranks_given_their_own_shards_of_users_are_refused(tmp_path):
    """Issue 46 path 3 in the Trainer (tests/hf/trainer_ddp_worker.py "users_sharded"): each rank
    given its own half of the rows, so a user with rows in both halves would be drawn and
    clipped on both ranks (on main the Trainer was built). Refused at construction on both."""
    from .test_trainer import run_two_ranks

    for rank in run_two_ranks(tmp_path, 0.0, clipping="users_sharded"):
        assert "the ranks were given different rows or user_ids" in rank["raised"]


def test_expected_users_per_step_above_the_users_is_refused_at_construction(tmp_path):
    """Issue 46: 4 x 2 = 8 expected users per step of 6 ran at q_u = 1 with the update divided
    by 8 (on main); refused by name. 3 x 2 = 6 of 6: q_u = 1."""
    def trainer(per_device):
        return DPTrainer(model=tiny_llama(), args=training_args(tmp_path, per_device_train_batch_size=per_device,
                                                                gradient_accumulation_steps=2),
                         train_dataset=user_dataset(), privacy=arguments(privacy_unit="user", user_column="author"))

    with pytest.raises(ValueError, match=r"batch_size=8 .* above the 6 users .*accepted values: a batch_size of "
                                         r"at most 6, or sample_rate="):
        trainer(4)
    assert trainer(3).sample_rate == 1.0


def test_a_batch_without_its_users_is_refused(tmp_path):
    """A subclass feeding the training step a batch that did not come from the user-level
    loader (no units): refused before any backward pass."""

    class Foreign(DPTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            take_units(inputs)
            return super().training_step(model, inputs, num_items_in_batch)

    with pytest.raises(ValueError, match=r"privacy_unit='user': a physical batch came without its users"):
        train(tmp_path, 2, 2, FORMS["bookkeeping"][2], trainer_class=Foreign, max_steps=1)


def test_gradient_checkpointing_runs_the_output_passes_per_user(tmp_path):
    """A checkpointed model with a sketched form runs the two passes from the output, whose
    second pass weights each row by its user's clip factor: equal to brute-force per-user
    clipping."""
    per_device, accumulation, privacy = FORMS["bookkeeping"]
    model, reference, trainer = train(tmp_path, per_device, accumulation, privacy, max_steps=2,
                                      gradient_checkpointing=True)
    assert trainer.recorded and sum(len(u) for _, u in trainer.recorded) > 0
    brute_force(reference, trainer.recorded, accumulation, per_device * accumulation, trainer.user_index())
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
