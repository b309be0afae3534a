"""User-level privacy (``privacy_unit="user"``) in the forms that honour it.

At sigma = 0 the released update equals brute-force per-user clipping
(:func:`tests.oracles.per_user_clipped_mean`: autograd on each row alone, the mean over a
user's rows, one clip per user, no hook) in book-keeping (exact norms: the regrouped
sequence is no longer than the sketch, so ghost norms replace the estimate) and in the
per-example form (a user's rows over several backward passes). Removing one user with all
their rows moves the released sum by at most C, where example-level clipping moves it by
up to ``m_u C``. Tolerance: float32 summation order (1e-6 absolute on updates of order
1e-2).
"""

from __future__ import annotations

import copy

import pytest
import torch
from opacus import PrivacyEngine
from opacus.accountants import PRVAccountant
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn

import opacus_rc  # noqa: F401

from tests.models import SequenceClassifier
from tests.oracles import per_user_clipped_mean

#: every test also with the batches copied as on a device (tests/conftest.py, issue 52)
pytestmark = pytest.mark.usefixtures("batches_as_on_a_device")

C, USERS_PER_STEP, K = 0.05, 3, 4
FORMS = {
    "bookkeeping": dict(per_example_backward=False, sketch_size=64),
    "per_example": dict(per_example_backward=True),
    "two_pass": dict(grad_sample_mode="ghost", sketch_size=64),
    "output_passes": dict(grad_sample_mode="hooks", bookkeeping=False, sketch_size=64),
}


def _ce(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def user_data(n: int = 40, users: int = 7, t: int = 6, seed: int = 0):
    """Rows (x, y, row index) and their owners: user ``r % users`` owns row ``r`` (5 or 6
    rows each, more than K: each draw takes a subset)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 32, (n, t), generator=gen)
    y = torch.randint(0, 2, (n,), generator=gen)
    return torch.utils.data.TensorDataset(x, y, torch.arange(n)), [r % users for r in range(n)]


def private(model, data, user_ids, *, noise=0.0, seed=3, **options):
    engine = PrivacyEngine(accountant="rc_prv")
    out = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), criterion=nn.CrossEntropyLoss(),
        data_loader=torch.utils.data.DataLoader(data, batch_size=USERS_PER_STEP), noise_multiplier=noise,
        max_grad_norm=C, clipping="randomized", privacy_unit="user", user_ids=user_ids,
        max_examples_per_user=K, seed=seed, **options,
    )
    return engine, out


def one_logical_step(module, optimizer, *rest, loss_of=None):
    """Train on the loader's batches until a step is taken (``rest``: the loader, after
    the criterion of a ghost script; ``loss_of(module, x, y)``: the loss, by default the
    criterion's or cross-entropy); returns the rows used."""
    *criterion, loader = rest
    if loss_of is None:
        loss_of = (lambda m, x, y: criterion[0](m(x), y)) if criterion else _ce
    rows = []
    for x, y, index in loader:
        rows += index.tolist()
        loss_of(module, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if not optimizer._is_last_step_skipped:
            return rows
    raise AssertionError("the loader ended before a step was taken")


@pytest.mark.parametrize("form", sorted(FORMS))
def test_update_equals_brute_force_per_user_clipping(form):
    data, owners = user_data()
    torch.manual_seed(0)
    model = SequenceClassifier()
    reference = copy.deepcopy(model)
    _, out = private(model, data, owners, **FORMS[form])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(4):  # until a step holds at least two users
        rows = one_logical_step(*out)
        if len({owners[r] for r in rows}) >= 2:
            break
        reference.load_state_dict(model.state_dict())
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
    users = [owners[r] for r in rows]
    assert all(users.count(u) == min(K, owners.count(u)) for u in users)  # m_u rows of each sampled user
    x, y, _ = data[rows]
    expected = per_user_clipped_mean(reference, _ce, x, y, users, C, USERS_PER_STEP)
    for name, p in model.named_parameters():
        torch.testing.assert_close(before[name] - p.detach(), expected[name], atol=1e-6, rtol=0)


def released_sum(form: str, data, owners, unit: str) -> torch.Tensor:
    """The released sum (update x normaliser) of one step at sigma = 0 in which every user
    is sampled with all their rows (q_u = 1, k above every user's count)."""
    torch.manual_seed(0)
    model = SequenceClassifier()
    options = dict(FORMS[form], sample_rate=1.0)
    engine = PrivacyEngine(accountant="rc_prv")
    if unit == "user":
        options.update(privacy_unit="user", user_ids=owners, max_examples_per_user=64)
    out = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), criterion=nn.CrossEntropyLoss(),
        data_loader=torch.utils.data.DataLoader(data, batch_size=1), noise_multiplier=0.0,
        max_grad_norm=C, clipping="randomized", seed=1, **options,
    )
    released = {}  # the update as the real step takes it (lr 1, normaliser 1), before the
    # float32 parameters round it and before zero_grad clears it

    def keep(_optimizer, _args, _kwargs):
        released["sum"] = torch.cat([p.grad.double().flatten() for p in model.parameters()])

    out[1].original_optimizer.register_step_pre_hook(keep)
    one_logical_step(*out)
    return released["sum"]


