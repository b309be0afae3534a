"""A layer applied several times in one forward pass under FSDP2 (``grad_sample_mode="ghost_fsdp"``,
2 gloo processes on CPU): a Linear applied twice (:class:`tests.test_reused_layers.ReusedLinear`)
and an embedding-input RNN whose cell Linear runs once per step (:class:`~tests.test_reused_layers.
LoopRNN`), and the Linear applied inside a non-reentrant checkpointed region and again after it
(its replay in the backward pass no third use), wrapped by ``FSDP2Wrapper``.

At its second use in a pass such a layer is tied for the pass (its uses' projections onto the
row sketch summed per example, or per user, before the norm: the tied-parameter path), so the
per-unit norm is that of the *summed* gradient over the uses, as in one process
(tests/test_reused_layers.py). At sigma = 0 and lr = 0, with exact norms (sketch size 64 above
every sequence and every reused weight's rows: the tied row sketch is the identity), each rank's
release (its dim-0 shard of ``p.grad`` when the wrapped optimizer steps) equals its shard of
brute-force clipping of the union of both ranks' rows (:mod:`tests.oracles`), at every step, in
the wrapping and the hooks (``wrap_model=False``) forms, at example and at user level. A norm
taken use by use (``sum_uses ||g_use||^2``, Opacus's per-module norms) would release something
else (asserted: the test can fail). A layer applied twice without a tied projection (a LayerNorm
in an ALBERT-style shared stack) stays refused, on both ranks alike (no rank waits alone in a
collective), by :data:`opacus_rc.refusals.REFUSALS`'s ``tied_layer`` entry. The LM head applied
directly and then by ``ChunkedLMHeadLoss`` in one pass is the same case (equal to brute force);
applied directly after the chunked loss, it stays refused on both ranks.
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

from tests.oracles import per_example_clipped_mean, per_user_clipped_mean
from tests.spawn import spawn
from tests.test_reused_layers import D, T, LoopRNN, ReusedLinear, SharedStack

WORLD, PER_RANK, STEPS, USER_STEPS = 2, 4, 3, 6
#: clip bound (below every example's and user's gradient norm here: every unit is clipped), sketch size
C, K = 0.05, 64
#: user level: users, expected users per step, rows per user and draw, the loader's seed (its draws
#: hold steps with both shares non-empty, one empty and both empty: asserted)
USERS, USERS_PER_STEP, ROWS_PER_USER, USER_SEED, USER_ROWS = 7, 2, 4, 16, 40
ATOL = 1e-6


class ReusedAcrossRegion(ReusedLinear):
    """:class:`ReusedLinear` with its first use inside a non-reentrant checkpointed region (replayed
    in the backward pass: the replay is no third use) and its second after it."""

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(lambda t: torch.tanh(self.lin(t)), x, use_reentrant=False)
        return self.head(torch.tanh(self.lin(h))).mean(dim=1)


MODELS = {"reused_linear": ReusedLinear, "loop_rnn": LoopRNN, "across_region": ReusedAcrossRegion}
#: the layer each model applies several times
REUSED = {"reused_linear": "lin", "loop_rnn": "cell", "across_region": "lin"}
FORMS = {"wrapping": {}, "hooks_form": {"wrap_model": False}}


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[kind]()


def rows(kind: str, n: int, seed: int):
    """``n`` rows of ``kind``'s input (floats (n, T, D), or token ids (n, 6)) and labels."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=gen)
    if kind != "loop_rnn":
        return torch.randn(n, T, D, generator=gen), y
    return torch.randint(0, 16, (n, 6), generator=gen), y


