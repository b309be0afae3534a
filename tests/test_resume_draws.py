"""A resumed run never silently replays its Poisson draws (issue 46, path 6).

A DataLoader built with its own ``generator=torch.Generator().manual_seed(s)`` gives the
Poisson loader its generator (Opacus's way). A restarted script seeds it with ``s`` again,
so a run resumed with ``load_checkpoint`` drew the batches (examples or users) of the
original run's first steps again, with fresh noise, charged as independent draws. Such a
resume is refused by name unless the checkpoint holds the Poisson generator's state
(``include_rng_state=True``: the draws continue); a loader without ``generator=`` (draws from
``os.urandom``) and secure mode (the CSPRNG) resume freely with fresh draws.

Draws are compared as example (or row) indices: two equal Poisson draws over 64 examples
at q = 1/8, or two equal runs of 2 user draws, are the replay; fresh draws differ except with
probability < 1e-3 (user level: 2 draws over 7 users at q_u = 3/7 with 4-of-6 row subsets).
"""

from __future__ import annotations

import io

import pytest
import torch
from opacus import PrivacyEngine
from torch.utils.data import DataLoader

from opacus_rc import checkpoint
from opacus_rc.prepare import poisson_generator

from .forms.test_user_level import FORMS, USERS_PER_STEP, C, K, user_data
from .forms.test_user_level_paths import drawn_rows
from .models import SequenceClassifier
from .test_rng_streams import _build, _loader, _steps

#: every test also with the batches copied as on a device (tests/conftest.py, issue 52)
pytestmark = pytest.mark.usefixtures("batches_as_on_a_device")

REFUSAL = r"generator=.*replay.*include_rng_state=True.*without generator="


def seeded(seed: int = 5) -> dict:
    """The DataLoader keywords of a script that seeds its loader's generator."""
    return {"generator": torch.Generator().manual_seed(seed)}


def example_run(loader_kwargs=None, **options):
    """A restarted script: ``torch.manual_seed(0)``, its loader (``loader_kwargs``), make_private."""
    return _build("hooks", loader_kwargs=loader_kwargs, **options)


def save(run, **kwargs) -> io.BytesIO:
    buf = io.BytesIO()
    run[0].save_checkpoint(path=buf, module=run[2], optimizer=run[3], **kwargs)
    buf.seek(0)
    return buf


def test_resume_with_the_loaders_seeded_generator_is_refused():
    """Saved without the generators' states and resumed by the same script: on main the
    resumed steps' batches equalled steps 1 and 2's (the replay); now refused by name."""
    run = example_run(seeded())
    _steps(run)
    buf = save(run)
    resumed = example_run(seeded())
    with pytest.raises(ValueError, match=REFUSAL):
        resumed[0].load_checkpoint(path=buf, module=resumed[2], optimizer=resumed[3])


def test_resume_with_the_loaders_generator_state_continues_its_draws():
    """include_rng_state=True: the loader's generator is restored, the resumed steps draw
    the uninterrupted run's steps 3 and 4, not steps 1 and 2."""
    run = example_run(seeded())
    _, first = _steps(run)
    buf = save(run, include_rng_state=True)
    _, uninterrupted = _steps(run)
    resumed = example_run(seeded())
    resumed[0].load_checkpoint(path=buf, module=resumed[2], optimizer=resumed[3])
    _, again = _steps(resumed)
    assert again == uninterrupted and again != first


def test_resume_with_an_unseeded_loader_draws_fresh_batches():
    """A checkpoint of a seeded-loader run resumed with a loader without generator= (the
    plugin's os.urandom stream): accepted, fresh draws."""
    run = example_run(seeded())
    _, first = _steps(run)
    resumed = example_run()
    resumed[0].load_checkpoint(path=save(run), module=resumed[2], optimizer=resumed[3])
    _, again = _steps(resumed)
    assert again != first and again[0] != first[0]


def test_secure_mode_ignores_the_loaders_generator_and_resumes_fresh():
    """Secure mode draws the masks from the CSPRNG whatever the loader's generator: a
    resume is accepted and draws fresh batches."""

    def run():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2, bias=False)
        engine = PrivacyEngine(accountant="rc_prv", secure_mode=True)
        module, opt, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=_loader(**seeded()),
            noise_multiplier=1.0, max_grad_norm=1.0, clipping="randomized", sketch_size=2,
        )
        return engine, model, module, opt, torch.nn.CrossEntropyLoss(), loader

    first = run()
    _, drawn = _steps(first)
    resumed = run()
    resumed[0].load_checkpoint(path=save(first), module=resumed[2], optimizer=resumed[3])
    _, again = _steps(resumed)
    assert again != drawn and again[0] != drawn[0]


