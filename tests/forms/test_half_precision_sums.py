"""Half-precision clipped sums reach the noise in float32 (issue 52): with bf16 parameters, and
with float32 parameters under bf16 autocast, removing one of n aligned rows moves the clipped
sum by one clipped contribution, about C, in every form (opacus_rc.half_precision).

Setup. n identical rows (the same tokens and label): every example has the same gradient g,
clipped to norm C, so the step's clipped sum is ``S(n) = n v``, ``||v|| ~ C``. Noise 0, lr 0,
``loss_reduction="sum"``, q = 1 (every row drawn), exact norms (T <= k); S is read, float32, right
before the noise is added (``optimizer.add_noise``: the clipped sums, before the public
normaliser divides them). The neighbour has one row fewer (add/remove: the dataset shrinks).

Checks, with u = 2^-8 (bf16's unit roundoff), tau = 1e-3 and kappa = 16:

1. **one contribution**: ``||S(n) - S(n-1) - S(n)/n|| <= tau C``. Every row contributes the same
   v in both runs, so a sum that is not rounded moves by exactly v; float32 accumulation of
   n ~ 10^3 terms of norm C errs by about sqrt(n) 2^-24 n C ~ 2e-3 C in a random walk of
   roundings and by about 5e-5 C as measured (blocked matmuls, index_add): tau = 1e-3 C is
   ample, while a sum rounded to bf16 moves by up to 2^-9 n C (2 C at n = 1,029).
2. **sensitivity**: ``||S(n) - S(n-1)|| <= C (1 + kappa u) + tau C``: the contribution v is one
   example's half-precision gradient times its float32 clip factor; its norm is C up to the
   relative error of that gradient, at most kappa u for kappa rounded operations on its path
   (tests/forms/test_precision.py's bound; measured: 0.2% in the two-pass forms, whose clipped
   pass recomputes the gradient the norm was taken of).
3. **brute force**: per parameter p, ``||S_p(n) - n v*_p|| <= n (2 kappa u ||v*_p|| + tau C / P)``
   where v* is plain autograd's float64 gradient of one row at the same (widened) initial
   values, clipped to C (tests/oracles.py), and P the number of parameters: a half-precision
   gradient and its clip factor each err by at most kappa u relative; a parameter whose sum is
   missing misses by ``n ||v*_p||``.

Why ``"sum"`` here: under ``loss_reduction="mean"`` the backward pass of a mean loss multiplies
every example's gradient by 1/n, and in half precision each example's rounding then depends on
n itself: every contribution changes with the neighbour, by a relative u (measured with these
float32 sums at n = 1,029: up to 4.4 C). The plugin's own criteria and the private Trainer
therefore sum the losses in their backward passes whatever ``loss_reduction`` (checks 1-3 hold
under "mean": :func:`test_under_a_mean_loss_one_row_moves_the_sum_by_one_contribution`), and a
mean the script computes itself in half precision is refused by name
(:func:`test_a_mean_of_the_scripts_own_loss_in_half_precision_is_refused`).

Before the fix (e8eb7d9), checks 1-2 failed in the two-pass and book-keeping forms: with an
embedding or a LayerNorm the step was refused (the norm pass's bf16 embedding and LayerNorm
gradients, summed term by term in bf16 on CPU, were 65-73% off the float32 in-module sums); on
a linear model one row moved the sum by 1.2 to 3.1 C (linearity error 0.9 to 2.7 C). FSDP2 and
DDP: two gloo ranks (:func:`test_fsdp2_gloo_sums_are_float32`, :func:`test_ddp_gloo_sums_are_float32`).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Dict, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from opacus import PrivacyEngine
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn

import opacus_rc  # noqa: F401
from opacus_rc.lm_head import ChunkedLMHeadLoss
from opacus_rc.norm_samplers import RANDOMIZED_NORM_SAMPLERS, register_randomized_norm_sampler

from tests.models import CheckpointedSequenceClassifier, HeadModel, SequenceClassifier
from tests.oracles import per_example_clipped_mean
from tests.spawn import spawn

C, ROW, LABEL = 0.01, (3, 17, 5, 9), 1
U, KAPPA, TAU = 2.0**-8, 16, 1e-3
N, N_PER_EXAMPLE = 1029, 259  # the per-example form runs one backward pass per row

#: name -> make_private options, the model class, the loader's physical batch (None: one)
FORMS: Dict[str, Tuple[dict, type, Optional[int]]] = {
    "two_pass": (dict(grad_sample_mode="ghost"), SequenceClassifier, None),
    "two_pass_physical_batches": (dict(grad_sample_mode="ghost"), SequenceClassifier, 400),
    "output_passes": (dict(grad_sample_mode="hooks", bookkeeping=False), CheckpointedSequenceClassifier, None),
    "bookkeeping": (dict(grad_sample_mode="bookkeeping"), SequenceClassifier, None),
    "bookkeeping_with_criterion": (dict(grad_sample_mode="ghost", bookkeeping=True), SequenceClassifier, None),
    "per_example": (dict(per_example_backward=True), SequenceClassifier, None),
}
#: (parameter dtype, autocast dtype or None)
PRECISIONS = {"bf16": (torch.bfloat16, None), "autocast_bf16": (torch.float32, torch.bfloat16)}


def aligned_rows(n: int) -> torch.utils.data.TensorDataset:
    """n identical rows: every example has the same gradient."""
    return torch.utils.data.TensorDataset(torch.tensor([ROW]).repeat(n, 1), torch.full((n,), LABEL))


def initial(model_class: type, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return model_class().to(dtype)


def private(model: nn.Module, data, batch_size: int, reduction: str = "sum", **options):
    """make_private at noise 0, lr 0, exact norms; q = 1 (every row in the draw) and ``seed=`` unless
    ``options`` set them (None: left out)."""
    options = {k: v for k, v in dict(dict(sample_rate=1.0, seed=5), **options).items() if v is not None}
    engine = PrivacyEngine(accountant="rc_prv")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            criterion=nn.CrossEntropyLoss(reduction=reduction), loss_reduction=reduction,
            data_loader=torch.utils.data.DataLoader(data, batch_size=batch_size), noise_multiplier=0.0,
            max_grad_norm=C, clipping="randomized", sketch_size=64, **options,
        )


def read_sums_at_the_noise(optimizer) -> dict:
    """What ``optimizer.add_noise`` finds: the step's clipped sums (float64 copies) and their dtypes."""
    seen: dict = {}
    add_noise = optimizer.add_noise

    def reading() -> None:
        sums = [s.full_tensor() if hasattr(s, "full_tensor") else s for s in optimizer._clipped_sums()]  # (FSDP2)
        seen["sums"] = [s.detach().double().clone() for s in sums]
        seen["dtypes"] = {s.dtype for s in sums}
        add_noise()

    optimizer.add_noise = reading
    return seen


