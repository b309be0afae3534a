"""Audit of the averaging normaliser: does the released update reveal the dataset size?

With ``loss_reduction="mean"`` the step releases ``(sum_i c_i g_i + N(0, sigma^2 C^2 I_p)) / B``;
Opacus's ``B = int(n / len(loader))`` differs between neighbours (19 for n = 401, 20 for 400
at batch size 20), and in high dimension the noise's norm reveals B. The plugin's real path
runs for both neighbours on zero gradients (the release is exactly ``noise / B``); the score
of a step is ``||W.grad||``. See docs/audit.md, "The normaliser audit".
"""

from __future__ import annotations

import math
import time
from itertools import chain, islice, repeat
from dataclasses import dataclass
from typing import Callable, Tuple

import numpy as np
import torch
from torch import nn

from ..config import ESTIMATORS, SketchConfig
from .checks import check_choices, check_fields, check_ints, check_positive, check_unit_interval
from .experiment import AuditResult, Progress, accounted_epsilon, check_one_step, make_private_rc, result_fields
from .reference import normaliser_exact_epsilon
from .stats import threshold_audit

NORMALISER_VARIANTS = ("normaliser_dataset_size", "normaliser_public")
GRAD_SAMPLE_MODES = ("ghost", "hooks")


@dataclass(frozen=True)
class NormaliserAuditConfig:
    """One normaliser audit.

    Args:
        variant: ``"normaliser_public"`` (make_private's normaliser) or
            ``"normaliser_dataset_size"`` (Opacus's ``int(n / len(loader))``).
        dataset_size: ``n``, the size of the larger neighbour ``D'``; ``D`` has ``n - 1``.
        batch_size: the loader's ``batch_size``.
        output_dim: p, outputs of the linear layer (the dimension of the update).
        sigma: noise multiplier.
        steps: DP steps per neighbour.
        grad_sample_mode: ``"ghost"`` (two passes) or ``"hooks"`` (book-keeping).
        estimator, sketch_size: the sketch (they set the accountant's record: every gradient is 0).
        delta, alpha, max_grad_norm: as in :class:`~opacus_rc.audit.AuditConfig`.
        seed: seeds the loaders' sampling, the noise and the sketches.
    """

    variant: str = "normaliser_public"
    dataset_size: int = 401
    batch_size: int = 20
    output_dim: int = 10_000
    sigma: float = 1.0
    steps: int = 400
    grad_sample_mode: str = "ghost"
    estimator: str = SketchConfig.estimator
    sketch_size: int = SketchConfig.sketch_size
    delta: float = 1e-2
    alpha: float = 0.05
    seed: int = 0
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        check_choices(
            ("variant", self.variant, NORMALISER_VARIANTS),
            ("grad_sample_mode", self.grad_sample_mode, GRAD_SAMPLE_MODES),
            ("estimator", self.estimator, ESTIMATORS),
        )
        check_ints(self, (("dataset_size", 3), ("batch_size", 1), ("output_dim", 1), ("steps", 4), ("sketch_size", 1)))
        check_fields(
            self, ("batch_size",), lambda v: v < self.dataset_size,
            f"an int < dataset_size={self.dataset_size} (several batches per epoch)",
        )
        check_positive(self, ("sigma", "max_grad_norm"))
        check_unit_interval(self, ("delta", "alpha"))


@dataclass
class _Side:
    engine: object
    weight: nn.Parameter
    model: nn.Module
    optimizer: object
    criterion: Callable
    loader: torch.utils.data.DataLoader
    normaliser: float


def _build(config: NormaliserAuditConfig, n: int, seed: int) -> _Side:
    """The private objects of the neighbour with ``n`` examples, all seeded by ``seed``."""
    torch.manual_seed(seed)
    layer = nn.Linear(1, config.output_dim, bias=False)
    data = torch.utils.data.TensorDataset(torch.zeros(n, 1), torch.ones(n, 1))
    loader = torch.utils.data.DataLoader(
        data, batch_size=config.batch_size, generator=torch.Generator().manual_seed(seed)
    )
    engine, model, optimizer, criterion, dp_loader = make_private_rc(
        config, layer, loader, "mean", seed, grad_sample_mode=config.grad_sample_mode
    )
    if config.variant == "normaliser_dataset_size":
        # audit-only: Opacus's data-dependent normaliser ``int(n * (1 / len(loader)))`` (no
        # drop_last), as before the fix
        optimizer.expected_batch_size = int(n * (1 / math.ceil(n / config.batch_size)))
    return _Side(engine, layer.weight, model, optimizer, criterion, dp_loader,
                 float(optimizer.expected_batch_size))


def _scores(side: _Side, steps: int, delta: float, progress: Progress) -> Tuple[np.ndarray, float]:
    """Scores ``||W.grad||`` of ``steps`` real steps, and the engine's ``rc_prv``
    epsilon after the first one (the steps are independent trials of one step)."""
    out = np.empty(steps)
    eps = math.nan
    # epoch after epoch: every pass over the loader draws fresh Poisson batches
    for step, (x, y) in enumerate(islice(chain.from_iterable(repeat(side.loader)), steps)):
        side.criterion(side.model(x), y).backward()
        side.optimizer.step()
        out[step] = side.weight.grad.detach().double().norm().item()
        side.optimizer.zero_grad()
        if step == 0:
            check_one_step(side.engine.accountant.history, q=None)
            eps = accounted_epsilon(side.engine.accountant, delta)
        if progress is not None:
            progress(1)
    return out, eps


@dataclass
class NormaliserAuditResult(AuditResult):
    """:class:`~opacus_rc.audit.AuditResult` plus the two normalisers and the exact
    epsilon of the released pair (independent of the accountant)."""

    normaliser_in: float = float("nan")
    normaliser_out: float = float("nan")
    eps_exact: float = float("nan")
    output_dim: int = 0
    grad_sample_mode: str = "ghost"


def run_normaliser_audit(config: NormaliserAuditConfig, progress: Progress = None) -> NormaliserAuditResult:
    """Audit one normaliser variant: ``config.steps`` real steps on each neighbour."""
    start = time.perf_counter()
    n = config.dataset_size
    with_ex = _build(config, n, config.seed)  # D' = D + one example ("canary in")
    without = _build(config, n - 1, config.seed + 10)  # D
    scores_in, eps_in = _scores(with_ex, config.steps, config.delta, progress)
    scores_out, eps_out = _scores(without, config.steps, config.delta, progress)
    half = config.steps // 2
    test = threshold_audit(
        scores_in[:half], scores_out[:half], scores_in[half:], scores_out[half:],
        delta=config.delta, alpha=config.alpha,
    )
    return NormaliserAuditResult(
        **result_fields(config, test, max(eps_in, eps_out), 2 * config.steps, start),
        normaliser_in=with_ex.normaliser,
        normaliser_out=without.normaliser,
        eps_exact=normaliser_exact_epsilon(
            config.output_dim, with_ex.normaliser, without.normaliser, config.delta
        ),
        output_dim=config.output_dim,
        grad_sample_mode=config.grad_sample_mode,
    )