@pytest.mark.parametrize("form", sorted(FORMS))
def test_removing_one_user_moves_the_sum_by_at_most_C(form):
    """Neighbouring datasets: all rows, and all rows but user 0's (6 rows). The released
    sums differ by at most C at user level; at example level by more (the control: each of
    the user's rows has a clipped gradient of norm C, summed)."""
    data, owners = user_data()
    keep = [r for r in range(len(data)) if owners[r] != 0]
    without = torch.utils.data.TensorDataset(*(t[keep] for t in data.tensors))
    owners_without = [owners[r] for r in keep]
    user = (released_sum(form, data, owners, "user") - released_sum(form, without, owners_without, "user")).norm()
    assert user <= C * (1 + 1e-5)
    example = (released_sum(form, data, owners, "example") - released_sum(form, without, owners_without, "example")).norm()
    assert example > 2 * C


def test_per_example_form_charges_opacus_prv_at_the_user_rate():
    data, owners = user_data()
    model = SequenceClassifier()
    engine, (module, optimizer, loader) = private(model, data, owners, noise=1.0, per_example_backward=True)
    steps = sum(1 for _ in range(3) if one_logical_step(module, optimizer, loader) is not None)
    q_u = USERS_PER_STEP / len(set(owners))
    assert engine.accountant.history[-1][1] == pytest.approx(q_u)
    reference = PRVAccountant()
    reference.history = [(1.0, q_u, steps)]
    assert engine.get_epsilon(1e-5) == pytest.approx(reference.get_epsilon(1e-5), rel=1e-6)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(privacy_unit="person"), "privacy_unit='person' is invalid; accepted values: 'example', 'user'"),
        (dict(privacy_unit="user"), "needs user_ids="),
        (dict(privacy_unit="user", user_ids=[0] * 5), "user_ids has 5 ids for a dataset of 40 rows"),
        (dict(privacy_unit="user", user_ids=[0] * 39 + [None]), r"user_ids\[39\]=None is invalid"),
        (dict(privacy_unit="user", user_ids=[0] * 40, max_examples_per_user=0), "max_examples_per_user=0 is invalid"),
        (dict(user_ids=[0] * 40), "user_ids only apply with privacy_unit='user'"),
        (dict(privacy_unit="user", user_ids=[0] * 40, poisson_sampling=False), "needs poisson_sampling=True"),
    ],
)
def test_bad_input_names_the_parameter(options, message):
    data, _ = user_data()
    model = SequenceClassifier()
    with pytest.raises(ValueError, match=message):
        PrivacyEngine(accountant="rc_prv").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=torch.utils.data.DataLoader(data, batch_size=3), noise_multiplier=1.0, max_grad_norm=C,
            clipping="randomized", **options,
        )