def released_sums(form: str, rows: int, precision: str, reduction: str = "sum") -> dict:
    """One step of ``form`` on ``rows`` aligned rows; the clipped sums at the noise."""
    options, model_class, physical = FORMS[form]
    dtype, autocast = PRECISIONS[precision]
    model = initial(model_class, dtype)
    module, optimizer, *rest = private(model, aligned_rows(rows), rows, reduction, **options)
    *criterion, loader = rest
    if form == "output_passes":
        assert module.output_passes is not None  # the checkpointed model's plain loss: two passes from its output
    seen = read_sums_at_the_noise(optimizer)
    cast = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
    managed = BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical, optimizer=optimizer) if physical else None
    with managed if managed is not None else contextlib.nullcontext() as split:
        for x, y in split if managed is not None else loader:
            with cast:
                out = module(x)
                loss = criterion[0](out, y) if criterion else F.cross_entropy(out, y, reduction=reduction)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if "sums" in seen:
                return seen
    raise AssertionError("no step was taken")


def flat(sums) -> torch.Tensor:
    return torch.cat([s.flatten() for s in sums])


def brute_force(model_class: type, dtype: torch.dtype, rows: int, reduction: str = "sum") -> list:
    """n v*: plain autograd's float64 gradient of one row at the widened initial values, clipped
    to C, times the rows (per parameter, in the optimizer's order)."""
    model = initial(model_class, dtype).double()
    x, y = aligned_rows(1).tensors
    loss_of = lambda m, xb, yb: F.cross_entropy(m(xb), yb)  # noqa: E731  (one row: mean = sum)
    return list(per_example_clipped_mean(model, loss_of, x, y, C, 1.0 / rows).values())


def assert_one_contribution(s_n: torch.Tensor, s_less: torch.Tensor, n: int, c: float = C) -> None:
    """Checks 1 and 2 of the module docstring."""
    moved = s_n - s_less
    assert (moved - s_n / n).norm() <= TAU * c, f"the sum moved by {moved.norm() / c:.4f} C, one row is {s_n.norm() / n / c:.4f} C"
    assert moved.norm() <= c * (1 + KAPPA * U) + TAU * c, f"one row moved the sum by {moved.norm() / c:.4f} C"


