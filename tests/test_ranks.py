"""Rank checks (opacus_rc.ranks): a rank that raises before a collective that agrees on a refusal
across ranks takes part in it with a failure flag, so every other rank raises instead of waiting
for it forever (issue 53). Two gloo ranks, one spawn that must end within DEADLINE seconds; in
each case rank 1 alone raises before the check, and both ranks must raise:

* FSDP2 (``ghost_fsdp``) and DDP (DPDDP, two passes): rank 1 changes a gradient
  by hand after its backward pass, so its ``optimizer.step()`` refuses it (the clip guard) before
  the step's agreement on its refusal flags; rank 0 raises ``RefusedOnAnotherRank`` from that
  agreement (it waited there forever before);
* the same under FSDP2 with a numbered noise (``noise="banded"``), whose step has a second rank
  check after the flags' (every rank releases the same draw): rank 1 takes part in both with the
  failure flag; rank 0 raises at the flags' check (plain SGD), or, with a fused SGD whose decision
  on the flags stays on the device, at the draw's check;
* ``make_private`` on an FSDP2 model at user level: rank 1's ``max_examples_per_user=0`` is
  refused when the options are parsed; rank 0 raises ``RefusedOnAnotherRank`` from the check of
  the options and user ids (it waited in FSDP2's broadcast of the sketch seed, or in the check);
* after each case both ranks go on to the next (the collectives stay paired), and a last
  clean make_private and step run on both.

The one-process behaviour of the primitives (no process group: no collective) is tested too.
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
from opacus_rc.ranks import RefusedOnAnotherRank, agree_flag, agree_values, agreed

from tests.forms.test_user_level import user_data
from tests.models import SequenceClassifier
from tests.spawn import spawn

WORLD = 2
#: seconds both ranks get for every case (each ends in a few seconds when no rank waits forever)
DEADLINE = 120.0


def private(model, fused=None, **options):
    torch.manual_seed(0)
    data, owners = user_data()
    return PrivacyEngine(accountant="rc_prv").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, fused=fused),
        criterion=nn.CrossEntropyLoss(),
        data_loader=torch.utils.data.DataLoader(data, batch_size=4), noise_multiplier=0.0, max_grad_norm=1.0,
        clipping="randomized", sketch_size=64, **options,
    ), owners


def fsdp_model():
    from opacus.utils.fsdp_utils import FSDP2Wrapper

    torch.manual_seed(0)
    return FSDP2Wrapper(SequenceClassifier())


def ddp_model():
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

    torch.manual_seed(0)
    return DPDDP(SequenceClassifier())


def outcome(run) -> str:
    """``"ok"``, or the type and message of what ``run()`` raised."""
    try:
        run()
        return "ok"
    except Exception as error:  # noqa: BLE001 - the test compares what each rank raised
        return f"{type(error).__name__}: {error}"


def step_with_a_changed_gradient(rank: int, model, sample_rate: float = 1.0, **options) -> None:
    """One step on a share of each rank (non-empty at ``sample_rate=1``); rank 1 changes a gradient
    after its backward."""
    out, _ = private(model, seed=3, sample_rate=sample_rate, **options)
    module, opt, *criterion, loader = out
    loss_of = (lambda x, y: criterion[0](module(x), y)) if criterion else \
        (lambda x, y: nn.functional.cross_entropy(module(x), y))
    x, y, _ = next(iter(loader))
    loss_of(x, y).backward()
    if rank == 1:
        with torch.no_grad():
            local_shard(opt.params[0].grad).add_(1.0)
    opt.step()


def user_level_options(rank: int) -> None:
    """make_private at user level on an FSDP2 model (no seed: FSDP2 broadcasts a sketch seed after
    the options are parsed); rank 1's contribution bound is invalid."""
    _, owners = user_data()
    private(fsdp_model(), grad_sample_mode="ghost_fsdp", privacy_unit="user", user_ids=owners,
            max_examples_per_user=0 if rank == 1 else 4)


