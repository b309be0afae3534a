"""opacus_rc.recompute, activation checkpointing (reentrant, non-reentrant, Hugging Face's
``gradient_checkpointing_enable``) in every randomized-clipping mode.

With exact norms (sequence length T <= sketch size k) and noise 0 the update is the
brute-force one: per-example gradients by plain autograd, one example at a time, each
clipped to C, summed and divided by the batch size. Sketched (T > k), the update with
checkpointing equals the one without for the same sketches, and a recomputation never
starts a new sketch pass.
"""

from __future__ import annotations

import copy
import warnings
from typing import Callable, Dict, List, Optional

import peft
import pytest
import torch
import torch.nn.functional as F
import transformers
from opacus import PrivacyEngine
from torch import nn
from torch.utils.checkpoint import checkpoint

from opacus_rc.sketch import Sketcher

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")  # tiny tensors: threads only contend

VOCAB, T, BATCH, CLIP, STEPS = 24, 6, 3, 0.05, 3

#: mode name -> make_private options
MODES: Dict[str, dict] = {
    "two_pass": dict(grad_sample_mode="ghost"),
    "bookkeeping": dict(grad_sample_mode="hooks"),
    "ghost_bookkeeping": dict(grad_sample_mode="ghost", bookkeeping=True),
    "hooks_object": dict(grad_sample_mode="ghost", wrap_model=False),
    "bookkeeping_hooks_object": dict(grad_sample_mode="hooks", wrap_model=False),
    "per_example": dict(per_example_backward=True),  # one example per backward pass, exact
    "per_example_hooks_object": dict(per_example_backward=True, wrap_model=False),
}
#: the forms that sketch and keep per-layer state (the per-example form has neither: plain
#: autograd's gradient of each example, which also leaves a reentrant region without a grad
#: input untrained, as in non-private training)
SKETCHED_MODES = [m for m in MODES if not m.startswith("per_example")]


# --- models ---------------------------------------------------------------------------


class CheckpointedMLP(nn.Module):
    """Embedding, then blocks of Linear-tanh-Linear, each block (optionally) run under
    ``torch.utils.checkpoint``, mean-pooled and classified.

    ``use_reentrant``: None (no checkpointing), a bool (one region per block) or a pair
    ``(outer, inner)``: one region around all blocks, a nested region per block.
    """

    def __init__(self, use_reentrant=None, d: int = 8, blocks: int = 2):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d)) for _ in range(blocks)
        )
        self.head = nn.Linear(d, 2)

    def _blocks(self, h: torch.Tensor, use_reentrant: Optional[bool]) -> torch.Tensor:
        for block in self.blocks:
            if use_reentrant is None:
                h = h + block(h)
            else:
                h = h + checkpoint(block, h, use_reentrant=use_reentrant)
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        if isinstance(self.use_reentrant, tuple):
            outer, inner = self.use_reentrant
            h = checkpoint(self._blocks, h, inner, use_reentrant=outer)
        else:
            h = self._blocks(h, self.use_reentrant)
        return self.head(h).mean(dim=1)


def llama(tied: bool = False, layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        attn_implementation="eager", tie_word_embeddings=tied,
    )
    return transformers.LlamaForCausalLM(cfg)


def enable_hf_checkpointing(model: nn.Module, form: str) -> None:
    """``form``: "none", "hf_default" (no arguments), "hf_reentrant", "hf_non_reentrant"."""
    if form == "none":
        return
    kwargs = {
        "hf_default": {},
        "hf_reentrant": {"gradient_checkpointing_kwargs": {"use_reentrant": True}},
        "hf_non_reentrant": {"gradient_checkpointing_kwargs": {"use_reentrant": False}},
    }[form]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated alias in transformers 5
        model.gradient_checkpointing_enable(**kwargs)


def lora(model: nn.Module) -> nn.Module:
    return peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))


# --- data and losses ------------------------------------------------------------------


def batches(n_steps: int = STEPS, batch: int = BATCH, t: int = T, classes: bool = False):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n_steps):
        x = torch.randint(0, VOCAB, (batch, t), generator=gen)
        y = torch.randint(0, 2, (batch,), generator=gen) if classes else x.roll(-1, dims=1)
        out.append((x, y))
    return out


def lm_logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(x.shape[1]).repeat(x.shape[0], 1)  # per-sample position ids
    return model(input_ids=x, position_ids=positions).logits


