"""Banded noise (``make_private(..., noise="banded", bands=b)``, :mod:`opacus_rc.correlated`) in
every form, at example and user level, through BatchMemoryManager, a loop stopped inside a draw,
DDP and FSDP2 (2 gloo processes), checkpoints, secure mode and LoRA.

The check of a release (:func:`check_releases`) is independent of the package's recursion: with
the learning rate 0 the model never moves, so the release of step t (``p.grad`` when the wrapped
optimizer updates) must equal

    brute-force clipping of exactly the draw the loader delivered / B  +  w_t / B,

where the clipped sum comes from :mod:`tests.oracles` (autograd on each example or user alone)
and ``w = C^{-1} z`` is solved in float64 from ``z`` replayed from the run's ``noise_generator``
(the secure-mode test records ``z`` from the CSPRNG instead), with ``C`` built here from the
coefficients of ``(1 - x)^(-1/2)`` (:func:`band_coefficients`), not from the package. A wrong
coefficient, a wrong step index (a physical batch counted as a step, a discarded draw not
advancing the recursion) or a wrong draw fails it. Tolerance: 1e-6 absolute on releases of order
1e-2 (float32 recursion and sums; a coefficient off by 1% moves a release by ~5e-5).
"""

from __future__ import annotations

import copy
import io
import math
import os
import warnings
from types import SimpleNamespace
from typing import Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
from opacus import PrivacyEngine
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn

import opacus_rc  # noqa: F401  (registers the plugin: a spawned rank loads no conftest)
from opacus_rc import csprng
from opacus_rc.noises.banded import BANDED_STATE_KEY
from opacus_rc.draws import CyclicPoissonLoader
from opacus_rc.finite import local_shard

from tests.forms.test_user_level import user_data
from tests.models import CheckpointedSequenceClassifier, SequenceClassifier
from tests.oracles import cyclic_part, per_example_clipped_mean, per_user_clipped_mean
from tests.spawn import spawn

#: every test also with the batches copied as on a device (tests/conftest.py, issue 52)
pytestmark = pytest.mark.usefixtures("batches_as_on_a_device")

C, SIGMA, BANDS, STEPS = 0.05, 1.0, 3, 5
NOISE_SEED, LOADER_SEED = 11, 3
ATOL = 1e-6
#: the forms (docs/forms.md) and the make_private options that choose each
FORMS = {
    "two_pass": dict(grad_sample_mode="ghost"),
    "bookkeeping": dict(grad_sample_mode="bookkeeping"),
    "bookkeeping_with_criterion": dict(grad_sample_mode="ghost", bookkeeping=True),
    "output_passes": dict(grad_sample_mode="hooks", bookkeeping=False),  # on a checkpointed model
    "per_example": dict(per_example_backward=True),
}
#: 24 rows (x, y, row index), user r % 8 owning row r (3 rows each); example level: q = 4/24,
#: user level: q_u = 2/8 (2 of a user's 3 rows per draw); b q <= 3/4 inside a part
USERS, PER_USER = 8, 2
BATCH = {"example": 4, "user": 2}


def band_coefficients(bands: int) -> List[float]:
    """The banded square root's coefficients, computed here: those of ``(1 - x)^(-1/2)``,
    ``binom(2j, j) / 4^j``, cut at ``bands`` terms and divided by their norm."""
    c = [math.comb(2 * j, j) / 4**j for j in range(bands)]
    norm = math.sqrt(sum(v * v for v in c))
    return [v / norm for v in c]


def band_matrix(bands: int, steps: int) -> torch.Tensor:
    c = torch.zeros(steps, steps, dtype=torch.float64)
    for t in range(steps):
        for j, value in enumerate(band_coefficients(bands)):
            if t - j >= 0:
                c[t, t - j] = value
    return c


def data():
    return user_data(n=24, users=USERS)


