"""Golden epsilons of the rc_prv accountant, bit for bit.

Each value was computed by the accountant before its history switched from dict records
to :class:`StepRecord` (commit e8f462b) and is stored as ``float.hex``: any change to how a
history is recorded, stored, merged or read must leave every epsilon identical (``==``),
not merely close, under the BLAS kernels they were recorded with (:mod:`tests.blas`).
Histories: deterministic and randomized (Hutchinson, Hutch++) steps, shared and
per-example sketches, k = 8 and 32, 1 and 3 micro-batches, Opacus-style
3-tuples read with sketch keyword arguments, mixed groups, and checkpoints (the current
``state_dict`` and one written by the dict-record code).
"""

from __future__ import annotations

import io

import pytest
import torch

from opacus_rc.accounting import RCPRVAccountant, get_noise_multiplier_rc
from opacus_rc.config import SketchConfig

from ..blas import assert_golden

pytestmark = pytest.mark.usefixtures("one_blas_thread")  # bit-identical: one thread

DELTA = 1e-5
SHARED8 = SketchConfig(estimator="hutchinson", sketch_size=8, sketching="shared")
PER_EX32 = SketchConfig(estimator="hutchinson", sketch_size=32, sketching="per_example")
HUTCHPP8 = SketchConfig(estimator="hutchpp", sketch_size=8, sketching="per_example")
HUTCHPP32 = SketchConfig(estimator="hutchpp", sketch_size=32, sketching="shared")
SHARED32 = SketchConfig(estimator="hutchinson", sketch_size=32, sketching="shared")


def stepped(*runs) -> RCPRVAccountant:
    """An accountant after ``runs`` of ``(steps, sigma, q, sketch_config, micro_batches)``."""
    acc = RCPRVAccountant()
    for n, sigma, q, cfg, m in runs:
        for _ in range(n):
            acc.step(noise_multiplier=sigma, sample_rate=q, sketch_config=cfg, micro_batches=m)
    return acc


def assigned(history) -> RCPRVAccountant:
    acc = RCPRVAccountant()
    acc.history = list(history)
    return acc


MIXED = (
    (40, 1.0, 0.01, None, 1),
    (30, 2.0, 0.01, SHARED8, 1),
    (20, 1.1, 0.01, PER_EX32, 1),
    (10, 2.0, 0.01, HUTCHPP8, 1),
    (15, 1.0, 0.01, None, 3),
    (25, 2.0, 0.01, SHARED8, 1),  # not consecutive with the first SHARED8 run: merged on read
    (5, 1.0, 0.01, HUTCHPP32, 1),
)

#: name -> (accountant factory, get_epsilon keyword arguments)
CASES = {
    "det_3tuple": (lambda: assigned([(1.0, 0.01, 1000)]), {}),
    "det_stepped": (lambda: stepped((60, 0.9, 0.02, None, 1)), {}),
    "det_m3": (lambda: stepped((40, 1.0, 0.01, None, 3)), {}),
    "shared8": (lambda: stepped((50, 2.0, 0.01, SHARED8, 1)), {}),
    "per_example32": (lambda: stepped((50, 1.0, 0.01, PER_EX32, 1)), {}),
    "hutchpp8_per_example": (lambda: stepped((50, 2.0, 0.01, HUTCHPP8, 1)), {}),
    "hutchpp32_shared": (lambda: stepped((50, 1.0, 0.01, HUTCHPP32, 1)), {}),
    "shared32_m3": (lambda: stepped((30, 1.0, 0.01, SHARED32, 3)), {}),
    "per_example32_m3": (lambda: stepped((30, 1.0, 0.01, PER_EX32, 3)), {}),
    "3tuple_kwargs_shared8": (
        lambda: assigned([(2.0, 0.01, 200)]),
        {"estimator": "hutchinson", "sketch_size": 8, "sketching": "shared"},
    ),
    "3tuple_kwargs_hutchpp32_per_example": (
        lambda: assigned([(1.0, 0.01, 200)]),
        {"estimator": "hutchpp", "sketch_size": 32, "sketching": "per_example"},
    ),
    "3tuple_kwargs_size_only": (lambda: assigned([(2.0, 0.02, 100)]), {"sketch_size": 8}),
    "dict_records": (
        lambda: assigned([
            (1.0, 0.01, 30, {"sketch_size": 32, "sketching": "shared"}),
            (2.0, 0.01, 20, {"accounting_sketch_count": 8, "estimator": "hutchinson"}),
            (1.0, 0.01, 10, {"micro_batches": 3}),
            (1.0, 0.01, 10, None),
        ]),
        {},
    ),
    "mixed": (lambda: stepped(*MIXED), {}),
    "mixed_plus_3tuple_kwargs": (
        lambda: assigned(stepped(*MIXED[:3]).history + [(1.0, 0.01, 25)]),
        {"sketch_size": 32, "sketching": "per_example"},
    ),
    "mixed_eps_error_delta": (lambda: stepped(*MIXED), {"eps_error": 0.05, "delta_error": 1e-8}),
}

