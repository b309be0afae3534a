"""The private Trainer (and TRL's SFTTrainer) with ``noise="banded"``: cyclic Poisson draws
(draw t from part t mod b of the units, at b q), each logical step's draw number carried to the
optimizer as the banded noise's step, sigma calibrated and epsilon charged for the banded record
(``ceil(steps / b)`` DP-SGD rounds at ``sigma / column_norm``, rate b q), the recursion continued
on resume. Tiny Llama from a config, generated data; nothing downloaded."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from opacus.accountants import PRVAccountant
from transformers import default_data_collator

from opacus_rc.accounting.accountant import RCPRVAccountant
from opacus_rc.correlated import banded_sqrt_coefficients, max_column_norm
from opacus_rc.hf import DPTrainer, PrivacyArguments, is_empty_batch, private_trainer
from opacus_rc.hf.noise import check_draw_step
from opacus_rc.noises.banded import BandedNoise
from opacus_rc.hf.data import PoissonAccumulationSampler, poisson_sampler_of
from opacus_rc.packing import SEGMENTS_KEY
from opacus_rc.units import UserIndex

from tests.models import RowDataset, tiny_llama
from tests.oracles import cyclic_part

from .test_trainer import char_tokenizer, sft_dataset, training_args
from .test_trainer_users import user_dataset

#: every test also with the batches copied as on a device (tests/conftest.py, issue 52)
pytestmark = pytest.mark.usefixtures("dict_batches_as_on_a_device")

DELTA, SIGMA = 1e-5, 1.0
_DRAW, _UNITS = "__opacus_rc_draw_step__", "__opacus_rc_row_units__"


def banded(bands: int, **kw) -> PrivacyArguments:
    return PrivacyArguments(**{"noise_multiplier": SIGMA, "delta": DELTA, "noise": "banded", "bands": bands, **kw})


def recording(trainer_class):
    """The trainer class recording each physical batch's draw number and units, and each
    release's banded noise step (the argument of ``BandedNoise.steps_to`` and the step it
    starts from)."""

    class Recording(trainer_class):
        def training_step(self, model, inputs, num_items_in_batch=None):
            self.draws = getattr(self, "draws", [])
            self.draws.append((inputs.get(_DRAW), inputs.get(_UNITS), is_empty_batch(inputs)))
            return super().training_step(model, inputs, num_items_in_batch)

        def create_optimizer(self, model=None):
            optimizer = super().create_optimizer(model)
            noise = optimizer.banded
            if not hasattr(noise, "released"):
                noise.released = []
                steps_to = noise.steps_to
                noise.steps_to = lambda step: noise.released.append((step, noise.next_step)) or steps_to(step)
            return optimizer

    return Recording


def logical_draws(trainer, accumulation: int) -> list:
    """The draw number of each logical step (checked equal over its physical batches)."""
    steps = [trainer.draws[i:i + accumulation] for i in range(0, len(trainer.draws), accumulation)]
    numbers = [{d for d, _, _ in step} for step in steps]
    assert all(len(n) == 1 for n in numbers), numbers
    return [n.pop() for n in numbers]


def expected_record(trainer, bands: int):
    """The record of the run's steps: the privacy arguments' step record, in the noise's run."""
    record = trainer.privacy.step_record(trainer.args.per_device_train_batch_size)
    assert record.bands == bands and record.column_norm == max_column_norm(banded_sqrt_coefficients(bands))
    return dataclasses.replace(record, noise_run=trainer._dp_optimizer.banded.run_id)


def cyclic_sampler(trainer):
    """The cyclic Poisson sampler of the Trainer's loader (its secret partition)."""
    return poisson_sampler_of(trainer._dp_loader)._user_draws