def test_ddp_child_of_the_loaders_generator_is_refused_too():
    """Under DDP the Poisson generator is a per-rank child of the loader's generator: the
    restarted script derives the same child, so it is refused as the generator itself."""
    children = [poisson_generator(_loader(**seeded()), None, distributed=True) for _ in range(2)]
    assert torch.equal(torch.rand(8, generator=children[0]), torch.rand(8, generator=children[1]))
    assert all(checkpoint.replays(child) for child in children)
    assert not checkpoint.replays(poisson_generator(_loader(), None, distributed=True))


# --- user level (UserDataLoader) ----------------------------------------------------------


def user_run(loader_kwargs=None):
    torch.manual_seed(0)
    data, owners = user_data()
    model = SequenceClassifier()
    engine = PrivacyEngine(accountant="rc_prv")
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(data, batch_size=USERS_PER_STEP, **(loader_kwargs or {})), noise_multiplier=1.0,
        max_grad_norm=C, clipping="randomized", privacy_unit="user", user_ids=owners, max_examples_per_user=K,
        **FORMS["bookkeeping"],
    )
    return engine, module, optimizer, loader


@pytest.mark.parametrize("include_rng_state", [False, True], ids=["refused", "continues"])
def test_user_level_resume_never_replays_the_user_draws(include_rng_state):
    """UserDataLoader over the loader's seeded generator: on main the resumed draws were the
    original run's first draws; now refused, or continued with include_rng_state=True."""
    engine, module, optimizer, loader = user_run(seeded())
    first = drawn_rows(loader, module, optimizer, 2)
    buf = io.BytesIO()
    engine.save_checkpoint(path=buf, module=module, optimizer=optimizer, include_rng_state=include_rng_state)
    buf.seek(0)
    uninterrupted = drawn_rows(loader, module, optimizer, 2)
    engine2, module2, optimizer2, loader2 = user_run(seeded())
    if not include_rng_state:
        with pytest.raises(ValueError, match=REFUSAL):
            engine2.load_checkpoint(path=buf, module=module2, optimizer=optimizer2)
        return
    engine2.load_checkpoint(path=buf, module=module2, optimizer=optimizer2)
    again = drawn_rows(loader2, module2, optimizer2, 2)
    assert again == uninterrupted and again != first


def test_user_level_resume_with_an_unseeded_loader_draws_fresh_users():
    engine, module, optimizer, loader = user_run(seeded())
    first = drawn_rows(loader, module, optimizer, 2)
    buf = io.BytesIO()
    engine.save_checkpoint(path=buf, module=module, optimizer=optimizer)
    buf.seek(0)
    engine2, module2, optimizer2, loader2 = user_run()
    engine2.load_checkpoint(path=buf, module=module2, optimizer=optimizer2)
    assert drawn_rows(loader2, module2, optimizer2, 2) != first


def test_rng_state_of_another_rank_is_refused(monkeypatch):
    """include_rng_state=True saves this rank's streams: loaded on another rank (one file
    loaded by every rank), the ranks' Poisson masks would coincide; refused by name."""
    import opacus_rc.sketch as sk

    run = example_run(seeded())
    _steps(run)
    buf = save(run, include_rng_state=True)
    resumed = example_run(seeded())
    monkeypatch.setattr(sk, "_process_rank", lambda: 1)
    with pytest.raises(ValueError, match="rank 0's generator states.*on rank 1.*one checkpoint per rank"):
        resumed[0].load_checkpoint(path=buf, module=resumed[2], optimizer=resumed[3])


def test_hf_trainer_user_sampler_draws_fresh_after_the_scripts_seed():
    """DPTrainer's Poisson sampler (user level here) seeds its own generator from os.urandom:
    a restarted script (``set_seed``, then ``train(resume_from_checkpoint=...)``) draws other
    users, never the original run's (the Trainer's checkpoint holds no DP generator state)."""
    from transformers import set_seed

    from opacus_rc.hf import PoissonAccumulationSampler
    from opacus_rc.units import UserIndex

    _, owners = user_data()
    draws = []
    for _ in range(2):
        set_seed(0)
        users = UserIndex(owners, len(owners), K)
        draws.append(list(PoissonAccumulationSampler(
            num_samples=len(owners), sample_rate=USERS_PER_STEP / 7, micro_batches=1, steps=2, users=users,
        )))
    assert draws[0] != draws[1]
