"""The shape of the noise protocol (issue 53): a third noise mechanism is its class and one row of
:data:`opacus_rc.noises.NOISES`, nothing else. The toy below is written here, against the
protocol only (:mod:`opacus_rc.noises.base`): ``noise="toy"``, two fixed bands
``c = (2, 1) / sqrt(5)`` (a banded Toeplitz ``C`` of its own, ``w_t = (z_t - c_1 w_{t-1}) / c_0``)
over cyclic Poisson draws of 2 parts. Registered for one test (monkeypatch), it runs end to end
through ``make_private`` (every release equals brute-force clipping of its draw plus
``(C^-1 z)_t / B`` with ``z`` replayed and ``C`` solved here in float64), its charge
(``ceil(n / 2)`` DP-SGD rounds at ``sigma / zeta`` and rate ``2 q``, with its run), calibration,
its public and secret state in checkpoints, and the private Trainer."""

from __future__ import annotations

import io
import math
import warnings
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
from opacus import PrivacyEngine

import opacus_rc  # noqa: F401
from opacus_rc.accounting.accountant import RCPRVAccountant
from opacus_rc.draws import CyclicPoissonLoader
from opacus_rc.noises import NOISES, Noise, NoiseMechanism, NoiseSpec

from tests.forms.test_banded import (
    BATCH, C, NOISE_SEED, LOADER_SEED, _ce, clipped_mean, data, make_model, replayed_noise, units_of,
)
from tests.oracles import cyclic_part

TOY = (2.0 / math.sqrt(5.0), 1.0 / math.sqrt(5.0))  # c_0, c_1: every column of C has norm <= 1
SIGMA, STEPS = 1.0, 5


class ToySecret:
    """The toy's secret part (its kept noise and run), as the checkpoint module reads it."""

    def __init__(self, noise: "ToyNoise") -> None:
        self.noise = noise

    def state_dict(self) -> Dict[str, Any]:
        return {"last": dict(self.noise.last), "run_id": self.noise.run_id, "run_start": self.noise.run_start}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.noise.last, self.noise.run_id, self.noise.run_start = state["last"], state["run_id"], state["run_start"]


class ToyNoise(NoiseMechanism):
    """Two bands with fixed coefficients: per parameter slot the last noise ``w_{t-1}`` (its
    state, secret), the recursion ``w_t = (z_t - c_1 w_{t-1}) / c_0``; its public state is the
    base's (the next step)."""

    def __init__(self) -> None:
        super().__init__(TOY_SPEC)
        self.last: Dict[int, torch.Tensor] = {}
        self.secret = ToySecret(self)

    def step(self, slot: int, draw: Callable[[], torch.Tensor], steps: int) -> torch.Tensor:
        for _ in range(steps):
            z = draw()
            w = (z - TOY[1] * self.last[slot]) / TOY[0] if slot in self.last else z / TOY[0]
            self.last[slot] = w
        return w

    def restart(self) -> None:
        self.last = {}
        super().restart()


TOY_SPEC = NoiseSpec("toy", ToyNoise, parts=2, bands=2, column_norm=math.hypot(*TOY) * (1 + 1e-12),
                     fresh_each_step=False)
#: the one row a third mechanism adds
TOY_ROW = Noise("toy", lambda given, most: TOY_SPEC)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(NOISES, "toy", TOY_ROW)


def toy_matrix(steps: int) -> torch.Tensor:
    """The toy's ``C`` (steps x steps, float64), built here."""
    return torch.diag(torch.full((steps,), TOY[0], dtype=torch.float64)) + torch.diag(
        torch.full((steps - 1,), TOY[1], dtype=torch.float64), -1)


def private(sigma: float = SIGMA, noise_seed: int = NOISE_SEED, loader_seed: Optional[int] = LOADER_SEED, **options):
    dataset, owners = data()
    model = make_model()
    reference = make_model()
    engine = PrivacyEngine(accountant="rc_prv")
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=torch.utils.data.DataLoader(dataset, batch_size=BATCH["example"], **(
            {} if loader_seed is None else {"generator": torch.Generator().manual_seed(loader_seed)})),
        noise_multiplier=sigma, max_grad_norm=C, clipping="randomized", grad_sample_mode="bookkeeping",
        noise="toy", noise_generator=torch.Generator().manual_seed(noise_seed), sketch_seed=7, **options,
    )
    run = SimpleNamespace(form="bookkeeping", unit="example", sigma=sigma, bands=2, engine=engine, module=module,
                          optimizer=optimizer, criterion=None, loader=loader, model=model, reference=reference,
                          owners=owners, data=dataset, releases=[])
    optimizer.original_optimizer.register_step_pre_hook(
        lambda *_: run.releases.append([p.grad.detach().clone() for p in optimizer.params]))
    return run


