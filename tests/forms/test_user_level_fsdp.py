"""User-level privacy under FSDP2 (``privacy_unit="user"`` with ``grad_sample_mode="ghost_fsdp"``,
2 gloo processes).

The design: the user-level loader shards *users*, not rows: rank r draws users r, r + 2, ... at
``q_u`` with its own generator, and a drawn user brings all of its ``m_u`` rows to that rank. So
the rows of one user in a draw are on one rank, whatever their positions in the dataset, and each
rank forms its users' sums (the two-pass form's regrouped sequences) and clip factors ``c_u / m_u``
locally; FSDP2 reduce-scatters the clipped pass's sums as at example level. The data here is the
case a row-wise shard would split: user ``r % 7`` owns row ``r``, so every user has even and odd
rows (a ``DistributedSampler`` would put each user on both ranks, and clip it twice).

At sigma = 0 and lr = 0 each rank's release (``p.grad`` when the wrapped optimizer steps, its
dim-0 shard) equals its shard of brute-force per-user clipping
(:func:`tests.oracles.per_user_clipped_mean`) of the union of both ranks' rows over the public
normaliser (expected users per step), at every step: both shares non-empty, one empty (either
rank), both empty. The runs: the wrapping form, the hooks form (``wrap_model=False``), activation
checkpointing, banded noise (cyclic Poisson over users), and a run saved after 2 steps
(``include_rng_state=True``, one file per rank) and resumed in a new engine, model and loader:
its 4 steps equal the uninterrupted run's. With sketched norms (shared sketches of one seed) the
release equals the one-process two-pass form's at user level. The accountant charges ``q_u`` (the
same history on both ranks); the mean loss of an empty share is 0 (finite). Ranks given their own
shard of the rows and ids are refused on both; and a refused checkpoint load (a banded run's state
into an independent run) leaves each rank's shards and optimizer as they were.

Tied parameters and the chunked LM head at user level (before: refused under FSDP2, "not
verified"): an embedding tied to a Linear head (grouped by hand in one unit), the chunked head
(untied, and tied to the embedding), in the wrapping and hooks forms, over the same draws: each
release equals brute-force per-user clipping as above (a tied use's rows regrouped into the
rank's users before its projection onto the row sketch, the uses' projections summed per user
before the norm; the head's block sums reduced to users; exact norms: every regrouped sequence
and the tied weight's 32 rows within the sketch size).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from opacus import PrivacyEngine
from torch import nn

import opacus_rc  # noqa: F401  (registers the plugin: a spawned rank loads no conftest)
from opacus_rc.finite import local_shard
from opacus_rc.lm_head import ChunkedLMHeadLoss

from tests.forms.test_cells import head_ce
from tests.forms.test_fsdp import make_tied
from tests.forms.test_user_level import _ce, user_data
from tests.models import CheckpointedSequenceClassifier, SequenceClassifier, TinyLM
from tests.oracles import per_user_clipped_mean
from tests.spawn import spawn
from tests.test_lm_head_fsdp import shard as shard_lm

WORLD, STEPS, USERS = 2, 6, 7
#: the LMs' vocabulary (user_data's token ids); its 32 rows of the tied weight are no more than the
#: sketch size (64): the tied row sketch is the identity, every norm exact
VOCAB = 32
#: expected users per step (q_u = 2 / 7), clip bound, rows per user and draw (users have 5 or 6)
BATCH, C, K = 2, 0.05, 4
ATOL = 1e-6
#: name: (make_private options, model class, seed); each run's STEPS draws hold a step with both
#: shares non-empty, one with one share empty and one with both empty (asserted)
RUNS = {
    "wrapping": ({}, SequenceClassifier, 16),
    "hooks_form": ({"wrap_model": False}, SequenceClassifier, 16),
    "checkpointed": ({}, CheckpointedSequenceClassifier, 16),
    "banded": ({"noise": "banded", "bands": 2}, SequenceClassifier, 4),
}


def make_model(cls=SequenceClassifier) -> nn.Module:
    torch.manual_seed(0)
    return cls()


def private(options: dict, cls, seed: int, data=None, owners=None, model=None, criterion=None):
    """An FSDP2 model (``model``, else ``cls`` wrapped by FSDP2Wrapper) made private at user level
    (lr 0, noise 0, exact norms: sketch_size above every regrouped sequence; ``criterion``: the loss,
    cross-entropy by default); returns (engine, module called, optimizer, criterion, loader)."""
    from opacus.utils.fsdp_utils import FSDP2Wrapper

    if data is None:
        data, owners = user_data(users=USERS)
    if model is None:
        model = FSDP2Wrapper(make_model(cls))
    engine = PrivacyEngine(accountant="rc_prv")
    module, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        criterion=nn.CrossEntropyLoss() if criterion is None else criterion,
        data_loader=torch.utils.data.DataLoader(data, batch_size=BATCH), noise_multiplier=0.0, max_grad_norm=C,
        grad_sample_mode="ghost_fsdp", clipping="randomized", sketch_size=64, privacy_unit="user", user_ids=owners,
        max_examples_per_user=K, seed=seed, **options,
    )
    return engine, (model if options.get("wrap_model", True) is False else module), opt, crit, loader


def train(run, steps: int, record: dict) -> dict:
    """``steps`` draws (as many epochs as needed): each step's rows on this rank, its release
    (this rank's shards) and the mean loss the criterion reports."""
    engine, module, opt, crit, loader = run
    releases = record.setdefault("releases", [])
    hook = opt.original_optimizer.register_step_pre_hook(
        lambda *_: releases.append([local_shard(p.grad.detach()).clone() for p in opt.params])
    )
    rows, losses = record.setdefault("rows", []), record.setdefault("losses", [])
    done = 0
    while done < steps:
        for x, y, index in loader:
            loss = crit(module(x), y)
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
            rows.append(index.tolist())
            done += 1
            if done == steps:
                break
    hook.remove()
    record["history"] = engine.accountant.state_dict()["history"]
    return record


def resumed(rank: int, out_dir: str) -> dict:
    """2 steps, a checkpoint of this rank (its generators' states too), then a new engine, model
    and loader that load it and take 2 more steps."""
    path = os.path.join(out_dir, f"checkpoint{rank}.pt")
    first = private({}, SequenceClassifier, 16)
    record = train(first, 2, {})
    first[0].save_checkpoint(path=path, module=first[1], optimizer=first[2], include_rng_state=True)
    second = private({}, SequenceClassifier, 16)
    second[0].load_checkpoint(path=path, module=second[1], optimizer=second[2])
    return train(second, 2, record)


#: sketched norms (sketch_size 4 below every regrouped sequence of 30 to 36 tokens), shared sketches
#: of one seed; every user drawn with all its rows (q_u = 1, k above every user's count)
SKETCHED = dict(sketch_size=4, sketching="shared", sketch_seed=7, estimator="hutchinson", max_examples_per_user=64,
                sample_rate=1.0)


def sketched_release(wrap=None) -> list:
    """One step at user level with sketched norms (:data:`SKETCHED`), lr 0, noise 0: the release
    (this rank's shards under FSDP2: ``wrap``; else two passes in one process)."""
    data, owners = user_data(users=USERS)
    model = make_model() if wrap is None else wrap(make_model())
    module, opt, crit, loader = PrivacyEngine(accountant="rc_prv").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), criterion=nn.CrossEntropyLoss(),
        data_loader=torch.utils.data.DataLoader(data, batch_size=BATCH), noise_multiplier=0.0, max_grad_norm=C,
        grad_sample_mode="ghost" if wrap is None else "ghost_fsdp", clipping="randomized", privacy_unit="user",
        user_ids=owners, **SKETCHED,
    )
    released = []
    opt.original_optimizer.register_step_pre_hook(
        lambda *_: released.append([local_shard(p.grad.detach()).clone() for p in opt.params])
    )
    x, y, _ = next(iter(loader))
    crit(module(x), y).backward()
    opt.step()
    return released[0]