def loss_of(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def user_rows(kind: str):
    """The user-level data (x, y, row index) and owners: user ``r % USERS`` owns row ``r``, so every
    user has rows at even and odd positions (a row-wise shard would split each user)."""
    x, y = rows(kind, USER_ROWS, seed=5)
    return torch.utils.data.TensorDataset(x, y, torch.arange(USER_ROWS)), [r % USERS for r in range(USER_ROWS)]


def private(kind: str, options: dict, user_level: bool):
    """``kind``'s model wrapped by FSDP2Wrapper and made private (noise 0, lr 0, exact norms; at user
    level the loader's ``seed`` seeds the sketches too); returns (the module to call, optimizer, criterion, loader)."""
    from opacus.utils.fsdp_utils import FSDP2Wrapper

    model = FSDP2Wrapper(make_model(kind))
    if user_level:
        data, owners = user_rows(kind)
        level = dict(privacy_unit="user", user_ids=owners, max_examples_per_user=ROWS_PER_USER, seed=USER_SEED)
        batch_size = USERS_PER_STEP
    else:
        data = torch.utils.data.TensorDataset(*rows(kind, WORLD * PER_RANK, seed=0))
        level = dict(poisson_sampling=False, sketch_seed=7, sketching="shared")
        batch_size = WORLD * PER_RANK
    module, opt, crit, loader = PrivacyEngine(accountant="rc_prv").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), criterion=nn.CrossEntropyLoss(),
        data_loader=torch.utils.data.DataLoader(data, batch_size=batch_size), noise_multiplier=0.0,
        max_grad_norm=C, grad_sample_mode="ghost_fsdp", clipping="randomized", sketch_size=K, **level,
        **options,
    )
    return (model if options.get("wrap_model", True) is False else module), opt, crit, loader


def releases_of(opt) -> list:
    """The list each step's release (this rank's shards of ``p.grad`` at the step) is appended to."""
    released = []
    opt.original_optimizer.register_step_pre_hook(
        lambda *_: released.append([local_shard(p.grad.detach()).clone() for p in opt.params])
    )
    return released


def example_run(rank: int, kind: str, options: dict) -> dict:
    """STEPS steps, each on a new batch of WORLD * PER_RANK rows (this rank's PER_RANK of them)."""
    module, opt, crit, _ = private(kind, options, user_level=False)
    released = releases_of(opt)
    for step in range(STEPS):
        x, y = rows(kind, WORLD * PER_RANK, seed=100 + step)
        part = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        crit(module(x[part]), y[part]).backward()
        opt.step()
        opt.zero_grad()
    return {"releases": released}


def user_run(kind: str, options: dict) -> dict:
    """USER_STEPS draws of the user-level loader (rank r draws users r, r + 2, ...)."""
    module, opt, crit, loader = private(kind, options, user_level=True)
    released, drawn = releases_of(opt), []
    while len(drawn) < USER_STEPS:
        for x, y, index in loader:
            crit(module(x), y).backward()
            opt.step()
            opt.zero_grad()
            drawn.append(index.tolist())
            if len(drawn) == USER_STEPS:
                break
    return {"releases": released, "rows": drawn}


def refused_shared_stack(rank: int):
    """An ALBERT-style stack (Linear, LayerNorm, Linear applied three times): the refusal each rank
    saw (None: it ran)."""
    from opacus.utils.fsdp_utils import FSDP2Wrapper

    torch.manual_seed(0)
    model = FSDP2Wrapper(SharedStack())
    module, opt, crit, _ = PrivacyEngine(accountant="rc_prv").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), criterion=nn.CrossEntropyLoss(),
        data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*rows("loop_rnn", 8, 0)), batch_size=8),
        noise_multiplier=0.0, max_grad_norm=C, poisson_sampling=False, grad_sample_mode="ghost_fsdp",
        clipping="randomized", sketch_size=K,
    )
    x, y = rows("loop_rnn", 8, seed=rank)
    try:
        crit(module(x[:, :T]), y).backward()
        opt.step()
    except ValueError as error:
        return str(error)
    return None


def head_rows():
    """Token rows and labels of the LM with a chunked head (tests/test_lm_head.py's batch)."""
    from tests.test_lm_head import batch

    return batch(WORLD * PER_RANK, 8, 24)


def head_aux(model, hidden):
    """An auxiliary per-sequence loss through the head applied directly."""
    return 0.1 * model.head(hidden).pow(2).mean(dim=(1, 2))


