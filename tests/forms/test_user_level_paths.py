"""privacy_unit="user" on every path a script can take: sketched book-keeping's one sketch
per user, checkpoints, secure mode, calibration at q_u, loaders built or used by hand,
accumulation, nonfinite="skip", one unit per engine, q_u at its cap, denoising.

Sketch statistics (:func:`test_sketched_user_norm_is_unbiased_with_one_sketch_per_user`):
the Hutchinson estimate of a user's ``||M_u||_F^2`` (``M_u = sum_r A_r^T G_r``, the user's
summed gradient of a linear weight) with a Gaussian N(0, 1/k) sketch of k columns is
``sum_j sigma_j^2 chi2_k / k``: unbiased, variance ``(2 / k) sum_j sigma_j^4``. The mean of
N independent steps' estimates is within 5 standard deviations ``5 sqrt(var / N)`` of the
exact value; two users' estimates from independent sketches have a sample correlation
within ``5 / sqrt(N)`` of 0.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from opacus import PrivacyEngine
from torch import nn

import opacus_rc  # noqa: F401
from opacus_rc.csprng import CSPRNG
from opacus_rc.draws import UserDataLoader

from tests.forms.test_user_level import C, FORMS, K, USERS_PER_STEP, _ce, one_logical_step, private, user_data
from tests.models import SequenceClassifier
from tests.oracles import per_user_clipped_mean

#: every test also with the batches copied as on a device (tests/conftest.py, issue 52)
pytestmark = pytest.mark.usefixtures("batches_as_on_a_device")

# --- sketched book-keeping: one sketch per user --------------------------------------------

T, D, P, SKETCH = 3, 4, 5, 2  # a row has 3 tokens; a user's 2 rows, 6 > SKETCH: sketched
COPIES, STEPS = 60, 5  # users 1..COPIES have the same two rows: COPIES x STEPS estimates


class Projection(nn.Module):
    """One linear layer; row r's loss is ``y_r * sum(out_r * W)``, so ``G_r = y_r W``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, P, bias=False)

    def forward(self, x):
        return self.fc(x)


def sketch_data():
    """User 0's two rows have the same input and opposite signs (their gradients cancel);
    users 1 .. COPIES each have the same two nearly parallel rows."""
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(T, D, generator=gen)
    x1 = torch.randn(T, D, generator=gen)
    x2 = x1 + 0.1 * torch.randn(T, D, generator=gen)
    x = torch.stack([x0, x0] + [x1, x2] * COPIES)
    y = torch.tensor([1.0, -1.0] + [1.0, 1.0] * COPIES)
    owners = [u for u in range(COPIES + 1) for _ in range(2)]
    return torch.utils.data.TensorDataset(x, y), owners, torch.randn(T, P, generator=gen)


def user_sq_norm_estimates(sketching: str) -> torch.Tensor:
    """(STEPS, 1 + COPIES): each step's sketched squared norm of each user's summed weight
    gradient (every user, both rows, in every draw: q_u = 1)."""
    data, owners, weights = sketch_data()
    model = Projection()
    engine = PrivacyEngine(accountant="rc_prv")
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=torch.utils.data.DataLoader(data, batch_size=3), noise_multiplier=0.0, max_grad_norm=1.0,
        clipping="randomized", privacy_unit="user", user_ids=owners, max_examples_per_user=2, sample_rate=1.0,
        loss_reduction="sum", sketch_size=SKETCH, sketching=sketching, seed=0,
    )
    estimates = []
    for _ in range(STEPS):
        for x, y in loader:  # one draw per epoch at q_u = 1
            (module(x) * weights * y[:, None, None]).sum().backward()
            (record,) = module.records.of(model.fc.weight)
            estimates.append(record.sq_norms.detach().clone())
            optimizer.step()
            optimizer.zero_grad()
    return torch.stack(estimates).double()


def exact_user_matrices():
    """``M_u = sum_r y_r x_r^T W`` of user 0 and of a copy, and row 0's gradient."""
    data, _, weights = sketch_data()
    x, y = data.tensors
    per_row = torch.einsum("r,rtd,tp->rdp", y[:4].double(), x[:4].double(), weights.double())
    return per_row[:2].sum(dim=0), per_row[2:].sum(dim=0), per_row[0]


