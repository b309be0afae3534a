"""opacus_rc/units.py: the user index, the user-level Poisson sampler and the regrouping
of a batch's rows into its users.

Statistical tests use fixed generator seeds and 5-sigma bounds from the binomial law
(a false failure has probability below 1e-6 per bound, and the seeds are fixed, so each
test is deterministic; the bounds are what a correct sampler meets at any seed):

* a user's inclusion count over N draws is Bin(N, q_u): |count - N q_u| <= 5 sqrt(N q_u (1 - q_u));
* two users are independent: their joint count is Bin(N, q_u^2) (5 sigma, each pair);
* a sampled heavy user (n_u > k) keeps each row with probability k / n_u and each pair of
  rows with probability k (k - 1) / (n_u (n_u - 1)) (a uniform k-subset): counts over the
  S draws that hold the user, Bin(S, p) at 5 sigma;
* fresh subsets: two consecutive draws of the user repeat the subset with probability
  1 / C(n_u, k): over S - 1 consecutive pairs the count is below mean + 5 sigma (a sampler
  that reused its subset would repeat it S - 1 times).
"""

from __future__ import annotations

import copy
import itertools
import math

import numpy as np
import pytest
import torch

from opacus_rc.draws import DrawSampler
from opacus_rc.units import (
    EXAMPLES,
    RowUnits,
    UserIndex,
    UserPoissonSampler,
    regroup_rows,
    sum_rows_by_unit,
    unit_layout,
    unit_sizes,
    user_key,
)

#: rows per user: light users (n_u <= k) and two heavy ones (n_u > k)
ROWS_PER_USER = [1, 2, 3, 10, 7]
K = 3
Q = 0.3
DRAWS = 3000


def owners_of(rows_per_user=ROWS_PER_USER):
    """Row r's owner, rows of users interleaved (user u owns rows in several places)."""
    owners = [u for u, n in enumerate(rows_per_user) for _ in range(n)]
    order = torch.randperm(len(owners), generator=torch.Generator().manual_seed(0)).tolist()
    return [owners[i] for i in order]


def draws(seed: int = 0, n: int = DRAWS, q: float = Q, k: int = K):
    """``n`` draws; the owners of the rows as the index numbers the users."""
    labels = owners_of()
    index = UserIndex(labels, len(labels), k)
    sampler = UserPoissonSampler(index, q, torch.Generator().manual_seed(seed), steps=n)
    return index, index.user_of_row.tolist(), list(sampler)


def five_sigma(n: int, p: float) -> float:
    return 5 * math.sqrt(n * p * (1 - p))


def users_in(draw, owners):
    return set(owners[r] for r in draw)


def test_each_user_is_sampled_at_q_u_independently_of_the_others():
    index, owners, out = draws()
    assert len(out) == DRAWS
    present = torch.tensor([[u in users_in(d, owners) for u in range(index.num_users)] for d in out])
    counts = present.sum(dim=0).double()
    assert (counts - DRAWS * Q).abs().max() <= five_sigma(DRAWS, Q), counts
    for a, b in itertools.combinations(range(index.num_users), 2):
        joint = int((present[:, a] & present[:, b]).sum())
        assert abs(joint - DRAWS * Q * Q) <= five_sigma(DRAWS, Q * Q), (a, b, joint)


def test_a_sampled_user_contributes_min_k_n_u_distinct_contiguous_rows_of_their_own():
    index, owners, out = draws(n=500)
    for draw in out:
        assert len(set(draw)) == len(draw)
        runs = [(u, len(list(g))) for u, g in itertools.groupby(owners[r] for r in draw)]
        users = [u for u, _ in runs]
        assert len(users) == len(set(users)), "a user's rows are not contiguous"
        assert all(size == min(K, len(index.rows_of(u))) == int(index.contributed[u]) for u, size in runs)


@pytest.mark.parametrize("rows_of_heavy", [10, 7])
def test_a_heavy_users_rows_are_a_uniform_subset_fresh_at_each_draw(rows_of_heavy):
    index, owners, out = draws(seed=1)
    heavy = [len(index.rows_of(u)) for u in range(index.num_users)].index(rows_of_heavy)
    rows = index.rows_of(heavy).tolist()
    n = len(rows)
    subsets = [tuple(sorted(r for r in d if owners[r] == heavy)) for d in out]
    subsets = [s for s in subsets if s]
    s = len(subsets)
    single, pair = K / n, K * (K - 1) / (n * (n - 1))
    for row in rows:
        count = sum(row in sub for sub in subsets)
        assert abs(count - s * single) <= five_sigma(s, single), (row, count, s)
    for a, b in itertools.combinations(rows, 2):
        count = sum(a in sub and b in sub for sub in subsets)
        assert abs(count - s * pair) <= five_sigma(s, pair), (a, b, count, s)
    repeat = 1 / math.comb(n, K)
    repeats = sum(x == y for x, y in zip(subsets, subsets[1:]))
    assert repeats <= (s - 1) * repeat + five_sigma(s - 1, repeat)