def per_example_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B,) losses: cross-entropy, averaged over the sequence for an LM."""
    if logits.dim() == 2:
        return F.cross_entropy(logits, y, reduction="none")
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none").view(y.shape).mean(1)


def private_loss(criterion, logits: torch.Tensor, y: torch.Tensor):
    """The loss whose ``backward()`` the mode runs (criterion of the 4-tuple, or a plain
    mean of per-example losses for book-keeping's 3-tuple)."""
    if criterion is None:
        return per_example_loss(logits, y).mean()
    if logits.dim() == 2:
        return criterion(logits, y)
    return criterion(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), shape=logits.shape[:2])


# --- reference and private training ---------------------------------------------------


def brute_force_steps(model: nn.Module, forward: Callable, data) -> List[Dict[str, torch.Tensor]]:
    """SGD (lr 1) on sum_i clip_C(grad_i) / B, per-example grads by plain autograd."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out = []
    for x, y in data:
        total = {n: torch.zeros_like(p) for n, p in params.items()}
        for i in range(x.shape[0]):
            model.zero_grad()
            per_example_loss(forward(model, x[i : i + 1]), y[i : i + 1]).sum().backward()
            grads = {n: p.grad.detach().clone() for n, p in params.items()}
            norm = torch.stack([g.pow(2).sum() for g in grads.values()]).sum().sqrt()
            factor = min(1.0, CLIP / (float(norm) + 1e-6))
            for n in total:
                total[n] += factor * grads[n]
        with torch.no_grad():
            for n, p in params.items():
                p -= total[n] / x.shape[0]
        model.zero_grad()
        out.append({n: p.detach().clone() for n, p in params.items()})
    return out


def private_steps(model: nn.Module, forward: Callable, data, mode: str, **options):
    """Parameters after each step of SGD (lr 1) with randomized clipping, noise 0; checks
    after each step that no layer keeps activations or a batch size."""
    engine = PrivacyEngine(accountant="rc_prv")
    x0 = torch.cat([x for x, _ in data])
    y0 = torch.cat([y for _, y in data])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x0, y0), batch_size=data[0][0].shape[0])
    params = [p for p in model.parameters() if p.requires_grad]
    settings = {**MODES[mode], "sketch_size": 8, "sketch_seed": 0, "sketching": "shared", **options}
    out = engine.make_private(
        module=model, optimizer=torch.optim.SGD(params, lr=1.0), data_loader=loader,
        criterion=nn.CrossEntropyLoss(), noise_multiplier=0.0, max_grad_norm=CLIP,
        poisson_sampling=False, clipping="randomized", **settings,
    )
    module = out[0] if isinstance(out[0], nn.Module) else model  # wrap_model=False: hooks object
    opt = out[1]
    criterion = out[2] if len(out) == 4 else None
    names = {id(p): n for n, p in model.named_parameters()}
    history = []
    one_at_a_time = bool(settings.get("per_example_backward"))
    for x, y in data:
        parts = [(x[i:i + 1], y[i:i + 1]) for i in range(len(x))] if one_at_a_time else [(x, y)]
        for j, (xj, yj) in enumerate(parts):  # the per-example form: one example per backward
            private_loss(criterion, forward(module, xj), yj).backward()
            if j < len(parts) - 1:
                opt.signal_skip_step(do_skip=True, same_draw=True)
            opt.step()
            opt.zero_grad()
        leftovers = [
            type(m).__name__ for m in model.modules()
            if getattr(m, "activations", None) or hasattr(m, "max_batch_len")
        ]
        assert not leftovers, f"stale activations or batch sizes left on {leftovers}"
        history.append({names[id(p)]: p.detach().clone() for p in params})
    return history


def assert_same_trajectory(got, want, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys()
        for name in w:
            torch.testing.assert_close(g[name], w[name], rtol=rtol, atol=atol, msg=lambda m: f"step {step}, {name}: {m}")


def mlp_forward(model, x):
    return model(x)


def hf_forward(model, x):
    return lm_logits(model, x)


# --- exact norms: equal to brute force ------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "use_reentrant",
    [None, True, False, (False, False), (True, False), (False, True)],
    ids=["none", "reentrant", "non_reentrant", "nested_non_reentrant", "non_reentrant_in_reentrant",
         "reentrant_in_non_reentrant"],
)
def test_plain_module_checkpoint_equals_brute_force(mode, use_reentrant):
    """torch.utils.checkpoint around Linear blocks, exact norms, noise 0, 3 steps."""
    torch.manual_seed(0)
    init = CheckpointedMLP()
    data = batches(classes=True)
    want = brute_force_steps(copy.deepcopy(init), mlp_forward, data)
    model = copy.deepcopy(init)
    model.use_reentrant = use_reentrant
    assert_same_trajectory(private_steps(model, mlp_forward, data, mode), want)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("form", ["none", "hf_default", "hf_reentrant", "hf_non_reentrant"])
@pytest.mark.parametrize("peft", [False, True], ids=["llama", "peft_lora"])
def test_hf_llama_checkpointing_equals_brute_force(mode, form, peft):
    """Tiny LlamaForCausalLM, HF gradient checkpointing in each form, 3 steps; with PEFT
    LoRA on q/v (frozen base) too, without ``enable_input_require_grads()`` from the user."""
    init = lora(llama()) if peft else llama()
    init.train()
    data = batches()
    want = brute_force_steps(copy.deepcopy(init), hf_forward, data)
    model = copy.deepcopy(init)
    enable_hf_checkpointing(model, form)
    assert_same_trajectory(private_steps(model, hf_forward, data, mode), want)


# --- sketched norms: checkpointing changes nothing -----------------------------------


class _PassCounter:
    """Counts ``Sketcher.begin_pass`` calls and sketches drawn."""

    def __init__(self, monkeypatch):
        self.passes = self.draws = 0
        begin, draw = Sketcher.begin_pass, Sketcher._draw

        def counted_begin(sketcher):
            self.passes += 1
            return begin(sketcher)

        def counted_draw(sketcher, *args, **kwargs):
            self.draws += 1
            return draw(sketcher, *args, **kwargs)

        monkeypatch.setattr(Sketcher, "begin_pass", counted_begin)
        monkeypatch.setattr(Sketcher, "_draw", counted_draw)


@pytest.mark.parametrize("sketching", ["shared", "per_example"])
@pytest.mark.parametrize("mode", SKETCHED_MODES)
@pytest.mark.parametrize("form", ["hf_reentrant", "hf_non_reentrant"])
def test_sketched_update_unchanged_by_checkpointing(mode, form, sketching, monkeypatch):
    """T > k: same sketch seed, same update with and without checkpointing; one sketch
    pass per step and the same number of sketches drawn (per-example sketches are the
    ones a new pass would redraw)."""
    init = llama()
    init.train()
    data = batches(t=12)
    counts = []
    runs = []
    for f in ("none", form):
        counter = _PassCounter(monkeypatch)
        model = copy.deepcopy(init)
        enable_hf_checkpointing(model, f)
        runs.append(private_steps(model, hf_forward, data, mode, sketch_size=2, sketching=sketching))
        counts.append((counter.passes, counter.draws))
    assert_same_trajectory(runs[1], runs[0])
    assert counts[1] == counts[0]
    assert counts[0][0] == STEPS  # one sketch pass per step


@pytest.mark.parametrize("form", ["none", "hf_reentrant", "hf_non_reentrant"])
@pytest.mark.parametrize("mode", ["two_pass", "hooks_object"])
def test_tied_embedding_one_sketch_per_step(mode, form, monkeypatch):
    """Tied embedding / LM head (per-example sketches, T > k): one sketch pass per step
    whatever recomputes, and the update equals the one without checkpointing."""
    init = llama(tied=True)
    init.train()
    data = batches(t=12)
    reference = private_steps(copy.deepcopy(init), hf_forward, data, mode, sketch_size=2, sketching="per_example")
    counter = _PassCounter(monkeypatch)
    model = copy.deepcopy(init)
    enable_hf_checkpointing(model, form)
    got = private_steps(model, hf_forward, data, mode, sketch_size=2, sketching="per_example")
    assert counter.passes == STEPS
    assert_same_trajectory(got, reference)


# --- what cannot be computed is refused ----------------------------------------------


@pytest.mark.parametrize("mode", SKETCHED_MODES)
def test_reentrant_region_without_grad_input_is_refused(mode):
    """checkpoint(use_reentrant=True) on a region whose input does not require grad (a
    frozen embedding in front): torch differentiates nothing inside it; the step is
    refused with a message naming the supported forms, before any update."""
    torch.manual_seed(0)
    model = CheckpointedMLP(use_reentrant=True)
    model.emb.weight.requires_grad_(False)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"use_reentrant=False.*enable_input_require_grads"):
        private_steps(model, mlp_forward, batches(n_steps=1, classes=True), mode)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k])


class SometimesSkipped(nn.Module):
    """A trainable layer used at the first step only."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.extra = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.emb(x)
        if self.calls == 1:
            h = self.extra(h)
        return self.head(h).mean(dim=1)