def train(run, releases: int) -> List[dict]:
    """Train on the run's loader until ``releases`` releases; each: its draw's number, the rows
    trained on and the mechanism steps charged."""
    optimizer, out = run.optimizer, []
    while len(out) < releases:
        for x, y, index in run.loader:
            batch = optimizer.ledger.latest
            _ce(run.module, x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
            assert batch.last  # one physical batch per draw
            out.append(dict(step=batch.draw.step, rows=index.tolist(), charged=optimizer.mechanism_steps))
            if len(out) == releases:
                break
    return out


def check_toy_releases(run, released: List[dict], start: int = 0) -> None:
    """Each release: brute-force clipping of its draw over B plus ``(C^-1 z)_t / B``, ``z`` replayed
    from the noise generator, ``C`` the toy's from step ``start`` (a run's first step)."""
    names = [n for n, _ in run.reference.named_parameters()]
    z = replayed_noise([p.shape for p in run.optimizer.params], run.sigma * C, [r["charged"] for r in released])
    c = toy_matrix(len(z))
    normaliser = run.optimizer.expected_batch_size
    for slot, name in enumerate(names):
        w = torch.linalg.solve_triangular(c, torch.stack([step[slot].double().flatten() for step in z]), upper=False)
        for release, grads in zip(released, run.releases):
            want = clipped_mean(run, release["rows"], normaliser)[name].double().flatten()
            torch.testing.assert_close(grads[slot].double().flatten(), want + w[release["step"] - start] / normaliser,
                                       atol=1e-6, rtol=0, msg=lambda m: f"step {release['step']}, {name}: {m}")


def test_a_third_noise_is_its_class_and_one_row(toy):
    """make_private(noise="toy"): the cyclic loader over the toy's 2 parts (draw t from part
    t mod 2), every release brute force plus the toy's replayed noise, the accountant charges the
    toy's record (bands 2, its column norm, its run) as ceil(5 / 2) = 3 rounds at sigma / zeta and
    rate 2 q; ``optimizer.toy`` is the mechanism (``optimizer.banded`` None)."""
    run = private()
    assert isinstance(run.loader, CyclicPoissonLoader) and run.loader.batch_sampler.poisson.bands == 2
    assert isinstance(run.optimizer.toy, ToyNoise) and run.optimizer.banded is None
    released = train(run, STEPS)
    assert [r["step"] for r in released] == list(range(STEPS)) and all(r["charged"] == 1 for r in released)
    secret = run.loader.batch_sampler.poisson._secret
    assert all(cyclic_part(secret, u, 2) == r["step"] % 2 for r in released for u in units_of(run, r["rows"]))
    assert any(r["rows"] for r in released)
    check_toy_releases(run, released)
    ((sigma, rate, steps, record),) = run.engine.accountant.history
    q = BATCH["example"] / len(run.data)
    assert (sigma, steps, record.bands, record.noise_run) == (SIGMA, STEPS, 2, run.optimizer.toy.run_id)
    assert rate == pytest.approx(2 * q, rel=1e-12) and record.column_norm == TOY_SPEC.column_norm
    ((charged_sigma, charged_rate, rounds, plain),) = run.engine.accountant.charged()
    assert (charged_sigma, charged_rate, rounds) == (SIGMA / TOY_SPEC.column_norm, rate, 3) and plain.dp_sgd
    probe = RCPRVAccountant()
    probe.history = [(SIGMA / TOY_SPEC.column_norm, 2 * q, 3, plain)]
    assert run.engine.get_epsilon(1e-5) == pytest.approx(probe.get_epsilon(1e-5), rel=1e-12)


def test_the_toys_state_follows_the_protocol_in_checkpoints(toy):
    """Its public state (the next step) is in ``optimizer.state_dict()`` under its own key, its
    secret only with include_rng_state=True; a default checkpoint resumes the numbering in a new
    run (the recursion restarts: ``w = z / c_0`` first), charged apart; loading its state into
    independent noise, or independent noise's into it, is refused by name."""
    first = private()
    train(first, 3)
    state = first.optimizer.state_dict()
    assert state["opacus_rc_toy_noise"] == {"next_step": 3}
    with_secret, without = io.BytesIO(), io.BytesIO()
    first.engine.save_checkpoint(path=with_secret, module=first.module, optimizer=first.optimizer, include_rng_state=True)
    first.engine.save_checkpoint(path=without, module=first.module, optimizer=first.optimizer)
    for buffer, kept in ((with_secret, True), (without, False)):
        buffer.seek(0)
        assert ("toy_noise" in torch.load(buffer, weights_only=False).get("opacus_rc_rng_state", {})) == kept
    resumed = private(noise_seed=12, loader_seed=None)  # (a seeded loader would replay its draws: refused)
    without.seek(0)
    resumed.engine.load_checkpoint(path=without, module=resumed.module, optimizer=resumed.optimizer)
    assert resumed.optimizer.next_noise_step == 3 and resumed.optimizer.toy.last == {}
    released = train(resumed, 2)
    assert [r["step"] for r in released] == [3, 4]
    z = replayed_noise([p.shape for p in resumed.optimizer.params], SIGMA * C, [1, 1], seed=12)
    c = toy_matrix(2)
    normaliser = resumed.optimizer.expected_batch_size
    for slot, (name, _) in enumerate(resumed.reference.named_parameters()):
        w = torch.linalg.solve_triangular(c, torch.stack([s[slot].double().flatten() for s in z]), upper=False)
        for i, (release, grads) in enumerate(zip(released, resumed.releases)):
            want = clipped_mean(resumed, release["rows"], normaliser)[name].double().flatten()
            torch.testing.assert_close(grads[slot].double().flatten(), want + w[i] / normaliser, atol=1e-6, rtol=0)
    runs = [record.noise_run for *_, record in resumed.engine.accountant.history]
    assert len(runs) == 2 and runs[0] != runs[1]
    assert [rounds for *_, rounds, _ in resumed.engine.accountant.charged()] == [2, 1]  # ceil(3/2) + ceil(2/2)

    model = make_model()
    independent = PrivacyEngine(accountant="rc_prv").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=torch.utils.data.DataLoader(data()[0], batch_size=4), noise_multiplier=1.0, max_grad_norm=C,
        clipping="randomized", grad_sample_mode="bookkeeping",
    )[1]
    with pytest.raises(ValueError, match="noise=toy loaded into a run with noise=independent"):
        independent.load_state_dict(first.optimizer.state_dict())
    with pytest.raises(ValueError, match="noise=independent loaded into a run with noise=toy"):
        first.optimizer.load_state_dict(independent.state_dict())