def test_draws_come_from_the_given_generator_only_and_replay_with_its_seed():
    torch.manual_seed(1)
    global_state = torch.get_rng_state()
    _, _, first = draws(seed=5, n=50)
    assert torch.equal(torch.get_rng_state(), global_state), "the sampler drew from torch's global generator"
    torch.manual_seed(2)
    _, _, again = draws(seed=5, n=50)
    assert again == first
    _, _, other = draws(seed=6, n=50)
    assert other != first


def test_steps_default_to_an_epoch_over_users():
    index = UserIndex(owners_of(), sum(ROWS_PER_USER), K)
    assert len(UserPoissonSampler(index, 0.25)) == 4
    assert len(UserPoissonSampler(index, 1.0)) == 1
    assert len(list(UserPoissonSampler(index, 0.25, torch.Generator().manual_seed(0), steps=7))) == 7


# --- UserIndex -----------------------------------------------------------------------------


def test_user_index_of_any_hashable_ids():
    ids = ["bob", ("org", 2), "bob", 7, ("org", 2), "bob"]
    index = UserIndex(ids, 6, 2)
    assert index.num_users == 3
    assert index.user_of_row.tolist() == [0, 1, 0, 2, 1, 0]
    assert index.rows_of(0).tolist() == [0, 2, 5]
    assert index.contributed.tolist() == [2, 2, 1]
    units = index.units_of([5, 3, 1])
    assert units.users.tolist() == [0, 2, 1] and units.sizes.tolist() == [2, 1, 2]


def test_user_index_of_a_tensor_of_ids():
    index = UserIndex(torch.tensor([4, 9, 4, 4]), 4, 8)
    assert index.num_users == 2 and index.rows_of(0).tolist() == [0, 2, 3]


@pytest.mark.parametrize(
    "ids, message",
    [
        (None, "needs user_ids="),
        ([0, 1], "user_ids has 2 ids for a dataset of 3 rows"),
        ([0, None, 1], r"user_ids\[1\]=None is invalid"),
        ([0, [1], 1], r"user_ids\[1\]=\[1\] is invalid"),
        (3, "user_ids=int is invalid"),
        ("abc", "user_ids='abc' is invalid"),  # a column name, not one id per row
        # one person as two units (each clipped to C) if these were taken as ids:
        (list(torch.tensor([5, 5, 6])), r"user_ids\[0\]=tensor\(5\) is invalid .*tensor.tolist\(\)"),
        ([object(), object(), object()], r"user_ids\[0\]=<object object .* is invalid"),
        ([1, float("nan"), float("nan")], r"user_ids\[1\]=nan is invalid .*a missing id\?"),
    ],
)
def test_user_index_refuses_bad_ids(ids, message):
    with pytest.raises(ValueError, match=message):
        UserIndex(ids, 3, 2)


@pytest.mark.parametrize(
    "bad",
    [("a", float("nan")), ("a", ("b", float("nan"))), np.float64("nan"), 1.5, float("inf"), ("a", 0.5),
     ("a", torch.tensor(1)), frozenset({1})],
)
def test_user_index_refuses_an_id_without_a_stable_value_anywhere_in_it(bad):
    """Issue 46 path 5: a NaN (nested in a tuple too) is unequal to another copy of itself,
    so on main one person's two rows ``("a", nan)`` were two users, each clipped to C (2.0 C
    at sigma 0). Now refused by name, with the accepted values."""
    ids = [bad, copy.deepcopy(bad), "b"]
    with pytest.raises(ValueError, match=r"user_ids\[0\]=.* is invalid .*accepted values: an int, a str"):
        UserIndex(ids, 3, 2)


def test_equal_ids_are_one_user_and_keys_are_plain_values():
    """Ids equal as values are one user (3.0 is the int 3; numpy scalars are their values)."""
    ids = [3, 3.0, np.int64(3), ("a", 1), ("a", np.int32(1)), ("a", 1.0), "x", np.str_("x"), True, np.bool_(True)]
    index = UserIndex(ids, len(ids), 2)
    assert index.user_of_row.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    assert [repr(user_key(ids[i])) for i in (2, 5, 7, 9)] == ["3", "('a', 1)", "'x'", "1"]


@pytest.mark.parametrize("k", [0, -1, 1.5, True, "2"])
def test_user_index_refuses_a_bad_bound(k):
    with pytest.raises(ValueError, match="max_examples_per_user=.* is invalid"):
        UserIndex([0, 1, 1], 3, k)


# --- a batch's rows regrouped into its units ------------------------------------------------