def clean_step(rank: int) -> None:
    """Both ranks, no error: make_private at user level and one step under FSDP2."""
    _, owners = user_data()
    (module, opt, crit, loader), _ = private(fsdp_model(), grad_sample_mode="ghost_fsdp", privacy_unit="user",
                                             user_ids=owners, max_examples_per_user=4, seed=1)
    x, y, _ = next(iter(loader))
    crit(module(x), y).backward()
    opt.step()


CASES = {
    "fsdp_step": lambda rank: step_with_a_changed_gradient(rank, fsdp_model(), grad_sample_mode="ghost_fsdp"),
    "ddp_two_pass_step": lambda rank: step_with_a_changed_gradient(rank, ddp_model(), grad_sample_mode="ghost"),
    "fsdp_make_private": user_level_options,
    # a numbered noise: the step's second rank check (the released draw), reached with the flags'
    # decision on the host (plain SGD: rank 0 raises at the flags) or on the device (fused SGD: at the draw)
    "fsdp_banded_step": lambda rank: step_with_a_changed_gradient(
        rank, fsdp_model(), 0.5, grad_sample_mode="ghost_fsdp", noise="banded", bands=2),
    "fsdp_banded_fused_step": lambda rank: step_with_a_changed_gradient(
        rank, fsdp_model(), 0.5, grad_sample_mode="ghost_fsdp", noise="banded", bands=2, fused=True),
    "clean": clean_step,
}


def worker(rank, init_file, out_dir):
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    out = {name: outcome(lambda: case(rank)) for name, case in CASES.items()}
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_a_rank_that_raises_before_a_rank_check_makes_the_others_raise_gloo():
    """Both ranks end within DEADLINE seconds; rank 1 raises its own refusal, rank 0 raises
    RefusedOnAnotherRank from the check; the clean case after them runs on both."""
    ranks = spawn(worker, WORLD, deadline=DEADLINE)
    for name in ("fsdp_step", "ddp_two_pass_step"):
        assert ranks[1][name].startswith("ValueError: optimizer.step() refused: the gradient of"), ranks[1][name]
        assert ranks[0][name].startswith("RefusedOnAnotherRank: another rank raised an error before this step's"), \
            ranks[0][name]
    for name in ("fsdp_banded_step", "fsdp_banded_fused_step"):
        assert ranks[1][name].startswith("ValueError: optimizer.step() refused: the gradient of"), ranks[1][name]
    assert ranks[0]["fsdp_banded_step"].startswith(
        "RefusedOnAnotherRank: another rank raised an error before this step's agreement"), ranks[0]["fsdp_banded_step"]
    assert ranks[0]["fsdp_banded_fused_step"].startswith(
        "RefusedOnAnotherRank: another rank raised an error before this step's check that every rank releases the "
        "same draw"), ranks[0]["fsdp_banded_fused_step"]
    assert ranks[1]["fsdp_make_private"].startswith("ValueError: max_examples_per_user=0 is invalid")
    assert ranks[0]["fsdp_make_private"].startswith(
        "RefusedOnAnotherRank: another rank raised an error before make_private's check"), ranks[0]["fsdp_make_private"]
    assert [r["clean"] for r in ranks] == ["ok", "ok"]


def test_rank_checks_in_one_process_are_no_collective():
    """Without a process group: no value is agreed (None), a flag is its own code, and a block
    that raises re-raises its error without a check."""
    assert agree_values([1, 2], "a check") is None
    assert int(agree_flag(torch.tensor(True))) == 1 and int(agree_flag(torch.tensor(False))) == 0
    assert int(agree_flag(torch.tensor(True), failed=True)) == -1
    checks = []
    with agreed(checks.append):
        pass
    with pytest.raises(KeyError), agreed(checks.append):
        raise KeyError("own")
    assert checks == [False]  # (one process: join_failed takes part in no collective)
    with agreed(checks.append, active=False):
        pass
    assert checks == [False]
    assert issubclass(RefusedOnAnotherRank, RuntimeError)
