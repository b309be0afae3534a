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
B = WORLD * PER_RANK


def _ce(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def step_on(model, x, y, noise, distributed):
    """One logical step over (x, y), one example per backward pass."""
    engine = PrivacyEngine(accountant="rc_prv")
    module, optimizer, _ = engine.make_private(
        module=DPDDP(model) if distributed else model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=torch.utils.data.DataLoader(token_task(n=B), batch_size=B), noise_multiplier=noise,
        max_grad_norm=C, clipping="randomized", per_example_backward=True, poisson_sampling=False,
        noise_generator=torch.Generator().manual_seed(3),
    )
    for i in range(len(x)):
        _ce(module, x[i:i + 1], y[i:i + 1]).backward()
        optimizer.signal_skip_step(do_skip=i < len(x) - 1, same_draw=True)
        optimizer.step()
        optimizer.zero_grad()
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
