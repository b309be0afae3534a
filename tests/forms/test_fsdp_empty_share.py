"""An empty Poisson share on one FSDP2 rank (``grad_sample_mode="ghost_fsdp"``, 2 gloo processes).

With Poisson sampling each rank draws its own share of the step's rows; at a small rate a share is
often empty on one rank while the other rank has rows (with ``noise="banded"``, cyclic Poisson,
more often still). The rank without rows must contribute a zero clipped sum and still run every
collective of FSDP2's two backward passes (its all-gathers and reduce-scatters) in the same order
as the other rank; before the fix it failed in Opacus's ghost_fsdp hook (``cannot reshape tensor
of 0 elements``) and the other rank died on the gloo connection.

The check: with the learning rate 0 and ``noise_multiplier=0`` each rank's release (``p.grad``
when the wrapped optimizer steps, its dim-0 shard) equals its shard of brute-force per-example
clipping (:func:`tests.oracles.per_example_clipped_mean`) of the union of both ranks' rows over
the public normaliser B, for every step: both shares non-empty, one empty (on either rank), both
empty (a release of zeros). Independent noise (the wrapping and the hooks form) and
``noise="banded", bands=2``; the loader seeds are chosen so that the draws hold each case, which
the test asserts. The mean loss a rank reports for its empty share is 0 (it was 0 / 0 = NaN).
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

from tests.forms.test_user_level import user_data
from tests.models import SequenceClassifier
from tests.oracles import per_example_clipped_mean
from tests.spawn import spawn

WORLD, STEPS = 2, 6
#: 24 rows of 6 tokens; q = B / 24: about one row per rank and step, so shares are often empty
ROWS, BATCH, C, K = 24, 2, 0.05, 8  # K >= T: exact norms (the brute force's)
ATOL = 1e-6
#: name: (make_private options, loader seed); each seed's first STEPS draws hold a step with both
#: shares non-empty, one with one share empty and one with both empty (asserted)
RUNS = {
    "independent": ({}, 1),
    "independent_hooks_form": ({"wrap_model": False}, 1),
    "banded": ({"noise": "banded", "bands": 2}, 7),
}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return SequenceClassifier()


def _ce(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def run_steps(options: dict, seed: int) -> dict:
    """STEPS Poisson draws at lr 0 and noise 0 on an FSDP2 model: each step's rows on this rank
    and its release (this rank's shards)."""
    from opacus.utils.fsdp_utils import FSDP2Wrapper

    data, _ = user_data(n=ROWS, users=8)
    model = FSDP2Wrapper(make_model())
    engine = PrivacyEngine(accountant="rc_prv")
    module, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), criterion=nn.CrossEntropyLoss(),
        data_loader=torch.utils.data.DataLoader(data, batch_size=BATCH, generator=torch.Generator().manual_seed(seed)),
        noise_multiplier=0.0, max_grad_norm=C, grad_sample_mode="ghost_fsdp", clipping="randomized",
        sketch_size=K, sketch_seed=7, noise_generator=torch.Generator().manual_seed(11), **options,
    )
    if not options.get("wrap_model", True):
        module = model  # the hooks form returns the hooks object; the model is called
    releases = []
    opt.original_optimizer.register_step_pre_hook(
        lambda *_: releases.append([local_shard(p.grad.detach()).clone() for p in opt.params])
    )
    rows, losses = [], []
    for x, y, index in loader:
        loss = crit(module(x), y)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
        rows.append(index.tolist())
        if len(rows) == STEPS:
            break
    return {
        "rows": rows, "releases": releases, "losses": losses, "normaliser": opt.expected_batch_size * WORLD,
        "history": engine.accountant.state_dict()["history"],
    }


def worker(rank, init_file, out_dir):
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    out = {name: run_steps(options, seed) for name, (options, seed) in RUNS.items()}
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_fsdp_empty_poisson_share_releases_the_other_ranks_rows_gloo():
    """Every step's release on each rank is its shard of brute-force clipping of the union of the
    ranks' rows (zeros when both shares are empty); both ranks charge the same STEPS steps."""
    spawned = spawn(worker, WORLD)
    reference = make_model()
    names = [n for n, p in reference.named_parameters() if p.requires_grad]
    data, _ = user_data(n=ROWS, users=8)
    x_all, y_all, _ = data.tensors
    for name in RUNS:
        ranks = [r[name] for r in spawned]
        assert ranks[0]["history"] == ranks[1]["history"]
        assert ranks[0]["history"][0][2] == STEPS  # (sigma, rate, steps, ...): one entry, every step charged
        shares = list(zip(*(r["rows"] for r in ranks)))
        assert len(shares) == STEPS and all(len(r["releases"]) == STEPS for r in ranks)
        kinds = {tuple(bool(s) for s in step) for step in shares}
        assert {(True, True), (False, False)} <= kinds and kinds & {(True, False), (False, True)}, \
            f"{name}: the draws miss a case ({shares}): pick another seed"
        for rank, r in enumerate(ranks):
            assert r["normaliser"] == BATCH  # the public normaliser q N, not the rows drawn
            # the mean loss over this rank's rows: 0 over none (was 0 / 0 = NaN), finite otherwise
            assert all(loss == 0.0 for share, loss in zip(r["rows"], r["losses"]) if not share), name
            assert torch.isfinite(torch.tensor(r["losses"])).all(), name
            for step, (share, release) in enumerate(zip(shares, r["releases"])):
                rows = torch.tensor(sorted(share[0] + share[1]), dtype=torch.long)
                want = per_example_clipped_mean(reference, _ce, x_all[rows], y_all[rows], C, BATCH)
                for slot, param in enumerate(names):
                    expected = torch.chunk(want[param], WORLD, dim=0)[rank]
                    torch.testing.assert_close(
                        release[slot].double(), expected.double(), atol=ATOL, rtol=0,
                        msg=lambda m: f"{name}, rank {rank}, step {step} {share}, {param}: {m}",
                    )


@pytest.mark.parametrize("mode, bookkeeping", [("ghost", None), ("ghost", True)])
def test_mean_loss_of_an_empty_draw_is_zero(mode, bookkeeping):
    """One process: the criterion of a ghost script (two passes, or book-keeping behind it) on an
    empty Poisson draw reports a mean loss of 0, not NaN, and the step releases zeros (noise 0)."""
    data, _ = user_data(n=ROWS, users=8)
    torch.manual_seed(0)
    model = SequenceClassifier()
    extra = {} if bookkeeping is None else {"bookkeeping": bookkeeping}
    module, opt, crit, loader = PrivacyEngine(accountant="rc_prv").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), criterion=nn.CrossEntropyLoss(),
        data_loader=torch.utils.data.DataLoader(data, batch_size=BATCH), noise_multiplier=0.0, max_grad_norm=C,
        grad_sample_mode=mode, clipping="randomized", sample_rate=1e-9, seed=0, **extra,
    )
    before = [p.detach().clone() for p in model.parameters()]
    x, y, index = next(iter(loader))
    assert len(index) == 0
    loss = crit(module(x), y)
    assert loss.item() == 0.0
    loss.backward()
    opt.step()
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
