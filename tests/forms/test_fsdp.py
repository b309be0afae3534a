"""Randomized clipping under FSDP2 (Opacus's ``grad_sample_mode="ghost_fsdp"`` on a model
wrapped by ``FSDP2Wrapper``), with 2 gloo processes on CPU.

One spawn runs every distributed scenario (each rank saves what it saw); the tests
compare against Opacus's own ghost_fsdp and against one process on the union of the rank
batches:

* noise 0, exact norms (T <= k): the update equals Opacus's ghost_fsdp flat clipping;
* noise 0, sketched (shared sketches, fixed sketch_seed; Hutchinson and Hutch++): the
  update equals one process on the union of the batches with the same sketches;
* two micro-batches accumulated equal one batch;
* activation checkpointing (non-reentrant and reentrant) changes nothing;
* the noise std equals Opacus ghost_fsdp's (within 15%) and the theoretical
  ``sigma C / total batch``; shards get independent noise;
* epsilon is the same on both ranks;
* shared sketches agree across ranks (also without a seed), per-example ones do not;
* book-keeping (grad_sample_mode="hooks") and "ghost" on an FSDP2 model: a ValueError
  naming ghost_fsdp;
* tied embedding / head (grouped by hand) equals one process;
* a step (fused Adam) has no operation that makes the host wait;
* a non-finite example on one rank: every rank refuses the same step (also decided on the
  device with a fused optimizer) and no rank hangs;
* examples/fsdp_finetune.py runs under torchrun (tiny configuration).
"""

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from opacus import PrivacyEngine
from torch import nn

from tests.conftest import distinct
from tests.models import CheckpointedSequenceClassifier, SequenceClassifier, token_task
from tests.spawn import spawn

WORLD, PER_RANK = 2, 8
T_EXACT, T_SKETCHED, K = 8, 40, 8  # T <= k: exact norms; T > k: sketched
C, SIGMA = 0.5, 50.0


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return SequenceClassifier()


def batch(t: int, rank=None):
    x, y = token_task(n=WORLD * PER_RANK, t=t).tensors
    if rank is None:
        return x, y
    shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return x[shard], y[shard]


def private(model, t, *, clipping, mode, noise=0.0, accountant="rc_prv", micro_batches=1, optimizer=None, **options):
    """make_private on a loader whose batch spans the whole dataset (WORLD * PER_RANK),
    or a 1 / micro_batches part of it (the expected size of one micro-batch)."""
    engine = PrivacyEngine(accountant=accountant)
    loader = torch.utils.data.DataLoader(
        token_task(n=WORLD * PER_RANK, t=t), batch_size=WORLD * PER_RANK // micro_batches
    )
    # shared sketches unless a test asks otherwise: ranks and one process draw the same sketch
    extra = {"sketch_size": K, "sketch_seed": 7, "sketching": "shared", **options} if clipping == "randomized" else {}
    out = engine.make_private(
        module=model,
        optimizer=optimizer if optimizer is not None else torch.optim.SGD(model.parameters(), lr=1.0),
        criterion=nn.CrossEntropyLoss(),
        data_loader=loader,
        noise_multiplier=noise,
        max_grad_norm=C,
        poisson_sampling=False,
        grad_sample_mode=mode,
        clipping=clipping,
        noise_generator=torch.Generator().manual_seed(11),
        **extra,
    )
    return engine, out


def full_params(model: nn.Module):
    """Parameters gathered from their shards (a collective: every rank calls it)."""
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }


def lora(model: nn.Module) -> nn.Module:
    """LoRA (r = 4) on both linear layers: only the A/B factors train."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["fc1", "fc2"]))


def make_checkpointed(use_reentrant: bool) -> nn.Module:
    torch.manual_seed(0)
    return CheckpointedSequenceClassifier(use_reentrant=use_reentrant)  # make_model()'s parameters


def fsdp_step(rank, t, micro_batches=1, with_lora=False, checkpointed=None, **kwargs):
    """``checkpointed``: None, or use_reentrant of the checkpointed fc1 -> tanh -> norm."""
    from opacus.utils.fsdp_utils import FSDP2Wrapper

    base = make_model() if checkpointed is None else make_checkpointed(checkpointed)
    model = FSDP2Wrapper(lora(base) if with_lora else base)
    engine, (module, opt, crit, _) = private(model, t, micro_batches=micro_batches, **kwargs)
    if not kwargs.get("wrap_model", True):
        module = model  # the hooks form returns the hooks object; the model is called
    x, y = batch(t, rank)
    for part in torch.chunk(torch.arange(PER_RANK), micro_batches):
        crit(module(x[part]), y[part]).backward()
    opt.step()
    return engine, module, opt, full_params(model)


class NormAcrossRegion(SequenceClassifier):
    """The LayerNorm used inside a checkpointed region and again after it (one layer, two
    uses): FSDP2's per-module norms must not keep only one of them."""

    def __init__(self, use_reentrant: bool):
        super().__init__()
        self.use_reentrant = use_reentrant

    def _region(self, h):
        return self.norm(torch.tanh(self.fc1(h)))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self._region, self.emb(x), use_reentrant=self.use_reentrant)
        return self.fc2(self.norm(h)).mean(dim=1)


