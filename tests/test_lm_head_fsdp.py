"""The chunked LM head under FSDP2 (``grad_sample_mode="ghost_fsdp"``, clipping="randomized"),
with 2 gloo processes on CPU (the pattern of tests/forms/test_fsdp.py: one spawn runs every
scenario, each rank saves what it saw).

* exact norms (T <= k), noise 0: the update over 2 ranks equals brute-force per-sequence
  clipping of the unchunked model on the union of the rank batches; the losses equal
  the unchunked per-sequence losses of each rank's shard (wrap_model True and False);
* sketched (same sketch_seed): the chunked update equals the unchunked FSDP2 run with the
  same sketches (vocabulary-side and input-side sketch; tied embedding / head grouped by
  hand), losses equal;
* two micro-batches per rank equal one batch (shared sketches);
* without privacy, the gradients equal the unchunked head's;
* a head whose parameters an enclosing unit manages is refused, naming fully_shard,
  ``hidden_states()`` on an FSDP2 root (it would skip the root's forward), and the loss
  called twice in one forward pass (the second norm would overwrite the first).
"""

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from opacus import PrivacyEngine
from torch import nn

from opacus_rc.lm_head import ChunkedLMHeadLoss
from tests.models import TinyLM
from tests.test_lm_head import C, batch, brute_force, per_sequence_ce

from .spawn import spawn

WORLD, PER_RANK = 2, 4
EXACT = dict(vocab=24, t=8, sketch_size=16)  # T <= k: every norm exact
SKETCHED = dict(vocab=40, t=20, sketch_size=4)  # V > d: the head sketched on the vocabulary side


class CausalLM(TinyLM):
    """TinyLM (same parameters) whose forward runs the head too: the unchunked reference
    (its head inside the root's forward, the way FSDP2 expects a tied group to run)."""

    def forward(self, x):
        return self.head(super().forward(x))


def data(vocab, t):
    return batch(WORLD * PER_RANK, t, vocab, all_ignored=(1,))


def shard(model: nn.Module, tied: bool, head_unit: bool = True) -> nn.Module:
    """FSDP2Wrapper's layout (every layer its own unit), or by hand: a tied embedding and
    head in one unit (FSDP2 wants a shared parameter in one group), or the head left to
    the root's unit (``head_unit=False``)."""
    from opacus.utils.fsdp_utils import FSDP2Wrapper
    from torch.distributed.fsdp import fully_shard

    if not tied and head_unit:
        return FSDP2Wrapper(model)
    for layer in (model.fc, model.norm):
        fully_shard(layer)
    if tied:
        fully_shard([model.tok, model.head])
    else:
        fully_shard(model.tok)
    return fully_shard(model)


def fsdp_step(rank, *, chunked, vocab, t, tied=False, bias=True, wrap_model=True, micro_batches=1,
              head_unit=True, head_calls=1, **options):
    """One noiseless SGD(lr=1) step over 2 ranks; (full parameters after it, the losses of
    this rank's micro-batches)."""
    model = shard((TinyLM if chunked else CausalLM)(vocab=vocab, tied=tied, bias=bias), tied, head_unit)
    head_loss = ChunkedLMHeadLoss(model.head, block_size=3)
    x, y = data(vocab, t)
    # a loader of micro-batches (its batch size sets the expected size of one)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x) // micro_batches)
    module, opt, crit, _ = PrivacyEngine(accountant="rc_prv").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        criterion=head_loss if chunked else nn.CrossEntropyLoss(ignore_index=-100),
        data_loader=loader, noise_multiplier=0.0, max_grad_norm=C, poisson_sampling=False,
        grad_sample_mode="ghost_fsdp", clipping="randomized", wrap_model=wrap_model,
        sketch_seed=3, **options,
    )
    body = module if wrap_model else model
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    losses = []
    for part in torch.chunk(torch.arange(PER_RANK), micro_batches):
        xb, yb = x[mine][part], y[mine][part]
        if chunked:
            hidden = body(xb)
            loss = crit(hidden, yb)
            for _ in range(head_calls - 1):
                loss = loss + crit(hidden, yb)
        else:
            logits = body(xb)
            loss = crit(logits.reshape(-1, vocab), yb.reshape(-1), shape=logits.shape[:2])
        loss.backward()
        losses.append(loss.item())
    opt.step()
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in model.named_parameters()}
    return params, losses


def plain_fsdp_grads(rank, chunked):
    """No privacy: the chunked head's gradients under FSDP2 (one backward pass)."""
    model = shard((TinyLM if chunked else CausalLM)(vocab=40, bias=True), tied=False)
    x, y = data(40, 20)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    if chunked:
        loss = ChunkedLMHeadLoss(model.head, block_size=3)(model(x[mine]), y[mine])
    else:
        loss = per_sequence_ce(model(x[mine]), y[mine]).mean()
    loss.backward()
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