def assert_brute_force(sums: list, reference: list, n: int) -> None:
    """Check 3 of the module docstring."""
    for got, want in zip(sums, reference):
        error = (got - want.reshape(got.shape)).norm()
        assert error <= 2 * KAPPA * U * want.norm() + n * TAU * C / len(sums), (error, want.norm())


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
@pytest.mark.parametrize("form", sorted(FORMS))
def test_removing_one_aligned_row_moves_the_float32_sum_by_one_contribution(form, precision):
    n = N_PER_EXAMPLE if form == "per_example" else N
    seen, less = released_sums(form, n, precision), released_sums(form, n - 1, precision)
    assert seen["dtypes"] == less["dtypes"] == {torch.float32}
    assert_one_contribution(flat(seen["sums"]), flat(less["sums"]), n)
    assert_brute_force(seen["sums"], brute_force(FORMS[form][1], PRECISIONS[precision][0], n), n)


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
@pytest.mark.parametrize("form", ["two_pass", "bookkeeping_with_criterion", "per_example"])
def test_under_a_mean_loss_one_row_moves_the_sum_by_one_contribution(form, precision):
    """``loss_reduction="mean"`` where the plugin reduces the losses itself (the ghost criterion,
    in the two-pass form and behind book-keeping: its backward passes sum the per-example losses,
    no 1/n enters a gradient) or where a backward pass holds one example: checks 1-3 hold (before,
    4.4 C under bf16 autocast in the two-pass form at n = 1,029)."""
    n = N_PER_EXAMPLE if form == "per_example" else N
    seen, less = released_sums(form, n, precision, "mean"), released_sums(form, n - 1, precision, "mean")
    assert_one_contribution(flat(seen["sums"]), flat(less["sums"]), n)
    assert_brute_force(seen["sums"], brute_force(FORMS[form][1], PRECISIONS[precision][0], n), n)


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
@pytest.mark.parametrize("form", ["bookkeeping", "output_passes", "two_pass_physical_batches"])
def test_a_mean_of_the_scripts_own_loss_in_half_precision_is_refused(form, precision):
    """A plain loss the script averages itself (book-keeping, output passes) computes in half
    precision with 1/n of the realised batch in every example's gradient: refused by name at its
    backward pass, nothing released (the sums are not read). The ghost criterion over
    BatchMemoryManager's physical batches sums its losses: it runs."""
    if form == "two_pass_physical_batches":
        assert "sums" in released_sums(form, 64, precision, "mean")
        return
    with pytest.raises(ValueError, match="loss_reduction='mean' with a model that computes in half precision"):
        released_sums(form, 64, precision, "mean")


def test_a_float32_mean_loss_runs_in_every_form():
    """The refusal is of half precision only: float32 under "mean" releases one contribution per row."""
    for form in ("bookkeeping", "output_passes"):
        options, model_class, _ = FORMS[form]
        sums = []
        for rows in (65, 64):
            model = initial(model_class, torch.float32)
            module, optimizer, *rest = private(model, aligned_rows(rows), rows, "mean", **options)
            seen = read_sums_at_the_noise(optimizer)
            x, y = next(iter(rest[-1]))
            F.cross_entropy(module(x), y).backward()
            optimizer.step()
            sums.append(flat(seen["sums"]))
        assert_one_contribution(sums[0], sums[1], 65)


# --- the chunked LM head, and Hugging Face GPT-2 (Conv1D, a head tied to the embedding) ------

HEAD_LABELS = (17, 5, 9, 3)
HEAD_FORMS = {
    "two_pass": dict(grad_sample_mode="ghost"),
    "bookkeeping": dict(grad_sample_mode="bookkeeping"),
    "bookkeeping_with_criterion": dict(grad_sample_mode="ghost", bookkeeping=True),
}