def reused_across_region_errors(rank):
    """The refusal of each checkpointing form for :class:`NormAcrossRegion` (None: ran)."""
    from opacus.utils.fsdp_utils import FSDP2Wrapper

    errors = {}
    for reentrant in (False, True):
        torch.manual_seed(0)
        model = FSDP2Wrapper(NormAcrossRegion(use_reentrant=reentrant))
        _, (module, opt, crit, _) = private(model, T_SKETCHED, clipping="randomized", mode="ghost_fsdp")
        x, y = batch(T_SKETCHED, rank)
        try:
            crit(module(x), y).backward()
            opt.step()
            errors[reentrant] = None
        except ValueError as e:
            errors[reentrant] = str(e)
    return errors


class TiedLM(nn.Module):
    """Embedding -> Linear -> LayerNorm -> Linear -> head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        base = make_model()
        self.emb, self.fc1, self.norm = base.emb, base.fc1, base.norm
        self.fc2 = nn.Linear(24, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.fc2(self.norm(torch.tanh(self.fc1(self.emb(x)))))).mean(dim=1)


def make_tied() -> nn.Module:
    torch.manual_seed(0)
    return TiedLM()


def tied_fsdp_step(rank):
    """Tied embedding / head grouped by hand (FSDP2Wrapper cannot shard a shared
    parameter across groups), the other layers sharded one by one."""
    from torch.distributed.fsdp import fully_shard

    model = make_tied()
    for layer in (model.fc1, model.norm, model.fc2):
        fully_shard(layer)
    fully_shard([model.emb, model.head])
    fully_shard(model)
    _, (module, opt, crit, _) = private(model, T_SKETCHED, clipping="randomized", mode="ghost_fsdp")
    x, y = batch(T_SKETCHED, rank)
    crit(module(x), y).backward()
    opt.step()
    return full_params(model)


def secure_fsdp_step(rank):
    """secure_mode: each rank draws only its shard's noise, from the CSPRNG."""
    from opacus.utils.fsdp_utils import FSDP2Wrapper

    model = FSDP2Wrapper(make_model())
    engine = PrivacyEngine(accountant="rc_prv", secure_mode=True)
    module, opt, crit, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        criterion=nn.CrossEntropyLoss(),
        data_loader=torch.utils.data.DataLoader(
            token_task(n=WORLD * PER_RANK, t=T_EXACT), batch_size=WORLD * PER_RANK
        ),
        noise_multiplier=SIGMA, max_grad_norm=C, grad_sample_mode="ghost_fsdp",
        clipping="randomized", sketch_size=K,
    )
    x, y = batch(T_EXACT, rank)
    crit(module(x), y).backward()
    opt.step()
    return full_params(model)