def test_sketched_user_norm_is_unbiased_with_one_sketch_per_user():
    estimates = user_sq_norm_estimates("per_example")
    cancelling, copy_matrix, row = exact_user_matrices()
    sigma = torch.linalg.svdvals(copy_matrix)
    exact, var = float(sigma.pow(2).sum()), float(2 / SKETCH * sigma.pow(4).sum())
    samples = estimates[:, 1:].reshape(-1)
    # a sketch per row would estimate ||M_1||^2 + ||M_2||^2, about half of exact here
    assert abs(float(samples.mean()) - exact) <= 5 * math.sqrt(var / len(samples)), (samples.mean(), exact)
    # user 0's rows cancel: its one sequence's sketch sees a zero gradient (per-row
    # sketches, summed, would see about 2 ||g_row||^2)
    assert float(cancelling.norm()) < 1e-6
    assert float(estimates[:, 0].abs().max()) <= 1e-5 * float(row.pow(2).sum())
    # users with identical rows have independent sketches: the estimates of copies 2i and
    # 2i + 1 are uncorrelated
    pairs = estimates[:, 1:].reshape(-1, 2)
    correlation = float(torch.corrcoef(pairs.T)[0, 1])
    assert abs(correlation) <= 5 / math.sqrt(len(pairs))
    assert bool((pairs[:, 0] != pairs[:, 1]).all())


def test_shared_sketching_gives_identical_users_one_estimate():
    """The control of the independence check: one sketch for the batch."""
    estimates = user_sq_norm_estimates("shared")
    torch.testing.assert_close(estimates[:, 1:], estimates[:, 1:2].expand(-1, COPIES), rtol=1e-5, atol=0)


# --- paths -----------------------------------------------------------------------------------


def drawn_rows(loader, module, optimizer, draws: int):
    """The dataset rows of the next ``draws`` draws (trained on, bookkeeping)."""
    out = []
    it = iter(loader)
    for _ in range(draws):
        x, y, index = next(it)
        out.append(index.tolist())
        _ce(module, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return out


def test_bookkeeping_refuses_a_batch_the_loader_did_not_deliver_after_a_step():
    """The users announced for a delivered batch are consumed by its step: a later batch of
    the same size from another loader is not clipped with them (it held user 0's rows in
    three "users", each clipped to C)."""
    data, owners = user_data()
    _, (module, optimizer, loader) = private(SequenceClassifier(), data, owners, **FORMS["bookkeeping"])
    (rows,) = drawn_rows(loader, module, optimizer, 1)
    x, y, _ = data[torch.arange(len(rows))]
    with pytest.raises(ValueError, match="no batch of the loader make_private returned was pending"):  # at its forward
        _ce(module, x, y).backward()


def test_checkpoint_with_rng_state_resumes_the_user_samplers_draws(tmp_path):
    data, owners = user_data()
    engine, (module, optimizer, loader) = private(SequenceClassifier(), data, owners, **FORMS["bookkeeping"])
    assert getattr(engine, opacus_rc.checkpoint.POISSON_GENERATOR_ATTR) is loader.batch_sampler.poisson.uniform.generator
    drawn_rows(loader, module, optimizer, 1)
    path = tmp_path / "ckpt.pt"
    engine.save_checkpoint(path=path, module=module, optimizer=optimizer, include_rng_state=True)
    expected = drawn_rows(loader, module, optimizer, 2)

    def resumed(include: bool):
        fresh, (m, o, l) = private(SequenceClassifier(), data, owners, seed=None, **FORMS["bookkeeping"])
        if include:
            fresh.load_checkpoint(path=path, module=m, optimizer=o)
        return drawn_rows(l, m, o, 2)

    assert resumed(True) == expected
    assert resumed(False) != expected


def test_secure_mode_draws_users_and_subsets_from_the_csprng():
    data, owners = user_data()
    engine = PrivacyEngine(accountant="rc_prv", secure_mode=True)
    model = SequenceClassifier()
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=torch.utils.data.DataLoader(data, batch_size=USERS_PER_STEP), noise_multiplier=1.0,
        max_grad_norm=C, clipping="randomized", privacy_unit="user", user_ids=owners, max_examples_per_user=K,
        sketch_size=64,
    )
    assert isinstance(loader.batch_sampler.poisson.uniform.generator, CSPRNG)
    # a draw is empty with probability (1 - 3/7)^7 = 0.02 (one failure in 50 runs asserted a
    # single step): some step of 8 holds rows, except with probability 0.02^8 < 1e-13
    assert any(one_logical_step(module, optimizer, loader) for _ in range(8))
    torch.manual_seed(0)
    first = [index.tolist() for _, _, index in loader]
    torch.manual_seed(0)
    second = [index.tolist() for _, _, index in loader]
    assert first != second  # torch's global generator does not decide the draws