def refused_load(rank: int, out_dir: str) -> dict:
    """A banded run's checkpoint (its parameters moved by hand after its step, so that a load would
    show) loaded into an independent run: refused on each rank, and the loading run's parameter
    shards, optimizer state and accountant are untouched."""
    path = os.path.join(out_dir, f"banded{rank}.pt")
    saved = private({"noise": "banded", "bands": 2}, SequenceClassifier, 4)
    train(saved, 1, {})
    with torch.no_grad():
        for p in saved[2].params:
            local_shard(p).add_(1.0)
    saved[0].save_checkpoint(path=path, module=saved[1], optimizer=saved[2])
    loading = private({}, SequenceClassifier, 16)
    train(loading, 1, {})

    def state():
        return ([local_shard(p.detach()).clone() for p in loading[2].params], repr(loading[2].state_dict()),
                repr(loading[0].accountant.history))

    before = state()
    try:
        loading[0].load_checkpoint(path=path, module=loading[1], optimizer=loading[2])
        refused = None
    except ValueError as error:
        refused = str(error)
    after = state()
    untouched = all(torch.equal(a, b) for a, b in zip(before[0], after[0])) and before[1:] == after[1:]
    return {"refused": refused, "untouched": untouched}


def tied_model() -> nn.Module:
    """tests/forms/test_fsdp.py's classifier whose head (a Linear) is tied to its embedding: the
    two grouped by hand in one FSDP2 unit (FSDP2 wants a shared parameter in one group), the other
    layers sharded one by one."""
    from torch.distributed.fsdp import fully_shard

    model = make_tied()
    for layer in (model.fc1, model.norm, model.fc2):
        fully_shard(layer)
    fully_shard([model.emb, model.head])
    return fully_shard(model)


