"""DDP (gloo, 2 CPU processes) through Opacus's DPDDP path with randomized clipping.

Each rank estimates its own examples' norms with the same seeded shared sketches; with
noise 0 the update equals the single-process update on the union of the batches, and
with noise on, noise is added once (rank 0), not once per rank.
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from opacus import PrivacyEngine
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from torch import nn

from .conftest import SequenceClassifier, token_task

WORLD, PER_RANK, T = 2, 8, 40  # T > k = 8: linear layers are sketched
C = 0.5


def private_step(model, x, y, noise, distributed):
    """One step on (x, y); the loader spans the whole dataset, as Opacus expects (it
    derives the per-worker expected batch size from it: 16 / world size)."""
    engine = PrivacyEngine(accountant="rc_prv")
    full = token_task(n=WORLD * PER_RANK, t=T)
    loader = torch.utils.data.DataLoader(full, batch_size=WORLD * PER_RANK)
    module, opt, crit, _ = engine.make_private(
        module=DPDDP(model) if distributed else model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        criterion=nn.CrossEntropyLoss(),
        data_loader=loader,
        noise_multiplier=noise,
        max_grad_norm=C,
        poisson_sampling=False,
        grad_sample_mode="ghost",
        clipping="randomized",
        sketch_size=8,
        sketch_seed=7,
        noise_generator=torch.Generator().manual_seed(11),
    )
    crit(module(x), y).backward()
    opt.step()
    return type(opt).__name__


def worker(rank, init_file, noise, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = SequenceClassifier()
    x, y = token_task(n=WORLD * PER_RANK, t=T).tensors
    shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    name = private_step(model, x[shard], y[shard], noise, distributed=True)
    torch.save({"params": model.state_dict(), "optimizer": name}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def run_ddp(noise):
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(worker, args=(init_file, noise, tmp), nprocs=WORLD, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)]


def single_process(noise):
    torch.manual_seed(0)
    model = SequenceClassifier()
    x, y = token_task(n=WORLD * PER_RANK, t=T).tensors
    private_step(model, x, y, noise, distributed=False)
    return model.state_dict()


@pytest.fixture(scope="module")
def initial():
    torch.manual_seed(0)
    return SequenceClassifier().state_dict()


def test_ddp_equals_single_process_on_the_union(initial):
    ranks = run_ddp(noise=0.0)
    single = single_process(noise=0.0)
    assert ranks[0]["optimizer"] == "DistributedRandomizedClippingOptimizer"
    for name in single:
        torch.testing.assert_close(ranks[0]["params"][name], ranks[1]["params"][name])
        torch.testing.assert_close(ranks[0]["params"][name], single[name], rtol=1e-4, atol=1e-6)
    assert any(not torch.equal(single[n], initial[n]) for n in single)


def test_ddp_adds_noise_once(initial):
    """Noise std of the averaged update is sigma C / (total batch), as in one process;
    noise added on both ranks would make it sqrt(2) larger. The fc1 weight has
    24 x 16 = 384 entries: the sample std is within ~3.6% (1 SE) of the truth, so the
    tolerance 15% (about 4 SE) separates 1 from sqrt(2) = 1.41."""
    sigma = 50.0  # noise dominates the clipped signal (|signal| <= C / 16 per entry)
    noisy = run_ddp(noise=sigma)
    clean = single_process(noise=0.0)
    name = "fc1.weight"
    diff = noisy[0]["params"][name] - clean[name]
    expected = sigma * C / (WORLD * PER_RANK)
    assert diff.std().item() == pytest.approx(expected, rel=0.15)
    torch.testing.assert_close(noisy[0]["params"][name], noisy[1]["params"][name])