def _ce(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def make_model(form: str = "two_pass") -> nn.Module:
    torch.manual_seed(0)
    return CheckpointedSequenceClassifier() if form == "output_passes" else SequenceClassifier()


def private(form: str, unit: str, *, sigma: float = SIGMA, bands: int = BANDS, model=None, wrap=None, secure=False,
            noise_seed: Optional[int] = NOISE_SEED, loader_seed: Optional[int] = LOADER_SEED,
            batch_size: Optional[int] = None, permutation: Optional[torch.Tensor] = None, **options):
    """A banded run at lr 0 (the model never moves: one brute-force reference for every step);
    ``wrap``: DPDDP or FSDP2Wrapper, applied after the reference copy is taken; ``permutation``:
    the same rows in another order (the third field keeps each row's original index)."""
    dataset, owners = data()
    if permutation is not None:
        dataset = torch.utils.data.TensorDataset(*(t[permutation] for t in dataset.tensors))
        owners = [owners[int(i)] for i in permutation]
    model = model if model is not None else make_model(form)
    reference = copy.deepcopy(model)
    if wrap is not None:
        model = wrap(model)
    engine = PrivacyEngine(accountant="rc_prv", secure_mode=secure)
    loader_options = {} if loader_seed is None else {"generator": torch.Generator().manual_seed(loader_seed)}
    seeds = {} if noise_seed is None else {"noise_generator": torch.Generator().manual_seed(noise_seed), "sketch_seed": 7}
    units = dict(privacy_unit="user", user_ids=owners, max_examples_per_user=PER_USER) if unit == "user" else {}
    out = engine.make_private(
        module=model, optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0),
        criterion=nn.CrossEntropyLoss(),
        data_loader=torch.utils.data.DataLoader(dataset, batch_size=batch_size or BATCH[unit], **loader_options),
        noise_multiplier=sigma, max_grad_norm=C, clipping="randomized", noise="banded", bands=bands,
        **seeds, **units, **{**FORMS[form], **options},
    )
    module, optimizer, *criterion, loader = out
    run = SimpleNamespace(
        form=form, unit=unit, sigma=sigma, bands=bands, engine=engine, module=module, optimizer=optimizer,
        criterion=criterion[0] if criterion else None, loader=loader, model=model, reference=reference,
        owners=owners, data=dataset, releases=[],
    )
    # the release: what the wrapped optimizer updates the parameters by (after noise and scaling;
    # under FSDP2 this rank's shard)
    optimizer.original_optimizer.register_step_pre_hook(
        lambda *_: run.releases.append([local_shard(p.grad.detach()).clone() for p in optimizer.params])
    )
    return run


def loss(run, x, y):
    return run.criterion(run.module(x), y) if run.criterion is not None else _ce(run.module, x, y)


