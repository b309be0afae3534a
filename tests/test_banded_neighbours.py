"""Banded noise under true add/remove neighbours: a unit added in front of the data moves no other
unit to another part of the cycle (user level: the parts are keyed by the users' ids), and at
example level, where a unit's key is its row, the parts are secret and independent, so the
releases of a dataset and of its neighbour have the same distribution but for the added row.

Before (parts by position, ``unit mod b``), one row added in front moved every other unit to the
other part: the user-level releases moved by about ``n C / b`` at sigma 0, and the example-level
distinguishing experiment below told the neighbours apart at every seed.
"""

from __future__ import annotations

import math
from typing import List, Tuple

import pytest
import torch
from scipy import stats
from torch import nn

from opacus_rc import PrivacyEngine
from opacus_rc.hf.data import PoissonAccumulationSampler
from opacus_rc.units import CyclicPoissonSampler, UserIndex

from tests.models import SequenceClassifier
from tests.oracles import cyclic_part

C, BANDS = 0.05, 2
#: the forms of the user-level runs (docs/forms.md)
FORMS = {
    "two_pass": dict(grad_sample_mode="ghost"),
    "bookkeeping": dict(grad_sample_mode="bookkeeping"),
    "per_example": dict(per_example_backward=True),
}


def _users(added: bool) -> Tuple[torch.utils.data.TensorDataset, List[int]]:
    """8 users (ids 10..17) of 3 rows each, interleaved; ``added``: user 99's 3 rows in front."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 32, (24, 6), generator=gen), torch.randint(0, 2, (24,), generator=gen)
    owners = [10 + r % 8 for r in range(24)]
    if added:
        x = torch.cat([torch.randint(0, 32, (3, 6), generator=torch.Generator().manual_seed(1)), x])
        y = torch.cat([torch.tensor([1, 0, 1]), y])
        owners = [99, 99, 99] + owners
    return torch.utils.data.TensorDataset(x, y), owners


def _user_level_releases(form: str, added: bool, steps: int) -> Tuple[List[torch.Tensor], bytes, List[set]]:
    """sigma 0, lr 0, ``loss_reduction="sum"``, rate 1 inside a part (every user of the part is
    drawn), the Poisson generator from ``seed=``: each release is the clipped sum of the users of
    part ``t mod b``. Returns the releases, the run's secret and each draw's users."""
    data, owners = _users(added)
    torch.manual_seed(0)
    model = SequenceClassifier()
    engine = PrivacyEngine(accountant="rc_prv")
    module, optimizer, *criterion, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        criterion=nn.CrossEntropyLoss(reduction="sum"), loss_reduction="sum",
        data_loader=torch.utils.data.DataLoader(data, batch_size=2), sample_rate=1.0 / BANDS,
        noise_multiplier=0.0, max_grad_norm=C, clipping="randomized", privacy_unit="user", user_ids=owners,
        max_examples_per_user=3, noise="banded", bands=BANDS, seed=5, **FORMS[form],
    )
    releases, users, drawn = [], [], set()
    while len(releases) < steps:
        for x, y in loader:
            drawn |= {owners[i] for i in _rows_of(data, x)}
            out = module(x)
            loss = criterion[0](out, y) if criterion else nn.functional.cross_entropy(out, y, reduction="sum")
            loss.backward()
            optimizer.step()
            if not optimizer._is_last_step_skipped:
                releases.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double().clone())
                users.append(drawn)
                drawn = set()
            optimizer.zero_grad()
            if len(releases) == steps:
                break
    return releases, loader.batch_sampler.poisson._secret, users


def _rows_of(data: torch.utils.data.TensorDataset, x: torch.Tensor) -> List[int]:
    """The dataset rows of a batch (by value: the rows are distinct)."""
    everything = data.tensors[0]
    return [int((everything == row).all(dim=1).nonzero()[0]) for row in x]


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_user_added_in_front_moves_no_other_user(form):
    """User level, sigma 0, rate 1 inside a part: the dataset and its neighbour with user 99's rows
    added in front (same secret: ``seed=``) draw the same users at every step but for user 99,
    each user at the steps of its part (``BLAKE2b_secret(id) mod b``, computed here), and the
    releases differ only at user 99's part's steps, by at most C (its clipped mean)."""
    steps = 4
    base, secret, base_users = _user_level_releases(form, False, steps)
    neighbour, other_secret, neighbour_users = _user_level_releases(form, True, steps)
    assert secret == other_secret
    for t in range(steps):
        assert neighbour_users[t] - {99} == base_users[t]
        assert all(cyclic_part(secret, u, BANDS) == t % BANDS for u in neighbour_users[t])
        moved = (neighbour[t] - base[t]).norm().item()
        if 99 in neighbour_users[t]:
            assert moved <= C * (1 + 1e-5)
        else:
            assert moved <= 1e-6  # float32 sums of the same clipped gradients
    assert any(99 in users for users in neighbour_users) and any(99 not in users for users in neighbour_users)


def test_the_trainers_sampler_moves_no_user_when_one_is_added_in_front():
    """The private Trainer's sampler (PoissonAccumulationSampler, users, bands): with one user added
    in front, every other user keeps its part (rate 1: the same users per draw but the new one)."""
    owners = [10 + r % 6 for r in range(24)]

    def draws(ids: List[int]) -> List[set]:
        index = UserIndex(ids, len(ids), 4)
        sampler = PoissonAccumulationSampler(num_samples=len(ids), sample_rate=1.0, micro_batches=1, steps=4,
                                             bands=BANDS, users=index)
        sampler._user_draws._partition(b"k" * 32)  # the same secret for both datasets
        return [{ids[r] for r in rows} for _, rows in sampler.numbered_draws()]

    base, neighbour = draws(owners), draws([99, 99] + owners)
    assert [users - {99} for users in neighbour] == base
    assert all(cyclic_part(b"k" * 32, u, BANDS) == t % BANDS for t, users in enumerate(neighbour) for u in users)


def _first_release(values: torch.Tensor, seed: int, sigma: float, rate: float) -> float:
    """The first release of a banded run on rows of scalar clipped contributions ``values`` (C = 1):
    the sum over draw 0 of the cyclic sampler (its own secret and masks from ``seed``) plus
    ``sigma N(0, 1)`` (the first noise of the recursion is ``z_0 / c_0 = z_0`` up to c_0)."""
    sampler = CyclicPoissonSampler(None, rate, BANDS, torch.Generator().manual_seed(seed), steps=1,
                                   num_units=len(values))
    (_, rows), = sampler.numbered_draws()
    noise = torch.randn((), generator=torch.Generator().manual_seed(10**6 + seed), dtype=torch.float64)
    return float(values[rows].sum()) + sigma * float(noise)


def _by_position(values: torch.Tensor, seed: int, sigma: float, rate: float) -> float:
    """The same release with the parts by position (``row mod b``, the rule before): the control."""
    gen = torch.Generator().manual_seed(seed)
    part = torch.arange(len(values))[0::BANDS]
    rows = part[torch.rand(len(part), generator=gen, dtype=torch.float64) < rate]
    noise = torch.randn((), generator=torch.Generator().manual_seed(10**6 + seed), dtype=torch.float64)
    return float(values[rows].sum()) + sigma * float(noise)


def test_example_level_neighbours_added_in_front_are_not_told_apart():
    """Example level, a row added in front (true add/remove): 48 rows whose clipped contributions
    alternate +1, -1 (C = 1), sigma 2.5 (about epsilon 1 for a few steps at b = 2), b q = 1/2
    inside a part; 400 runs of each dataset, the first release. With secret, independent parts
    the two release distributions differ only by the added row (shift <= 1/4 in the mean against a
    standard deviation ~ 3.3): a two-sample Kolmogorov-Smirnov test must not reject at 1e-3. The
    control, the same experiment with parts by position, is rejected at 1e-30: there the added row
    moves every +1 row to the other part (the release's mean moves from +6 to -6)."""
    runs, sigma, rate = 400, 2.5, 0.5
    values = torch.tensor([1.0 if r % 2 == 0 else -1.0 for r in range(48)], dtype=torch.float64)
    neighbour = torch.cat([torch.tensor([1.0], dtype=torch.float64), values])
    for release, reject in ((_first_release, False), (_by_position, True)):
        base = [release(values, seed, sigma, rate) for seed in range(runs)]
        added = [release(neighbour, seed, sigma, rate) for seed in range(runs, 2 * runs)]
        p = stats.ks_2samp(base, added).pvalue
        if reject:
            assert p < 1e-30, p
        else:
            assert p > 1e-3, p
            spread = math.sqrt((torch.tensor(base).var() + torch.tensor(added).var()).item() / 2)
            assert abs(sum(added) / runs - sum(base) / runs) / spread < 0.25  # the Gaussian-fit mu


def test_parts_are_uniform_and_independent_of_other_units():
    """Over 2,000 secrets: each unit's part is uniform (chi-square, 3 bands), two units' parts are
    independent (a 3 x 3 contingency table), and a unit's part does not depend on the others'
    keys (the same key keeps its part when 100 other units are added in front)."""
    counts, joint = torch.zeros(3), torch.zeros(3, 3)
    for seed in range(2000):
        sampler = CyclicPoissonSampler(None, 1.0, 3, torch.Generator().manual_seed(seed), steps=1, num_units=2)
        parts = [cyclic_part(sampler._secret, u, 3) for u in (0, 1)]
        counts[parts[0]] += 1
        joint[parts[0], parts[1]] += 1
    assert stats.chisquare(counts.numpy()).pvalue > 1e-3
    assert stats.chi2_contingency(joint.numpy())[1] > 1e-3
    index = UserIndex(["a", "b"], 2, 1)
    grown = UserIndex([f"x{i}" for i in range(100)] + ["a", "b"], 102, 1)
    for seed in range(20):
        secret = CyclicPoissonSampler(index, 1.0, 3, torch.Generator().manual_seed(seed))._secret
        small = CyclicPoissonSampler(index, 1.0, 3)
        large = CyclicPoissonSampler(grown, 1.0, 3)
        small._partition(secret)
        large._partition(secret)
        part_small = {u: p for p in range(3) for u in small.parts[p].tolist()}
        part_large = {u: p for p in range(3) for u in large.parts[p].tolist()}
        assert [part_small[0], part_small[1]] == [part_large[100], part_large[101]]