def head_sums(form: str, rows: int) -> dict:
    """One step of ``form`` with :class:`ChunkedLMHeadLoss` (per-sequence token sums, summed) on
    ``rows`` aligned rows, bf16 parameters; the clipped sums at the noise."""
    model = initial(HeadModel, torch.bfloat16)
    head_loss = ChunkedLMHeadLoss(model.head, block_size=3, reduction="sum")
    data = torch.utils.data.TensorDataset(torch.tensor([ROW]).repeat(rows, 1), torch.tensor([HEAD_LABELS]).repeat(rows, 1))
    engine = PrivacyEngine(accountant="rc_prv")
    options = dict(HEAD_FORMS[form], criterion=head_loss) if form != "bookkeeping" else HEAD_FORMS[form]
    module, optimizer, *rest = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), loss_reduction="sum",
        data_loader=torch.utils.data.DataLoader(data, batch_size=rows), noise_multiplier=0.0, max_grad_norm=C,
        clipping="randomized", poisson_sampling=False, sketch_size=64, seed=5, **options,
    )
    criterion = rest[0] if len(rest) == 2 else head_loss
    seen = read_sums_at_the_noise(optimizer)
    x, y = next(iter(rest[-1]))
    criterion(module(x), y).backward()
    optimizer.step()
    return seen


def head_brute_force(rows: int) -> list:
    model = initial(HeadModel, torch.bfloat16).double()
    x, y = torch.tensor([ROW]), torch.tensor([HEAD_LABELS])
    loss_of = lambda m, xb, yb: F.cross_entropy(m.head(m(xb)).transpose(1, 2), yb, reduction="sum")  # noqa: E731
    return list(per_example_clipped_mean(model, loss_of, x, y, C, 1.0 / rows).values())


@pytest.mark.parametrize("form", sorted(HEAD_FORMS))
def test_chunked_head_sums_are_float32(form):
    """:class:`ChunkedLMHeadLoss` sums its weight gradient block by block: each block's matmul in
    float32 (not rounded to bf16 per block, nor at the end to the head's dtype)."""
    seen, less = head_sums(form, N), head_sums(form, N - 1)
    assert seen["dtypes"] == {torch.float32}
    assert_one_contribution(flat(seen["sums"]), flat(less["sums"]), N)
    assert_brute_force(seen["sums"], head_brute_force(N), N)


GPT2_FORMS = {"output_passes": dict(grad_sample_mode="hooks", bookkeeping=False), "bookkeeping": dict(grad_sample_mode="bookkeeping")}


def gpt2(dtype: torch.dtype, form: str) -> nn.Module:
    """GPT-2 (one layer); its head untied for book-keeping, which refuses tied weights."""
    from tests.models import TokenLM, hf_model

    lm = hf_model("gpt2")
    if form == "bookkeeping":
        lm.config.tie_word_embeddings = False
        lm.lm_head.weight = nn.Parameter(lm.lm_head.weight.detach().clone())
    return TokenLM(lm).to(dtype)


def gpt2_sums(form: str, rows: int, precision: str) -> dict:
    """A plain-loss step (token losses summed) of Hugging Face GPT-2 (Conv1D layers, the LM head
    tied to the token embedding, LayerNorm, position embeddings) on aligned rows."""
    dtype, autocast = PRECISIONS[precision]
    model = gpt2(dtype, form)
    data = torch.utils.data.TensorDataset(torch.tensor([ROW]).repeat(rows, 1), torch.tensor([HEAD_LABELS]).repeat(rows, 1))
    # the tied weight's norm is always sketched: one sketch shared by the rows keeps them alike
    module, optimizer, loader = private(model, data, rows, sketching="shared", **GPT2_FORMS[form])
    seen = read_sums_at_the_noise(optimizer)
    x, y = next(iter(loader))
    cast = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with cast:
        logits = module(x)
    F.cross_entropy(logits.float().transpose(1, 2), y, reduction="sum").backward()
    optimizer.step()
    return seen


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
@pytest.mark.parametrize("form", sorted(GPT2_FORMS))
def test_gpt2_conv1d_and_tied_head_sums_are_float32(form, precision):
    """Conv1D's weight gradient in a half-precision call: deferred like a linear layer's (summed
    in float32 in the clipped pass; the tied head and embedding both add theirs), or from
    Opacus's per-sample gradients (book-keeping, head untied)."""
    seen, less = gpt2_sums(form, N, precision), gpt2_sums(form, N - 1, precision)
    assert seen["dtypes"] == {torch.float32}
    assert_one_contribution(flat(seen["sums"]), flat(less["sums"]), N)
    model = gpt2(PRECISIONS[precision][0], form).double()
    loss_of = lambda m, xb, yb: F.cross_entropy(m(xb).transpose(1, 2), yb, reduction="sum")  # noqa: E731
    reference = per_example_clipped_mean(model, loss_of, torch.tensor([ROW]), torch.tensor([HEAD_LABELS]), C, 1.0 / N)
    assert_brute_force(seen["sums"], list(reference.values()), N)


# --- what stays refused in half precision ----------------------------------------------------


