"""The audited experiment: the plugin's real randomized-clipping step, run many times.

One ``nn.Linear(d, p, bias=False)`` goes through ``make_private(..., clipping="randomized")``
once; each step releases the noisy gradient ``W.grad`` (SGD at ``lr = 0``). R canaries (rank-1
gradients of norm ``canary_norm * C`` on distinct output coordinates) join a base data set D
of background examples; the score of replica r is ``W.grad[r, d-1] / (sigma C)``: ``N(0, 1)``
without its canary, ``N(Z_r / sigma, 1)`` with it. See docs/audit.md, "Design".
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ..accounting.accountant import RCPRVAccountant, StepRecord
from ..config import ESTIMATORS, SKETCHINGS, SketchConfig
from ._broken import VARIANTS, broken_sketcher, install_sketcher
from .checks import check_choices, check_ints, check_positive, check_unit_interval
from .stats import ThresholdAudit, threshold_audit

Progress = Optional[Callable[[int], None]]
Batch = Tuple[torch.Tensor, torch.Tensor]


class InnerProductLoss(nn.Module):
    """``l_i = sum_{t,j} output_itj * target_itj``: the output gradient is the target.

    Args:
        reduction: ``"sum"``, ``"mean"`` or ``"none"`` (per-sample losses).
    """

    def __init__(self, reduction: str = "sum") -> None:
        super().__init__()
        self.reduction = reduction

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        per_sample = (output * target).flatten(1).sum(dim=1)
        if self.reduction == "none":
            return per_sample
        if self.reduction in ("sum", "mean"):
            return getattr(per_sample, self.reduction)()
        raise ValueError(f"reduction={self.reduction!r}; accepted values: 'none', 'sum', 'mean'")


@dataclass(frozen=True)
class AuditConfig:
    """One audited configuration.

    Args:
        delta: the delta of both the lower bound and the accounted epsilon.
        alpha: the lower bound holds with probability >= 1 - alpha.
        seed: seeds the data, the sketches, the noise and the inclusion design.
        canary_norm: the canary's gradient norm in units of C.
        background: examples of the base data set D.
        max_grad_norm: C.
        estimator: ``"hutchinson"`` or ``"hutchpp"``.
        sketch_size: k.
        sigma: noise multiplier.
        variant: ``"honest"``, ``"biased_low"`` or ``"data_dependent_sketch"``.
        sketching: ``"shared"`` or ``"per_example"``.
        steps: DP steps run; trials = steps * replicas (half with the canary).
        replicas: canaries per step, R (independent trials per step).
    """

    delta: float = 1e-2
    alpha: float = 0.05
    seed: int = 0
    canary_norm: float = 100.0
    background: int = 4
    max_grad_norm: float = 1.0
    estimator: str = SketchConfig.estimator
    sketch_size: int = SketchConfig.sketch_size
    sigma: float = 1.0
    variant: str = "honest"
    sketching: str = "shared"
    steps: int = 100
    replicas: int = 256

    def __post_init__(self) -> None:
        self._check(VARIANTS)

    def _check(self, variants: Tuple[str, ...]) -> None:
        """ValueError naming the first invalid field (``variant`` must be one of ``variants``)."""
        check_choices(
            ("estimator", self.estimator, ESTIMATORS),
            ("variant", self.variant, variants),
            ("sketching", self.sketching, SKETCHINGS),
        )
        check_ints(self, (("sketch_size", 1), ("steps", 2), ("replicas", 2), ("background", 1)))
        check_positive(self, ("sigma", "canary_norm", "max_grad_norm"))
        check_unit_interval(self, ("delta", "alpha"))

    @property
    def shapes(self) -> Tuple[int, int, int]:
        """``(d, p, T)``: ``d = k + 2`` (the canary's input coordinate ``d - 1`` is
        outside the first k), ``p = R + background`` (at least d: the sketch is on the
        output side), ``T = k + 8`` (longer than k: the layer is really sketched)."""
        d = self.sketch_size + 2
        return d, max(self.replicas + self.background, d), self.sketch_size + 8


@dataclass
class AuditResult:
    """Audit of one configuration: the contract fields, then details."""

    estimator: str
    sketch_size: int
    sigma: float
    variant: str
    eps_lower: float
    eps_accounted: float
    sketching: str = "shared"
    delta: float = 1e-2
    alpha: float = 0.05
    trials: int = 0
    test: Optional[ThresholdAudit] = None
    mean_score_in: float = float("nan")
    seconds: float = 0.0

    CONTRACT_KEYS = ("estimator", "sketch_size", "sigma", "variant", "eps_lower", "eps_accounted")

    def contract(self) -> Dict[str, object]:
        """The fields of the command's JSON output, in order."""
        return {k: getattr(self, k) for k in self.CONTRACT_KEYS}