class WithBase(nn.Module):
    """A Hugging Face-like causal LM: its ``base_model`` returns the hidden states."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TinyLM()

    @property
    def base_model(self) -> nn.Module:
        return self.model


def hidden_states_error():
    from torch.distributed.fsdp import fully_shard

    from opacus_rc.lm_head import hidden_states

    try:
        hidden_states(fully_shard(WithBase()), torch.zeros(2, 4, dtype=torch.long))
    except ValueError as e:
        return str(e)
    return None


def worker(rank, init_file, out_dir):
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    out = {}
    out["exact"] = fsdp_step(rank, chunked=True, **EXACT)
    out["exact_hooks"] = fsdp_step(rank, chunked=True, wrap_model=False, **EXACT)
    for name, options in {
        "hutchpp": dict(estimator="hutchpp", sketching="shared", **SKETCHED),
        "input_side": dict(SKETCHED, vocab=8),  # V < d: the head sketched on the input side
        "tied": dict(tied=True, bias=False, **SKETCHED),
    }.items():
        for chunked in (True, False):
            out[f"{name}_{chunked}"] = fsdp_step(rank, chunked=chunked, **options)
    out["plain"] = [plain_fsdp_grads(rank, chunked) for chunked in (True, False)]
    out["micro"] = fsdp_step(rank, chunked=True, micro_batches=2, estimator="hutchpp", sketching="shared", **SKETCHED)
    try:
        fsdp_step(rank, chunked=True, head_unit=False, **EXACT)
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    out["hidden_states"] = hidden_states_error()
    try:
        fsdp_step(rank, chunked=True, head_calls=2, **EXACT)
        out["called_twice"] = None
    except ValueError as e:
        out["called_twice"] = str(e)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    return spawn(worker, WORLD)


def assert_same(a, b, atol=1e-6, rtol=1e-4):
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], atol=atol, rtol=rtol, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("which", ["exact", "exact_hooks"])
def test_exact_update_equals_brute_force_on_the_union(ranks, which):
    """T = 8 <= k = 16: every norm exact; 2 ranks of 4 sequences give plain per-sequence
    clipping of the unchunked model on all 8 (one all-ignored)."""
    model = TinyLM(vocab=EXACT["vocab"], bias=True)
    x, y = data(EXACT["vocab"], EXACT["t"])
    initial = {n: p.detach() for n, p in model.named_parameters()}
    ref = brute_force(model, x, y)
    for rank, r in enumerate(ranks):
        params, losses = r[which]
        assert_same({n: initial[n] - params[n] for n in initial}, ref)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        expected = per_sequence_ce(model.head(model(x[mine])), y[mine]).mean()
        assert losses[0] == pytest.approx(float(expected.detach()), abs=1e-5)
    assert float(ref["head.weight"].abs().max()) > 0


@pytest.mark.parametrize("name", ["hutchpp", "input_side", "tied"])
def test_sketched_update_equals_unchunked_fsdp(ranks, name):
    """Same sketch_seed: the chunked head draws the head's sketches the unchunked FSDP2 run
    draws (tied: the weight's row sketch shared with the embedding's use, summed before the
    norm); the updates and losses agree, on both ranks."""
    for r in ranks:
        (ours, our_losses), (ref, ref_losses) = r[f"{name}_True"], r[f"{name}_False"]
        assert_same(ours, ref)
        assert our_losses == pytest.approx(ref_losses, abs=1e-5)
    assert_same(ranks[0][f"{name}_True"][0], ranks[1][f"{name}_True"][0], atol=0, rtol=0)
    initial = dict(TinyLM(vocab=8 if name == "input_side" else 40, tied=name == "tied",
                          bias=name != "tied").named_parameters())
    head = "tok.weight" if name == "tied" else "head.weight"  # a tied weight is named once
    assert not torch.equal(ranks[0][f"{name}_True"][0][head], initial[head].detach())


def test_sketched_is_not_exact(ranks):
    """The sketch bites (k = 4 < T = 20): not brute-force clipping."""
    model = TinyLM(vocab=40, bias=True)
    x, y = data(40, 20)
    ref = brute_force(model, x, y)
    update = model.head.weight.detach() - ranks[0]["hutchpp_True"][0]["head.weight"]
    assert not torch.allclose(update, ref["head.weight"], atol=1e-6, rtol=1e-3)


def test_micro_batches_equal_one_batch(ranks):
    assert_same(ranks[0]["micro"][0], ranks[0]["hutchpp_True"][0])


def test_plain_training_gradients_equal_unchunked(ranks):
    """Without privacy: FSDP2 reduce-scatters the chunked head's weight gradient as the
    unchunked head's."""
    assert_same(*ranks[0]["plain"])
    assert_same(ranks[0]["plain"][0], ranks[1]["plain"][0], atol=0, rtol=0)


def test_head_inside_an_enclosing_unit_is_refused(ranks):
    for r in ranks:
        assert "fully_shard(lm_head)" in r["refused"]


def test_hidden_states_of_an_fsdp_root_is_refused(ranks):
    """hidden_states() would call the base model and skip the FSDP2 root's forward."""
    assert "FSDP2 root" in ranks[0]["hidden_states"]


def test_the_loss_called_twice_in_a_pass_is_refused(ranks):
    """The untied head's norm is its module's ``norm_sample``: a second call in the pass
    would overwrite the first call's norm (an under-estimated norm), so it is refused."""
    for r in ranks:
        assert "more than once in one forward pass" in r["called_twice"]