class Poisonable(nn.Module):
    """Scales the output of examples whose first token is 0 by inf."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * torch.where(x[:, 0] == 0, float("inf"), 1.0)[:, None]


def private_adam(model: nn.Module, fused: bool):
    """Randomized clipping (noise 1, per-example sketches: the default) on an FSDP2 model
    with Adam."""
    _, (module, opt, crit, _) = private(
        model, T_SKETCHED, clipping="randomized", mode="ghost_fsdp", noise=1.0, sketching="per_example",
        optimizer=torch.optim.Adam(model.parameters(), lr=0.1, fused=fused),
    )
    return module, opt, crit


def refused_fsdp_steps(rank, fused: bool):
    """A poisoned example on rank 1 only, then (fused Adam: the device-side refusal is reported
    at the next step) a clean step. The error each rank saw and the parameters."""
    from opacus.utils.fsdp_utils import FSDP2Wrapper

    model = FSDP2Wrapper(Poisonable(make_model()))
    module, opt, crit = private_adam(model, fused=fused)
    x, y = batch(T_SKETCHED, rank)
    x = x.clone()
    x[:, 0] = torch.where(x[:, 0] == 0, 1, x[:, 0])
    clean = x.clone()
    if rank == 1:
        x[2, 0] = 0
    error = None
    try:
        crit(module(x), y).backward()
        opt.step()
        opt.zero_grad()
        crit(module(clean), y).backward()
        opt.step()
    except FloatingPointError as e:
        error = str(e)
    return {"error": error, "params": full_params(model)}


def counted_fsdp_step(rank):
    """A second step (the first is measured by nothing: lazy set-up) of randomized
    clipping under FSDP2 with fused Adam, under benchmarks.host_sync's counter."""
    from opacus.utils.fsdp_utils import FSDP2Wrapper

    from benchmarks.host_sync import HostSyncCounter

    model = FSDP2Wrapper(make_model())
    module, opt, crit = private_adam(model, fused=True)
    x, y = batch(T_SKETCHED, rank)
    for _ in range(2):
        with HostSyncCounter() as syncs:
            crit(module(x), y).backward()
            opt.step()
        opt.zero_grad()
    return syncs.where


def worker(rank, init_file, out_dir):
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    out = {}
    _, _, opt, out["opacus_exact"] = fsdp_step(rank, T_EXACT, clipping="flat", mode="ghost_fsdp", accountant="prv")
    _, module, opt, out["rc_exact"] = fsdp_step(rank, T_EXACT, clipping="randomized", mode="ghost_fsdp")
    out["deferred"] = len(module._patched)
    out["optimizer"] = type(opt).__name__
    for estimator in ("hutchinson", "hutchpp"):
        _, _, _, out[f"rc_{estimator}"] = fsdp_step(
            rank, T_SKETCHED, clipping="randomized", mode="ghost_fsdp", estimator=estimator
        )
    _, _, _, out["rc_per_example"] = fsdp_step(
        rank, T_SKETCHED, clipping="randomized", mode="ghost_fsdp", sketching="per_example",
        estimator="hutchpp",
    )
    _, _, _, out["rc_hooks_form"] = fsdp_step(
        rank, T_SKETCHED, clipping="randomized", mode="ghost_fsdp", wrap_model=False
    )
    _, _, _, out["rc_lora"] = fsdp_step(
        rank, T_SKETCHED, with_lora=True, clipping="randomized", mode="ghost_fsdp"
    )
    for reentrant in (False, True):
        _, _, _, out[f"rc_checkpointed_{reentrant}"] = fsdp_step(
            rank, T_SKETCHED, checkpointed=reentrant, clipping="randomized", mode="ghost_fsdp"
        )
    _, _, _, out["rc_two_micro_batches"] = fsdp_step(
        rank, T_SKETCHED, micro_batches=2, clipping="randomized", mode="ghost_fsdp"
    )
    _, _, _, out["opacus_noisy"] = fsdp_step(
        rank, T_EXACT, clipping="flat", mode="ghost_fsdp", accountant="prv", noise=SIGMA
    )
    engine, _, _, out["rc_noisy"] = fsdp_step(
        rank, T_EXACT, clipping="randomized", mode="ghost_fsdp", noise=SIGMA
    )
    out["epsilon"] = engine.get_epsilon(delta=1e-5)
    out["rc_noisy_secure"] = secure_fsdp_step(rank)
    out["history"] = engine.accountant.state_dict()["history"]  # plain dicts: loads weights_only
    # sketches: shared ones agree across ranks (also seeded from entropy), per-example not
    from opacus.utils.fsdp_utils import FSDP2Wrapper

    for sketching, seed in (("shared", None), ("per_example", 7)):
        _, (module, *_rest) = private(
            FSDP2Wrapper(make_model()), T_SKETCHED, clipping="randomized", mode="ghost_fsdp",
            sketching=sketching, sketch_seed=seed,
        )
        out[f"sketch_{sketching}"] = module.sketcher.gaussian(2, 16, K, torch.device("cpu"))
    out["rc_tied"] = tied_fsdp_step(rank)
    out["reused_across_region"] = reused_across_region_errors(rank)
    out["syncs"] = counted_fsdp_step(rank)
    out["refused"] = refused_fsdp_steps(rank, fused=False)
    out["refused_fused"] = refused_fsdp_steps(rank, fused=True)
    for mode in ("hooks", "ghost"):
        try:
            private(FSDP2Wrapper(make_model()), T_SKETCHED, clipping="randomized", mode=mode)
            out[f"error_{mode}"] = None
        except ValueError as e:
            out[f"error_{mode}"] = str(e)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    return spawn(worker, WORLD)


