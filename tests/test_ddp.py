"""DDP (gloo, 2 CPU processes) through Opacus's DPDDP path with randomized clipping, in
both the two-pass (grad_sample_mode="ghost") and the book-keeping ("hooks") form.

Each rank estimates its own examples' norms with the same seeded shared sketches; with
noise 0 the update equals the single-process update on the union of the batches, and
with noise on, noise is added once (rank 0), not once per rank. Per-example sketches
differ across ranks (independent examples), shared sketches do not.
"""

import gc
import os

import pytest
import torch
import torch.distributed as dist
from opacus import PrivacyEngine
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from torch import nn

import opacus_rc  # noqa: F401  (registers the plugin: a spawned rank loads no conftest)

from .models import CheckpointedSequenceClassifier, SequenceClassifier, token_task
from .spawn import spawn as spawn_ranks

WORLD, PER_RANK, T = 2, 8, 40  # T > k = 8: linear layers are sketched
C = 0.5


MODES = {"ghost": "DistributedRandomizedClippingOptimizer",
         "hooks": "DistributedRandomizedClippingBookkeepingOptimizer"}


def private_step(model, x, y, noise, distributed, mode):
    """One step on (x, y); the loader spans the whole dataset, as Opacus expects (it
    derives the per-worker expected batch size from it: 16 / world size)."""
    engine = PrivacyEngine(accountant="rc_prv")
    full = token_task(n=WORLD * PER_RANK, t=T)
    loader = torch.utils.data.DataLoader(full, batch_size=WORLD * PER_RANK)
    out = engine.make_private(
        module=DPDDP(model) if distributed else model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        criterion=nn.CrossEntropyLoss(),
        data_loader=loader,
        noise_multiplier=noise,
        max_grad_norm=C,
        poisson_sampling=False,
        grad_sample_mode=mode,
        clipping="randomized",
        sketch_size=8,
        sketching="shared",  # one sketch for the logical batch: equal to one process
        sketch_seed=7,
        noise_generator=torch.Generator().manual_seed(11),
    )
    module, opt = out[0], out[1]
    crit = out[2] if mode == "ghost" else nn.CrossEntropyLoss()  # book-keeping: a plain loss
    crit(module(x), y).backward()
    opt.step()
    return type(opt).__name__, engine.accountant.state_dict()["history"]  # plain dicts: loads weights_only