def test_example_level_trains_and_charges_the_banded_record(tmp_path):
    """Five logical steps at q = 1/6 with b = 3: draws 0..4, each released as noise step t;
    charged at 3q with bands=3; epsilon that of ceil(5/3) = 2 rounds at sigma / column_norm."""
    model = tiny_llama()
    before = model.lm_head.weight.detach().clone()
    trainer = recording(DPTrainer)(
        model=model, args=training_args(tmp_path, max_steps=5, logging_steps=5, learning_rate=1e-2),
        train_dataset=RowDataset(), privacy=banded(3, sample_rate=1 / 6),
    )
    trainer.train()
    assert not torch.equal(model.lm_head.weight, before)
    assert logical_draws(trainer, 2) == [0, 1, 2, 3, 4]
    noise = trainer._dp_optimizer.banded
    assert noise.released == [(t, t) for t in range(5)]  # the noise's step is the draw's, one step each
    assert trainer._dp_optimizer.next_noise_step == 5
    record = expected_record(trainer, 3)
    assert trainer.accountant.history == [(SIGMA, 3 * (1 / 6), 5, record)]
    # epsilon: the accountant's reduction, recomputed independently from charged()
    (sigma, q, rounds, plain), = trainer.accountant.charged()
    assert (sigma, q, rounds) == (pytest.approx(SIGMA / record.column_norm), pytest.approx(0.5), 2)
    assert plain.bands == 1 and plain.sketch_size == record.sketch_size
    probe = RCPRVAccountant()
    probe.history = [(SIGMA / record.column_norm, 0.5, 2, plain)]
    assert trainer.get_epsilon() == pytest.approx(probe.get_epsilon(delta=DELTA), rel=1e-9)
    assert trainer.state.log_history[-1]["epsilon"] == pytest.approx(trainer.get_epsilon())


def test_target_epsilon_is_calibrated_for_the_banded_record(tmp_path):
    """The per-example form (exact clipping: an ordinary subsampled Gaussian): sigma is calibrated
    for the banded record, and epsilon equals Opacus's prv at ceil(steps / b) rounds of
    sigma / column_norm at b q."""
    trainer = recording(DPTrainer)(
        model=tiny_llama(), args=training_args(tmp_path, max_steps=4, per_device_train_batch_size=1,
                                               gradient_accumulation_steps=4, logging_steps=4),
        train_dataset=RowDataset(), privacy=banded(2, noise_multiplier=None, target_epsilon=4.0),
    )
    trainer.train()
    q = 1 / 6  # B = 4 of N = 24
    assert trainer.sample_rate == pytest.approx(q)
    assert logical_draws(trainer, 4) == [0, 1, 2, 3]
    sigma = trainer._dp_sigma
    record = expected_record(trainer, 2)
    assert record.sketch_size is None  # exact clipping
    assert trainer.accountant.history == [(sigma, 2 * q, 4, record)]
    prv = PRVAccountant()
    prv.history = [(sigma / record.column_norm, 2 * q, math.ceil(4 / 2))]
    assert trainer.get_epsilon() == pytest.approx(prv.get_epsilon(DELTA), rel=1e-6)
    assert 4.0 - 0.05 <= trainer.get_epsilon() <= 4.0


def test_user_level_draws_a_part_of_the_users_per_step(tmp_path):
    """privacy_unit="user" at q_u = 1/6, b = 2: every user of draw t is in part t mod 2 of the
    users; charged at 2 q_u with bands=2."""
    trainer = recording(DPTrainer)(
        model=tiny_llama(),
        args=training_args(tmp_path, max_steps=4, per_device_train_batch_size=2, remove_unused_columns=False),
        train_dataset=user_dataset(), data_collator=default_data_collator,
        privacy=banded(2, sample_rate=0.25, privacy_unit="user", user_column="author", max_examples_per_user=3),
    )
    trainer.train()
    assert logical_draws(trainer, 2) == [0, 1, 2, 3]
    assert trainer._dp_optimizer.banded.released == [(t, t) for t in range(4)]
    sampler = cyclic_sampler(trainer)
    for step, units, empty in trainer.draws:  # (units.users: the users' numbers; their keys: the author ids)
        assert empty or all(cyclic_part(sampler._secret, sampler.index.keys[u], 2) == step % 2
                            for u in units.users.tolist())
    assert trainer.accountant.history == [(SIGMA, 0.5, 4, expected_record(trainer, 2))]
    assert trainer.state.log_history[-1]["privacy_unit"] == "user"