GOLDEN = {
    "3tuple_kwargs_hutchpp32_per_example": "0x1.28e113151ebe1p+0",  # 1.1596843649447168
    "3tuple_kwargs_shared8": "0x1.278b26f66f09cp+1",  # 2.3089340880670317
    "3tuple_kwargs_size_only": "0x1.7ac54e5ca2591p+1",  # 2.9591463043513575
    "det_3tuple": "0x1.d69f8693f58adp+0",  # 1.8383716689327614
    "det_m3": "0x1.d1c1fb3ee8043p+0",  # 1.8193661717014187
    "det_stepped": "0x1.a33e92b5f4b19p+0",  # 1.6376735395649062
    "dict_records": "0x1.783bd87d35c8ep+0",  # 1.4696631723107063
    "hutchpp32_shared": "0x1.1a584aa815fc0p+0",  # 1.1029097233167562
    "hutchpp8_per_example": "0x1.8fa26668d1a7ep-3",  # 0.19513397223836998
    "mixed": "0x1.a9d4b88d46e1bp+0",  # 1.6634021134294759
    "mixed_eps_error_delta": "0x1.b4143f8faf106p+0",  # 1.7034339643278726
    "mixed_plus_3tuple_kwargs": "0x1.ddfa8f1df25e6p-1",  # 0.9335522388511748
    "per_example32": "0x1.92de5fa5123cap-1",  # 0.7868528260233856
    "per_example32_m3": "0x1.e62318ff0977fp+1",  # 3.7979460950181756
    "shared32_m3": "0x1.e62318ff0977fp+1",  # 3.7979460950181756
    "shared8": "0x1.035ae1b37be98p+0",  # 1.013105493850082
    "calibration_hutchpp32": "0x1.d18ecee70bf61p-1",  # 0.909292665199228
}

#: a checkpoint as the dict-record accountant wrote it (``state_dict()`` of ``stepped(*MIXED)``)
LEGACY_STATE = {
    "history": [
        (1.0, 0.01, 40, None),
        (2.0, 0.01, 30, {"estimator": "hutchinson", "sketch_size": 8, "sketching": "shared", "micro_batches": 1}),
        (1.1, 0.01, 20, {"estimator": "hutchinson", "sketch_size": 32, "sketching": "per_example", "micro_batches": 1}),
        (2.0, 0.01, 10, {"estimator": "hutchpp", "sketch_size": 8, "sketching": "per_example", "micro_batches": 1}),
        (1.0, 0.01, 15, {"micro_batches": 3}),
        (2.0, 0.01, 25, {"estimator": "hutchinson", "sketch_size": 8, "sketching": "shared", "micro_batches": 1}),
        (1.0, 0.01, 5, {"estimator": "hutchpp", "sketch_size": 32, "sketching": "shared", "micro_batches": 1}),
    ],
    "mechanism": "rc_prv",
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_epsilon_is_bit_identical(name):
    make, kwargs = CASES[name]
    assert_golden(make().get_epsilon(DELTA, **kwargs), GOLDEN[name])


def _round_trip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    restored = RCPRVAccountant()
    restored.load_state_dict(torch.load(buf, weights_only=True))
    return restored


def test_state_dict_round_trip_is_bit_identical():
    acc = stepped(*MIXED)
    restored = _round_trip(acc.state_dict())
    assert_golden(restored.get_epsilon(DELTA), GOLDEN["mixed"])
    assert restored.state_dict()["history"] == acc.state_dict()["history"]
    restored.step(noise_multiplier=1.0, sample_rate=0.01, sketch_config=HUTCHPP32)  # merges on resume
    assert len(restored.history) == len(acc.history) and restored.history[-1][2] == 6


def test_legacy_dict_checkpoint_loads_bit_identical():
    restored = _round_trip(LEGACY_STATE)
    assert_golden(restored.get_epsilon(DELTA), GOLDEN["mixed"])
    assert restored.state_dict()["history"] == LEGACY_STATE["history"]


def test_calibration_is_bit_identical():
    sigma = get_noise_multiplier_rc(3.0, DELTA, 0.02, steps=100, sketch_config=HUTCHPP32, epsilon_tolerance=0.05)
    assert_golden(sigma, GOLDEN["calibration_hutchpp32"])