def lm(tied: bool = False) -> nn.Module:
    """The LM whose head the chunked loss computes (a tied embedding / head: one unit)."""
    return TinyLM(vocab=VOCAB, tied=tied)


#: the models of the combinations: name -> (the FSDP2 model, its unsharded reference, the loss of
#: one row for brute force, whether its loss is the chunked head's: labels are the inputs)
MODELS = {
    "tied": (tied_model, make_tied, _ce, False),
    "head": (lambda: shard_lm(lm(), False), lm, head_ce, True),
    "tied_head": (lambda: shard_lm(lm(tied=True), True), lambda: lm(tied=True), head_ce, True),
}
#: tied parameters and the chunked LM head at user level: name -> (make_private options, model);
#: the draws of :data:`RUNS`'s seed 16 (the same loader: empty shares included)
COMBINATIONS = {
    "tied": ({}, "tied"),
    "tied_hooks_form": ({"wrap_model": False}, "tied"),
    "head": ({}, "head"),
    "head_hooks_form": ({"wrap_model": False}, "head"),
    "tied_head": ({}, "tied_head"),
}


def model_data(kind: str):
    """The rows (x, labels, row index) and owners of ``kind``'s model: the chunked head's labels
    are the inputs (next-token loss), the classifier's its classes."""
    data, owners = user_data(users=USERS)
    if MODELS[kind][3]:
        x, _, index = data.tensors
        data = torch.utils.data.TensorDataset(x, x, index)
    return data, owners


def combination(options: dict, kind: str):
    """``kind``'s FSDP2 model made private at user level (:func:`private`): the chunked head its
    criterion where ``kind`` has one."""
    model = MODELS[kind][0]()
    data, owners = model_data(kind)
    criterion = ChunkedLMHeadLoss(model.head, block_size=4, shift_labels=True) if MODELS[kind][3] else None
    return private(options, None, 16, data, owners, model=model, criterion=criterion)