def test_the_sampler_draws_part_t_mod_b_numbered_across_epochs():
    """PoissonAccumulationSampler(bands=b): rows (or users) of draw t all in part t mod b (each
    unit's part the keyed hash of its key), at the rate inside a part; numbered on across epochs,
    from the noise's next step (serve)."""
    sampler = PoissonAccumulationSampler(num_samples=30, sample_rate=0.6, micro_batches=2, steps=5, bands=3)
    noise = BandedNoise(banded_sqrt_coefficients(3))
    noise.next_step = noise.run_start = 7
    sampler.serve(noise)
    secret = sampler._user_draws._secret
    for _ in range(2):  # two epochs
        batches = list(sampler.numbered_draws())
        assert len(batches) == 10
        for step, rows in batches:
            assert all(cyclic_part(secret, r, 3) == step % 3 for r in rows)
    assert [s for s, _ in batches][::2] == [12, 13, 14, 15, 16]
    users = UserIndex([i % 6 for i in range(24)], 24, 3)
    sampler = PoissonAccumulationSampler(num_samples=24, sample_rate=1.0, micro_batches=1, steps=4, bands=2,
                                         users=users)
    secret = sampler._user_draws._secret
    for step, rows in sampler.numbered_draws():
        owners = set(users.user_of_row[rows].tolist())
        assert owners == {u for u in range(6) if cyclic_part(secret, users.keys[u], 2) == step % 2}  # rate 1


def test_empty_draws_still_advance_the_noise(tmp_path):
    """At q = 0.02 most draws are empty: each is still its noise step, released and charged."""
    trainer = recording(DPTrainer)(
        model=tiny_llama(), args=training_args(tmp_path, max_steps=6, learning_rate=1e-2), train_dataset=RowDataset(),
        privacy=banded(4, sample_rate=0.02),
    )
    trainer.train()
    assert any(empty for _, _, empty in trainer.draws)
    assert logical_draws(trainer, 2) == list(range(6))
    assert trainer._dp_optimizer.banded.released == [(t, t) for t in range(6)]
    assert trainer.accountant.history == [(SIGMA, 0.08, 6, expected_record(trainer, 4))]


def test_resume_restarts_the_recursion_in_a_new_run(tmp_path):
    """A Trainer checkpoint (optimizer.pt) holds the noise's next step, not its kept vectors
    (secrets): the resumed run numbers its draws from that step and restarts the recursion in a
    new run (a partition of its own), charged apart: ceil(2/3) + ceil(2/3) rounds. Resuming
    mid-epoch without ignore_data_skip is refused by name (the Trainer's skipping loader
    carries no draw numbers)."""

    def run(steps, resume=None, **args):
        trainer = recording(DPTrainer)(
            model=tiny_llama(),
            args=training_args(tmp_path, max_steps=steps, save_strategy="steps", save_steps=2, logging_steps=1, **args),
            train_dataset=RowDataset(), privacy=banded(3, sample_rate=1 / 6),
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    first = run(2)
    checkpoint = tmp_path / "out" / "checkpoint-2"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=False)
    assert saved["opacus_rc_banded_noise"] == {"coefficients": pytest.approx(banded_sqrt_coefficients(3)), "next_step": 2}
    first_record = expected_record(first, 3)
    resumed = run(4, str(checkpoint), ignore_data_skip=True)
    assert logical_draws(resumed, 2) == [2, 3]
    assert resumed._dp_optimizer.banded.released == [(2, 2), (3, 3)]
    assert resumed._dp_optimizer.banded.run_start == 2
    record = expected_record(resumed, 3)
    assert record.noise_run != first_record.noise_run
    assert resumed.accountant.history == [(SIGMA, 0.5, 2, first_record), (SIGMA, 0.5, 2, record)]
    plain = resumed.accountant.charged()[0][3]
    probe = RCPRVAccountant()
    probe.history = [(SIGMA / record.column_norm, 0.5, 2, plain)]  # one round in each run
    assert resumed.get_epsilon() == pytest.approx(probe.get_epsilon(delta=DELTA), rel=1e-9)
    with pytest.raises(ValueError, match="noise='banded'.*ignore_data_skip=True"):
        run(4, str(checkpoint))


