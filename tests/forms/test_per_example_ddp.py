"""The per-example form under DDP (Opacus's DPDDP, 2 gloo processes): each rank clips its
own examples one backward pass at a time, with no gradient all-reduce in the backward
pass, and the clipped sums are all-reduced once per logical step. At sigma = 0 the update
equals brute-force per-example clipping of the union of the ranks' examples; with noise,
rank 0 alone adds it (the update's spread is sigma C / B, not sqrt(2) times that)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from opacus import PrivacyEngine
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from torch import nn

import opacus_rc  # noqa: F401
from opacus_rc.forms.per_example import check_supported

from tests.models import SequenceClassifier, token_task
from tests.oracles import per_example_clipped_mean
from tests.spawn import spawn

WORLD, PER_RANK, C = 2, 5, 0.05
NOISE_SEED = 3
B = WORLD * PER_RANK


def _ce(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def private(model, noise, distributed):
    """``make_private`` of ``model`` in the per-example form (noise from a seeded generator)."""
    engine = PrivacyEngine(accountant="rc_prv")
    module, optimizer, _ = engine.make_private(
        module=DPDDP(model) if distributed else model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=torch.utils.data.DataLoader(token_task(n=B), batch_size=B), noise_multiplier=noise,
        max_grad_norm=C, clipping="randomized", per_example_backward=True, poisson_sampling=False,
        noise_generator=torch.Generator().manual_seed(NOISE_SEED),
    )
    return module, optimizer


def one_draw(module, optimizer, x, y):
    """One logical step over (x, y), one example per backward pass."""
    for i in range(len(x)):
        _ce(module, x[i:i + 1], y[i:i + 1]).backward()
        optimizer.signal_skip_step(do_skip=i < len(x) - 1, same_draw=True)
        optimizer.step()
        optimizer.zero_grad()


def step_on(model, x, y, noise, distributed):
    """One logical step over (x, y) on a model made private for it."""
    module, optimizer = private(model, noise, distributed)
    one_draw(module, optimizer, x, y)
    return type(optimizer).__name__


def worker(rank, init_file, noise, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = SequenceClassifier()
    x, y = token_task(n=B).tensors
    shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    name = step_on(model, x[shard], y[shard], noise, distributed=True)
    torch.save({"params": model.state_dict(), "optimizer": name}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_ddp_per_example_equals_brute_force_on_the_union():
    ranks = spawn(worker, WORLD, 0.0)
    assert ranks[0]["optimizer"] == "DistributedPerExampleOptimizer"
    torch.manual_seed(0)
    reference = SequenceClassifier()
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    x, y = token_task(n=B).tensors
    want = per_example_clipped_mean(reference, _ce, list(x), list(y), C, B)
    for name in before:
        torch.testing.assert_close(ranks[0]["params"][name], ranks[1]["params"][name])
        torch.testing.assert_close(before[name] - ranks[0]["params"][name], want[name], rtol=1e-5, atol=1e-6)


def test_ddp_per_example_adds_the_noise_once():
    """sigma = 20 dwarfs the clipped sum (<= C per example): the update's std over the
    1,000-odd entries is sigma C / B within 5 / sqrt(2n) = 11%; noise from both ranks would
    be sqrt(2) = 1.41x."""
    ranks = spawn(worker, WORLD, 20.0)
    torch.manual_seed(0)
    initial = SequenceClassifier().state_dict()
    delta = torch.cat([(initial[n] - ranks[0]["params"][n]).reshape(-1) for n in initial])
    assert float(delta.std()) == pytest.approx(20.0 * C / B, rel=5 / (2 * delta.numel()) ** 0.5)


def test_torch_ddp_is_refused_with_the_alternative():
    class FakeDDP(nn.parallel.DistributedDataParallel):
        def __init__(self):  # no process group needed for the type check
            nn.Module.__init__(self)

    with pytest.raises(ValueError, match="DifferentiallyPrivateDistributedDataParallel"):
        check_supported(FakeDDP())


def fsdp_worker(rank, init_file, out_dir):
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=1)
    torch.manual_seed(0)
    model = SequenceClassifier()
    fully_shard(model)
    try:
        step_on(model, *token_task(n=2).tensors, 0.0, distributed=False)  # the FSDP2 module itself
        error = ""
    except ValueError as e:
        error = str(e)
    torch.save({"error": error}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_fsdp2_is_refused_with_the_alternative_gloo():
    (result,) = spawn(fsdp_worker, 1)
    assert "does not support FSDP2" in result["error"] and "ghost_fsdp" in result["error"]


class _CountsOnRankZero(SequenceClassifier):
    """Counts its forward passes in a buffer, in place, on rank 0 only."""

    def __init__(self, rank):
        super().__init__()
        self.rank = rank
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        if self.rank == 0:
            self.calls.add_(1)
        return super().forward(x)


def forward_change_worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = _CountsOnRankZero(rank)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = token_task(n=B).tensors
    shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    try:
        step_on(model, x[shard], y[shard], 0.0, distributed=True)
        error = ""
    except (ValueError, FloatingPointError) as e:
        error = str(e)
    unchanged = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    torch.save({"error": error, "unchanged": unchanged}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_ddp_a_buffer_changed_on_one_rank_refuses_the_step_on_both():
    """Issue 38, item 4 under DPDDP: the forward pass of rank 0 changes a buffer; both ranks
    refuse the step together (no hang in the gradient all-reduce), nothing released."""
    ranks = spawn(forward_change_worker, WORLD)
    assert "buffer 'calls' was changed in place during the forward pass" in ranks[0]["error"]
    assert "another rank" in ranks[1]["error"]
    assert all(r["unchanged"] for r in ranks)

POISSON_N, POISSON_BATCH, EPOCHS = 8, 2, 2  # q = 1/4 of a 4-example share per rank: empty draws are common


def poisson_worker(rank, init_file, noise, out_dir):
    """``EPOCHS`` epochs of the loader ``make_private`` returned (Poisson, one example per
    physical batch; some local draws empty); per logical step, this rank's examples and the
    parameters after it."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = SequenceClassifier()
    module, optimizer, loader = PrivacyEngine(accountant="rc_prv").make_private(
        module=DPDDP(model), optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=torch.utils.data.DataLoader(
            token_task(n=POISSON_N), batch_size=POISSON_BATCH, generator=torch.Generator().manual_seed(5)),
        noise_multiplier=noise, max_grad_norm=C, clipping="randomized", per_example_backward=True,
        noise_generator=torch.Generator().manual_seed(NOISE_SEED),
    )
    steps, draw = [], ([], [])
    for _ in range(EPOCHS):
        for x, y in loader:
            draw[0].append(x)
            draw[1].append(y)
            _ce(module, x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
            if not optimizer._is_last_step_skipped:  # the end of a Poisson draw
                params = {n: p.detach().clone() for n, p in model.named_parameters()}
                steps.append({"x": torch.cat(draw[0]), "y": torch.cat(draw[1]), "params": params})
                draw = ([], [])
    torch.save({"steps": steps}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_ddp_per_example_poisson_steps_with_noise_release_the_clipped_sum_plus_one_noise():
    """sigma = 1, Poisson draws of about one example per rank (a rank's draw is often empty
    while the other's is not: Opacus's distributed sampler skipped those, the ranks' steps
    fell out of step and a rank crashed in a collective), 2 epochs: every rank takes every
    draw's step; both ranks end every step with the same parameters; each update minus the
    noise of the seeded generator (drawn once per step, by rank 0, parameter by parameter)
    is brute-force clipping of the union of the ranks' draws, over the public batch size."""
    sigma = 1.0
    ranks = spawn(poisson_worker, WORLD, sigma)
    assert len(ranks[0]["steps"]) == len(ranks[1]["steps"]) == EPOCHS * POISSON_N // POISSON_BATCH
    sizes = [[len(s["x"]) for s in r["steps"]] for r in ranks]
    assert any((a == 0) != (b == 0) for a, b in zip(*sizes)), sizes  # the path: one rank's draw empty
    torch.manual_seed(0)
    reference = SequenceClassifier()
    noise = torch.Generator().manual_seed(NOISE_SEED)
    for mine, theirs in zip(*(r["steps"] for r in ranks)):
        for name, value in mine["params"].items():
            assert torch.equal(value, theirs["params"][name]), name
        x, y = torch.cat([mine["x"], theirs["x"]]), torch.cat([mine["y"], theirs["y"]])
        want = per_example_clipped_mean(reference, _ce, list(x), list(y), C, POISSON_BATCH)
        with torch.no_grad():
            for name, p in reference.named_parameters():
                drawn = torch.normal(0.0, sigma * C, size=p.shape, generator=noise)
                update = p - mine["params"][name]
                torch.testing.assert_close(update - drawn / POISSON_BATCH, want[name], rtol=1e-5, atol=1e-6)
                p.copy_(mine["params"][name])
