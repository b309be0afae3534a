"""User-level privacy under DDP (Opacus's DPDDP, 2 gloo processes): each rank samples and
clips its own share of the users (a user's rows stay on one rank), the ranks' clipped sums
are all-reduced once per step. At sigma = 0, with every user sampled with all their rows
(q_u = 1, k above every user's count), the update equals brute-force per-user clipping of
all users, in book-keeping and in the per-example form; removing one user with all their
rows moves it by at most C / normaliser. Tolerance: float32 summation order (1e-6)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from opacus import PrivacyEngine
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from torch import nn

import opacus_rc  # noqa: F401

from tests.forms.test_user_level import FORMS, _ce, one_logical_step, user_data
from tests.models import SequenceClassifier
from tests.oracles import per_user_clipped_mean
from tests.spawn import spawn

WORLD, C, NORMALISER = 2, 0.05, 6


def worker(rank, init_file, form, drop_user, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    data, owners = user_data()
    owner_of_row = list(owners)  # by the original row index, the data's third column
    if drop_user is not None:
        keep = [r for r in range(len(data)) if owners[r] != drop_user]
        data = torch.utils.data.TensorDataset(*(t[keep] for t in data.tensors))
        owners = [owners[r] for r in keep]
    torch.manual_seed(0)
    model = SequenceClassifier()
    engine = PrivacyEngine(accountant="rc_prv")
    out = engine.make_private(
        module=DPDDP(model), optimizer=torch.optim.SGD(model.parameters(), lr=1.0), criterion=nn.CrossEntropyLoss(),
        data_loader=torch.utils.data.DataLoader(data, batch_size=NORMALISER), noise_multiplier=0.0,
        max_grad_norm=C, clipping="randomized", privacy_unit="user", user_ids=owners, max_examples_per_user=64,
        sample_rate=1.0, seed=2, **FORMS[form],
    )
    rows = one_logical_step(*out)
    torch.save({"params": model.state_dict(), "users": sorted({owner_of_row[r] for r in rows}),
                "optimizer": type(out[1]).__name__}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("form", ["bookkeeping", "per_example", "two_pass"])
def test_ddp_user_level_equals_brute_force_over_all_users(form):
    ranks = spawn(worker, WORLD, form, None)
    assert ranks[0]["optimizer"].startswith("Distributed")
    assert set(ranks[0]["users"]).isdisjoint(ranks[1]["users"])  # each user on one rank
    data, owners = user_data()
    assert sorted(ranks[0]["users"] + ranks[1]["users"]) == sorted(set(owners))  # q_u = 1: every user
    torch.manual_seed(0)
    reference = SequenceClassifier()
    x, y, _ = data.tensors
    want = per_user_clipped_mean(reference, _ce, x, y, owners, C, NORMALISER)
    for name, p in reference.named_parameters():
        for r in range(WORLD):
            torch.testing.assert_close(p.detach() - ranks[r]["params"][name], want[name], atol=1e-6, rtol=0)


def test_ddp_removing_one_user_moves_the_update_by_at_most_C():
    full = spawn(worker, WORLD, "per_example", None)[0]["params"]
    without = spawn(worker, WORLD, "per_example", 3)[0]["params"]
    moved = torch.cat([(full[n] - without[n]).flatten() for n in full]).norm()
    assert 0 < moved <= C / NORMALISER * (1 + 1e-5)


def shard_worker(rank, init_file, sharded, out_dir):
    """Each rank passes its own shard (rows rank, rank + 2, ...: every user has rows in both,
    user u owning row r when r % 7 == u) with its own ids, or (``sharded=False``) the whole
    dataset and ids, as the plugin expects."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    data, owners = user_data()
    if sharded:
        rows = list(range(rank, len(data), WORLD))
        data = torch.utils.data.TensorDataset(*(t[rows] for t in data.tensors))
        owners = [owners[r] for r in rows]
    torch.manual_seed(0)
    model = SequenceClassifier()
    result = {"refused": None, "users": None}
    try:
        out = PrivacyEngine(accountant="rc_prv").make_private(
            module=DPDDP(model), optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=torch.utils.data.DataLoader(data, batch_size=NORMALISER), noise_multiplier=0.0,
            max_grad_norm=C, clipping="randomized", privacy_unit="user", user_ids=owners, max_examples_per_user=64,
            sample_rate=1.0, seed=2, per_example_backward=True,
        )
        owner_of_row = user_data()[1]  # by the original row index, the data's third column
        result["users"] = sorted({owner_of_row[r] for r in one_logical_step(*out)})
    except ValueError as error:
        result["refused"] = str(error)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_ddp_ranks_given_their_own_shards_of_users_are_refused():
    """Issue 46 path 3: with a shard per rank (each rank its own rows and ids), a user with
    rows in both shards was drawn and clipped on both ranks: 2.0 C for one person, silently
    (on main the run proceeded, every user on both ranks). Refused on every rank by name; the
    whole dataset and the same ids on both ranks run, each user on one rank."""
    for rank in spawn(shard_worker, WORLD, True):
        assert rank["users"] is None
        assert "the ranks were given different rows or user_ids" in rank["refused"]
        assert "every rank passes the whole dataset and the same user_ids" in rank["refused"]
    ranks = spawn(shard_worker, WORLD, False)
    assert [r["refused"] for r in ranks] == [None, None]
    assert set(ranks[0]["users"]).isdisjoint(ranks[1]["users"])
    assert sorted(ranks[0]["users"] + ranks[1]["users"]) == sorted(set(user_data()[1]))