@pytest.mark.parametrize("mode", ["ghost", "bookkeeping"])
@pytest.mark.parametrize("outside", ["embedding", "layernorm"])
def test_a_parameter_also_used_outside_its_module_is_refused_exactly(outside, mode):
    """In a half-precision call autograd computes no in-module gradient: any gradient left is an
    outside use, refused at the step with no tolerance (a comparison with autograd's bf16 batch
    sum, 65-73% off on CPU, could not tell)."""
    from tests.test_clip_guard import OutsideUse, classification_data

    model = OutsideUse(outside).to(torch.bfloat16)
    x, y = classification_data()
    module, optimizer, *rest = private(model, torch.utils.data.TensorDataset(x, y), len(x), grad_sample_mode=mode)
    loss = rest[0](module(x), y) if len(rest) == 2 else F.cross_entropy(module(x), y, reduction="sum")
    with pytest.raises(ValueError, match="outside its module"):
        loss.backward()
        optimizer.step()
    assert all(getattr(p, "wide_grad", None) is None for p in model.parameters())


def test_a_layer_called_in_both_precisions_in_one_step_is_refused():
    """Its clipped sum would be part autograd's, part the engine's."""

    class Twice(SequenceClassifier):
        def forward(self, x):
            h = torch.tanh(self.fc1(self.emb(x)))
            with torch.autocast("cpu", enabled=False):
                h = h + self.fc1(self.emb(x).float())
            return self.fc2(self.norm(h)).mean(dim=1)

    model = initial(Twice, torch.float32)
    data = aligned_rows(8)
    module, optimizer, criterion, loader = private(model, data, 8, grad_sample_mode="ghost")
    x, y = data.tensors
    with pytest.raises(ValueError, match="both in half precision and in float32"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            criterion(module(x), y).backward()


class Scale(nn.Module):
    """``x * w``: a layer with a registered randomized norm sampler (no per-example gradient)."""

    def __init__(self, d: int = 24) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.weight


class Scaled(SequenceClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.scale = Scale()

    def forward(self, x):
        return self.fc2(self.scale(self.norm(torch.tanh(self.fc1(self.emb(x)))))).mean(dim=1)


def test_a_layer_whose_norm_sampler_gives_no_per_example_gradient_is_refused_in_half_precision():
    """Its clipped sum can be neither autograd's (a bf16 batch sum) nor the engine's (no
    per-example gradient): a ValueError naming the layer, nothing released."""

    @register_randomized_norm_sampler(Scale)
    def scale_norms(layer, activations, backprops, sketcher):
        per_example = (activations[0] * backprops).flatten(1, -2).float().sum(dim=1)
        return {layer.weight: per_example.norm(dim=1)}

    try:
        model = initial(Scaled, torch.bfloat16)
        data = aligned_rows(8)
        module, optimizer, criterion, loader = private(model, data, 8, grad_sample_mode="ghost")
        x, y = data.tensors
        with pytest.raises(ValueError, match="Scale called in half precision"):
            criterion(module(x), y).backward()
        assert all(getattr(p, "wide_grad", None) is None for p in model.parameters())
    finally:
        RANDOMIZED_NORM_SAMPLERS.pop(Scale, None)


# --- FSDP2: two gloo ranks --------------------------------------------------------------------

WORLD = 2


def rows_on_rank(n: int, rank: int) -> int:
    """The rows of rank ``rank`` when the two ranks hold ``n``: rank 0 has the extra one (the
    neighbour, one row fewer, has it removed there)."""
    return n // WORLD + (rank < n % WORLD)


def fsdp_sums(rank: int, n: int, precision: str) -> list:
    """One ``ghost_fsdp`` step on this rank's aligned rows; the ranks' clipped sums at the noise
    (full tensors), times the world size: FSDP2 averages the ranks' sums."""
    from opacus.utils.fsdp_utils import FSDP2Wrapper

    dtype, autocast = PRECISIONS[precision]
    rows = rows_on_rank(n, rank)
    model = FSDP2Wrapper(initial(SequenceClassifier, dtype))
    data = aligned_rows(rows)
    module, optimizer, criterion, _ = private(
        model, data, rows, grad_sample_mode="ghost_fsdp", poisson_sampling=False,
        sample_rate=None, seed=None, noise_generator=torch.Generator().manual_seed(1),
    )
    seen = read_sums_at_the_noise(optimizer)
    x, y = data.tensors
    cast = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with cast:
        loss = criterion(module(x), y)
    loss.backward()
    optimizer.step()
    return [WORLD * s for s in seen["sums"]], seen["dtypes"]


def _fsdp_worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    out = {(precision, n): fsdp_sums(rank, n, precision) for precision in PRECISIONS for n in (N, N - 1)}
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_runs() -> dict:
    return spawn(_fsdp_worker, WORLD)[0]


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_fsdp2_gloo_sums_are_float32(fsdp_runs, precision):
    """``ghost_fsdp`` on two gloo ranks (the removed row on rank 0): each rank's float32 clipped
    sums are reduce-scattered in float32 (FSDP2's own reduction would be in the parameters' bf16)."""
    (sums, dtypes), (less, _) = fsdp_runs[precision, N], fsdp_runs[precision, N - 1]
    assert dtypes == {torch.float32}
    assert_one_contribution(flat(sums), flat(less), N)
    assert_brute_force(sums, brute_force(SequenceClassifier, PRECISIONS[precision][0], N), N)


# --- DDP: two gloo ranks ----------------------------------------------------------------------

DDP_FORMS = {"two_pass": dict(grad_sample_mode="ghost"), "bookkeeping": dict(grad_sample_mode="bookkeeping"),
             "per_example": dict(per_example_backward=True)}
N_DDP_PER_EXAMPLE = 259  # rows in all (one backward pass each)


def read_reduced_sums(optimizer) -> dict:
    """The ranks' summed float32 clipped sums as the wrapped optimizer's step finds them (noise 0,
    ``"sum"``: no normaliser): a half-precision parameter's in ``p.summed_grad`` (all-reduced
    there, ``p.grad`` being its rounding), a float32 one's in ``p.grad`` (Opacus's all-reduce)."""
    seen: dict = {}

    def reading(_optimizer, _args, _kwargs) -> None:
        sums = [p.summed_grad if p.summed_grad.dtype != p.dtype else p.grad for p in optimizer.params]
        seen["sums"], seen["dtypes"] = [s.detach().double().clone() for s in sums], {s.dtype for s in sums}

    optimizer.original_optimizer.register_step_pre_hook(reading)
    return seen


def ddp_sums(rank: int, form: str, n: int, precision: str) -> tuple:
    """One DPDDP step of ``form`` on this rank's aligned rows (the removed row on rank 0)."""
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

    dtype, autocast = PRECISIONS[precision]
    rows = rows_on_rank(n, rank)
    model = initial(SequenceClassifier, dtype)
    data = aligned_rows(rows)
    module, optimizer, *rest = private(
        DPDDP(model), data, rows, poisson_sampling=False, sample_rate=None, seed=None,
        noise_generator=torch.Generator().manual_seed(1), **DDP_FORMS[form],
    )
    seen = read_reduced_sums(optimizer)
    x, y = data.tensors
    cast = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
    parts = [slice(i, i + 1) for i in range(rows)] if form == "per_example" else [slice(0, rows)]
    for i, part in enumerate(parts):
        with cast:
            out = module(x[part])
            loss = rest[0](out, y[part]) if len(rest) == 2 else F.cross_entropy(out, y[part], reduction="sum")
        loss.backward()
        optimizer.signal_skip_step(do_skip=i < len(parts) - 1, same_draw=True)
        optimizer.step()
        optimizer.zero_grad()
    return seen["sums"], seen["dtypes"]


def _ddp_worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    out = {}
    for form in DDP_FORMS:
        n = N_DDP_PER_EXAMPLE if form == "per_example" else N
        for precision in PRECISIONS:
            for rows in (n, n - 1):
                out[form, precision, rows] = ddp_sums(rank, form, rows, precision)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_runs() -> dict:
    return spawn(_ddp_worker, WORLD)[0]


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
@pytest.mark.parametrize("form", sorted(DDP_FORMS))
def test_ddp_gloo_sums_are_float32(ddp_runs, form, precision):
    """Opacus's DPDDP (rank 0 alone adds the noise, then the ranks' sums are all-reduced): a
    half-precision parameter's float32 sums are all-reduced before they are rounded to its dtype
    (Opacus all-reduces ``p.grad``: rank 1's sum, which no noise covers, rounded to bf16)."""
    n = N_DDP_PER_EXAMPLE if form == "per_example" else N
    (sums, dtypes), (less, _) = ddp_runs[form, precision, n], ddp_runs[form, precision, n - 1]
    assert dtypes == {torch.float32}
    assert_one_contribution(flat(sums), flat(less), n)
    assert_brute_force(sums, brute_force(SequenceClassifier, PRECISIONS[precision][0], n), n)
