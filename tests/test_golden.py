"""Golden run of every form of :data:`opacus_rc.forms.FORMS` (and of Opacus's flat clipping):
the released parameters after a few seeded steps and the epsilon equal those recorded (a
refactoring must change neither). FSDP2's form runs in this process, in a gloo group of
one rank.

``seed=`` makes noise, Poisson masks and sketches reproducible, so the same code gives the
same draws on every machine. Epsilon (numpy/scipy, one BLAS thread) is compared bit for
bit under the BLAS kernels it was recorded with (:mod:`tests.blas`). The parameters are compared to float rounding: the CPU's matmul kernels differ
between machines (an AMD and an Intel host give different last bits for the same code,
which a hash of the bytes turned into a failure), so the test allows |diff| <= 1e-5 +
1e-4 |recorded| per entry. A behaviour change moves them by far more: one example more or
less, a different clip factor, noise or sketch changes an entry by the order of
lr * sigma * C / B = 0.5 * 0.7 * 0.5 / 16 ~ 1e-2. Recording (only when a change is *meant*
to alter the numbers, and said so in the commit):  python -m tests.test_golden --write
(``--write NAME ...``: those runs only, the others kept as recorded)
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import sys
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist
from opacus import PrivacyEngine
from torch import nn

import opacus_rc  # noqa: F401
from opacus_rc import forms
from opacus_rc.lm_head import ChunkedLMHeadLoss
from opacus_rc.optimizer import RandomizedClippingMixin

from .blas import assert_golden
from .models import CheckpointedSequenceClassifier, HeadModel, SequenceClassifier, token_task

pytestmark = pytest.mark.usefixtures("one_blas_thread")  # bit-identical: one thread

GOLDEN = pathlib.Path(__file__).with_name("golden.json")
T, K = 24, 4  # T > k: every linear layer is sketched

TWO_PASS, OUTPUT_PASSES, BOOKKEEPING, WITH_CRITERION = "two_pass", "output_passes", "bookkeeping", "bookkeeping_with_criterion"
FSDP, PER_EXAMPLE = "ghost_fsdp", "per_example"

#: name -> (make_private keywords, model, criterion kind, the form of opacus_rc.forms.FORMS it
#: runs: None for Opacus's own flat clipping)
FORMS = {
    "two_pass_per_example": (dict(grad_sample_mode="ghost"), "plain", "ce", TWO_PASS),
    "two_pass_shared_hutchpp": (
        dict(grad_sample_mode="ghost", sketching="shared", estimator="hutchpp"), "plain", "ce", TWO_PASS
    ),
    "bookkeeping": (dict(grad_sample_mode="bookkeeping"), "plain", "ce", BOOKKEEPING),
    "ghost_bookkeeping": (dict(grad_sample_mode="ghost", bookkeeping=True), "plain", "ce", WITH_CRITERION),
    # hooks on a model checkpointed by torch.utils.checkpoint (no Hugging Face flag): book-keeping
    "bookkeeping_checkpointed_non_reentrant": (dict(grad_sample_mode="hooks"), "ckpt", "ce", BOOKKEEPING),
    "bookkeeping_checkpointed_reentrant": (dict(grad_sample_mode="hooks"), "ckpt_reentrant", "ce", BOOKKEEPING),
    "output_passes_checkpointed_non_reentrant": (
        dict(grad_sample_mode="hooks", bookkeeping=False), "ckpt", "ce", OUTPUT_PASSES
    ),
    "output_passes_checkpointed_reentrant": (
        dict(grad_sample_mode="hooks", bookkeeping=False), "ckpt_reentrant", "ce", OUTPUT_PASSES
    ),
    "two_pass_checkpointed": (dict(grad_sample_mode="ghost"), "ckpt", "ce", TWO_PASS),
    "chunked_head_two_pass": (dict(grad_sample_mode="ghost"), "head", "head", TWO_PASS),
    "chunked_head_bookkeeping": (dict(grad_sample_mode="bookkeeping"), "head", "head", BOOKKEEPING),
    "denoised_bookkeeping": (dict(grad_sample_mode="bookkeeping", denoise="spectral"), "plain", "ce", BOOKKEEPING),
    "ghost_fsdp": (dict(grad_sample_mode="ghost_fsdp"), "fsdp", "ce", FSDP),
    "per_example": (dict(grad_sample_mode="ghost", per_example_backward=True), "plain", "ce", PER_EXAMPLE),
    "flat_opacus": (dict(grad_sample_mode="hooks", clipping="flat"), "plain", "ce", None),
}


def build_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "plain":
        return SequenceClassifier()
    if kind == "fsdp":
        from opacus.utils.fsdp_utils import FSDP2Wrapper

        return FSDP2Wrapper(SequenceClassifier())  # its parameters: one shard each (one rank)
    if kind == "head":
        return HeadModel()
    return CheckpointedSequenceClassifier(use_reentrant=kind == "ckpt_reentrant")


@contextlib.contextmanager
def process_group(kind: str):
    """A gloo group of one rank (this process) around an FSDP2 run; nothing otherwise."""
    if kind != "fsdp":
        yield
        return
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def logical_steps(engine) -> int:
    """The steps charged so far (the per-example form takes one ``step()`` per example)."""
    return sum(entry[2] for entry in engine.accountant.history)


def run_form(name: str, steps: int = 3) -> dict:
    options, kind, loss_kind, form = FORMS[name]
    options = dict(options)
    clipping = options.pop("clipping", "randomized")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with process_group(kind):
            return _run(name, options, kind, loss_kind, form, clipping, steps)
    finally:
        torch.set_num_threads(threads)


def _run(name: str, options: dict, kind: str, loss_kind: str, form, clipping: str, steps: int) -> dict:
    """``run_form``'s run: ``steps`` logical steps of the form, its parameters and epsilon."""
    model = build_model(kind)
    data = token_task(n=64, t=T)
    engine = PrivacyEngine(accountant="rc_prv" if clipping == "randomized" else "prv")
    head = ChunkedLMHeadLoss(model.head, block_size=8) if loss_kind == "head" else None
    seeds = (dict(seed=7, sketch_size=K) if clipping == "randomized"
             else dict(noise_generator=torch.Generator().manual_seed(7)))
    if clipping != "randomized":
        data_gen = torch.Generator().manual_seed(11)
    loader = torch.utils.data.DataLoader(
        data, batch_size=16, generator=None if clipping == "randomized" else data_gen
    )
    out = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), data_loader=loader,
        criterion=head if head is not None else nn.CrossEntropyLoss(), noise_multiplier=0.7,
        max_grad_norm=0.5, clipping=clipping, **seeds, **options,
    )
    module, optimizer = out[0], out[1]
    runs_form = form is not None and type(optimizer) in forms.FORMS[form].optimizers
    assert runs_form or (form is None and not isinstance(optimizer, RandomizedClippingMixin)), (
        f"{name} declares form {form!r} but runs {type(optimizer).__name__}"
    )
    criterion = out[2] if len(out) == 4 else (head if head is not None else nn.CrossEntropyLoss())
    loader = out[-1]
    while logical_steps(engine) < steps:
        for x, y in loader:
            if loss_kind == "head":
                loss = criterion(module(x), x)
            else:
                loss = criterion(module(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if logical_steps(engine) == steps:
                break
    values = torch.cat([full(p).detach().reshape(-1) for p in model.parameters()])
    return {"parameters": [float(f"{v:.9g}") for v in values.tolist()],
            "epsilon": float(engine.get_epsilon(1e-5)).hex()}


def full(p: torch.Tensor) -> torch.Tensor:
    """A parameter's full value (an FSDP2 parameter is a DTensor: gathered)."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def recorded() -> dict:
    return json.loads(GOLDEN.read_text())


def test_every_form_has_a_golden_run():
    """A form added to opacus_rc.forms.FORMS needs a run here and its recorded values."""
    assert set(forms.FORMS) - {form for *_, form in FORMS.values()} == set()
    assert set(recorded()) == set(FORMS)


@pytest.mark.parametrize("name", sorted(FORMS))
def test_form_equals_the_golden_run(name):
    got, golden = run_form(name), recorded()[name]
    hint = (f"{name}: the released parameters or epsilon changed; if the change is meant, record "
            "it with python -m tests.test_golden --write and say why in the commit")
    assert_golden(float.fromhex(got["epsilon"]), golden["epsilon"], hint)
    np.testing.assert_allclose(got["parameters"], golden["parameters"], rtol=1e-4, atol=1e-5, err_msg=hint)


if __name__ == "__main__":
    if "--write" in sys.argv:
        names = sys.argv[sys.argv.index("--write") + 1:] or sorted(FORMS)
        values = {**(recorded() if GOLDEN.exists() else {}), **{name: run_form(name) for name in names}}
        GOLDEN.write_text(json.dumps({name: values[name] for name in sorted(FORMS)}) + "\n")
        print(f"wrote {GOLDEN}: {', '.join(names)}")
