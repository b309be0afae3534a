"""Activation checkpointing with ``preserve_rng_state=False`` (review item 3).

The two-pass forms backpropagate twice, and each backward pass recomputes a checkpointed
region: without ``preserve_rng_state`` the two recomputations draw other dropout masks, and
the clip factor of the first pass scaled the second pass's gradient (measured: one example
contributed up to 1.17 C to the update at noise 0 with exact norms). Every two-pass form
refuses it at the first step, also for a region without trainable layers (its masks change
the gradients upstream of it), for torch's checkpoint called by the model and for Hugging
Face's ``gradient_checkpointing_kwargs``, in the plain engine and in DPTrainer. Book-keeping
(one backward pass: one recomputation, whose gradient is the one clipped) stays allowed.

Measured as an attacker: one example per batch (its contribution is the whole update), noise
0, exact norms (T <= sketch_size), a clip bound far below the gradient norm.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from opacus import PrivacyEngine
from torch import nn
from torch.utils.checkpoint import checkpoint

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

VOCAB, T, K, CLIP = 16, 4, 8, 1e-3  # T <= K: exact norms
#: a clipped update's norm is C * n / (n + 1e-6) <= C (Opacus's factor), up to float32 rounding;
#: >= C (1 - 1e-3) shows the clip is active (the gradient norm n is far above C)
BOUND = CLIP * (1 + 1e-5)
ACTIVE = CLIP * (1 - 1e-3)
REFUSAL = r"preserve_rng_state=False .*two-pass.*preserve_rng_state=True.*book-keeping"

TWO_PASS = {
    "ghost": dict(grad_sample_mode="ghost"),
    "ghost_hooks_object": dict(grad_sample_mode="ghost", wrap_model=False),
    "output_passes": dict(grad_sample_mode="hooks", bookkeeping=False),
}
BOOKKEEPING = {
    "bookkeeping": dict(grad_sample_mode="bookkeeping"),
    "ghost_bookkeeping": dict(grad_sample_mode="ghost", bookkeeping=True),
}


class DropoutRegion(nn.Module):
    """Embedding, a checkpointed Linear-tanh-Dropout region, a head. ``frozen``: the
    region's Linear is frozen (the region has no trainable layer, its masks still change the
    embedding's gradient)."""

    def __init__(self, use_reentrant: bool, preserve_rng_state: bool, frozen: bool = False, d: int = 8):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.fc = nn.Linear(d, d)
        self.fc.requires_grad_(not frozen)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(d, 2)
        self.options = dict(use_reentrant=use_reentrant, preserve_rng_state=preserve_rng_state)

    def region(self, h: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.tanh(self.fc(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.region, self.emb(x), **self.options)).mean(dim=1)


def one_example_update(model: nn.Module, options: dict, seed: int = 0) -> float:
    """||update|| of one SGD step (lr 1) on one example, noise 0: that example's contribution
    (the released gradient, measured before it is subtracted from the parameters)."""
    torch.manual_seed(seed)
    x, y = torch.randint(0, VOCAB, (1, T)), torch.randint(0, 2, (1,))
    params = [p for p in model.parameters() if p.requires_grad]
    out = PrivacyEngine(accountant="rc_prv").make_private(
        module=model, optimizer=torch.optim.SGD(params, lr=1.0),
        data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=1),
        criterion=nn.CrossEntropyLoss(), noise_multiplier=0.0, max_grad_norm=CLIP, poisson_sampling=False,
        clipping="randomized", sketch_size=K, sketch_seed=0, per_example_backward=False, **options,
    )
    module = out[0] if isinstance(out[0], nn.Module) else model
    logits = module(x)
    (out[2](logits, y) if len(out) == 4 else F.cross_entropy(logits, y)).backward()
    out[1].step()
    # the released update is p.grad (lr 1); the parameters' change p - lr * grad is rounded to
    # the parameters' float32 spacing, up to 1.5e-5 of C here (model inits drawn after 120 seeds)
    return float(torch.cat([p.grad.flatten() for p in params]).double().norm())


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable_region", "frozen_region"])
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("mode", TWO_PASS)
def test_two_pass_refuses_unpreserved_rng_state(mode, use_reentrant, frozen):
    """On main this ran and the example's contribution exceeded C: over seeds 0-4, up to
    1.17 C (trainable region, every form) and 1.004 C (frozen region)."""
    with pytest.raises(ValueError, match=REFUSAL):
        one_example_update(DropoutRegion(use_reentrant, False, frozen), TWO_PASS[mode])


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("mode", TWO_PASS)
def test_two_pass_with_preserved_rng_state_stays_within_the_bound(mode, use_reentrant):
    """The default (preserve_rng_state=True) runs; the clip is active (the unclipped update
    would be far above C) and the example contributes at most C."""
    assert ACTIVE <= one_example_update(DropoutRegion(use_reentrant, True), TWO_PASS[mode]) <= BOUND


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable_region", "frozen_region"])
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("mode", BOOKKEEPING)
def test_bookkeeping_with_unpreserved_rng_state_stays_within_the_bound(mode, use_reentrant, frozen):
    """One backward pass: its recomputation's gradient is the one clipped."""
    assert ACTIVE <= one_example_update(DropoutRegion(use_reentrant, False, frozen), BOOKKEEPING[mode]) <= BOUND