@pytest.mark.parametrize("mode", ["two_pass", "hooks_object"])
def test_norms_of_a_layer_left_out_of_a_pass_are_not_reused(mode):
    """The per-sample norms of a pass are consumed by its clipping: a layer that takes
    no part in the next pass is refused, never clipped with the last batch's norms."""
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="no per-sample gradient for 'extra.weight', 'extra.bias'"):
        private_steps(SometimesSkipped(), mlp_forward, batches(n_steps=2, classes=True), mode)


@pytest.mark.parametrize("form", ["none", "hf_non_reentrant"])
def test_inputs_in_non_reentrant_regions_are_not_kept(form):
    """After the forward pass, the captured inputs of the layers inside checkpointed
    decoder layers are checkpointing's placeholders (recomputed in the backward pass),
    not tensors that would pin what checkpointing frees; outside regions (embedding, LM
    head) and without checkpointing they are tensors."""
    from opacus_rc.recompute import SavedInputs

    model = llama()
    model.train()
    enable_hf_checkpointing(model, form)
    (x, y), = batches(n_steps=1)
    engine = PrivacyEngine(accountant="rc_prv")
    module, opt, crit, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH),
        criterion=nn.CrossEntropyLoss(), noise_multiplier=0.0, max_grad_norm=CLIP,
        poisson_sampling=False, clipping="randomized", grad_sample_mode="ghost", sketch_size=8,
    )
    logits = hf_forward(module, x)
    kinds = {
        name: type(m.activations[-1]) is SavedInputs
        for name, m in model.named_modules() if getattr(m, "activations", None)
    }
    inside = {name for name in kinds if ".layers." in name}
    assert inside and len(inside) < len(kinds)
    assert all(kinds[n] == (form != "none") for n in inside)
    assert not any(kinds[n] for n in set(kinds) - inside)
    private_loss(crit, logits, y).backward()
    opt.step()
    assert not any(getattr(m, "activations", None) for m in model.modules())