def test_chunked_head_per_user_in_the_per_example_form():
    """The per-example form runs the chunked head inside each row's backward pass: a user's
    rows still sum into one gradient, clipped once (brute force over the plain loss). Book-keeping
    and the two-pass form: tests/forms/test_cells.py."""
    from opacus_rc.lm_head import ChunkedLMHeadLoss

    from tests.models import HeadModel

    def head_loss(model, x):
        return ChunkedLMHeadLoss(getattr(model, "_module", model).head, block_size=4)(model(x), x)

    data, owners = user_data()
    torch.manual_seed(0)
    model = HeadModel()
    reference = copy.deepcopy(model)
    _, (module, optimizer, loader) = private(model, data, owners, per_example_backward=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rows = one_logical_step(module, optimizer, loader, loss_of=lambda m, x, _: head_loss(m, x))
    assert len({owners[r] for r in rows}) >= 2
    x = data.tensors[0][rows]
    expected = per_user_clipped_mean(reference, lambda m, xi, _: head_loss(m, xi), x, x, [owners[r] for r in rows],
                                     C, USERS_PER_STEP)
    for name, p in model.named_parameters():
        torch.testing.assert_close(before[name] - p.detach(), expected[name], atol=1e-6, rtol=0)


@pytest.mark.parametrize("form", ["bookkeeping", "two_pass"])
def test_batch_memory_manager_splits_between_users(form):
    """BatchMemoryManager over the user-level loader cuts each draw between users (physical
    batches of whole users, at most max_physical_batch_size rows): one logical step still
    equals brute-force per-user clipping of the draw, charged as one micro-batch; a
    max_physical_batch_size below max_examples_per_user is refused by name."""
    data, owners = user_data()
    torch.manual_seed(0)
    model = SequenceClassifier()
    reference = copy.deepcopy(model)
    engine, (module, optimizer, *criterion, loader) = private(model, data, owners, sample_rate=0.9, **FORMS[form])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rows, batches = [], 0
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=K + 1, optimizer=optimizer) as split:
        for x, y, index in split:
            batches += 1
            rows += index.tolist()
            (criterion[0](module(x), y) if criterion else _ce(module, x, y)).backward()
            optimizer.step()
            optimizer.zero_grad()
            if not optimizer._is_last_step_skipped:
                break
    users = [owners[r] for r in rows]
    assert batches >= 3 and len(set(users)) >= 4  # several physical batches of whole users
    assert engine.accountant.history[-1][3].micro_batches == 1
    x, y, _ = data[rows]
    expected = per_user_clipped_mean(reference, _ce, x, y, users, C, USERS_PER_STEP)
    for name, p in model.named_parameters():
        torch.testing.assert_close(before[name] - p.detach(), expected[name], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="max_physical_batch_size=2 is below max_examples_per_user=4"):
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=optimizer) as split:
            next(iter(split))


def test_batch_memory_manager_over_the_per_example_forms_loader():
    """The per-example form's loader is split into rows already; BatchMemoryManager over it
    keeps the rows and their users (a user's rows still sum into one clipped mean)."""
    data, owners = user_data()
    torch.manual_seed(0)
    model = SequenceClassifier()
    reference = copy.deepcopy(model)
    _, (module, optimizer, loader) = private(model, data, owners, **FORMS["per_example"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=optimizer) as split:
        rows = one_logical_step(module, optimizer, split)
    users = [owners[r] for r in rows]
    assert len(set(users)) >= 2
    x, y, _ = data[rows]
    expected = per_user_clipped_mean(reference, _ce, x, y, users, C, USERS_PER_STEP)
    for name, p in model.named_parameters():
        torch.testing.assert_close(before[name] - p.detach(), expected[name], atol=1e-6, rtol=0)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_batch_the_loader_did_not_deliver_is_refused_in_every_form(form):
    """A user-level optimizer fed from the user's own loader (not the one make_private
    returned): the rows' users are unknown, so no form may clip them (per row, charged per
    user): refused by name, nothing released. The two-pass forms clipped per row before."""
    data, owners = user_data()
    torch.manual_seed(0)
    model = SequenceClassifier()
    _, (module, optimizer, *criterion, _) = private(model, data, owners, **FORMS[form])
    before = [p.detach().clone() for p in model.parameters()]
    x, y, _ = data[: 1 if form == "per_example" else 6]  # the per-example form takes one row
    with pytest.raises(ValueError, match="privacy_unit='user'.*has not delivered a batch"):
        (criterion[0](module(x), y) if criterion else _ce(module, x, y)).backward()
        optimizer.step()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
