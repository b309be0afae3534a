"""One draw, one release (issue 46, paths 1 and 2, and the empty draw without backward).

At noise 0 a release is ``sum of clipped units / B``; each test compares it with brute-force
clipping (:mod:`tests.oracles`) of exactly the draw the release claims to be:

* path 1: a loop that stops inside a draw and iterates the loader again released the partial
  draw's clipped sums together with the next draw (2 C for an example in both);
* path 2: with the next batch fetched before the current forward (prefetching), book-keeping
  and the two-pass forms clipped the current batch with the user layout announced last (one
  user's 2 rows as 2 units: 2 C); the units now come from the batch the forward took.
"""

from __future__ import annotations

import pytest
import torch
from opacus.utils.batch_memory_manager import BatchMemoryManager

from tests.forms.test_per_example_draws import C, _ce, _lockstep_releases, private
from tests.forms.test_user_level import FORMS as USER_FORMS, one_logical_step, user_data
from tests.forms.test_user_level import private as user_private
from tests.models import SequenceClassifier
from tests.oracles import per_example_clipped_mean, per_user_clipped_mean

#: every test also with the batches copied as on a device (tests/conftest.py, issue 52)
pytestmark = pytest.mark.usefixtures("batches_as_on_a_device")

EXAMPLE_FORMS = {
    "per_example": dict(per_example_backward=True),
    "output_passes": dict(per_example_backward=False, grad_sample_mode="hooks", bookkeeping=False),
    "bookkeeping": dict(per_example_backward=False),
}


def _assert_release_is(update, want, model):
    for name, _ in model.named_parameters():
        torch.testing.assert_close(update[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("form", sorted(EXAMPLE_FORMS))
def test_a_loop_stopped_inside_a_draw_releases_only_the_next_whole_draw(form):
    """BatchMemoryManager (one row per physical batch): the first draw is left after its first
    row; the next release equals brute-force clipping of exactly the next draw's examples
    (before: the left row's clipped gradient was released with it, charged once)."""
    b = 8
    model, engine, (module, optimizer, *_, loader) = private(n=16, batch_size=b, **EXAMPLE_FORMS[form])
    managed = BatchMemoryManager(data_loader=loader, max_physical_batch_size=1, optimizer=optimizer).__enter__()
    for x, y in managed:  # `if i == max_steps: break` inside the draw
        _ce(module, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        break
    assert optimizer._is_last_step_skipped, "the first draw held one row: pick another seed"
    with pytest.warns(RuntimeWarning, match="left after 1 of its"):
        ((update, xs, ys, reference),) = _lockstep_releases(module, optimizer, managed, model, steps=1)
    assert len(xs) >= 1
    _assert_release_is(update, per_example_clipped_mean(reference, _ce, xs, ys, C, b), model)
    assert [h[3].micro_batches for h in engine.accountant.history] == [1]


def test_a_partial_users_running_sum_is_dropped_with_its_draw():
    """The per-example form at user level: a loop stopped after the first of a user's rows; the
    next release is exactly the next draw's users, each clipped once (before: the half-finished
    user sum joined the next draw's, 2 C)."""
    data, owners = user_data()
    _, (module, optimizer, loader) = user_private(SequenceClassifier(), data, owners, **USER_FORMS["per_example"])
    for x, y, _ in loader:
        _ce(module, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if optimizer._is_last_step_skipped:  # stopped inside a draw
            break
    reference = _copy_user(module)
    with pytest.warns(RuntimeWarning, match="left after"):
        rows = one_logical_step(module, optimizer, loader)
    _check_user_release(module, reference, data, owners, rows, optimizer)


def _copy_user(module):
    model = SequenceClassifier()
    model.load_state_dict({k.removeprefix("_module."): v for k, v in module.state_dict().items()})
    return model


def _check_user_release(module, reference, data, owners, rows, optimizer):
    x, y, _ = data[torch.tensor(rows, dtype=torch.long)]
    users = [owners[r] for r in rows]
    want = per_user_clipped_mean(reference, _ce, list(x), list(y), users, C, optimizer.expected_batch_size)
    update = {n: r.detach() - p.detach() for (n, r), p in zip(reference.named_parameters(), _copy_user(module).parameters())}
    _assert_release_is(update, want, reference)


@pytest.mark.parametrize("form", ["bookkeeping", "two_pass", "output_passes"])
def test_prefetching_clips_each_batch_with_its_own_users(form):
    """The next batch fetched before the current forward (the user layout announced last was
    the next batch's): the release equals brute-force per-user clipping of the batch trained on."""
    data, _ = user_data(n=28)
    owners = [u for u in range(7) for _ in range(u + 1)]  # user u owns u + 1 rows: m_u = 1, 2, 3, 4, 4, ...
    _, (module, optimizer, *criterion, loader) = user_private(SequenceClassifier(), data, owners, **USER_FORMS[form])
    loss_of = (lambda m, x, y: criterion[0](m(x), y)) if criterion else _ce

    def layout(batch):  # each user's rows in the batch, in order
        users = [owners[r] for r in batch[2].tolist()]
        return [users.count(u) for u in dict.fromkeys(users)]

    for _ in range(200):  # an epoch of two draws: the second prefetched (announced last), as many rows
        it = iter(loader)
        current, ahead = next(it), next(it)
        if len(current[0]) == len(ahead[0]) and layout(current) != layout(ahead):
            break
    else:
        pytest.fail("no two draws of as many rows with another layout: pick another seed")
    reference = _copy_user(module)
    x, y, index = current
    loss_of(module, x, y).backward()
    optimizer.step()
    optimizer.zero_grad()
    _check_user_release(module, reference, data, owners, index.tolist(), optimizer)
    assert len(ahead) == 3


def test_bookkeeping_runs_a_loop_that_skips_the_backward_on_an_empty_draw():
    """``if len(x): loss.backward()``: the empty draw's step releases noise only (before: book-keeping
    refused it with "no per-sample gradient for parameter 'weight'")."""
    model, engine, (module, optimizer, *_, loader) = private(n=4, batch_size=1, **EXAMPLE_FORMS["bookkeeping"])
    empty = nonempty = 0
    for _ in range(10):
        for x, y in loader:
            loss = _ce(module, x, y)
            if len(x):
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            empty, nonempty = empty + (len(x) == 0), nonempty + (len(x) > 0)
    assert empty and nonempty, "pick another seed: both kinds of draw are needed"
    assert len(engine.accountant.history) >= 1 and sum(h[2] for h in engine.accountant.history) == empty + nonempty


def test_a_second_step_for_one_batch_names_the_double_step():
    """``optimizer.step()`` twice for one physical batch (issue 48): after a release, and inside a draw
    of BatchMemoryManager's loader; the refusal names the double step, not only ``zero_grad``."""
    model, engine, (module, optimizer, *_, loader) = private(n=8, batch_size=4, **EXAMPLE_FORMS["bookkeeping"])
    x, y = next(iter(loader))
    _ce(module, x, y).backward()
    optimizer.step()
    with pytest.raises(ValueError, match="called twice for one physical batch"):
        optimizer.step()
    model, engine, (module, optimizer, *_, loader) = private(n=16, batch_size=8, **EXAMPLE_FORMS["bookkeeping"])
    managed = BatchMemoryManager(data_loader=loader, max_physical_batch_size=1, optimizer=optimizer).__enter__()
    x, y = next(iter(managed))
    _ce(module, x, y).backward()
    optimizer.step()
    assert optimizer._is_last_step_skipped, "the first draw held one row: pick another seed"
    with pytest.raises(ValueError, match="called twice for one physical batch"):
        optimizer.step()