def head_run(rank: int, order: str):
    """The LM head (its own unit) applied directly and by the chunked loss in one pass, each
    sequence's loss their sum (``order``: which use comes first); one step (noise 0, lr 0, exact
    norms): the release, or the refusal each rank saw."""
    from opacus_rc.forms.two_pass import DPTensorRandomizedClipping
    from opacus_rc.lm_head import ChunkedLMHeadLoss
    from tests.models import TinyLM
    from tests.test_lm_head_fsdp import shard

    model = shard(TinyLM(bias=True), tied=False)
    head_loss = ChunkedLMHeadLoss(model.head, block_size=3)
    x, y = head_rows()
    module, opt, *_ = PrivacyEngine(accountant="rc_prv").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), criterion=head_loss,
        data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x)),
        noise_multiplier=0.0, max_grad_norm=C, poisson_sampling=False, grad_sample_mode="ghost_fsdp",
        clipping="randomized", sketch_size=K, sketch_seed=3,
    )
    head_loss.reduction = "none"  # per-sequence losses
    released = releases_of(opt)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    hidden = module(x[mine])
    try:
        if order == "direct_first":
            first = head_aux(model, hidden)
            losses = first + head_loss(hidden, y[mine])
        else:
            losses = head_loss(hidden, y[mine])
            losses = losses + head_aux(model, hidden)
        DPTensorRandomizedClipping(module, opt, losses, "mean").backward()
        opt.step()
    except ValueError as error:
        return str(error)
    return {"releases": released}


def worker(rank, init_file, out_dir):
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    out = {}
    for kind in MODELS:
        for form, options in FORMS.items():
            out[("example", kind, form)] = example_run(rank, kind, options)
            out[("user", kind, form)] = user_run(kind, options)
    for order in ("direct_first", "chunked_first"):
        out[("head", order)] = head_run(rank, order)
    out["refused"] = refused_shared_stack(rank)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned():
    return spawn(worker, WORLD)


def per_use_clipped_mean(model, layer: nn.Linear, xs, ys, units, normaliser: float, loss=None) -> dict:
    """What a norm taken use by use would release: each unit's (mean) gradient clipped by the norm
    ``sqrt(sum_uses ||g_use||^2 + ||g_rest||^2)``, ``g_use`` the Linear ``layer``'s gradient through
    one of its uses (the per-module norms that count two uses as two parameters), not of their sum."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    own = {id(layer.weight), id(layer.bias)}
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    for unit in dict.fromkeys(units):
        members = [r for r, u in enumerate(units) if u == unit]
        mean = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
        uses: list = []
        for r in members:
            calls = []
            handle = layer.register_forward_hook(lambda _m, inputs, output: calls.append((inputs[0], output)))
            try:
                value = (loss or loss_of)(model, xs[r][None], ys[r][None])
            finally:
                handle.remove()
            grads = torch.autograd.grad(value, [*params.values(), *(out for _, out in calls)])
            for n, g in zip(params, grads):
                mean[n] += g.double() / len(members)
            for i, ((inp, _), go) in enumerate(zip(calls, grads[len(params):])):
                a, g = inp.detach().reshape(-1, inp.shape[-1]).double(), go.reshape(-1, go.shape[-1]).double()
                use = (g.t() @ a / len(members), g.sum(0) / len(members))
                if i < len(uses):
                    uses[i] = (uses[i][0] + use[0], uses[i][1] + use[1])
                else:
                    uses.append(use)
        rest = sum(mean[n].pow(2).sum() for n, p in params.items() if id(p) not in own)
        norm = torch.sqrt(rest + sum(w.pow(2).sum() + b.pow(2).sum() for w, b in uses))
        scale = min(1.0, C / (float(norm) + 1e-6))
        for n in params:
            total[n] += scale * mean[n]
    return {n: t / normaliser for n, t in total.items()}


def assert_releases(name: str, ranks: list, want_of) -> None:
    """Each rank's release at each step is its dim-0 shard of ``want_of(step)`` (``{name: update}``)."""
    reference = make_model(name[1])
    names = [n for n, p in reference.named_parameters() if p.requires_grad]
    for rank, r in enumerate(ranks):
        assert len(r["releases"]) == (STEPS if name[0] == "example" else USER_STEPS), name
        for step, release in enumerate(r["releases"]):
            want = want_of(step)
            for slot, param in enumerate(names):
                torch.testing.assert_close(
                    release[slot].double(), torch.chunk(want[param].double(), WORLD, dim=0)[rank], atol=ATOL, rtol=0,
                    msg=lambda m: f"{name}, rank {rank}, step {step}, {param}: {m}",
                )