def units(users, sizes):
    return RowUnits(torch.tensor(users), torch.tensor(sizes))


def test_regroup_rows_puts_a_users_rows_one_after_another():
    t = torch.arange(5 * 2 * 1).float().reshape(5, 2, 1)  # 5 rows of 2 tokens
    u = units([7, 7, 3, 9, 9], [2, 2, 1, 2, 2])
    slot, position, count = unit_layout(u, 5)
    assert slot.tolist() == [0, 0, 1, 2, 2] and position.tolist() == [0, 1, 0, 0, 1] and count == 3
    out = regroup_rows(t, u)
    assert out.shape == (3, 4, 1)
    assert out[0].flatten().tolist() == [0, 1, 2, 3]
    assert out[1].flatten().tolist() == [4, 5, 0, 0]  # zero-padded to the longest unit
    assert out[2].flatten().tolist() == [6, 7, 8, 9]
    # a user's gradient sum_r A_r^T G_r is that of the regrouped sequence
    a, g = torch.randn(5, 2, 3), torch.randn(5, 2, 4)
    direct = sum_rows_by_unit(torch.einsum("btd,btp->bdp", a, g), u)
    regrouped = torch.einsum("btd,btp->bdp", regroup_rows(a, u), regroup_rows(g, u))
    torch.testing.assert_close(regrouped, direct)
    assert unit_sizes(u).tolist() == [2, 1, 2]


def test_a_users_rows_in_any_order_are_one_unit():
    """A collate that sorts moves a user's rows apart: they are still its unit (slots in order of
    first appearance, positions among the unit's rows), regrouped and summed together."""
    interleaved = units([7, 3, 7], [2, 1, 2])
    slot, position, count = unit_layout(interleaved, 3)
    assert (slot.tolist(), position.tolist(), count) == ([0, 1, 0], [0, 0, 1], 2)
    assert sum_rows_by_unit(torch.tensor([[1.0], [2.0], [4.0]]), interleaved).flatten().tolist() == [5.0, 2.0]
    assert interleaved.last.tolist() == [False, True, True]
    regrouped = regroup_rows(torch.tensor([[[1.0]], [[2.0]], [[4.0]]]), interleaved)
    assert regrouped.reshape(2, 2).tolist() == [[1.0, 4.0], [2.0, 0.0]]


def test_sum_rows_by_unit():
    t = torch.tensor([[1.0], [2.0], [4.0]])
    assert sum_rows_by_unit(t, units([5, 5, 1], [2, 2, 1])).flatten().tolist() == [3.0, 4.0]


@pytest.mark.parametrize(
    "users, sizes, batch, message",
    [
        ([0, 0, 1], [3, 3, 1], 3, "holds part of a user's rows"),  # user 0 has 3 rows in the draw: split
        ([0, 1], [1, 1], 3, "a forward pass took 3 rows"),  # not the delivered batch
    ],
)
def test_unit_layout_refuses_a_batch_that_splits_a_user(users, sizes, batch, message):
    with pytest.raises(ValueError, match=message):
        unit_layout(units(users, sizes), batch)
    if len(users) == batch:
        with pytest.raises(ValueError, match=message):
            regroup_rows(torch.zeros(batch, 1, 1), units(users, sizes))
        with pytest.raises(ValueError, match=message):
            sum_rows_by_unit(torch.zeros(batch), units(users, sizes))


class _OneDraw:
    """A Poisson batch sampler of one fixed draw."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return 1

    def __iter__(self):
        yield self.rows


@pytest.mark.parametrize(
    "index, most, chunks, last",
    [
        (UserIndex(["a", "a", "a", "b", "c", "c"], 6, 3), 1, [[0], [1], [2], [3], [4], [5]],
         [False, False, True, True, False, True]),
        (UserIndex(["a", "a", "a", "b", "c", "c"], 6, 3), 4, [[0, 1, 2, 3], [4, 5]], [False, False, True, True, False, True]),
        (UserIndex(["a", "a", "a", "b", "c", "c"], 6, 3), None, [[0, 1, 2, 3, 4, 5]], [False, False, True, True, False, True]),
        (EXAMPLES, 4, [[0, 1, 2], [3, 4, 5]], [True] * 6),  # Opacus's np.array_split
    ],
)
def test_a_draws_physical_batches_keep_units_whole_and_mark_each_units_last_row(index, most, chunks, last):
    sampler = DrawSampler(_OneDraw([0, 1, 2, 3, 4, 5]), index, most)
    assert list(sampler) == chunks
    batches = list(sampler.pending)
    assert [b.index for b in batches] == list(range(len(chunks)))
    assert all(b.draw is batches[0].draw and b.draw.batches == len(chunks) for b in batches)
    assert batches[-1].last and not any(b.last for b in batches[:-1])
    assert torch.cat([b.units.last for b in batches]).tolist() == last