def test_seeded_draws_do_not_depend_on_torchs_global_generator():
    data, owners = user_data()
    runs = []
    for torch_seed in (0, 1):
        torch.manual_seed(torch_seed)
        _, (module, optimizer, loader) = private(SequenceClassifier(), data, owners, **FORMS["bookkeeping"])
        runs.append(drawn_rows(loader, module, optimizer, 2))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("users, per_step", [(8, 5), (7, USERS_PER_STEP)])
def test_make_private_with_epsilon_spends_the_target_over_epochs_of_the_returned_loader(users, per_step):
    """Issue 46 path 9: calibrated at q_u (not 1 / len(loader)) for the steps the returned
    loader runs, E x len(loader). On main sigma was calibrated for int(E / q_u) steps: with 8
    users, 5 per step (q_u = 5/8), 3 epochs, 4 steps, while the loader runs round(1.6) = 2
    draws per epoch, 6 steps: epsilon 4.91 against a target of 4. Now epsilon after E epochs
    lies in [target - epsilon_tolerance, target] (the calibration's window; get_epsilon at
    the calibration's eps_error, 0.01: the same PRV composition)."""
    data, owners = user_data(users=users)
    model = SequenceClassifier()
    engine = PrivacyEngine(accountant="rc_prv")
    target, delta, epochs, tolerance = 4.0, 1e-5, 3, 0.05
    module, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=torch.utils.data.DataLoader(data, batch_size=per_step), target_epsilon=target,
        target_delta=delta, epochs=epochs, max_grad_norm=C, clipping="randomized", privacy_unit="user",
        user_ids=owners, max_examples_per_user=K, per_example_backward=True, epsilon_tolerance=tolerance, seed=0,
    )
    for _ in range(epochs):
        for x, y, _ in loader:
            if len(y):
                _ce(module, x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
    q_u = per_step / users
    assert [entry[1] for entry in engine.accountant.history] == pytest.approx([q_u] * len(engine.accountant.history))
    assert sum(entry[2] for entry in engine.accountant.history) == epochs * len(loader)
    assert target - tolerance <= engine.get_epsilon(delta) <= target


def test_a_user_loader_refuses_to_iterate_without_its_optimizer():
    data, owners = user_data()
    _, (module, optimizer, loader) = private(SequenceClassifier(), data, owners, **FORMS["bookkeeping"])
    by_hand = UserDataLoader(data, index=loader.user_index, sample_rate=0.5,
                             generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="delivers each batch to the optimizer make_private returned"):
        next(iter(by_hand))
    by_hand.follow(optimizer)
    batch = next(iter(by_hand))
    assert optimizer.ledger.latest.units.users.tolist() == loader.user_index.user_of_row[batch[2]].tolist()


def test_bookkeeping_refuses_two_backward_passes_in_a_step():
    data, owners = user_data()
    _, (module, optimizer, loader) = private(SequenceClassifier(), data, owners, **FORMS["bookkeeping"])
    for x, y, _ in loader:
        if len(x):
            break
    _ce(module, x, y).backward()
    with pytest.raises(ValueError, match="a layer saw 24 rows where the forward's batch.* has 12"):
        _ce(module, x, y).backward()
        optimizer.step()


class FloatClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))).mean(dim=1)