def test_the_toy_is_calibrated_refused_and_trained_by_name(toy, tmp_path):
    """make_private_with_epsilon calibrates sigma for the toy's record; a keyword of another row
    (bands=) and denoise (its steps' noises are not fresh) are refused naming noise='toy'; the
    private Trainer trains with it (cyclic draws numbered, the toy's record charged)."""
    dataset, _ = data()
    model = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, optimizer, _ = PrivacyEngine(accountant="rc_prv").make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            data_loader=torch.utils.data.DataLoader(dataset, batch_size=4), target_epsilon=2.0, target_delta=1e-5,
            epochs=2, max_grad_norm=C, clipping="randomized", grad_sample_mode="bookkeeping", noise="toy",
        )
    probe = RCPRVAccountant()
    probe.step(noise_multiplier=optimizer.noise_multiplier, sample_rate=2 * 4 / 24, steps=12,
               sketch_config=optimizer.sketch_config, **TOY_SPEC.record_fields())  # 2 epochs of 6 draws
    assert 2.0 - 0.01 <= probe.get_epsilon(1e-5) <= 2.0
    for options, message in (({"bands": 2}, "bands=2 only applies with noise='banded'; got noise='toy'"),
                             ({"denoise": "spectral"}, "noise='toy' is not supported with denoise='spectral'")):
        with pytest.raises(ValueError, match=message):
            private(**options)

    from opacus_rc.hf import DPTrainer, PrivacyArguments

    from tests.hf.test_trainer import training_args
    from tests.models import RowDataset, tiny_llama

    trainer = DPTrainer(
        model=tiny_llama(), args=training_args(tmp_path, max_steps=3, learning_rate=1e-2), train_dataset=RowDataset(),
        privacy=PrivacyArguments(noise_multiplier=SIGMA, delta=1e-5, noise="toy", sample_rate=1 / 6),
    )
    trainer.train()
    assert isinstance(trainer._dp_optimizer.toy, ToyNoise) and trainer._dp_optimizer.next_noise_step == 3
    ((sigma, rate, steps, record),) = trainer.accountant.history
    assert (sigma, steps, record.bands, record.column_norm) == (SIGMA, 3, 2, TOY_SPEC.column_norm)
    assert rate == pytest.approx(2 / 6)