def test_banded_options_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="noise='bandd'.*did you mean 'banded'"):
        PrivacyArguments(noise_multiplier=1.0, delta=DELTA, noise="bandd", bands=2)
    for bands in (0, -1, 1.5, None, True):
        with pytest.raises(ValueError, match=f"bands={bands!r}"):
            banded(bands)
    with pytest.raises(ValueError, match="bands=2 only applies with noise='banded'"):
        PrivacyArguments(noise_multiplier=1.0, delta=DELTA, bands=2)
    with pytest.raises(ValueError, match="noise='banded'.*clipping='flat'"):
        banded(2, clipping="flat")
    with pytest.raises(ValueError, match="noise='banded'.*denoise='spectral'"):
        banded(2, denoise="spectral")
    with pytest.raises(ValueError, match="bands=7 is above the 6 logical steps"):  # 7 q > 1 at q = 1/6
        DPTrainer(model=tiny_llama(), args=training_args(tmp_path), train_dataset=RowDataset(),
                  privacy=banded(7, sample_rate=1 / 6))
    with pytest.raises(ValueError, match="noise='banded': a physical batch came without its draw's number"):
        check_draw_step(banded(2), None)


def test_the_optimizer_refuses_two_draws_in_one_release(tmp_path):
    trainer = DPTrainer(model=tiny_llama(), args=training_args(tmp_path), train_dataset=RowDataset(),
                        privacy=banded(2, sample_rate=1 / 6))
    optimizer = trainer.create_optimizer()
    optimizer.signal_draw_step(0)
    optimizer.signal_draw_step(0)  # another physical batch of the same draw
    with pytest.raises(ValueError, match="noise='banded'"):
        optimizer.signal_draw_step(1)