def result_fields(
    config, test: Optional[ThresholdAudit], eps_accounted: float, trials: int, start: float
) -> Dict[str, object]:
    """The :class:`AuditResult` fields that every audit fills alike (no test: nothing was
    released, ``eps_lower`` 0)."""
    return dict(
        estimator=config.estimator, sketch_size=config.sketch_size, sigma=float(config.sigma),
        variant=config.variant, eps_lower=0.0 if test is None else test.eps_lower, eps_accounted=eps_accounted,
        delta=config.delta, alpha=config.alpha, trials=trials, test=test, seconds=time.perf_counter() - start,
    )


@lru_cache(maxsize=64)
def _cached_epsilon(history: Tuple, delta: float) -> float:
    accountant = RCPRVAccountant()
    accountant.history = list(history)
    return float(accountant.get_epsilon(delta))


def accounted_epsilon(accountant, delta: float) -> float:
    """``accountant.get_epsilon(delta)`` by a fresh ``RCPRVAccountant``, cached by history (its
    entries normalised by :meth:`RCPRVAccountant.entry`; the variants of a configuration share it)."""
    return _cached_epsilon(tuple(map(RCPRVAccountant.entry, accountant.history)), float(delta))


def check_one_step(history, q: Optional[float] = 1.0, sigma: Optional[float] = None, **record) -> None:
    """The ``rc_prv`` history holds one step at rate ``q`` and noise ``sigma`` (None: any)
    whose :class:`StepRecord` has the attributes ``record``; else RuntimeError."""
    sigma_, q_, steps, rec = history[0] if len(history) == 1 else (None,) * 4
    ok = steps == 1 and q in (None, q_) and sigma in (None, sigma_) and isinstance(rec, StepRecord) and all(
        getattr(rec, k) == v for k, v in record.items()
    )
    if not ok:
        wanted = "".join(f" with {k}={v!r}" for k, v in record.items())
        raise RuntimeError(f"expected one step at q={q}{wanted} in the rc_prv history, got {history}")


class _Experiment(NamedTuple):
    """The private model, optimizer, criterion, accountant and data of one audited configuration."""

    accountant: object
    model: nn.Module
    optimizer: object
    criterion: object
    weight: nn.Parameter
    background: Batch
    canaries: Batch


class _Reused(nn.Module):
    """``sum_l layer(x)`` over L uses of one layer in a forward pass."""

    def __init__(self, layer: nn.Module, uses: int) -> None:
        super().__init__()
        self.layer, self.uses = layer, uses

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(self.layer(x) for _ in range(self.uses))