def single_process(t, with_lora=False, **kwargs):
    model = lora(make_model()) if with_lora else make_model()
    _, (module, opt, crit, _) = private(model, t, clipping="randomized", mode="ghost", **kwargs)
    x, y = batch(t)
    crit(module(x), y).backward()
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same(a, b, **tol):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], **tol, msg=lambda m: f"{name}: {m}")


def test_exact_norms_equal_opacus_ghost_fsdp(ranks):
    """T <= k: every norm is exact, so randomized clipping is Opacus's flat clipping."""
    assert ranks[0]["optimizer"] == "FSDPRandomizedClippingOptimizer"
    assert ranks[0]["deferred"] == 2  # fc1, fc2 (FSDPLinear) skip first-pass weight grads
    initial = dict(make_model().named_parameters())
    for r in ranks:
        assert_same(r["rc_exact"], r["opacus_exact"], rtol=1e-4, atol=1e-6)
    assert any(not torch.equal(ranks[0]["rc_exact"][n], initial[n].detach()) for n in initial)


@pytest.mark.parametrize("estimator", ["hutchinson", "hutchpp"])
def test_sketched_equals_single_process_on_the_union(ranks, estimator):
    single = single_process(T_SKETCHED, estimator=estimator)
    assert_same(ranks[0][f"rc_{estimator}"], ranks[1][f"rc_{estimator}"])
    assert_same(ranks[0][f"rc_{estimator}"], single, rtol=1e-4, atol=1e-6)