def test_private_sft_trainer_with_banded_noise(tmp_path):
    """TRL's SFTTrainer made private (bf16 autocast, gradient checkpointing: SFTConfig's
    defaults) trains with banded noise: draws numbered, charged at b q with bands=b."""
    import trl

    model = tiny_llama()
    before = model.lm_head.weight.detach().clone()
    config = trl.SFTConfig(
        output_dir=str(tmp_path / "sft"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_steps=3, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, logging_steps=3,
        learning_rate=1e-2,
    )
    trainer = recording(private_trainer(trl.SFTTrainer))(
        model=model, args=config, train_dataset=sft_dataset(), processing_class=char_tokenizer(),
        privacy=banded(3, sample_rate=1 / 6),
    )
    trainer.train()
    assert not torch.equal(model.lm_head.weight, before)
    assert logical_draws(trainer, 2) == [0, 1, 2]
    assert trainer._dp_optimizer.banded.released == [(t, t) for t in range(3)]
    assert trainer.accountant.history == [(SIGMA, 0.5, 3, expected_record(trainer, 3))]
    assert trainer.state.log_history[-1]["epsilon"] == pytest.approx(trainer.get_epsilon())


# ------------------------------------------------------------------- two processes (gloo)

#: the clip of the two-process runs (exact norms at T <= 16 <= k = 32)
DDP_C = 0.05
#: kind -> (b, q, per-device batch), 2 accumulation steps, 2 ranks. Rows: B = 2 x 2 x 2 = 8 = q N
#: at q = 1/3 of 24 rows; users (privacy_unit="user", 6 users): B = 1 x 2 x 2 = 4 expected users at
#: q = 1/2, in the per-example form (a physical batch of one). The rate inside a part, b q, is 1:
#: every unit of the part is drawn, so a rank's share of a draw is empty only for a part of at most
#: one unit, whatever the secret partition (the test needs a draw with rows on both ranks)
DDP_RUNS = {"trainer": (3, 1 / 3, 2), "sft": (3, 1 / 3, 2), "users": (2, 1 / 2, 1)}
#: the form each kind runs (its physical batch and options: :func:`ddp_banded_run`)
DDP_FORMS = {"trainer": "bookkeeping", "sft": "bookkeeping", "users": "per_example"}


def release_recording(trainer_class):
    """The trainer class recording, on its rank (or in its one process): each physical batch (its
    draw number, its rows and units, before the Trainer takes them off: the collated tensors, or a
    padding-free batch's packed sequences, each unpacked as its own row), each logical draw the
    sampler makes (its number, its rows and the stable keys of their units: the rows, or the users'
    ids), each release (``p.grad`` when the wrapped optimizer updates, after the ranks' all-reduce)
    and each ``z`` the optimizer draws (rank 0 only: the others add none). :func:`recorded`
    collects it."""

    class Recording(trainer_class):
        def training_step(self, model, inputs, num_items_in_batch=None):
            self.batches = getattr(self, "batches", [])
            segments = inputs.get(SEGMENTS_KEY)
            if is_empty_batch(inputs):
                rows = None
            elif segments is not None:  # padding_free: each packed sequence is a row of its own
                fields = {k: inputs[k].clone() for k in ("input_ids", "labels")}
                rows = [{k: v[0] for k, v in row.items()} for row in segments.unpacked(fields)]
            else:
                rows = {k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
            self.batches.append((inputs.get(_DRAW), rows, inputs.get(_UNITS)))
            return super().training_step(model, inputs, num_items_in_batch)

        def get_train_dataloader(self):
            loader = super().get_train_dataloader()
            sampler, self.drawn = poisson_sampler_of(loader), []
            index = self.user_index()
            key = (lambda row: row) if index is None else (lambda row: index.keys[int(index.user_of_row[row])])
            draws = sampler.numbered_draws
            sampler.numbered_draws = lambda: (self.drawn.append((d[0], d[1], [key(r) for r in d[1]])) or d
                                              for d in draws())
            return loader

        def create_optimizer(self, model=None):
            optimizer = super().create_optimizer(model)
            if not hasattr(self, "releases"):
                self.releases, self.z = [], []
                names = {id(p): n for n, p in self.model.named_parameters()}
                self.slot_names = [names[id(p)] for p in optimizer.params]
                optimizer.original_optimizer.register_step_pre_hook(
                    lambda *_: self.releases.append([p.grad.detach().clone() for p in optimizer.params]))
                draw = optimizer._noise
                optimizer._noise = lambda std, reference: (lambda z: self.z.append(z.clone()) or z)(draw(std, reference))
            return optimizer

    return Recording


def trainer_form(trainer) -> str:
    """The clipping form a private Trainer runs, by the compatibility matrix's names
    (docs/forms.md): the two passes from the output on a checkpointed model, else its optimizer's."""
    return "output_passes" if getattr(trainer._dp_hooks, "output_passes", None) is not None else trainer._dp_form.name


def recorded(trainer) -> dict:
    """What a :func:`release_recording` trainer recorded in its run, with what :func:`check_releases`
    reads of the run: its sampler's share, secret partition (cyclic draws) and parts, the unit, the
    users' ids, every training row's tokens, the public B, the form, the history and epsilon."""
    bands = trainer.privacy.noise_spec().parts
    sampler, index, data = poisson_sampler_of(trainer._dp_loader), trainer.user_index(), trainer.train_dataset
    return {
        "batches": trainer.batches, "drawn": trainer.drawn[:len(trainer.batches)], "releases": trainer.releases,
        "z": trainer.z, "slot_names": trainer.slot_names, "history": trainer.accountant.history,
        "epsilon": trainer.get_epsilon(), "bands": bands,
        "secret": None if bands is None else cyclic_sampler(trainer)._secret, "share": (sampler.rank, sampler.world_size), "unit": trainer.privacy_unit,
        "user_keys": None if index is None else list(index.keys),
        "row_ids": [tuple(int(t) for t in data[i]["input_ids"]) for i in range(len(data))],
        "expected_batch_size": trainer.expected_batch_size, "form": trainer_form(trainer),
        "optimizer": type(trainer._dp_optimizer).__name__,
    }


def ddp_banded_run(out, kind: str, max_steps: int, resume=None) -> dict:
    """One rank's banded run (``kind``: ``"trainer"``, DPTrainer on RowDataset; ``"sft"``, TRL's
    SFTTrainer made private, float32 without checkpointing; ``"users"``, DPTrainer at
    ``privacy_unit="user"``) at learning rate 0, sigma = 1, a checkpoint every 2 steps;
    ``resume``: a checkpoint every rank resumes from. What it recorded."""
    import os

    bands, q, per_device = DDP_RUNS[kind]
    model = tiny_llama(seed=int(os.environ["RANK"]))  # different on purpose: DPDDP broadcasts rank 0's
    units = dict(privacy_unit="user", user_column="author", max_examples_per_user=3) if kind == "users" else {}
    privacy = banded(bands, sample_rate=q, max_grad_norm=DDP_C, sketch_size=32, **units)
    common = dict(model=model, optimizers=(torch.optim.SGD(model.parameters(), lr=0.0), None), privacy=privacy)
    schedule = dict(per_device_train_batch_size=per_device, gradient_accumulation_steps=2, max_steps=max_steps,
                    save_strategy="steps", save_steps=2, logging_steps=1, ignore_data_skip=True)
    if kind == "trainer":
        trainer = release_recording(DPTrainer)(args=training_args(out, **schedule), train_dataset=RowDataset(),
                                               **common)
    elif kind == "users":
        trainer = release_recording(DPTrainer)(args=training_args(out, remove_unused_columns=False, **schedule),
                                               train_dataset=user_dataset(), data_collator=default_data_collator,
                                               **common)
    else:
        import trl

        config = trl.SFTConfig(output_dir=str(out / "out"), report_to=[], use_cpu=True, disable_tqdm=True, bf16=False,
                               gradient_checkpointing=False, lr_scheduler_type="constant", **schedule)
        trainer = release_recording(private_trainer(trl.SFTTrainer))(
            args=config, train_dataset=sft_dataset(), processing_class=char_tokenizer(), **common)
    trainer.train(resume_from_checkpoint=resume)
    optimizer = trainer._dp_optimizer
    return {
        **recorded(trainer), "run_id": optimizer.banded.run_id, "run_start": optimizer.banded.run_start,
        "holder": optimizer.banded.holder, "record": trainer.privacy.step_record(per_device),
    }


def ddp_shifted_draws(out) -> dict:
    """One rank's DPTrainer whose sampler, on rank 1, numbers its draws one ahead (as if its loader
    had been iterated once more): the first release is refused on both ranks (no rank waits in a
    collective), nothing charged."""
    import os

    rank = int(os.environ["RANK"])
    bands, q, per_device = DDP_RUNS["trainer"]

    class Shifted(DPTrainer):
        def _dp_on_train_begin(self):
            super()._dp_on_train_begin()
            if rank == 1:
                cyclic_sampler(self).next_draw += 1

    trainer = Shifted(model=tiny_llama(seed=0), args=training_args(out, per_device_train_batch_size=per_device),
                      train_dataset=RowDataset(), privacy=banded(bands, sample_rate=q))
    try:
        trainer.train()
        raised = ""
    except ValueError as error:
        raised = str(error)
    return {"raised": raised, "history": trainer.accountant.history}


def rows_of(batch) -> list:
    """A recorded physical batch's rows, each alone: a padding-free batch's sequences as recorded,
    a collated batch's rows cut to their tokens (right padding: the attention mask's ones first)."""
    if batch is None or isinstance(batch, list):
        return batch or []
    ids, labels, mask = batch["input_ids"], batch["labels"], batch.get("attention_mask")
    rows = []
    for i in range(ids.shape[0]):
        n = ids.shape[1] if mask is None else int(mask[i].sum())
        assert mask is None or bool(mask[i, :n].all()), "not right padding"
        rows.append({"input_ids": ids[i, :n], "labels": labels[i, :n]})
    return rows


def check_releases(ranks, start: int, steps: int, clip: float = DDP_C, accumulation: int = 2) -> None:
    """The releases of ``steps`` logical steps from draw ``start`` of one run recorded on each rank
    (:func:`recorded`; one process: one rank). Every rank trained on exactly the rows its sampler
    drew (their tokens, and their users' ids), the ranks' units disjoint; with cyclic draws
    (``bands``) every rank numbers the draws ``start ..`` alike and draws them from part ``t mod b``
    of one partition (rank 0's secret). Rank 0 alone draws noise; every release, on every rank, is
    brute-force clipping (per row, or per user: :mod:`tests.oracles`; each row alone, positions from
    0) of the union of the ranks' rows of the step over the public B, plus ``(C^-1 z)_t / B`` of
    rank 0's ``z`` from the run's first step (independent noise: ``C = I``; a resumed banded run
    restarts the recursion: ``C`` from its start), ``C`` built here; the histories agree."""
    from tests.forms.test_banded import band_matrix
    from tests.oracles import per_example_clipped_mean, per_user_clipped_mean

    from .test_trainer_padding_free import sequence_loss

    first, world = ranks[0], len(ranks)
    bands, unit = first["bands"], first["unit"]
    numbers = [None if bands is None else t for t in range(start, start + steps) for _ in range(accumulation)]
    for rank, r in enumerate(ranks):
        assert (r["history"], r["epsilon"], r["secret"], r["form"]) == (first["history"], first["epsilon"],
                                                                        first["secret"], first["form"])
        assert r["share"] == (rank, world) and len(r["releases"]) == steps
        assert [d for d, *_ in r["batches"]] == [d for d, *_ in r["drawn"]] == numbers
        assert bands is None or all(cyclic_part(first["secret"], key, bands) == t % bands
                                    for t, _, keys in r["drawn"] for key in keys)
        for (_, rows, keys), (_, batch, units) in zip(r["drawn"], r["batches"]):  # the rows trained: those drawn
            trained = [tuple(row["input_ids"].tolist()) for row in rows_of(batch)]
            drawn = [r["row_ids"][row] for row in rows]
            if unit == "user":
                users = [] if batch is None else units.users.tolist()
                assert len(users) == len(trained)
                trained, drawn = zip(trained, [r["user_keys"][u] for u in users]), zip(drawn, keys)
            assert sorted(trained) == sorted(drawn)
    units_of = [{key for _, _, keys in r["drawn"] for key in keys} for r in ranks]
    assert sum(map(len, units_of)) == len(set().union(*units_of)), "a unit drawn on two ranks"
    batches = [[b for r in ranks for b in r["batches"][accumulation * t:accumulation * (t + 1)]] for t in range(steps)]
    assert any(sum(len(rows_of(batch)) for _, batch, _ in step) > 1 for step in batches), "no draw of several rows"
    both = [t for t in range(steps)
            if all(any(rows for _, rows, _ in r["drawn"][accumulation * t:accumulation * (t + 1)]) for r in ranks)]
    assert world == 1 or both, "no draw with rows on both ranks: pick another schedule"
    reference = tiny_llama(seed=0)  # rank 0's weights: DPDDP broadcast them, learning rate 0 kept them
    names, slots = first["slot_names"], len(first["slot_names"])
    assert len(first["z"]) == steps * slots and all(r["z"] == [] for r in ranks[1:])
    z = [[first["z"][t * slots + s] for s in range(slots)] for t in range(steps)]
    w = [torch.linalg.solve_triangular(band_matrix(bands or 1, steps),
                                       torch.stack([zt[s].double().flatten() for zt in z]), upper=False)
         for s in range(slots)]
    normaliser = first["expected_batch_size"]
    for t, step in enumerate(batches):
        rows = [row for _, batch, _ in step for row in rows_of(batch)]
        index = torch.arange(len(rows))  # the oracles take tensors: row i is index i

        def loss_of(m, i, _):
            return sequence_loss(m, rows[int(i)]["input_ids"][None], rows[int(i)]["labels"][None])

        if unit == "user":  # each rank holds whole users: a user's rows are on one rank
            users = [u for _, batch, units in step if batch is not None for u in units.users.tolist()]
            want = per_user_clipped_mean(reference, loss_of, index, index, users, clip, normaliser)
        else:
            want = per_example_clipped_mean(reference, loss_of, index, index, clip, normaliser)
        for r in ranks:
            for s, name in enumerate(names):
                torch.testing.assert_close(
                    r["releases"][t][s].double().flatten(), want[name].double().flatten() + w[s][t] / normaliser,
                    atol=1e-6, rtol=0, msg=lambda m: f"draw {start + t}, {name}: {m}")


def check_ddp_banded(ranks, start: int, steps: int, kind: str) -> None:
    """Two ranks' banded run of ``kind`` (:func:`ddp_banded_run`) from draw ``start``: one run
    (rank 0's, from ``start``) and the form of the kind, held by rank 0; its releases
    (:func:`check_releases`)."""
    _, _, per_device = DDP_RUNS[kind]
    first, second = ranks
    assert first["run_id"] == second["run_id"] and first["run_start"] == start
    assert first["optimizer"].startswith("Distributed") and (first["holder"], second["holder"]) == ("full", None)
    assert first["form"] == DDP_FORMS[kind] and first["expected_batch_size"] == per_device * 2 * 2
    check_releases(ranks, start, steps)


@pytest.mark.parametrize("kind", sorted(DDP_RUNS))
def test_two_gloo_ranks_banded_release_is_the_union_of_the_ranks_draws_and_resumes(tmp_path, kind):
    """torchrun --nproc_per_node 2 (DPTrainer, TRL's SFTTrainer made private, and DPTrainer at
    privacy_unit="user"), sigma = 1, two steps, then a resume from the checkpoint on every rank to
    four: every rank uses rank 0's partition and run and the same draw numbers; rank 0 alone adds
    the noise; each release is brute force on the union of the ranks' draws plus the banded noise
    replayed from rank 0's ``z`` (:func:`check_ddp_banded`); the resumed run continues the
    numbering (draws 2 and 3) in a new run, charged apart: the history and epsilon are those of one
    process, ``[(sigma, b q, 2, run 1), (sigma, b q, 2, run 2)]``, ceil(2/b) + ceil(2/b) rounds."""
    from .test_trainer import run_two_ranks

    bands, q, _ = DDP_RUNS[kind]
    ranks = run_two_ranks(tmp_path, SIGMA, f"banded_{kind}")
    check_ddp_banded([r["first"] for r in ranks], 0, 2, kind)
    check_ddp_banded([r["resumed"] for r in ranks], 2, 2, kind)
    first, resumed = ranks[0]["first"], ranks[0]["resumed"]
    assert resumed["run_id"] != first["run_id"]
    records = [dataclasses.replace(first["record"], noise_run=run) for run in (first["run_id"], resumed["run_id"])]
    assert first["history"] == [(SIGMA, bands * q, 2, records[0])]
    assert resumed["history"] == [(SIGMA, bands * q, 2, records[0]), (SIGMA, bands * q, 2, records[1])]
    probe = RCPRVAccountant()  # one process's charge: ceil(2 / b) rounds in each run
    plain = records[0].reduced(1.0, 1)[2]
    probe.history = [(SIGMA / records[0].column_norm, bands * q, 2 * math.ceil(2 / bands), plain)]
    assert resumed["epsilon"] == pytest.approx(probe.get_epsilon(delta=DELTA), rel=1e-9)


def test_two_gloo_ranks_releasing_different_draws_are_refused_on_both(tmp_path):
    """Rank 1's sampler one draw ahead of rank 0's (:func:`ddp_shifted_draws`): the release would
    add rank 0's noise of draw 0 to a union of draws 0 and 1 (a unit's draws would no longer be b
    apart): refused by name on both ranks at the first release, nothing charged."""
    from .test_trainer import run_two_ranks

    ranks = run_two_ranks(tmp_path, SIGMA, "banded_shifted")
    for r in ranks:
        assert "noise='banded' under torch.distributed: the ranks release draws 0 to 1" in r["raised"], r["raised"]
        assert r["history"] == []