def worker(rank, init_file, noise, mode, out_dir, model_cls=SequenceClassifier):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = model_cls()
    x, y = token_task(n=WORLD * PER_RANK, t=T).tensors
    shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    name, history = private_step(model, x[shard], y[shard], noise, distributed=True, mode=mode)
    torch.save(
        {"params": model.state_dict(), "optimizer": name, "history": history},
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    dist.destroy_process_group()


def spawn(fn, *args):
    return spawn_ranks(fn, WORLD, *args)


def run_ddp(noise, mode):
    return spawn(worker, noise, mode)


def single_process(noise, mode):
    torch.manual_seed(0)
    model = SequenceClassifier()
    x, y = token_task(n=WORLD * PER_RANK, t=T).tensors
    private_step(model, x, y, noise, distributed=False, mode=mode)
    return model.state_dict()


@pytest.fixture(scope="module")
def initial():
    torch.manual_seed(0)
    return SequenceClassifier().state_dict()


@pytest.mark.parametrize("mode", MODES)
def test_ddp_equals_single_process_on_the_union(initial, mode):
    ranks = run_ddp(noise=0.0, mode=mode)
    single = single_process(noise=0.0, mode=mode)
    assert ranks[0]["optimizer"] == MODES[mode]
    # each rank charges one step at the loader's rate, one micro-batch, its sketch
    for r in ranks:
        (sigma, q, steps, record), = r["history"]
        assert (sigma, q, steps, record["micro_batches"]) == (0.0, 1.0, 1, 1)
        assert (record["sketch_size"], record["sketching"]) == (8, "shared")
    for name in single:
        torch.testing.assert_close(ranks[0]["params"][name], ranks[1]["params"][name])
        torch.testing.assert_close(ranks[0]["params"][name], single[name], rtol=1e-4, atol=1e-6)
    assert any(not torch.equal(single[n], initial[n]) for n in single)


def checkpointed_worker(rank, init_file, mode, out_dir):
    worker(rank, init_file, 0.0, mode, out_dir, model_cls=CheckpointedSequenceClassifier)


def test_ddp_with_activation_checkpointing_equals_single_process():
    """Non-reentrant activation checkpointing around fc1 -> tanh -> LayerNorm under DPDDP,
    two-pass: the update equals one process without checkpointing (same sketches)."""
    ranks = spawn(checkpointed_worker, "ghost")
    single = single_process(noise=0.0, mode="ghost")
    for name in single:
        torch.testing.assert_close(ranks[0]["params"][name], ranks[1]["params"][name])
        torch.testing.assert_close(ranks[0]["params"][name], single[name], rtol=1e-4, atol=1e-6)


class FlaggedCheckpointedClassifier(CheckpointedSequenceClassifier):
    """Checkpointed as Hugging Face marks it (``gradient_checkpointing = True``): a
    plain-loss script ("hooks") on it runs the two passes from the model's output."""

    gradient_checkpointing = True


def output_passes_worker(rank, init_file, out_dir):
    worker(rank, init_file, 0.0, "hooks", out_dir, model_cls=FlaggedCheckpointedClassifier)


def test_ddp_output_passes_of_a_checkpointed_plain_loss_script_equal_single_process():
    """A plain-loss script on a checkpointed model under DPDDP: the two passes run from the
    output on every rank (the distributed two-pass optimizer), and the update equals one
    process on the union without checkpointing (same shared sketches, noise 0)."""
    ranks = spawn(output_passes_worker)
    single = single_process(noise=0.0, mode="ghost")
    assert ranks[0]["optimizer"] == MODES["ghost"]
    for r in ranks:
        (sigma, q, steps, record), = r["history"]
        assert (sigma, q, steps, record["micro_batches"]) == (0.0, 1.0, 1, 1)
    for name in single:
        torch.testing.assert_close(ranks[0]["params"][name], ranks[1]["params"][name])
        torch.testing.assert_close(ranks[0]["params"][name], single[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_ddp_adds_noise_once(initial, mode):
    """Noise std of the averaged update is sigma C / (total batch), as in one process;
    noise added on both ranks would make it sqrt(2) larger. The fc1 weight has
    24 x 16 = 384 entries: the sample std is within ~3.6% (1 SE) of the truth, so the
    tolerance 15% (about 4 SE) separates 1 from sqrt(2) = 1.41."""
    sigma = 50.0  # noise dominates the clipped signal (|signal| <= C / 16 per entry)
    noisy = run_ddp(noise=sigma, mode=mode)
    clean = single_process(noise=0.0, mode=mode)
    name = "fc1.weight"
    diff = noisy[0]["params"][name] - clean[name]
    expected = sigma * C / (WORLD * PER_RANK)
    assert diff.std().item() == pytest.approx(expected, rel=0.15)
    torch.testing.assert_close(noisy[0]["params"][name], noisy[1]["params"][name])


def sketch_worker(rank, init_file, sketching, out_dir):
    from opacus_rc.config import SketchConfig
    from opacus_rc.sketch import Sketcher

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    sketcher = Sketcher(SketchConfig(sketching=sketching), seed=3)
    torch.save(sketcher.gaussian(2, 16, 8, torch.device("cpu")), os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_ddp_per_example_sketches_are_independent_across_ranks():
    """Same sketch_seed on every rank: shared sketches agree (one sketch per logical
    batch), per-example sketches differ (each rank's examples get their own draws: the
    hidden-sketch analysis assumes independent per-example sketches)."""
    shared = spawn(sketch_worker, "shared")
    per_example = spawn(sketch_worker, "per_example")
    torch.testing.assert_close(shared[0], shared[1])
    assert per_example[0].shape == (2, 16, 8)
    assert not torch.isclose(per_example[0], per_example[1]).any()


class Poisonable(nn.Module):
    """Scales the output of examples whose first token is 0 by inf (non-finite loss
    and gradients for them only)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * torch.where(x[:, 0] == 0, float("inf"), 1.0)[:, None]


def refusal_worker(rank, init_file, mode, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = Poisonable(SequenceClassifier())
    x, y = token_task(n=WORLD * PER_RANK, t=T).tensors
    x = x[rank * PER_RANK:(rank + 1) * PER_RANK].clone()
    x[:, 0] = torch.where(x[:, 0] == 0, 1, x[:, 0])
    if rank == 1:
        x[2, 0] = 0  # one poisoned example, on rank 1 only
    error = None
    try:
        private_step(model, x, y[rank * PER_RANK:(rank + 1) * PER_RANK], 1.0, distributed=True, mode=mode)
    except FloatingPointError as e:
        error = str(e)
    torch.save({"error": error, "params": model.state_dict()}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("mode", MODES)
def test_ddp_refusal_is_agreed_by_every_rank(mode):
    """A non-finite example on rank 1 only: both ranks refuse the same step (no rank
    waits forever in the gradient all-reduce); parameters stay as they were."""
    ranks = spawn(refusal_worker, mode)
    assert "non-finite per-sample" in ranks[1]["error"]
    assert "non-finite value on another rank" in ranks[0]["error"]
    torch.manual_seed(0)
    initial = Poisonable(SequenceClassifier()).state_dict()
    for r in ranks:
        for name, value in initial.items():
            torch.testing.assert_close(r["params"][name], value)


def poisson_worker(rank, init_file, seeding, out_dir):
    """make_private with Poisson sampling after torch.manual_seed(0) on every rank; saves
    the local positions (in this rank's share) of the first three batches' examples."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = SequenceClassifier()
    options = {"seed": 3} if seeding == "seed" else {}
    loader_options = {"generator": torch.Generator().manual_seed(3)} if seeding == "loader" else {}
    out = PrivacyEngine(accountant="rc_prv").make_private(
        module=DPDDP(model), optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        criterion=nn.CrossEntropyLoss(),
        data_loader=torch.utils.data.DataLoader(token_task(n=64, t=T), batch_size=8, **loader_options),
        noise_multiplier=1.0, max_grad_norm=C, grad_sample_mode="ghost", clipping="randomized",
        sketch_size=8, **options,
    )
    sampler = out[-1].batch_sampler
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(sampler.shuffle_seed))
    local = {int(i): pos for pos, i in enumerate(perm[rank::WORLD])}
    batches = [sorted(local[int(i)] for i in b) for b, _ in zip(sampler, range(3))]
    torch.save(batches, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("seeding", ["entropy", "seed", "loader"])
def test_ddp_ranks_draw_independent_poisson_masks(seeding):
    """Every rank seeds torch alike (and, for "seed" / "loader", passes the same seed):
    the Poisson masks over the ranks' shares still differ (issue 21: they used to come
    from the global generator, identical on every rank). 32 local examples at q = 1/8:
    three equal masks have probability (q^2 + (1-q)^2)^96 < 1e-10."""
    ranks = spawn(poisson_worker, seeding)
    assert ranks[0] != ranks[1]


def torch_ddp_after_worker(rank, init_file, batch_size, mode, out_dir):
    """make_private on a plain model, then torch's DDP around what it returned: one step;
    saves the refusal's message."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = SequenceClassifier()
    out = PrivacyEngine(accountant="rc_prv").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), criterion=nn.CrossEntropyLoss(),
        data_loader=torch.utils.data.DataLoader(token_task(n=16, t=T), batch_size=batch_size),
        noise_multiplier=1.0, max_grad_norm=C, grad_sample_mode=mode, clipping="randomized", seed=3,
    )
    net, optimizer, loader = DDP(out[0]), out[1], out[-1]
    crit = out[2] if mode == "ghost" else nn.CrossEntropyLoss()
    error = None
    try:
        for x, y in loader:
            if len(x):
                crit(net(x), y).backward()
                optimizer.step()
                break
    except ValueError as e:
        error = str(e)
    torch.save(error, os.path.join(out_dir, f"rank{rank}.pt"))
    # DDP's reducer freed after its process group can deadlock in gloo's teardown (its worker
    # thread waits for the GIL the freeing thread holds): wait for the ranks, free it first
    dist.barrier()
    del net, out
    gc.collect()
    dist.destroy_process_group()


@pytest.mark.parametrize("batch_size, mode", [(1, "hooks"), (4, "ghost")])
def test_torch_ddp_after_make_private_is_refused_naming_ddp(batch_size, mode):
    """torch's DDP applied to make_private's module (the per-example form at batch size 1,
    two passes with the ghost criterion): the refusal names DistributedDataParallel and
    says to wrap the model in Opacus's DPDDP before make_private."""
    for error in spawn(torch_ddp_after_worker, batch_size, mode):
        assert error is not None and "refused" in error
        assert "torch's DistributedDataParallel" in error and "DPDDP before make_private" in error
