"""Half precision in every form (issue 48): bf16 and fp16 parameters, and bf16 autocast.

Each test takes one step of one form at one privacy unit, at noise 0 and at sigma = 1 (seeded:
the same noise as the float32 run), and checks that

* the step ran: ``p.grad`` in the parameter's dtype, every entry finite;
* the clipped sum the noise went into (``p.summed_grad``) is float32;
* the released update (``p.grad`` as the wrapped optimizer gets it: ``(S + N) / B``) is close to
  the float32 run's from the same initial values (the half-precision values, widened).

Tolerance. Let u be the unit roundoff: ``2**-8`` for bf16 (8 significant bits), ``2**-11``
for fp16. A per-example gradient computed in half precision has a relative error of about
``kappa u``, where kappa counts the rounded operations on its path (forward and backward of
embedding, linear, tanh, LayerNorm, linear, mean: about a dozen); its clip factor inherits the
same error, so each clipped contribution moves by at most ``2 kappa u C``. The noise is drawn
and added in float32 (identical to the float32 run's), then the noised sum is rounded once to the
parameter's dtype (``u |S + N|`` per entry) and divided by B (``u`` again). Hence, in norm,

    ||Delta_half - Delta_32|| <= (2 kappa u C n + 2 u ||S + N||) / B,   kappa = 16,

for n clipped units (rows, or users). Under autocast the parameters and ``p.grad`` are
float32 and the last two roundings do not happen (the bound holds a fortiori). Measured at
noise 0: 1.0 to 2.5 u of relative error in norm, 0.02 to 0.2 of the bound.

The crash of issue 48 (``batch_size=1``: the per-example form chosen automatically, bf16
parameters: ``attempting to assign a gradient with dtype 'float' to a tensor with grad_dtype
'BFloat16'``) is ``test_one_step_is_close_to_float32[per_example_automatic-...-bf16]``.
FSDP2 (``ghost_fsdp``, example level only) runs in one gloo process (slow suite): :func:`test_fsdp2_in_one_gloo_process`.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Dict, Optional, Tuple

import pytest
import torch
from opacus import PrivacyEngine
from torch import nn

import opacus_rc  # noqa: F401

from tests.models import SequenceClassifier
from tests.spawn import spawn

#: unit roundoff of each half-precision format (round to nearest: half the spacing at 1)
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
#: bound on the relative error of one per-example gradient, in units of u (module docstring)
KAPPA = 16
C, ROWS, USERS, T = 0.05, 12, 4, 6

FORMS: Dict[str, Tuple[dict, int]] = {  # make_private options, the loader's batch_size
    "two_pass": (dict(grad_sample_mode="ghost"), 4),
    "bookkeeping": (dict(grad_sample_mode="bookkeeping"), 4),
    "bookkeeping_with_criterion": (dict(grad_sample_mode="ghost", bookkeeping=True), 4),
    "output_passes": (dict(grad_sample_mode="hooks", bookkeeping=False), 4),
    "per_example": (dict(per_example_backward=True), 4),
    "per_example_automatic": (dict(), 1),  # chosen by batch_size=1: issue 48's crash
}
#: the forms whose loss the script computes itself (no criterion returned)
PLAIN_LOSS = ("bookkeeping", "output_passes")
#: (parameter dtype, autocast dtype or None)
PRECISIONS = {
    "bf16": (torch.bfloat16, None),
    "fp16": (torch.float16, None),
    "autocast_bf16": (torch.float32, torch.bfloat16),
}


def _data() -> Tuple[torch.utils.data.TensorDataset, list]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 32, (ROWS, T), generator=gen)
    y = torch.randint(0, 2, (ROWS,), generator=gen)
    return torch.utils.data.TensorDataset(x, y), [r % USERS for r in range(ROWS)]


def _initial(dtype: torch.dtype) -> SequenceClassifier:
    """The model in ``dtype`` (float32 for the autocast runs), seeded."""
    torch.manual_seed(0)
    return SequenceClassifier().to(dtype)


def released_step(model: nn.Module, form: str, unit: str, sigma: float, autocast: Optional[torch.dtype] = None) -> dict:
    """One step of ``form`` at ``unit`` (every row drawn: q = 1, sketch longer than any
    sequence, so exact norms; noise ``sigma``, seeded); returns what the wrapped optimizer got:
    the update ``p.grad`` (float64 copies), its dtypes, the dtypes of the clipped sums the noise
    went into, and the normaliser B."""
    options, batch_size = FORMS[form]
    # a plain loss the script averages is refused in half precision (docs/guide.md, "The mean loss's
    # rounding"): those forms run a summed loss, whose update is the noisy sum (normaliser 1)
    reduction = "sum" if form in PLAIN_LOSS else "mean"
    data, owners = _data()
    if unit == "user":
        options = dict(options, privacy_unit="user", user_ids=owners, max_examples_per_user=ROWS)
    engine = PrivacyEngine(accountant="rc_prv")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module, optimizer, *rest = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            criterion=nn.CrossEntropyLoss(reduction=reduction), loss_reduction=reduction,
            data_loader=torch.utils.data.DataLoader(data, batch_size=batch_size), noise_multiplier=sigma,
            max_grad_norm=C, clipping="randomized", sample_rate=1.0, sketch_size=64, seed=5, **options,
        )
    *criterion, loader = rest
    seen: dict = {}

    def keep(_optimizer, _args, _kwargs) -> None:
        seen["update"] = [p.grad.double().clone() for p in optimizer.params]
        seen["grad_dtypes"] = {p.grad.dtype for p in optimizer.params}
        seen["sum_dtypes"] = {p.summed_grad.dtype for p in optimizer.params}
        seen["normaliser"] = optimizer.expected_batch_size * optimizer.accumulated_iterations if reduction == "mean" else 1

    optimizer.original_optimizer.register_step_pre_hook(keep)
    cast = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
    for x, y in loader:
        with cast:
            out = module(x)
            loss = criterion[0](out, y) if criterion else nn.functional.cross_entropy(out, y, reduction=reduction)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if not optimizer._is_last_step_skipped:
            return seen
    raise AssertionError("the loader ended before a step was taken")


def assert_close_to_float32(seen: dict, reference: dict, dtype: torch.dtype, units: int) -> None:
    """The bound of the module docstring, ``n`` clipped units: divided by B,
    ``||Delta_half - Delta_32|| <= 2 kappa u C n / B + 2 u ||Delta_32||``."""
    u = UNIT_ROUNDOFF[dtype]
    got, want = (torch.cat([g.flatten() for g in s["update"]]) for s in (seen, reference))
    assert torch.isfinite(got).all()
    bound = 2 * KAPPA * u * C * units / reference["normaliser"] + 2 * u * want.norm()
    error = (got - want).norm()
    assert error <= bound, f"update error {error:.3g} > bound {bound:.3g} (u = 2^{int(torch.log2(torch.tensor(u)))})"
    assert error > 0 or dtype == torch.float32  # the half-precision path really ran


_references: dict = {}


def reference_step(form: str, unit: str, sigma: float, dtype: torch.dtype) -> dict:
    """The float32 run from the initial values of the ``dtype`` run (widened: exact)."""
    key = (form, unit, sigma, dtype)
    if key not in _references:
        _references[key] = released_step(_initial(dtype).float(), form, unit, sigma)
    return _references[key]


@pytest.mark.parametrize("sigma", [0.0, 1.0])
@pytest.mark.parametrize("precision", sorted(PRECISIONS))
@pytest.mark.parametrize("unit", ["example", "user"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_one_step_is_close_to_float32(form, unit, precision, sigma):
    dtype, autocast = PRECISIONS[precision]
    seen = released_step(_initial(dtype), form, unit, sigma, autocast)
    assert seen["grad_dtypes"] == {dtype}  # p.grad in the parameter's dtype
    assert seen["sum_dtypes"] == {torch.float32}  # the sums and the noise in float32
    units = USERS if unit == "user" else ROWS
    assert_close_to_float32(seen, reference_step(form, unit, sigma, dtype), autocast or dtype, units)


# --- FSDP2 (ghost_fsdp): one gloo process --------------------------------------------------


def _fsdp_worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist
    from opacus.utils.fsdp_utils import FSDP2Wrapper

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=1)
    out = {}
    for name, (dtype, autocast) in PRECISIONS.items():
        for sigma in (0.0, 1.0):
            out[name, sigma] = released_step_fsdp(FSDP2Wrapper(_initial(dtype)), sigma, autocast)
            out[name, sigma, "float32"] = released_step_fsdp(FSDP2Wrapper(_initial(dtype).float()), sigma, None)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def released_step_fsdp(model: nn.Module, sigma: float, autocast: Optional[torch.dtype]) -> dict:
    """:func:`released_step` for ``ghost_fsdp`` (example level), on full tensors."""
    data, _ = _data()
    engine = PrivacyEngine(accountant="rc_prv")
    module, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), criterion=nn.CrossEntropyLoss(),
        data_loader=torch.utils.data.DataLoader(data, batch_size=ROWS), noise_multiplier=sigma, max_grad_norm=C,
        clipping="randomized", poisson_sampling=False, grad_sample_mode="ghost_fsdp", sketch_size=64,
        noise_generator=torch.Generator().manual_seed(5),
    )
    seen: dict = {}

    def keep(_optimizer, _args, _kwargs) -> None:
        seen["update"] = [p.grad.full_tensor().double().clone() for p in optimizer.params]
        seen["grad_dtypes"] = {p.grad.dtype for p in optimizer.params}
        seen["sum_dtypes"] = {optimizer.grad_state[p]["summed_grad"].dtype for p in optimizer.params}
        seen["normaliser"] = optimizer.expected_batch_size * optimizer.accumulated_iterations  # a mean loss

    optimizer.original_optimizer.register_step_pre_hook(keep)
    cast = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
    x, y = next(iter(loader))
    with cast:
        loss = criterion(module(x), y)
    loss.backward()
    optimizer.step()
    return seen


@pytest.fixture(scope="module")
def fsdp_runs() -> dict:
    return spawn(_fsdp_worker, 1)[0]


@pytest.mark.parametrize("sigma", [0.0, 1.0])
@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_fsdp2_in_one_gloo_process(fsdp_runs, precision, sigma):
    dtype, autocast = PRECISIONS[precision]
    seen = fsdp_runs[precision, sigma]
    assert seen["grad_dtypes"] == {dtype}
    assert seen["sum_dtypes"] == {torch.float32}
    assert_close_to_float32(seen, fsdp_runs[precision, sigma, "float32"], autocast or dtype, ROWS)


# --- benchmarks/precision.py (the table of docs/guide.md, "Precision: bf16 and fp16") ----------


@pytest.mark.slow
def test_precision_benchmark_smoke(tmp_path):
    """``python -m benchmarks.precision`` at a tiny size: one row per (T, precision), every figure
    finite; the ghost norms with the sketch longer than T are exact (the per-example form's)."""
    import json

    from benchmarks import precision

    out = tmp_path / "precision.json"
    precision.main(["--seq-lens", "32", "--batch", "2", "--no-progress", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["seq_len"], r["precision"]) for r in rows] == [(32, "bf16"), (32, "autocast")]
    for r in rows:
        assert r["ghost_vs_per_example_float32"]["worst"] < 1e-5
        assert all(r[f"update_{form}"] < 0.05 for form in precision.FORMS)
        assert 0 < r["exact_per_example"]["worst"] < 0.05 and r["sketched"]["worst"] < 0.05
