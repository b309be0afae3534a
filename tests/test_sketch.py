"""opacus_rc.sketch: per-example sketches are fresh in every physical batch of a step.

The hidden-Z accounting of ``sketching="per_example"`` assumes an independent sketch per
example. A logical step made of several physical batches (BatchMemoryManager, gradient
accumulation, the private Trainer's accumulation groups) must therefore draw new
per-example sketches for each of them, while a checkpoint recomputation of one physical
batch keeps the sketches of its forward. When every trainable layer sat inside a
``checkpoint(use_reentrant=True)`` region (LoRA with a frozen embedding and head), no
sketch pass started (the region's forward runs without gradients, its replay in the
backward pass): the second physical batch of the same size got the first one's sketches.

The tests record every keyed per-example sketch (``Sketcher.gaussian``) with the physical
batch it was drawn for (a forward pre-hook on the model counts the physical batches; a
checkpoint replay runs only a region, never the model's forward) and check that no two
examples, in any physical batch of the run, share a sketch (``distinct``: a reused sketch
has all its entries equal, independent draws almost none), and that a layer asking again
within one physical batch gets the same sketch.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any, List, Tuple

import pytest
import torch
from opacus import PrivacyEngine
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.utils.checkpoint import checkpoint

from opacus_rc.sketch import Sketcher

from .conftest import distinct

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

VOCAB, T, K = 16, 6, 2  # T > k: the norms are sketched (sketches drawn)
FORMS = ["none", "reentrant", "non_reentrant"]
MODES = {
    "two_pass": dict(grad_sample_mode="ghost"),
    "bookkeeping": dict(grad_sample_mode="hooks"),
    "hooks_object": dict(grad_sample_mode="ghost", wrap_model=False),
}


class FrozenEdges(nn.Module):
    """LoRA-like: frozen embedding and head; the trainable layers (two Linear-tanh-Linear
    blocks) all inside ``checkpoint`` regions of the given form. The embedding's output
    requires grad, as ``enable_input_require_grads()`` makes it (else a reentrant region
    is not differentiated)."""

    def __init__(self, form: str, d: int = 4):
        super().__init__()
        self.form = form
        self.emb = nn.Embedding(VOCAB, d).requires_grad_(False)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d)) for _ in range(2)
        )
        self.head = nn.Linear(d, 2).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x).requires_grad_(True)
        for block in self.blocks:
            if self.form == "none":
                h = h + block(h)
            else:
                h = h + checkpoint(block, h, use_reentrant=self.form == "reentrant")
        return self.head(h).mean(dim=1)


def _ident(key: Any) -> Any:
    """A sketch key (a parameter, a layer, or a tuple of them and tags) with every
    object but a string or number replaced by its id (parameters compare elementwise)."""
    if isinstance(key, tuple):
        return tuple(_ident(k) for k in key)
    return key if isinstance(key, (str, int, float)) else id(key)


class SketchRecorder:
    """Records ``(physical batch, key, sketch)`` for every keyed per-example sketch."""

    def __init__(self, monkeypatch, model: nn.Module):
        self.batch = -1
        self.records: List[Tuple[int, Any, torch.Tensor]] = []
        model.register_forward_pre_hook(self._next_batch)
        gaussian = Sketcher.gaussian

        def recorded(sketcher, batch, rows, cols, device, key=None):
            sketch = gaussian(sketcher, batch, rows, cols, device, key=key)
            if key is not None and sketch.dim() == 3:
                self.records.append((self.batch, (_ident(key), rows, cols), sketch.detach().clone()))
            return sketch

        monkeypatch.setattr(Sketcher, "gaussian", recorded)

    def _next_batch(self, _module, _args) -> None:
        if torch.is_grad_enabled():
            self.batch += 1

    def assert_fresh(self, min_batches: int) -> None:
        """No two examples of the run share a sketch of a layer; within one physical
        batch a layer's repeated requests get the same sketch."""
        first = {}
        for batch, key, sketch in self.records:
            if (batch, key) in first:
                assert torch.equal(first[batch, key], sketch), "a sketch changed within one physical batch"
            else:
                first[batch, key] = sketch
        keys = {key for _, key in first}
        assert keys, "no per-example sketch was drawn"
        assert len({b for b, _ in first}) >= min_batches
        for key in keys:
            examples = [(b, i, s[i]) for (b, k), s in first.items() if k == key for i in range(s.shape[0])]
            for (b1, i1, s1), (b2, i2, s2) in itertools.combinations(examples, 2):
                assert distinct(s1, s2), (
                    f"example {i1} of physical batch {b1} and example {i2} of physical batch {b2} "
                    f"share a per-example sketch"
                )


def batches(n: int, size: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n * size, T), generator=gen)
    y = torch.randint(0, 2, (n * size,), generator=gen)
    return torch.utils.data.TensorDataset(x, y)