def train(run, releases: int, loader=None, stop_inside: bool = False) -> List[dict]:
    """Train on ``loader`` (the run's) until ``releases`` releases; each: its draw's number, the
    rows trained on, the mechanism steps charged and the noise's next step after it.
    ``stop_inside``: leave the loop after the first physical batch of the next draw of several
    (``run.stopped``: its number)."""
    loader = run.loader if loader is None else loader
    optimizer, out, rows = run.optimizer, [], []
    while len(out) < releases:
        for item in loader:  # (a list of batches: each with the Batch the loader delivered it with)
            (x, y, index), batch = item if isinstance(loader, list) else (item, optimizer.ledger.latest)
            rows += index.tolist()
            loss(run, x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
            if stop_inside and batch.draw.batches > 1:
                assert optimizer._is_last_step_skipped
                run.stopped = batch.draw.step
                return out
            assert optimizer._is_last_step_skipped == (not batch.last)  # released after the draw's last batch only
            if batch.last:
                out.append(dict(step=batch.draw.step, rows=rows, charged=optimizer.mechanism_steps,
                                next_step=optimizer.banded.next_step, batches=batch.draw.batches))
                rows = []
                if len(out) == releases:
                    break
    assert not stop_inside, "no draw of several physical batches: pick another seed"
    return out


def replayed_noise(shapes, std: float, charged: List[int], seed: int = NOISE_SEED) -> List[List[torch.Tensor]]:
    """``z`` drawn as the optimizer draws it from ``noise_generator`` (per release, per parameter,
    one ``N(0, std^2)`` per mechanism step charged): ``[step][slot]``."""
    generator = torch.Generator().manual_seed(seed)
    z = [[None] * len(shapes) for _ in range(sum(charged))]
    start = 0
    for steps in charged:
        for slot, shape in enumerate(shapes):
            for t in range(start, start + steps):
                z[t][slot] = torch.normal(0.0, std, size=shape, generator=generator, dtype=torch.float32)
        start += steps
    return z


def solved_noise(z: List[List[torch.Tensor]], bands: int) -> List[List[torch.Tensor]]:
    """``w = C^{-1} z`` (float64), ``[step][slot]``."""
    if not z:
        return []
    c = band_matrix(bands, len(z))
    out = [[None] * len(z[0]) for _ in z]
    for slot in range(len(z[0])):
        stacked = torch.stack([z[t][slot].double().flatten() for t in range(len(z))])
        w = torch.linalg.solve_triangular(c, stacked, upper=False)
        for t in range(len(z)):
            out[t][slot] = w[t].view(z[t][slot].shape)
    return out


def clipped_mean(run, rows: List[int], normaliser: float) -> Dict[str, torch.Tensor]:
    x, y, _ = run.data[torch.tensor(rows, dtype=torch.long)]
    if run.unit == "user":
        return per_user_clipped_mean(run.reference, _ce, list(x), list(y), [run.owners[r] for r in rows], C, normaliser)
    return per_example_clipped_mean(run.reference, _ce, x, y, C, normaliser)


def check_releases(run, released: List[dict], z: Optional[List[List[torch.Tensor]]] = None, shard=None) -> None:
    """Each release equals brute-force clipping of exactly its draw plus ``w_t`` of the draw's
    step, over the public normaliser B; ``z``: the drawn noise (default: replayed), shaped as
    the releases; ``shard``: ``(rank, world)``, the releases are that rank's dim-0 chunks."""
    names = [n for n, p in run.reference.named_parameters() if p.requires_grad]
    shapes = [p.shape for p in run.optimizer.params]
    assert len(names) == len(shapes) and len(run.releases) == len(released)
    if z is None:
        z = replayed_noise(shapes, run.sigma * C, [r["charged"] for r in released])
    w = solved_noise(z, run.bands)
    normaliser = run.optimizer.expected_batch_size
    for release, grads in zip(released, run.releases):
        want = clipped_mean(run, release["rows"], normaliser)
        if shard is not None:
            want = {name: torch.chunk(value, shard[1], dim=0)[shard[0]] for name, value in want.items()}
        for slot, name in enumerate(names):
            noise = w[release["step"]][slot] / normaliser if run.sigma > 0 else 0.0
            torch.testing.assert_close(grads[slot].double(), want[name].double() + noise, atol=ATOL, rtol=0,
                                       msg=lambda m: f"step {release['step']}, {name}: {m}")


def units_of(run, rows: List[int]) -> List[int]:
    """The units' stable keys: the canonical user id, or the row at example level."""
    return [run.owners[r] for r in rows] if run.unit == "user" else list(rows)


def check_parts(run, released: List[dict]) -> None:
    """Draw t holds units of part ``t mod b`` only, each unit's part the keyed hash of its stable
    key under the run's secret partition (so a unit's draws are b apart)."""
    secret = run.loader.batch_sampler.poisson._secret
    for release in released:
        assert all(cyclic_part(secret, u, run.bands) == release["step"] % run.bands for u in units_of(run, release["rows"]))
    assert any(release["rows"] for release in released), "every draw was empty: pick another seed"


def check_history(run, steps: int) -> None:
    """K mechanism steps at the rate inside a part (b q) with bands=b; charged as ceil(K / b) rounds."""
    q = BATCH[run.unit] / (len(run.data) if run.unit == "example" else USERS)
    ((sigma, rate, n, record),) = run.engine.accountant.history
    assert (sigma, n, record.bands) == (run.sigma, steps, run.bands)
    assert rate == pytest.approx(run.bands * q, rel=1e-12)
    assert record.column_norm == pytest.approx(1.0, abs=1e-12) and record.column_norm >= 1.0
    ((_, charged_rate, rounds, plain),) = run.engine.accountant.charged()
    assert (charged_rate, rounds, plain.bands) == (rate, -(-steps // run.bands), 1)


# --- 1. every form, both units ------------------------------------------------------------------


@pytest.mark.parametrize("sigma", [0.0, SIGMA], ids=["sigma0", "sigma1"])
@pytest.mark.parametrize("unit", ["example", "user"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_release_is_the_draw_clipped_plus_the_banded_noise(form, unit, sigma):
    """At noise 0 each release is brute-force clipping of exactly the draw delivered; at noise 1
    it is that plus ``(C^{-1} z)_t / B``. STEPS = 5 > b = 3 (every coefficient in use), across an
    epoch boundary at user level (4 draws an epoch)."""
    run = private(form, unit, sigma=sigma)
    assert isinstance(run.optimizer.banded.coefficients, tuple)
    if form == "output_passes":
        assert run.module.output_passes is not None
    released = train(run, STEPS)
    assert [r["step"] for r in released] == list(range(STEPS))
    assert [r["next_step"] for r in released] == list(range(1, STEPS + 1))
    check_parts(run, released)
    check_releases(run, released)
    check_history(run, STEPS)


def test_the_coefficients_are_the_banded_square_root():
    run = private("bookkeeping", "example", bands=4)
    assert run.optimizer.banded.coefficients == pytest.approx(band_coefficients(4), rel=1e-12)
    assert isinstance(run.loader, CyclicPoissonLoader)


# --- 2, 3. BatchMemoryManager ------------------------------------------------------------------


@pytest.mark.parametrize("unit", ["example", "user"])
def test_batch_memory_manager_releases_after_the_draws_last_batch(unit):
    """Draws split into physical batches (of 2 rows at example level, 2 whole users' rows at user
    level): a step releases only after the draw's last batch (:func:`train` asserts it), the
    noise's index is the draw's ``step``, and the accountant charges one mechanism step per draw."""
    run = private("bookkeeping", unit, grad_sample_mode="hooks")
    rows = {"example": 2, "user": 2 * PER_USER}[unit]
    with BatchMemoryManager(data_loader=run.loader, max_physical_batch_size=rows, optimizer=run.optimizer) as split:
        released = train(run, STEPS, loader=split)
    assert any(r["batches"] > 1 for r in released), "no draw was split: pick another seed"
    assert [r["step"] for r in released] == list(range(STEPS)) and all(r["charged"] == 1 for r in released)
    check_parts(run, released)
    check_releases(run, released)
    check_history(run, STEPS)


@pytest.mark.parametrize("form", ["bookkeeping", "two_pass", "per_example"])
def test_a_loop_stopped_inside_a_draw_advances_the_noise_over_it(form):
    """BatchMemoryManager (one row per physical batch); the loop leaves a draw after its first
    batch, and the loader is iterated again: the draw is dropped (RuntimeWarning), its noise step
    is drawn and discarded (``banded.next_step`` jumps by 2) and charged (2 mechanism steps for
    that release); the release is the next draw's, with ``w`` of its own step."""
    run = private(form, "example")
    with BatchMemoryManager(data_loader=run.loader, max_physical_batch_size=1, optimizer=run.optimizer) as split:
        released = train(run, 1, loader=split)
        released += train(run, 100, loader=split, stop_inside=True)  # the draws released before the stop
        dropped = run.stopped
        assert run.optimizer.banded.next_step == dropped == len(released)
        with pytest.warns(RuntimeWarning, match="left after 1 of its"):
            after = train(run, 2, loader=split)
    assert [r["step"] for r in after] == [dropped + 1, dropped + 2]
    assert [r["charged"] for r in after] == [2, 1]
    assert [r["next_step"] for r in after] == [dropped + 2, dropped + 3]
    released += after
    check_releases(run, released)
    ((_, _, steps, record),) = run.engine.accountant.history
    assert steps == dropped + 3 == sum(r["charged"] for r in released) and record.bands == BANDS


# --- 6. checkpoints -----------------------------------------------------------------------------


def test_state_dict_holds_no_kept_noise_and_a_loaded_run_restarts_the_recursion():
    """optimizer.state_dict() holds the next step only (the kept vectors are secrets: with them and
    two consecutive models the last clipped sum is recovered); the kept vectors (``banded.kept``)
    are the last b - 1 noises. A fresh run (another noise generator) that loads the state numbers
    its first draw from that step and starts a new run of the recursion: its noises are
    ``C^{-1} z'`` of a block of its own, and the accountant charges the two runs apart."""
    first = private("bookkeeping", "example")
    train(first, 3)
    state = first.optimizer.state_dict()
    banded = state[BANDED_STATE_KEY]
    assert banded == {"coefficients": pytest.approx(band_coefficients(BANDS)), "next_step": 3}
    assert not any(isinstance(t, torch.Tensor) for t in torch.utils._pytree.tree_leaves(banded))
    kept = first.optimizer.banded.kept.state_dict()["past"]
    assert sorted(kept) == list(range(len(first.optimizer.params)))
    w = solved_noise(replayed_noise([p.shape for p in first.optimizer.params], SIGMA * C, [1, 1, 1]), BANDS)
    for slot, past in kept.items():  # newest first: w_2, w_1
        for vector, t in zip(past, (2, 1)):
            torch.testing.assert_close(vector.double(), w[t][slot], atol=1e-6, rtol=0)

    resumed = private("bookkeeping", "example", noise_seed=12, loader_seed=4)
    resumed.optimizer.load_state_dict(copy.deepcopy(state))
    assert resumed.optimizer.banded.next_step == 3 and resumed.optimizer.banded.buffer_bytes == 0
    released = train(resumed, 2)
    assert [r["step"] for r in released] == [3, 4]
    z = replayed_noise([p.shape for p in resumed.optimizer.params], SIGMA * C, [1, 1], seed=12)
    w_new = solved_noise(z, BANDS)  # a block of C of its own, from step 3
    normaliser = resumed.optimizer.expected_batch_size
    names = [n for n, _ in resumed.reference.named_parameters()]
    for release, grads, noise in zip(released, resumed.releases, w_new):
        want = clipped_mean(resumed, release["rows"], normaliser)
        for slot, name in enumerate(names):
            torch.testing.assert_close(grads[slot].double(), want[name].double() + noise[slot] / normaliser,
                                       atol=ATOL, rtol=0)
    check_parts(resumed, released)
    runs = {record.noise_run for *_, record in first.engine.accountant.history + resumed.engine.accountant.history}
    assert len(runs) == 2 and None not in runs


def test_loading_another_noises_state_is_refused_by_name():
    """An independent-noise state into a banded run, a banded one into an independent run, and a
    banded state of other bands: refused by name, nothing loaded."""
    banded = private("bookkeeping", "example")
    train(banded, 1)
    model = make_model()
    independent = PrivacyEngine(accountant="rc_prv").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=torch.utils.data.DataLoader(data()[0], batch_size=4), noise_multiplier=1.0, max_grad_norm=C,
        clipping="randomized", grad_sample_mode="bookkeeping",
    )[1]
    with pytest.raises(ValueError, match="noise=independent loaded into a run with noise=banded"):
        banded.optimizer.load_state_dict(independent.state_dict())
    assert banded.optimizer.banded.next_step == 1
    with pytest.raises(ValueError, match="noise=banded loaded into a run with noise=independent"):
        independent.load_state_dict(banded.optimizer.state_dict())
    other = private("bookkeeping", "example", bands=2)
    with pytest.raises(ValueError, match="3 bands .* loaded into a run with bands=2"):
        other.optimizer.load_state_dict(banded.optimizer.state_dict())
    assert other.optimizer.banded.next_step == 0


def _tensors(obj) -> List[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]


def test_privacy_engine_checkpoint_round_trip():
    """PrivacyEngine.save_checkpoint / load_checkpoint (default: no generator state, unseeded
    runs): the file holds none of the kept noise vectors (secure mode too, where the generators'
    states are never saved); the resumed run has the accountant's history and epsilon, numbers
    its loader's first draw from the next step, restarts the recursion (a new run: a partition of
    its own, charged apart) and releases brute-force clipping of its draws plus a fresh block's
    noise."""
    for secure in (False, True):
        first = private("two_pass", "user", noise_seed=None, loader_seed=None, secure=secure)
        train(first, 3)
        buffer = io.BytesIO()
        first.engine.save_checkpoint(path=buffer, module=first.module, optimizer=first.optimizer)
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=False)
        kept = [v for past in first.optimizer.banded.kept.state_dict()["past"].values() for v in past]
        assert len(kept) == (BANDS - 1) * len(first.optimizer.params)
        assert not any(t.shape == v.shape and torch.equal(t, v) for t in _tensors(saved) for v in kept)
    resumed = private("two_pass", "user", noise_seed=None, loader_seed=None)
    buffer.seek(0)
    resumed.engine.load_checkpoint(path=buffer, module=resumed.module, optimizer=resumed.optimizer)
    assert resumed.optimizer.banded.next_step == 3 and resumed.optimizer.banded.buffer_bytes == 0
    assert resumed.engine.accountant.history == first.engine.accountant.history
    assert resumed.engine.get_epsilon(1e-5) == first.engine.get_epsilon(1e-5)
    released = train(resumed, 2)
    assert [r["step"] for r in released] == [3, 4] and [r["charged"] for r in released] == [1, 1]
    check_parts(resumed, released)
    first_run, second_run = resumed.engine.accountant.history
    assert first_run[2] == 3 and second_run[2] == 2 and first_run[3].noise_run != second_run[3].noise_run
    assert [rounds for *_, rounds, _ in resumed.engine.accountant.charged()] == [1, 1]  # ceil(3/3) + ceil(2/3)


def test_checkpoint_with_rng_state_resumes_banded_noise_bit_exactly():
    """seed= and include_rng_state=True: the resumed run's next two releases equal the
    uninterrupted run's bit for bit (same draws, same recursion)."""
    def build():
        return private("bookkeeping", "example", noise_seed=None, loader_seed=None, seed=5)

    run = build()
    train(run, 2)
    buffer = io.BytesIO()
    run.engine.save_checkpoint(path=buffer, module=run.module, optimizer=run.optimizer, include_rng_state=True)
    uninterrupted = train(run, 2)
    resumed = build()
    buffer.seek(0)
    resumed.engine.load_checkpoint(path=buffer, module=resumed.module, optimizer=resumed.optimizer)
    again = train(resumed, 2)
    assert [r["step"] for r in again] == [2, 3] and [r["rows"] for r in again] == [r["rows"] for r in uninterrupted]
    for a, b in zip(run.releases[2:], resumed.releases):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_resume_onto_reordered_rows_is_refused_or_restarts():
    """The same rows rebuilt in another order. With include_rng_state=True at example level (a
    unit's key is its row) continuing the partition is refused by name; from a default checkpoint
    the recursion restarts in a new run with a partition of its own: within it each example's
    draws are b apart, and the runs are charged apart. At user level the partition is keyed by
    the users' ids: the reordered rows continue the run, each user in its part."""
    def build(unit, permutation=None, seed=5):
        return private("bookkeeping", unit, noise_seed=None, loader_seed=None, seed=seed, permutation=permutation)

    shuffled = torch.randperm(24, generator=torch.Generator().manual_seed(1))
    first = build("example")
    train(first, 2)
    with_state, without = io.BytesIO(), io.BytesIO()
    first.engine.save_checkpoint(path=with_state, module=first.module, optimizer=first.optimizer,
                                 include_rng_state=True)
    first.engine.save_checkpoint(path=without, module=first.module, optimizer=first.optimizer)
    resumed = build("example", shuffled)
    with_state.seek(0)
    with pytest.raises(ValueError, match="partition of the units is of other rows.*same order"):
        resumed.engine.load_checkpoint(path=with_state, module=resumed.module, optimizer=resumed.optimizer)
    restarted = build("example", shuffled, seed=None)  # (a resume without the streams' states: fresh randomness)
    without.seek(0)
    restarted.engine.load_checkpoint(path=without, module=restarted.module, optimizer=restarted.optimizer)
    released = train(restarted, 4)
    assert [r["step"] for r in released] == [2, 3, 4, 5]
    drawn: Dict[int, List[int]] = {}
    for release in released:  # (rows: the examples' original indices)
        for example in release["rows"]:
            drawn.setdefault(example, []).append(release["step"])
    assert all(b - a >= BANDS for steps in drawn.values() for a, b in zip(steps, steps[1:]))
    runs = [record.noise_run for *_, record in restarted.engine.accountant.history]
    assert len(runs) == 2 and runs[0] != runs[1]

    users = build("user")
    train(users, 2)
    saved = io.BytesIO()
    users.engine.save_checkpoint(path=saved, module=users.module, optimizer=users.optimizer, include_rng_state=True)
    continued = build("user", shuffled)
    saved.seek(0)
    continued.engine.load_checkpoint(path=saved, module=continued.module, optimizer=continued.optimizer)
    assert continued.optimizer.banded.run_id == users.optimizer.banded.run_id
    released = train(continued, 2)
    secret = continued.loader.batch_sampler.poisson._secret
    assert secret == users.loader.batch_sampler.poisson._secret
    # (rows: original indices; their owners as in the unshuffled run)
    assert all(cyclic_part(secret, u, BANDS) == r["step"] % BANDS for r in released for u in units_of(users, r["rows"]))
    ((_, _, steps, _),) = continued.engine.accountant.history  # one run
    assert steps == 4


# --- 7. secure mode -----------------------------------------------------------------------------


class CsprngSpy(csprng.CSPRNG):
    """The CSPRNG, recording the noise ``z`` it serves and counting its uniform draws (masks)."""

    def __init__(self):
        super().__init__()
        self.z, self.uniforms = [], 0

    def noise(self, std, reference):
        z = super().noise(std, reference)
        self.z.append(z.clone())
        return z

    def uniform(self, *args, **kwargs):
        self.uniforms += 1
        return super().uniform(*args, **kwargs)


def test_secure_mode_draws_masks_and_noise_from_the_csprng(monkeypatch):
    """PrivacyEngine(secure_mode=True): the cyclic loader's masks and the noise ``z`` come from the
    CSPRNG (a spy records them), torch's generator is not drawn from while training, and each
    release is brute-force clipping of its draw plus ``C^{-1} z`` of the recorded ``z``."""
    spy = CsprngSpy()
    monkeypatch.setattr(csprng, "_default", spy)
    run = private("bookkeeping", "example", secure=True, noise_seed=None, loader_seed=None)
    assert run.optimizer.secure_mode and run.loader.batch_sampler.uniform.generator is spy
    batches = [(b, run.optimizer.ledger.latest) for b in run.loader]  # (the DataLoader draws a worker seed from torch's)
    before = torch.random.get_rng_state()
    released = train(run, len(batches), loader=batches)
    assert torch.equal(torch.random.get_rng_state(), before), "torch's generator was drawn from"
    assert spy.uniforms >= len(batches)
    slots = len(run.optimizer.params)
    assert len(spy.z) == slots * len(released)
    check_parts(run, released)
    check_releases(run, released, z=[spy.z[t * slots:(t + 1) * slots] for t in range(len(released))])
    check_history(run, len(released))


# --- 8. LoRA ------------------------------------------------------------------------------------


def test_lora_keeps_noise_buffers_for_trainable_parameters_only():
    """peft LoRA (r = 2) on fc1 and fc2: the recursion keeps b - 1 vectors of each trainable
    (A, B) factor only, none of the frozen base weights, and the releases are exact."""
    import peft

    base = make_model()
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["fc1", "fc2"]))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 4 and sum(p.numel() for p in trainable) < sum(p.numel() for p in model.parameters()) / 4
    run = private("bookkeeping", "example", model=model)
    released = train(run, STEPS)
    past = run.optimizer.banded.kept.state_dict()["past"]
    assert len(run.optimizer.params) == 4 and all(p is q for p, q in zip(run.optimizer.params, trainable))
    assert sorted(past) == list(range(4))
    assert all([v.shape for v in past[s]] == [trainable[s].shape] * (BANDS - 1) for s in past)
    assert run.optimizer.banded.buffer_bytes == (BANDS - 1) * 4 * sum(p.numel() for p in trainable)
    check_releases(run, released)


# --- 4. DDP (2 gloo processes) ------------------------------------------------------------------

WORLD = 2
#: (form, unit) of the DDP worker's runs
DDP_RUNS = (("bookkeeping", "example"), ("two_pass", "user"), ("per_example", "user"), ("per_example", "example"))


def ddp_worker(rank, init_file, out_dir):
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    out = {}
    for form, unit in DDP_RUNS:
        run = private(form, unit, wrap=DPDDP)  # each rank its own Poisson stream (rank folded in)
        released = train(run, STEPS)
        out[form, unit] = {
            "released": released, "releases": run.releases, "optimizer": type(run.optimizer).__name__,
            "history": run.engine.accountant.state_dict()["history"],
            "sampler": type(run.loader.batch_sampler.poisson).__name__,
            "secret": run.loader.batch_sampler.poisson._secret,
        }
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_ddp_banded_release_is_the_union_of_the_ranks_draws():
    """Opacus's DPDDP, 2 ranks (one spawn for every case of :data:`DDP_RUNS`): both ranks draw from
    part t mod b (rank r its r-th share of it: no unit on both ranks), the release on every rank is
    brute-force clipping of the union of their draws plus rank 0's ``(C^{-1} z)_t`` over B (the
    others add no noise), and every rank's history is the same."""
    spawned = spawn(ddp_worker, WORLD)
    for form, unit in DDP_RUNS:
        ranks = [r[form, unit] for r in spawned]
        assert ranks[0]["optimizer"].startswith("Distributed") and ranks[0]["sampler"] == "CyclicPoissonSampler"
        assert ranks[0]["history"] == ranks[1]["history"]
        ((sigma, _, steps, record),) = ranks[0]["history"]
        assert (sigma, steps, record["bands"]) == (SIGMA, STEPS, BANDS)
        secret = ranks[0]["secret"]
        assert ranks[1]["secret"] == secret  # one partition: rank 0's, broadcast
        run = private(form, unit)  # one process: the brute force, the parameter shapes, B
        union = []
        for t in range(STEPS):
            assert [r["released"][t]["step"] for r in ranks] == [t, t]
            parts = [set(units_of(run, r["released"][t]["rows"])) for r in ranks]
            assert parts[0].isdisjoint(parts[1])
            assert all(cyclic_part(secret, u, BANDS) == t % BANDS for part in parts for u in part)
            union.append(dict(ranks[0]["released"][t], rows=ranks[0]["released"][t]["rows"] + ranks[1]["released"][t]["rows"]))
        assert any(a["rows"] and b["rows"] for a, b in zip(*(r["released"] for r in ranks))), \
            f"{form}, {unit}: no step drew on both ranks: pick another seed"
        for r in ranks:
            run.releases = r["releases"]
            check_releases(run, union)


def ddp_resume_worker(rank, init_file, out_dir):
    """A DDP run saved after 2 releases (each rank its own default checkpoint), resumed with only
    rank 0 loading (refused on both ranks, no hang), then with both loading (trains on, in a new run
    of the recursion whose partition is rank 0's on both ranks)."""
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    first = private("bookkeeping", "example", wrap=DPDDP)
    train(first, 2)
    path = os.path.join(out_dir, f"checkpoint{rank}.pt")
    first.engine.save_checkpoint(path=path, module=first.module, optimizer=first.optimizer)
    out = {}
    for loaders in ((0,), (0, 1)):
        resumed = private("bookkeeping", "example", wrap=DPDDP, noise_seed=None, loader_seed=None)
        if rank in loaders:
            resumed.engine.load_checkpoint(path=path, module=resumed.module, optimizer=resumed.optimizer)
        try:
            released = train(resumed, 2)
            out[loaders] = {"steps": [r["step"] for r in released], "secret": resumed.loader.batch_sampler.poisson._secret,
                            "run": resumed.optimizer.banded.run_id}
        except ValueError as error:
            out[loaders] = {"refused": str(error)}
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_ddp_banded_resume_loaded_on_one_rank_is_refused_gloo():
    """Only rank 0 loads the checkpoint: its noise is at step 2, rank 1's at 0 (its draws would be
    numbered from 0 while the noise goes on at step 2): both ranks refuse by name before any draw.
    Both loading: both number their draws from 2, with one partition (rank 0's secret) and run."""
    spawned = spawn(ddp_resume_worker, WORLD)
    for r in spawned:
        assert "refused" in r[(0,)] and "ranks' banded noise is at steps 0 to 2" in r[(0,)]["refused"]
        assert r[(0, 1)]["steps"] == [2, 3]
    assert spawned[0][(0, 1)]["secret"] == spawned[1][(0, 1)]["secret"]
    assert spawned[0][(0, 1)]["run"] == spawned[1][(0, 1)]["run"]


# --- 5. FSDP2 (2 gloo processes) ----------------------------------------------------------------

#: FSDP2 runs: bands 2; seeded: 8 rows a draw expected (b q = 2/3 inside a part, 6 units of it
#: per rank); secure (unseeded): 12 (b q = 1, every unit of the part). A share empty on one rank
#: (a zero clipped sum, the other rank's rows released) is tested in test_fsdp_empty_share.py
FSDP_BANDS, FSDP_STEPS = 2, 4
FSDP_BATCH = {False: 8, True: 12}


def fsdp_worker(rank, init_file, out_dir):
    from opacus.utils.fsdp_utils import FSDP2Wrapper

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    out = {}
    for secure in (False, True):
        spy = csprng._default = CsprngSpy()  # this process's CSPRNG (secure mode)
        seeds = dict(noise_seed=None, loader_seed=None) if secure else {}
        run = private("two_pass", "example", wrap=FSDP2Wrapper, grad_sample_mode="ghost_fsdp", secure=secure,
                      bands=FSDP_BANDS, batch_size=FSDP_BATCH[secure], **seeds)
        released = train(run, FSDP_STEPS)
        opt = run.optimizer
        out[secure] = {
            "released": released, "releases": run.releases, "optimizer": type(opt).__name__,
            "history": run.engine.accountant.state_dict()["history"], "z": [z.clone() for z in spy.z],
            "params": [(type(p).__name__, str(getattr(p, "placements", None)), tuple(local_shard(p).shape))
                       for p in opt.params],
            "buffers": {slot: [(type(t).__name__, str(getattr(t, "placements", None)), tuple(local_shard(t).shape))
                               for t in past] for slot, past in opt.banded.kept.state_dict()["past"].items()},
            "secret": run.loader.batch_sampler.poisson._secret,
        }
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_fsdp_banded_noise_is_sharded_like_the_parameters_gloo():
    """FSDP2 (``grad_sample_mode="ghost_fsdp"``; one spawn, a seeded and a secure run): the kept
    noise vectors are sharded like the parameters (DTensors with their placements and local shape;
    in secure mode the local shards themselves), never a full copy per rank; each rank's release is
    its shard of brute-force clipping of the union of the ranks' draws plus ``C^{-1} z`` (``z``: the
    full-shape draw of ``noise_generator``, std ``sigma C / world``, sliced; secure: each rank's own
    shard from the CSPRNG), and the two ranks' histories agree."""
    spawned = spawn(fsdp_worker, WORLD)
    for secure in (False, True):
        ranks = [r[secure] for r in spawned]
        assert ranks[0]["optimizer"] == "FSDPRandomizedClippingOptimizer"
        assert ranks[0]["history"] == ranks[1]["history"]
        ((sigma, _, steps, record),) = ranks[0]["history"]
        assert (sigma, steps, record["bands"]) == (SIGMA, FSDP_STEPS, FSDP_BANDS)
        for r in ranks:
            assert sorted(r["buffers"]) == list(range(len(r["params"])))
            for slot, (kind, placements, shape) in enumerate(r["params"]):
                assert kind == "DTensor" and "Shard(dim=0)" in placements
                want = ("Tensor", "None", shape) if secure else ("DTensor", placements, shape)
                assert r["buffers"][slot] == [want] * (FSDP_BANDS - 1)
        secret = ranks[0]["secret"]
        assert ranks[1]["secret"] == secret
        run = private("two_pass", "example", bands=FSDP_BANDS, batch_size=FSDP_BATCH[secure])  # the brute force, B
        union = []
        for t in range(FSDP_STEPS):
            assert [r["released"][t]["step"] for r in ranks] == [t, t]
            rows = [set(r["released"][t]["rows"]) for r in ranks]
            assert rows[0].isdisjoint(rows[1])
            assert all(cyclic_part(secret, u, FSDP_BANDS) == t % FSDP_BANDS for part in rows for u in part)
            union.append(dict(ranks[0]["released"][t], rows=sorted(rows[0] | rows[1])))
        shapes = [p.shape for p in run.optimizer.params]
        for rank, r in enumerate(ranks):
            if secure:  # this rank's shard, std sigma C / world; released as (sum / world + w) / (B / world)
                slots = len(shapes)
                z = [[WORLD * v for v in r["z"][t * slots:(t + 1) * slots]] for t in range(FSDP_STEPS)]
            else:  # the full-shape draw (the same generator seed on both ranks), sliced to the rank's shard
                full = replayed_noise(shapes, SIGMA * C / WORLD, [1] * FSDP_STEPS)
                z = [[WORLD * torch.chunk(v, WORLD, dim=0)[rank] for v in step] for step in full]
            run.releases = r["releases"]
            check_releases(run, union, z=z, shard=(rank, WORLD))