def own_shard(rank: int) -> dict:
    """Each rank given its own rows (rank, rank + 2, ...) and their ids: every user has rows in
    both shards; refused on both ranks, by name."""
    data, owners = user_data(users=USERS)
    rows = list(range(rank, len(data), WORLD))
    shard = torch.utils.data.TensorDataset(*(t[rows] for t in data.tensors))
    try:
        private({}, SequenceClassifier, 16, shard, [owners[r] for r in rows])
    except ValueError as error:
        return {"refused": str(error)}
    return {"refused": None}


def worker(rank, init_file, out_dir):
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    out = {name: train(private(options, cls, seed), STEPS, {}) for name, (options, cls, seed) in RUNS.items()}
    from opacus.utils.fsdp_utils import FSDP2Wrapper

    out["sketched"] = sketched_release(FSDP2Wrapper)
    out["resumed"] = resumed(rank, out_dir)
    out["own_shard"] = own_shard(rank)
    out["refused_load"] = refused_load(rank, out_dir)
    for name, (options, kind) in COMBINATIONS.items():
        out[name] = train(combination(options, kind), STEPS, {})
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def check_releases(name: str, ranks: list, steps: int, kind: str = None) -> None:
    """Every step's release on each rank is its shard of brute-force per-user clipping of the
    union of the ranks' rows over the public normaliser BATCH (``kind``: a model of
    :data:`MODELS`, else :class:`SequenceClassifier`)."""
    if kind is None:
        (data, owners), reference, loss_of = user_data(users=USERS), make_model(), _ce
    else:
        (data, owners), reference, loss_of = model_data(kind), MODELS[kind][1](), MODELS[kind][2]
    x_all, y_all, _ = data.tensors
    names = [n for n, p in reference.named_parameters() if p.requires_grad]
    for rank, r in enumerate(ranks):
        assert len(r["rows"]) == len(r["releases"]) == steps, name
        for step, release in enumerate(r["releases"]):
            rows = ranks[0]["rows"][step] + ranks[1]["rows"][step]
            users = [owners[i] for i in rows]
            want = per_user_clipped_mean(reference, loss_of, x_all[rows], y_all[rows], users, C, BATCH)
            for slot, param in enumerate(names):
                torch.testing.assert_close(
                    release[slot].double(), torch.chunk(want[param], WORLD, dim=0)[rank].double(), atol=ATOL, rtol=0,
                    msg=lambda m: f"{name}, rank {rank}, step {step} {rows}, {param}: {m}",
                )


@pytest.fixture(scope="module")
def spawned():
    return spawn(worker, WORLD)


def check_draws(name: str, ranks: list, by_rank: bool) -> None:
    """The run's draws hold a step with both shares non-empty, one with one share empty and one
    with both empty; each user is drawn, with all its m_u rows, by one rank only (``by_rank``:
    rank r draws users r, r + 2, ...); the ranks charge the same history; the mean loss of an
    empty share is 0."""
    _, owners = user_data(users=USERS)
    shares = list(zip(ranks[0]["rows"], ranks[1]["rows"]))
    kinds = {(bool(a), bool(b)) for a, b in shares}
    assert {(True, True), (False, False)} <= kinds and kinds & {(True, False), (False, True)}, \
        f"{name}: the draws miss a case ({shares}): pick another seed"
    drawn = [{owners[i] for step in r["rows"] for i in step} for r in ranks]
    assert drawn[0].isdisjoint(drawn[1]), name  # each user drawn by one rank only, over the whole run
    if by_rank:
        assert all(u % WORLD == rank for rank, users in enumerate(drawn) for u in users)
    for rank, r in enumerate(ranks):
        for step in r["rows"]:
            users = [owners[i] for i in step]
            assert all(users.count(u) == min(K, owners.count(u)) for u in users)  # all m_u rows of a drawn user
        assert all(loss == 0.0 for step, loss in zip(r["rows"], r["losses"]) if not step), name
        assert all(torch.isfinite(torch.tensor(r["losses"]))), name
    assert ranks[0]["history"] == ranks[1]["history"], name