def make_private(model: nn.Module, mode: str, dataset, batch_size: int):
    engine = PrivacyEngine(accountant="rc_prv")
    out = engine.make_private(
        module=model, optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
        data_loader=torch.utils.data.DataLoader(dataset, batch_size=batch_size),
        criterion=nn.CrossEntropyLoss(), noise_multiplier=0.0, max_grad_norm=1.0,
        poisson_sampling=False, clipping="randomized", sketch_size=K, sketch_seed=0,
        sketching="per_example", **MODES[mode],
    )
    module = out[0] if isinstance(out[0], nn.Module) else model  # wrap_model=False: hooks object
    criterion = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    return engine, module, out[1], criterion, out[-1]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("form", FORMS)
def test_batch_memory_manager_draws_fresh_sketches_per_physical_batch(form, mode, monkeypatch):
    """Two logical steps of 12 examples, physical batches of 4 (3 per step, equal sizes)."""
    torch.manual_seed(0)
    model = FrozenEdges(form)
    recorder = SketchRecorder(monkeypatch, model)
    engine, module, opt, criterion, loader = make_private(model, mode, batches(2, 12), batch_size=12)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=opt) as physical:
        for x, y in physical:
            criterion(module(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert sum(e[2] for e in engine.accountant.history) == 2  # 2 logical steps of 3 physical batches
    recorder.assert_fresh(min_batches=6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("form", FORMS)
def test_accumulated_micro_batches_draw_fresh_sketches(form, mode, monkeypatch):
    """Two steps, each accumulating two backward passes on batches of 4 before one step."""
    torch.manual_seed(0)
    model = FrozenEdges(form)
    recorder = SketchRecorder(monkeypatch, model)
    _, module, opt, criterion, _ = make_private(model, mode, batches(4, 4), batch_size=4)
    data = batches(4, 4, seed=1).tensors
    for step in range(2):
        for micro in range(2):
            i = 2 * step + micro
            criterion(module(data[0][4 * i: 4 * i + 4]), data[1][4 * i: 4 * i + 4]).backward()
        opt.step()
        opt.zero_grad()
    recorder.assert_fresh(min_batches=4)


@pytest.mark.parametrize("form", FORMS)
def test_private_trainer_accumulation_draws_fresh_sketches(form, tmp_path, monkeypatch):
    """DPTrainer on a LoRA Llama (frozen embedding and head; every trainable layer in a
    checkpointed decoder layer), q = 1 on 8 rows, 2 accumulation steps of 4 rows each."""
    import peft
    from opacus_rc.hf import DPTrainer, PrivacyArguments

    from .hf.test_trainer import training_args
    from .models import RowDataset, tiny_llama

    model = peft.get_peft_model(
        tiny_llama(), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )
    recorder = SketchRecorder(monkeypatch, model)
    options = {} if form == "none" else dict(
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": form == "reentrant"}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPTrainer(
            model=model, args=training_args(tmp_path, max_steps=2, **options), train_dataset=RowDataset(8),
            privacy=PrivacyArguments(noise_multiplier=1.0, delta=1e-5, sketch_size=4, sample_rate=1.0),
        )
        trainer.train()
    recorder.assert_fresh(min_batches=4)


def _ddp_fresh_sketch_worker(rank, init_file, out_dir):
    """One rank of a DPDDP run: two logical steps of 12 examples per rank, physical
    batches of 4 (BatchMemoryManager), every trainable layer in a reentrant region."""
    import os

    import torch.distributed as dist
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = FrozenEdges("reentrant")
    patch = pytest.MonkeyPatch()
    recorder = SketchRecorder(patch, model)
    data = batches(2, 12, seed=rank)  # each rank its own examples
    engine, module, opt, criterion, loader = make_private(DPDDP(model), "two_pass", data, batch_size=12)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=opt) as physical:
        for x, y in physical:
            criterion(module(x), y).backward()
            opt.step()
            opt.zero_grad()
    patch.undo()
    torch.save({"records": recorder.records, "history": engine.accountant.state_dict()["history"]},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_ddp_batch_memory_manager_draws_fresh_sketches_on_every_rank(monkeypatch):
    """2 gloo ranks: on each rank no two examples of any physical batch share a sketch,
    and the ranks' per-example sketches differ from each other's (independent examples)."""
    from .spawn import spawn

    ranks = spawn(_ddp_fresh_sketch_worker, 2)
    for r in ranks:
        recorder = SketchRecorder.__new__(SketchRecorder)
        recorder.records = r["records"]
        recorder.assert_fresh(min_batches=6)
        assert sum(e[2] for e in r["history"]) == 2
    both = SketchRecorder.__new__(SketchRecorder)
    # the layers' ids differ between the processes: compare by (order of first use, shape)
    keys = [sorted({k for _, k, _ in r["records"]}, key=str) for r in ranks]
    both.records = [
        (10 * rank + b, (keys[rank].index(k), k[1:]), s)
        for rank, r in enumerate(ranks) for b, k, s in r["records"]
    ]
    both.assert_fresh(min_batches=12)