# --- DDP (2 gloo ranks): every rank refuses at the first step -------------------------------


def ddp_worker(rank, init_file, out_dir):
    """Both forms in one process group (one spawn: a rank's start-up is most of the cost)."""
    import os

    import torch.distributed as dist
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    results = {}
    for use_reentrant in (True, False):
        torch.manual_seed(0)
        model = DropoutRegion(use_reentrant, False)
        x, y = torch.randint(0, VOCAB, (4, T)), torch.randint(0, 2, (4,))
        module, opt, criterion, _ = PrivacyEngine(accountant="rc_prv").make_private(
            module=DPDDP(model), optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4),
            criterion=nn.CrossEntropyLoss(), noise_multiplier=0.0, max_grad_norm=CLIP, poisson_sampling=False,
            clipping="randomized", grad_sample_mode="ghost", sketch_size=K, sketch_seed=0,
        )
        before = {k: v.clone() for k, v in model.state_dict().items()}
        error = None
        try:
            criterion(module(x[rank::2]), y[rank::2]).backward()
            opt.step()
        except ValueError as e:
            error = str(e)
        changed = any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
        results[use_reentrant] = {"error": error, "changed": changed}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_ddp_two_pass_refuses_unpreserved_rng_state():
    """DPDDP, two passes, reentrant and non-reentrant: every rank refuses, nothing is released."""
    import re

    from .spawn import spawn

    for results in spawn(ddp_worker, 2):
        for use_reentrant, r in results.items():
            assert r["error"] is not None and re.search(REFUSAL, r["error"]), (use_reentrant, r["error"])
            assert not r["changed"], use_reentrant


# --- Hugging Face: gradient_checkpointing_kwargs, plain engine and DPTrainer -----------------

from .hf.test_trainer import training_args  # noqa: E402
from .models import RowDataset, tiny_llama  # noqa: E402


def dropout_llama() -> nn.Module:
    model = tiny_llama()
    for m in model.modules():
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.5
    return model.train()


def hf_kwargs(use_reentrant: bool) -> dict:
    return {"use_reentrant": use_reentrant, "preserve_rng_state": False}


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_plain_engine_refuses_hf_unpreserved_rng_state(use_reentrant):
    """A plain-loss script on a checkpointed Hugging Face model runs two passes from the output."""
    model = dropout_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=hf_kwargs(use_reentrant))
    ids = RowDataset(4).ids
    hooks, opt, _ = PrivacyEngine(accountant="rc_prv").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4),
        noise_multiplier=0.0, max_grad_norm=CLIP, poisson_sampling=False, clipping="randomized",
        grad_sample_mode="hooks", wrap_model=False, sketch_size=32,
    )
    assert getattr(hooks, "output_passes", None) is not None
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with pytest.raises(ValueError, match=REFUSAL):
        model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False).loss.backward()


@pytest.mark.parametrize("where", ["args", "model"])
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_dp_trainer_refuses_unpreserved_rng_state(tmp_path, use_reentrant, where):
    """DPTrainer with Llama attention dropout, preserve_rng_state=False in TrainingArguments or
    on the model: refused at the first step (on main it trained)."""
    from opacus_rc.hf import DPTrainer, PrivacyArguments

    model = dropout_llama()
    if where == "model":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=hf_kwargs(use_reentrant))
        options = {}
    else:
        options = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs=hf_kwargs(use_reentrant))
    # refused when the Trainer is built, or at the latest at train() (TrainingArguments'
    # gradient_checkpointing is enabled there), before any step
    with pytest.raises(ValueError, match=r"preserve_rng_state=False.*two-pass.*preserve_rng_state=True"):
        trainer = DPTrainer(
            model=model, args=training_args(tmp_path, max_steps=1, **options), train_dataset=RowDataset(),
            privacy=PrivacyArguments(noise_multiplier=0.0, delta=1e-5, max_grad_norm=CLIP, sketch_size=32),
        )
        trainer.train()