def test_lora_and_hooks_form_equal_single_process(ranks):
    """LoRA-only (frozen base layers sharded too) and the wrap_model=False form."""
    assert_same(ranks[0]["rc_lora"], single_process(T_SKETCHED, with_lora=True), rtol=1e-4, atol=1e-6)
    assert_same(ranks[0]["rc_hooks_form"], ranks[0]["rc_hutchinson"], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_equals_single_process(ranks, reentrant):
    """Activation checkpointing around fc1 -> tanh -> LayerNorm under FSDP2: the update
    equals one process without checkpointing (same sketches)."""
    assert_same(ranks[0][f"rc_checkpointed_{reentrant}"], single_process(T_SKETCHED), rtol=1e-4, atol=1e-6)


def test_per_example_sketches_train(ranks):
    """Per-example Hutch++ sketches (independent across ranks) under FSDP2: a finite,
    non-zero update."""
    initial = dict(make_model().named_parameters())
    update = {n: ranks[0]["rc_per_example"][n] - initial[n].detach() for n in initial}
    assert all(torch.isfinite(u).all() for u in update.values())
    assert any(u.abs().max() > 0 for u in update.values())


def test_micro_batches_equal_one_batch(ranks):
    """Two micro-batches of 4 per rank then one step == one batch of 8 per rank (the
    micro-batches share the step's sketches; every example is clipped once)."""
    assert_same(ranks[0]["rc_two_micro_batches"], ranks[0]["rc_hutchinson"], rtol=1e-4, atol=1e-6)


def test_noise_std_matches_opacus_ghost_fsdp(ranks):
    """Noise once per parameter element at Opacus's scale: std sigma C / 16 over all
    ~1,000 parameter entries (sample std within ~2.2% per SE); noise on both ranks
    would be sqrt(2) larger, none (or one shard only) far smaller."""
    clean = ranks[0]["rc_exact"]
    diff_rc = torch.cat([(ranks[0]["rc_noisy"][n] - clean[n]).flatten() for n in clean])
    diff_opacus = torch.cat([(ranks[0]["opacus_noisy"][n] - clean[n]).flatten() for n in clean])
    expected = SIGMA * C / (WORLD * PER_RANK)
    assert diff_rc.std().item() == pytest.approx(diff_opacus.std().item(), rel=0.15)
    assert diff_rc.std().item() == pytest.approx(expected, rel=0.15)
    assert_same(ranks[0]["rc_noisy"], ranks[1]["rc_noisy"])
    secure = torch.cat([(ranks[0]["rc_noisy_secure"][n] - clean[n]).flatten() for n in clean])
    assert secure.std().item() == pytest.approx(expected, rel=0.15)
    fc1 = ranks[0]["rc_noisy_secure"]["fc1.weight"] - clean["fc1.weight"]
    assert distinct(fc1[:12], fc1[12:])  # shards drew independently (unseeded: os.urandom)
    fc1 = ranks[0]["rc_noisy"]["fc1.weight"] - clean["fc1.weight"]  # rows 0-11 rank 0, 12-23 rank 1
    assert not torch.isclose(fc1[:12], fc1[12:]).any()


def test_epsilon_equal_on_all_ranks(ranks):
    assert ranks[0]["epsilon"] == ranks[1]["epsilon"] > 0
    assert len(ranks[0]["history"]) == 1  # charged once per step


def test_sketches_shared_across_ranks_per_example_independent(ranks):
    torch.testing.assert_close(ranks[0]["sketch_shared"], ranks[1]["sketch_shared"])
    assert not torch.isclose(ranks[0]["sketch_per_example"], ranks[1]["sketch_per_example"]).any()


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_other_modes_refused_on_fsdp_models(ranks, mode):
    assert "grad_sample_mode='ghost_fsdp'" in ranks[0][f"error_{mode}"]


def test_tied_weights_equal_single_process(ranks):
    """A tied embedding / head: its per-sample norm is the norm of the summed sketched
    gradients of both uses (not two parameters), as in one process."""
    model = make_tied()
    _, (module, opt, crit, _) = private(model, T_SKETCHED, clipping="randomized", mode="ghost")
    x, y = batch(T_SKETCHED)
    crit(module(x), y).backward()
    opt.step()
    single = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert_same(ranks[0]["rc_tied"], single, rtol=1e-4, atol=1e-6)
    initial = dict(make_tied().named_parameters())
    assert not torch.equal(single["emb.weight"], initial["emb.weight"].detach())


def test_ghost_fsdp_needs_an_fsdp_model():
    with pytest.raises(ValueError, match="FSDP2Wrapper"):
        private(make_model(), T_SKETCHED, clipping="randomized", mode="ghost_fsdp")


def test_example_runs_with_torchrun():
    """examples/fsdp_finetune.py under torchrun (2 gloo processes), tiny configuration."""
    root = Path(__file__).resolve().parents[2]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(root / "examples" / "fsdp_finetune.py"), "--steps", "2", "--examples", "64",
        "--batch-size", "16", "--seq-len", "40", "--d-model", "64", "--layers", "1",
        "--sketch-size", "8", "--noise-multiplier", "1.0",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("epsilon = ") == 1  # rank 0 only
    assert "after 2 steps" in proc.stdout


@pytest.mark.parametrize("which", ["refused", "refused_fused"])
def test_refusal_is_agreed_by_every_rank(ranks, which):
    """Rank 1 alone sees a non-finite example: both ranks refuse (rank 0 sees it in its
    shard of the reduce-scattered clipped gradient, or is told it was on another rank)
    and the parameters are the initial ones on both."""
    assert "non-finite per-sample" in ranks[1][which]["error"]
    assert re.search("non-finite (clipped gradient|value on another rank)", ranks[0][which]["error"])
    initial = {f"inner.{n}": p for n, p in make_model().state_dict().items()}
    for r in ranks:
        assert_same(r[which]["params"], initial)


def test_no_host_synchronisation_in_a_step(ranks):
    """Forward, two backward passes and the step under FSDP2, with fused Adam: no Python
    read of a tensor value and no data-dependent shape (benchmarks/host_sync.py) on
    either rank; the collectives run on the device."""
    assert [r["syncs"] for r in ranks] == [[], []]


def test_layer_used_inside_and_after_a_region_is_refused(ranks):
    """Non-reentrant: the second use in the forward pass is refused (a layer applied twice
    is summed over its uses as a tied one, and a LayerNorm has no tied projection: the
    ``tied_layer`` refusal, tests/forms/test_fsdp_reused_layers.py for the layers that run).
    Reentrant: the replay's use comes after the later use's norm was taken; refused too,
    never one of the two uses' norms alone (an under-estimate)."""
    for r in ranks:
        errors = r["reused_across_region"]
        assert "LayerNorm applied twice in one forward pass" in errors[False]
        assert "is not supported: a tied parameter's per-example gradient" in errors[False]
        assert errors[True] is not None and "use_reentrant=False" in errors[True]
