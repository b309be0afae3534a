"""Golden run of every randomized form: the released parameters after a few seeded steps and
the epsilon equal those recorded (a refactoring must change neither).

``seed=`` makes noise, Poisson masks and sketches reproducible, so the same code gives the
same draws on every machine. Epsilon (numpy/scipy, one BLAS thread) is compared bit for
bit under the BLAS kernels it was recorded with (:mod:`tests.blas`). The parameters are compared to float rounding: the CPU's matmul kernels differ
between machines (an AMD and an Intel host give different last bits for the same code,
which a hash of the bytes turned into a failure), so the test allows |diff| <= 1e-5 +
1e-4 |recorded| per entry. A behaviour change moves them by far more: one example more or
less, a different clip factor, noise or sketch changes an entry by the order of
lr * sigma * C / B = 0.5 * 0.7 * 0.5 / 16 ~ 1e-2. Recording (only when a change is *meant*
to alter the numbers, and said so in the commit):  python -m tests.test_golden --write
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest
import torch
from opacus import PrivacyEngine
from torch import nn

import opacus_rc  # noqa: F401
from opacus_rc.lm_head import ChunkedLMHeadLoss

from .blas import assert_golden
from .models import CheckpointedSequenceClassifier, HeadModel, SequenceClassifier, token_task

pytestmark = pytest.mark.usefixtures("one_blas_thread")  # bit-identical: one thread

GOLDEN = pathlib.Path(__file__).with_name("golden.json")
T, K = 24, 4  # T > k: every linear layer is sketched

#: name -> (make_private keywords, model, criterion kind)
FORMS = {
    "two_pass_per_example": (dict(grad_sample_mode="ghost"), "plain", "ce"),
    "two_pass_shared_hutchpp": (dict(grad_sample_mode="ghost", sketching="shared", estimator="hutchpp"), "plain", "ce"),
    "bookkeeping": (dict(grad_sample_mode="bookkeeping"), "plain", "ce"),
    "ghost_bookkeeping": (dict(grad_sample_mode="ghost", bookkeeping=True), "plain", "ce"),
    "output_passes_non_reentrant": (dict(grad_sample_mode="hooks"), "ckpt", "ce"),
    "output_passes_reentrant": (dict(grad_sample_mode="hooks"), "ckpt_reentrant", "ce"),
    "two_pass_checkpointed": (dict(grad_sample_mode="ghost"), "ckpt", "ce"),
    "chunked_head_two_pass": (dict(grad_sample_mode="ghost"), "head", "head"),
    "chunked_head_bookkeeping": (dict(grad_sample_mode="bookkeeping"), "head", "head"),
    "denoised_bookkeeping": (dict(grad_sample_mode="bookkeeping", denoise="spectral"), "plain", "ce"),
    "flat_opacus": (dict(grad_sample_mode="hooks", clipping="flat"), "plain", "ce"),
}


def build_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "plain":
        return SequenceClassifier()
    if kind == "head":
        return HeadModel()
    return CheckpointedSequenceClassifier(use_reentrant=kind == "ckpt_reentrant")


def run_form(name: str, steps: int = 3) -> dict:
    options, kind, loss_kind = FORMS[name]
    options = dict(options)
    clipping = options.pop("clipping", "randomized")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
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
        criterion = out[2] if len(out) == 4 else (head if head is not None else nn.CrossEntropyLoss())
        loader = out[-1]
        done = 0
        while done < steps:
            for x, y in loader:
                if loss_kind == "head":
                    loss = criterion(module(x), x)
                else:
                    loss = criterion(module(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                done += 1
                if done == steps:
                    break
        values = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        return {"parameters": [float(f"{v:.9g}") for v in values.tolist()],
                "epsilon": float(engine.get_epsilon(1e-5)).hex()}
    finally:
        torch.set_num_threads(threads)


def recorded() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name", sorted(FORMS))
def test_form_equals_the_golden_run(name):
    got, golden = run_form(name), recorded()[name]
    hint = (f"{name}: the released parameters or epsilon changed; if the change is meant, record "
            "it with python -m tests.test_golden --write and say why in the commit")
    assert_golden(float.fromhex(got["epsilon"]), golden["epsilon"], hint)
    np.testing.assert_allclose(got["parameters"], golden["parameters"], rtol=1e-4, atol=1e-5, err_msg=hint)


if __name__ == "__main__":
    if "--write" in sys.argv:
        GOLDEN.write_text(json.dumps({name: run_form(name) for name in sorted(FORMS)}) + "\n")
        print(f"wrote {GOLDEN}")