class SharedAcrossRegion(nn.Module):
    """One Linear used inside a checkpointed block and again after it (a tied use)."""

    def __init__(self, use_reentrant: Optional[bool]):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.emb = nn.Embedding(VOCAB, 8)
        self.shared = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def _block(self, h):
        return torch.tanh(self.shared(h))

    def forward(self, x):
        h = self.emb(x)
        if self.use_reentrant is None:
            h = self._block(h)
        else:
            h = checkpoint(self._block, h, use_reentrant=self.use_reentrant)
        return self.head(self.shared(h)).mean(dim=1)


class SharedInTwoRegions(SharedAcrossRegion):
    """One Linear used in two checkpointed blocks (ALBERT-style sharing under
    checkpointing)."""

    def forward(self, x):
        h = self.emb(x)
        for _ in range(2):
            h = self._block(h) if self.use_reentrant is None else checkpoint(
                self._block, h, use_reentrant=self.use_reentrant)
        return self.head(h).mean(dim=1)


@pytest.mark.parametrize("shared", [SharedAcrossRegion, SharedInTwoRegions], ids=["after_region", "two_regions"])
@pytest.mark.parametrize("mode", ["two_pass", "hooks_object", "bookkeeping", "ghost_bookkeeping"])
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_parameter_used_inside_and_after_a_region(mode, use_reentrant, shared):
    """A Linear used inside a region and after it, or in two regions (ALBERT-style).
    Non-reentrant: the uses' sum is the one without checkpointing (same sketches).
    Reentrant: one use's norm (two-pass) or record (book-keeping) is complete before the
    region recomputes the other use, so the step is refused with the supported form (one
    clip factor per example, never one per use)."""
    torch.manual_seed(0)
    init = shared(use_reentrant=None)
    data = batches(classes=True)
    model = copy.deepcopy(init)
    model.use_reentrant = use_reentrant
    if use_reentrant:
        with pytest.raises(ValueError, match=r"inside a checkpoint.*use_reentrant=False"):
            private_steps(model, mlp_forward, data, mode)
        return
    want = private_steps(copy.deepcopy(init), mlp_forward, data, mode)
    assert_same_trajectory(private_steps(model, mlp_forward, data, mode), want)


def test_reading_the_saved_tensors_hooks_stack_leaves_it_unchanged():
    """forward_replay() walks the hooks stack by popping and pushing back: the stack,
    nested contexts included, is the same afterwards (their exits still match)."""
    from opacus_rc.recompute import _saved_tensors_pack_hooks, forward_replay

    def pack_a(x):
        return x

    def pack_b(x):
        return x

    assert forward_replay() is None and _saved_tensors_pack_hooks() == []
    with torch.autograd.graph.saved_tensors_hooks(pack_a, lambda x: x):
        with torch.autograd.graph.saved_tensors_hooks(pack_b, lambda x: x):
            assert _saved_tensors_pack_hooks() == [pack_b, pack_a]
            assert forward_replay() is None
            assert torch._C._autograd._top_saved_tensors_default_hooks(False)[0] is pack_b
        assert _saved_tensors_pack_hooks() == [pack_a]
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