def differs(a: dict, b: dict) -> bool:
    return any((a[n].double() - b[n].double()).abs().max() > 10 * ATOL for n in a)  # ten times the tolerance


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_fsdp_reused_layer_equals_per_example_clipping_gloo(spawned, kind, form):
    """Example level: every step's release on each rank is its shard of brute-force per-example
    clipping of the ranks' union (over the batch WORLD * PER_RANK); a norm taken use by use would
    differ."""
    reference = make_model(kind)
    wants = []
    for step in range(STEPS):
        x, y = rows(kind, WORLD * PER_RANK, seed=100 + step)
        want = per_example_clipped_mean(reference, loss_of, x, y, C, normaliser=WORLD * PER_RANK)
        per_use = per_use_clipped_mean(reference, getattr(reference, REUSED[kind]), x, y,
                                       list(range(len(x))), WORLD * PER_RANK)
        assert differs(want, per_use), (kind, step)  # the test can tell the two apart
        wants.append(want)
    assert_releases(("example", kind, form), [r[("example", kind, form)] for r in spawned], wants.__getitem__)


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_fsdp_reused_layer_equals_per_user_clipping_gloo(spawned, kind, form):
    """User level (rank r draws users r, r + 2, ... with all their rows): every step's release on
    each rank is its shard of brute-force per-user clipping of the ranks' union over the expected
    users per step, at steps with both shares non-empty, one empty and both empty; a norm taken use
    by use would differ (at a step with rows: by more than ten times the tolerance)."""
    ranks = [r[("user", kind, form)] for r in spawned]
    data, owners = user_rows(kind)
    x_all, y_all, _ = data.tensors
    shares = list(zip(ranks[0]["rows"], ranks[1]["rows"]))
    kinds = {(bool(a), bool(b)) for a, b in shares}
    assert {(True, True), (False, False)} <= kinds and kinds & {(True, False), (False, True)}, shares
    reference = make_model(kind)
    wants, differing = [], []
    for step in range(USER_STEPS):
        union = ranks[0]["rows"][step] + ranks[1]["rows"][step]
        users = [owners[i] for i in union]
        want = per_user_clipped_mean(reference, loss_of, x_all[union], y_all[union], users, C, USERS_PER_STEP)
        if union:
            per_use = per_use_clipped_mean(reference, getattr(reference, REUSED[kind]), x_all[union], y_all[union],
                                           users, USERS_PER_STEP)
            differing.append(differs(want, per_use))
        wants.append(want)
    assert any(differing), kind  # the test can tell the two apart
    assert_releases(("user", kind, form), ranks, wants.__getitem__)


def test_fsdp_reused_layer_without_tied_projection_is_refused_gloo(spawned):
    """A LayerNorm applied three times (no tied projection): refused on both ranks by the
    ``tied_layer`` entry, with its reason (a norm per use bounds each use, not their sum)."""
    for r in spawned:
        assert r["refused"] is not None
        assert "LayerNorm applied twice in one forward pass" in r["refused"]
        assert "is the sum of its uses' gradients" in r["refused"] and "up to L C" in r["refused"]


def test_fsdp_head_applied_directly_before_the_chunked_loss_equals_brute_force_gloo(spawned):
    """The LM head applied directly, then by the chunked loss, in one pass (before: the chunked
    use's norm was overwritten by the direct use's, a norm of one use): the two uses are summed as
    a tied head's, so each rank's release is its shard of brute-force per-sequence clipping of the
    ranks' union; a norm of either use alone, or one per use, would differ. Applied directly
    after the chunked loss (whose norm was taken as untied): refused on both ranks."""
    from tests.models import TinyLM
    from tests.test_lm_head import per_sequence_ce

    reference = TinyLM(bias=True)
    x, y = head_rows()

    def loss_of(model, xb, yb):
        hidden = model(xb)
        return (head_aux(model, hidden) + per_sequence_ce(model.head(hidden), yb)).mean()

    want = per_example_clipped_mean(reference, loss_of, x, y, C, normaliser=WORLD * PER_RANK)
    per_use = per_use_clipped_mean(reference, reference.head, x, y, list(range(len(x))), WORLD * PER_RANK,
                                   loss=loss_of)
    assert differs(want, per_use)
    names = [n for n, p in reference.named_parameters() if p.requires_grad]
    for rank, r in enumerate(spawned):
        (release,) = r[("head", "direct_first")]["releases"]
        for slot, param in enumerate(names):
            torch.testing.assert_close(release[slot].double(), torch.chunk(want[param].double(), WORLD)[rank],
                                       atol=ATOL, rtol=0, msg=lambda m: f"rank {rank}, {param}: {m}")
        assert "more than once in one forward pass" in r[("head", "chunked_first")]