def _data(config: AuditConfig, gen: torch.Generator) -> Tuple[Batch, Batch]:
    """Background examples (random gradients on output coordinates >= R, input
    coordinates < d - 1, norms 0.5 to 2 C) and the R canaries (docs/audit.md, "The canary")."""
    d, p, t = config.shapes
    r, nb, c = config.replicas, config.background, config.max_grad_norm
    xb = torch.zeros(nb, t, d)
    xb[:, :, : d - 1] = torch.randn(nb, t, d - 1, generator=gen)
    yb = torch.zeros(nb, t, p)
    yb[:, :, r:] = torch.randn(nb, t, p - r, generator=gen)
    grads = torch.einsum("btp,btd->bpd", yb, xb)
    scale = c / grads.flatten(1).norm(dim=1).clamp(min=1e-12)  # norm C each...
    scale = scale * torch.linspace(0.5, 2.0, nb)  # ...times 0.5..2
    yb *= scale[:, None, None]
    s = math.sqrt(config.canary_norm * c / t)
    xc = torch.zeros(r, t, d)
    xc[:, :, d - 1] = s
    yc = torch.zeros(r, t, p)
    yc[torch.arange(r), :, torch.arange(r)] = s
    return (xb, yb), (xc, yc)


def audit_layer(config: AuditConfig) -> Tuple[nn.Linear, Batch, Batch]:
    """The audit's bias-free layer ``d -> p``, D and the canaries (seeded by ``config.seed``)."""
    d, p, _ = config.shapes
    layer = nn.Linear(d, p, bias=False)
    return (layer, *_data(config, torch.Generator().manual_seed(config.seed)))


def make_private_rc(config, module: nn.Module, loader, reduction: str, seed: int, **options):
    """``PrivacyEngine(accountant="rc_prv").make_private(..., clipping="randomized")`` on
    ``module`` with an SGD at ``lr = 0`` and :class:`InnerProductLoss`, the noise and the
    sketches seeded from ``seed``: the engine, model, optimizer, criterion and loader."""
    from opacus import PrivacyEngine

    import opacus_rc  # noqa: F401  (registers clipping="randomized" and "rc_prv")

    engine = PrivacyEngine(accountant="rc_prv")
    out = engine.make_private(
        module=module,
        optimizer=torch.optim.SGD(module.parameters(), lr=0.0),
        criterion=InnerProductLoss(reduction=reduction),
        data_loader=loader,
        noise_multiplier=config.sigma,
        max_grad_norm=config.max_grad_norm,
        loss_reduction=reduction,
        noise_generator=torch.Generator().manual_seed(seed + 1),
        clipping="randomized",
        estimator=config.estimator,
        sketch_size=config.sketch_size,
        sketch_seed=seed + 2,
        **{"per_example_backward": False, **options},  # the sketched forms, even with one background example
    )
    # only the two-pass (ghost) path returns a criterion
    criterion = out[2] if len(out) == 4 else InnerProductLoss(reduction=reduction)
    return engine, out[0], out[1], criterion, out[-1]


def private_experiment(
    config: AuditConfig,
    wrap: Optional[Callable[[nn.Linear], nn.Module]] = None,
    loader_of: Optional[Callable[[Batch, Batch], DataLoader]] = None,
    **options,
) -> Tuple[_Experiment, DataLoader]:
    """:func:`make_private_rc` (no Poisson sampling) on the audit's layer, ``wrap(layer)`` if
    given, over ``loader_of(D, canaries)`` (default: D as one batch): the experiment and the
    loader ``make_private`` returned."""
    layer, background, canaries = audit_layer(config)
    loader = DataLoader(TensorDataset(*background), batch_size=config.background) if loader_of is None else (
        loader_of(background, canaries)
    )
    engine, model, optimizer, criterion, loader = make_private_rc(
        config, layer if wrap is None else wrap(layer), loader, "sum", config.seed, poisson_sampling=False, **options
    )
    return _Experiment(engine.accountant, model, optimizer, criterion, layer.weight, background, canaries), loader


def build_experiment(config: AuditConfig, uses: int = 1) -> _Experiment:
    """``make_private(..., clipping="randomized")`` on the audit's model, with the
    broken sketcher of ``config.variant`` swapped in (honest: none); ``uses > 1``: the
    layer applied that many times per pass, by book-keeping."""
    exp, _ = private_experiment(
        config, None if uses == 1 else (lambda layer: _Reused(layer, uses)),
        grad_sample_mode="ghost" if uses == 1 else "hooks", sketching=config.sketching, exact_when_cheaper=False,
    )
    if config.variant != "honest":
        install_sketcher(exp.model, broken_sketcher(config.variant, exp.model.sketcher))
    return exp


