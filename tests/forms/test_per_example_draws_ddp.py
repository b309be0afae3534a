"""A step is one Poisson draw under DDP (issue 38, item 1; Opacus's DPDDP, 2 gloo processes,
the per-example form): over the loader ``make_private`` returned (one example per physical
batch), an accumulation loop (``step()`` every 2 physical batches) is refused on both ranks
at the same ``step()`` with the draw-boundary message, nothing released or charged; a loop
that steps after every physical batch releases, at noise 0, exactly the clipped sum of one
draw across both ranks (brute-force per-example clipping of the union of the ranks' draws)."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
from opacus import PrivacyEngine
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import opacus_rc  # noqa: F401

from tests.models import SequenceClassifier, token_task
from tests.oracles import per_example_clipped_mean
from tests.spawn import spawn

WORLD, PER_RANK, C = 2, 4, 0.05
B = WORLD * PER_RANK


def _ce(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def _private(model, rank):
    """``make_private`` of DPDDP(model) over a loader of the B examples through a
    ``DistributedSampler`` (no shuffle), one batch of B / 2 per rank and epoch: each epoch
    is one draw of all B examples (q = 1, public B)."""
    data = token_task(n=B)
    engine = PrivacyEngine(accountant="rc_prv")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module, optimizer, loader = engine.make_private(
            module=DPDDP(model), optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DataLoader(
                data, batch_size=PER_RANK, sampler=DistributedSampler(data, WORLD, rank, shuffle=False)
            ),
            noise_multiplier=0.0,
            max_grad_norm=C, clipping="randomized", per_example_backward=True, poisson_sampling=False, seed=3,
        )
    return engine, module, optimizer, loader


def _loop(module, optimizer, loader, every):
    """``step()`` and ``zero_grad()`` every ``every`` physical batches, over one epoch: the
    physical batches delivered before a refusal (None: no refusal) and its message."""
    for i, (x, y) in enumerate(loader):
        try:  # refused at the forward of a second physical batch before a step, or at the step
            _ce(module, x, y).backward()
            if (i + 1) % every == 0:
                optimizer.step()
        except ValueError as error:
            return i + 1, str(error)
        if (i + 1) % every == 0:
            optimizer.zero_grad()
    return None, ""


def worker(rank, init_file, every, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = SequenceClassifier()
    engine, module, optimizer, loader = _private(model, rank)
    refused_after, message = _loop(module, optimizer, loader, every)
    history = [(h[0], h[1], h[2], h[3].micro_batches) for h in engine.accountant.history]
    torch.save(
        {"params": model.state_dict(), "refused_after": refused_after, "message": message, "history": history,
         "optimizer": type(optimizer).__name__},
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    dist.destroy_process_group()


def _initial():
    torch.manual_seed(0)
    return SequenceClassifier()


def test_ddp_accumulation_loop_is_refused_on_both_ranks_at_the_same_step():
    ranks = spawn(worker, WORLD, 2)
    initial = _initial().state_dict()
    for r in ranks:
        assert r["optimizer"] == "DistributedPerExampleOptimizer"
        assert r["refused_after"] == 2  # the first step(), after 2 physical batches, on both ranks
        assert "optimizer.step() refused: it followed 2 physical batches" in r["message"]
        assert "never call step() every k batches" in r["message"]
        assert r["history"] == []  # nothing charged...
        for name, value in initial.items():  # ...nor released
            torch.testing.assert_close(r["params"][name], value, rtol=0, atol=0)


def test_ddp_step_per_physical_batch_releases_one_draw_across_both_ranks():
    """Noise 0: the update is brute-force clipping of the union of the two ranks' draws (each
    example alone, over B), charged as one draw (one step, ``micro_batches = 1``)."""
    ranks = spawn(worker, WORLD, 1)
    reference = _initial()
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    x, y = token_task(n=B).tensors
    want = per_example_clipped_mean(reference, _ce, list(x), list(y), C, B)
    for r in ranks:
        assert r["refused_after"] is None and r["history"] == [(0.0, 1.0, 1, 1)]
        for name in before:
            torch.testing.assert_close(before[name] - r["params"][name], want[name], rtol=1e-5, atol=1e-6)