def test_fsdp_user_level_equals_brute_force_per_user_clipping_gloo(spawned):
    """Each form FSDP2 runs, at user level: every step's release is its shard of brute-force
    per-user clipping of the ranks' union (an empty share contributes nothing, both empty release
    zeros); each user is drawn, with all its m_u rows, by one rank only (rank r: users r, r + 2,
    ...), though every user has rows at even and odd positions; epsilon is charged at q_u on both ranks; the mean
    loss of an empty share is 0."""
    _, owners = user_data(users=USERS)
    assert all({r % 2 for r in range(len(owners)) if owners[r] == u} == {0, 1} for u in range(USERS))
    for name, (options, _, _) in RUNS.items():
        ranks = [r[name] for r in spawned]
        check_releases(name, ranks, STEPS)
        # rank r owns users r, r + 2, ... (banded: every 2nd user of each part)
        check_draws(name, ranks, by_rank="noise" not in options)
        if "noise" not in options:
            (sigma, rate, steps, *_), = ranks[0]["history"]
            assert (sigma, steps) == (0.0, STEPS) and abs(rate - BATCH / USERS) < 1e-12  # q_u = E[U] / users


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_fsdp_user_level_tied_weights_and_chunked_head_equal_brute_force_gloo(spawned, name):
    """Tied parameters (an embedding tied to a Linear head, and to the chunked head) and the chunked
    LM head at user level under FSDP2, in the wrapping and hooks forms: every step's release is
    each rank's shard of brute-force per-user clipping of the ranks' union (each use's rows
    regrouped into the rank's users before the tied projection; the head's block sums reduced to
    users), at steps with both shares non-empty, one empty and both empty; every user has rows at
    even and odd positions."""
    ranks = [r[name] for r in spawned]
    check_releases(name, ranks, STEPS, COMBINATIONS[name][1])
    check_draws(name, ranks, by_rank=True)
    assert any(t.abs().max() > 0 for r in ranks for release in r["releases"] for t in release), name


def test_fsdp_user_level_sketched_equals_one_process_gloo(spawned):
    """Sketched norms (shared sketches of one seed, every user drawn with all its rows): the ranks'
    shards of the release are the one-process two-pass form's at user level (each rank sketching
    its own users' regrouped sequences with the same sketch)."""
    single = sketched_release()
    for slot, want in enumerate(single):
        got = torch.cat([r["sketched"][slot] for r in spawned])
        torch.testing.assert_close(got, want, atol=ATOL * 1e-2, rtol=1e-5)
    assert any(t.abs().max() > 0 for t in single)


def test_fsdp_user_level_resume_continues_the_run_gloo(spawned):
    """Saved after 2 steps and loaded by a new engine, model and loader on each rank: the 4 steps
    are the uninterrupted run's (draws and releases) and are brute-force per-user clipping; the
    accountant holds the 4 steps at q_u."""
    ranks = [r["resumed"] for r in spawned]
    check_releases("resumed", ranks, 4)
    for rank, r in enumerate(ranks):
        whole = spawned[rank]["wrapping"]
        assert r["rows"] == whole["rows"][:4]
        for got, want in zip(r["releases"], whole["releases"][:4]):
            assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert sum(entry[2] for entry in r["history"]) == 4
        assert all(abs(entry[1] - BATCH / USERS) < 1e-12 for entry in r["history"])


def test_fsdp_user_level_ranks_given_their_own_shards_are_refused_gloo(spawned):
    """A rank-local shard of rows and ids (each user with rows in both): refused on both ranks."""
    for r in spawned:
        assert "the ranks were given different rows or user_ids" in r["own_shard"]["refused"]


def test_fsdp_refused_load_leaves_the_shards_and_optimizer_untouched_gloo(spawned):
    """A banded run's checkpoint loaded into an independent FSDP2 run: refused on both ranks
    (noise mismatch), and each rank's parameter shards, optimizer state and accountant history are
    the loading run's own (before issue 53 the module's state was loaded before the refusal)."""
    for r in spawned:
        assert "noise=banded loaded into a run with noise=independent" in r["refused_load"]["refused"]
        assert r["refused_load"]["untouched"]