def _batch(exp: _Experiment, include: np.ndarray) -> Batch:
    """D + the canaries where ``include`` is True."""
    idx = torch.from_numpy(np.flatnonzero(include))
    return tuple(torch.cat([b, c[idx]]) for b, c in zip(exp.background, exp.canaries))


def _released(exp: _Experiment, batches) -> np.ndarray:
    """One real DP step over the micro-batches ``batches``; the released gradient on the
    canaries' entries ``W.grad[r, d-1]``."""
    for x, y in batches:
        exp.criterion(exp.model(x), y).backward()
    exp.optimizer.step()
    released = exp.weight.grad.detach().clone()
    exp.optimizer.zero_grad()
    return released[: len(exp.canaries[0]), -1].double().numpy()


class Trials(NamedTuple):
    """What :func:`run_trials` observed."""

    scores: np.ndarray  # (steps, R), units of sigma C
    included: np.ndarray  # (steps, R): the canary was in
    history: tuple  # the accountant's history after the first round...
    eps_accounted: float  # ...and its epsilon
    test: ThresholdAudit

    def fields(self, config, start: float) -> Dict[str, object]:
        """:func:`result_fields` of these trials."""
        return result_fields(config, self.test, self.eps_accounted, int(self.scores.size), start)

    def mean_in(self, sigma: float) -> float:
        """The mean score with the canary, in units of C."""
        return float(self.scores[self.included].mean() * sigma)


def run_trials(config, exp: _Experiment, scores_of: Callable, check_history: Callable, progress: Progress) -> Trials:
    """``config.steps`` rounds of R trials, each with a random half of the canaries in:
    ``scores_of(include, rng)`` runs the round's step(s) and returns the canaries' released
    entries; ``check_history`` sees the accountant's history after the first round. The
    first half of the rounds chooses the threshold, the second half gives the bound."""
    rng = np.random.default_rng(config.seed + 3)
    r = config.replicas
    scale = 1.0 / (config.sigma * config.max_grad_norm)
    scores = np.empty((config.steps, r))
    included = np.empty((config.steps, r), dtype=bool)
    eps_accounted, history = math.nan, ()
    for step in range(config.steps):
        include = rng.permutation(r) < r // 2
        scores[step] = scores_of(include, rng) * scale
        included[step] = include
        if step == 0:
            check_history(exp.accountant.history)
            history = tuple(exp.accountant.history)
            eps_accounted = accounted_epsilon(exp.accountant, config.delta)
        if progress is not None:
            progress(1)
    sel, ev = slice(0, config.steps // 2), slice(config.steps // 2, None)
    test = threshold_audit(
        scores[sel][included[sel]], scores[sel][~included[sel]], scores[ev][included[ev]], scores[ev][~included[ev]],
        delta=config.delta, alpha=config.alpha,
    )
    return Trials(scores, included, history, eps_accounted, test)


def one_step_trials(config, exp: _Experiment, progress: Progress) -> Trials:
    """:func:`run_trials` over one-step releases of ``exp``, each charged one step at q = 1."""
    step = lambda include, _rng: _released(exp, [_batch(exp, include)])  # noqa: E731
    return run_trials(config, exp, step, check_one_step, progress)


def run_audit(config: AuditConfig, progress: Progress = None) -> AuditResult:
    """Audit one configuration: ``config.steps`` real steps of R trials each; ``eps_accounted``
    is the engine's ``rc_prv`` epsilon at ``config.delta`` after one step (q = 1)."""
    start = time.perf_counter()
    trials = one_step_trials(config, build_experiment(config), progress)
    return AuditResult(
        **trials.fields(config, start), sketching=config.sketching, mean_score_in=trials.mean_in(config.sigma)
    )