@pytest.mark.parametrize("form", ["bookkeeping", "per_example"])  # the forms that can drop one unit
def test_nonfinite_skip_drops_a_user_as_one_unit(form):
    """User 1's second row is non-finite: the user is dropped whole (counted once), the
    update is brute-force per-user clipping of the other users."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 3, 4, generator=gen)
    x[4, 1, 2] = float("inf")
    y = torch.randint(0, 2, (9,), generator=gen)
    owners = [0, 0, 1, 1, 1, 2, 2, 3, 3]  # contiguous: the draw (q_u = 1) is all rows in order
    data = torch.utils.data.TensorDataset(x, y, torch.arange(9))
    torch.manual_seed(0)
    model = FloatClassifier()
    reference = copy.deepcopy(model)
    engine = PrivacyEngine(accountant="rc_prv")
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=torch.utils.data.DataLoader(data, batch_size=4), noise_multiplier=0.0, max_grad_norm=C,
        clipping="randomized", privacy_unit="user", user_ids=owners, max_examples_per_user=8, sample_rate=1.0,
        nonfinite="skip", seed=0, **FORMS[form],
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rows = one_logical_step(module, optimizer, loader)
    assert rows == list(range(9))
    assert optimizer.skipped_examples == 1
    kept = [r for r in rows if owners[r] != 1]
    expected = per_user_clipped_mean(reference, _ce, x[kept], y[kept], [owners[r] for r in kept], C, 4)
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all()
        torch.testing.assert_close(before[name] - p.detach(), expected[name], atol=1e-6, rtol=0)


def _make_private(engine, unit: str, clipping: str = "randomized"):
    data, owners = user_data()
    model = SequenceClassifier()
    options = dict(privacy_unit="user", user_ids=owners, max_examples_per_user=K, sketch_size=64) if unit == "user" else {}
    if clipping == "randomized":
        options["clipping"] = "randomized"
    return engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=torch.utils.data.DataLoader(data, batch_size=USERS_PER_STEP), noise_multiplier=1.0,
        max_grad_norm=C, **options,
    )


@pytest.mark.parametrize(
    "first, second",
    [(("user", "randomized"), ("example", "randomized")), (("example", "randomized"), ("user", "randomized")),
     (("user", "randomized"), ("example", "flat")), (("example", "flat"), ("user", "randomized"))],
)
def test_one_engine_one_unit_even_before_a_step(first, second):
    """Every optimizer of an engine charges its accountant: an example-level one's steps
    under an engine that reports per user (or the converse) would mislabel epsilon."""
    engine = PrivacyEngine(accountant="rc_prv")
    _make_private(engine, *first)
    with pytest.raises(ValueError, match=f"privacy_unit='{second[0]}' on an engine whose earlier make_private"):
        _make_private(engine, *second)
    assert engine.privacy_unit == first[0]
    _make_private(engine, *first)  # the same unit again: accepted


def test_explicit_sample_rate_is_q_u():
    data, owners = user_data()
    engine, (module, optimizer, loader) = private(SequenceClassifier(), data, owners, sample_rate=0.2,
                                                  **FORMS["bookkeeping"])
    assert loader.sample_rate == 0.2 and optimizer.expected_batch_size == USERS_PER_STEP
    one_logical_step(module, optimizer, loader)
    assert engine.accountant.history[-1][1] == 0.2


@pytest.mark.parametrize("per_step, refused", [(8, True), (20, True), (7, False)])
def test_users_per_step_above_the_number_of_users_is_refused_by_name(per_step, refused):
    """Issue 46: a loader batch_size above the 7 users ran at q_u = 1 with no warning while
    the update was divided by the larger batch_size (on main: 20 -> q_u 1.0, normaliser 20).
    Refused, naming batch_size and sample_rate; 7 of 7 users: q_u = 1, every user drawn."""
    data, owners = user_data()
    model = SequenceClassifier()
    call = lambda: PrivacyEngine(accountant="rc_prv").make_private(  # noqa: E731
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=torch.utils.data.DataLoader(data, batch_size=per_step), noise_multiplier=1.0, max_grad_norm=C,
        clipping="randomized", privacy_unit="user", user_ids=owners, max_examples_per_user=K, sketch_size=64, seed=0,
    )
    if refused:
        with pytest.raises(ValueError, match=rf"batch_size={per_step} .* above the 7 users .*accepted values: a "
                                             r"batch_size of at most 7, or sample_rate="):
            call()
        return
    module, optimizer, loader = call()
    assert loader.sample_rate == 1.0 and len(loader) == 1 and optimizer.expected_batch_size == 7
    rows = one_logical_step(module, optimizer, loader)
    assert {owners[r] for r in rows} == set(owners)  # every user in every draw


def test_spectral_denoising_at_user_level_steps():
    data, owners = user_data()
    model = SequenceClassifier()
    before = [p.detach().clone() for p in model.parameters()]
    _, (module, optimizer, loader) = private(model, data, owners, noise=1.0, denoise="spectral",
                                             **FORMS["bookkeeping"])
    one_logical_step(module, optimizer, loader)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_bookkeeping_step_after_an_empty_last_physical_batch_releases_the_earlier_users():
    """The private Trainer's pattern: a physical batch of whole users clipped into the step's
    sum (a same-draw skipped step), then an empty last physical batch (no rows, no users
    announced), then the real step. That step clips nothing new and releases the first
    batch's users' clipped sum (brute force), not a refusal (seen once in 4 to 14 Trainer runs
    before the fix)."""
    data, owners = user_data()
    torch.manual_seed(0)
    model = SequenceClassifier()
    reference = copy.deepcopy(model)
    _, (module, optimizer, loader) = private(model, data, owners, **FORMS["bookkeeping"])
    x, y, index = next(x for x in loader if len(x[0]))
    _ce(module, x, y).backward()
    optimizer.signal_skip_step(do_skip=True, same_draw=True)
    optimizer.step()
    optimizer.zero_grad()
    optimizer.complete_batch(0)  # the empty last physical batch: no rows, no users announced
    optimizer.step()
    users = [owners[r] for r in index.tolist()]
    expected = per_user_clipped_mean(reference, _ce, x, y, users, C, USERS_PER_STEP)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(q.detach() - p.detach(), expected[name], atol=1e-6, rtol=0)


@pytest.mark.parametrize("form", ["bookkeeping", "per_example", "two_pass"])
def test_peft_lora_per_user_equals_brute_force(form):
    """PEFT LoRA on a small Llama (random init; only the adapters train): one user-level step
    at sigma = 0 equals brute-force per-user clipping of the adapters' gradients (q_u = 0.9:
    the first draw holds users; a Hugging Face model takes no empty batch)."""
    import peft

    from tests.models import tiny_llama

    def lm_loss(model, x, _y):
        return model(input_ids=x, labels=x, use_cache=False).loss

    base = tiny_llama(vocab=32)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                              init_lora_weights=False),
    )
    reference = copy.deepcopy(model)
    data, owners = user_data(t=8)
    engine = PrivacyEngine(accountant="rc_prv")
    out = engine.make_private(
        module=model, optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0),
        criterion=nn.CrossEntropyLoss(), data_loader=torch.utils.data.DataLoader(data, batch_size=USERS_PER_STEP),
        noise_multiplier=0.0, max_grad_norm=C, clipping="randomized", privacy_unit="user", user_ids=owners,
        max_examples_per_user=K, seed=4, sample_rate=0.9, **{**FORMS[form], "sketch_size": 256},
    )
    module, optimizer, *criterion, loader = out
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    def loss_of(m, x, _):
        if not criterion:
            return lm_loss(m, x, None)
        logits = m(input_ids=x, use_cache=False).logits[:, :-1]  # the ghost criterion: one loss per row
        return criterion[0](logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), shape=x[:, 1:].shape)

    rows = one_logical_step(module, optimizer, loader, loss_of=loss_of)
    assert len({owners[r] for r in rows}) >= 2
    x = data.tensors[0][rows]
    expected = per_user_clipped_mean(reference, lm_loss, x, x, [owners[r] for r in rows], C, USERS_PER_STEP)
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(before[name] - p.detach(), expected[name], atol=1e-6, rtol=1e-4)
