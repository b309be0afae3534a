"""Audits of privacy side paths: other ways of taking the audited step.

Each variant reuses the one-step audit's model, data, canaries and score
(:mod:`opacus_rc.audit.experiment`) and its held-out threshold test: gradient accumulation
(``accumulation_canary``), objects built by hand (``hand_built``), a layer applied twice per
forward pass (``reused_layer``), one draw split into physical batches under a reentrant
checkpoint (``reentrant_split``), a loss that reads the head's weight around the hooks
(``fused_head``), the per-example form (``per_example``), an accumulation loop over its
loader (``draw_boundary``), a model that keeps a running statistic of its inputs in a buffer
(``forward_buffer``: refused) and a canary user of several rows at ``privacy_unit="user"``
(``user_level``); ``fused_head_unchecked``, ``per_example_unchecked``,
``draw_boundary_unchecked``, ``forward_buffer_unchecked`` and ``user_level_per_row`` are
deliberately broken controls. What each runs, its score and its defaults: docs/audit.md,
"Side paths" and the sections after it.
"""

from __future__ import annotations

import itertools
import math
import time
import warnings
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, List, NamedTuple, Optional, Tuple

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ..accounting.accountant import RCPRVAccountant, StepRecord
from ..config import SketchConfig
from .checks import check_fields, check_ints
from .experiment import (
    AuditConfig, AuditResult, Batch, InnerProductLoss, Progress, Trials, _batch, _Experiment, _released,
    accounted_epsilon, audit_layer, build_experiment, check_one_step, make_private_rc, one_step_trials,
    private_experiment, result_fields, run_trials,
)
from .reference import (
    accumulation_exact_epsilon, composed_sum_epsilon, exact_epsilon, mixture_epsilon, sensitivity_atoms,
)

FUSED_HEAD_VARIANTS = ("fused_head", "fused_head_unchecked")
PER_EXAMPLE_VARIANTS = ("per_example", "per_example_unchecked")
FORWARD_BUFFER_VARIANTS = ("forward_buffer", "forward_buffer_unchecked")
DRAW_BOUNDARY_VARIANTS = ("draw_boundary", "draw_boundary_unchecked")
PARTIAL_DRAW_VARIANTS = ("partial_draw", "partial_draw_carried")
USER_LEVEL_VARIANTS = ("user_level", "user_level_per_row")
PATH_VARIANTS = ("accumulation_canary", "hand_built", "reused_layer", "reentrant_split", *FUSED_HEAD_VARIANTS,
                 *PER_EXAMPLE_VARIANTS, *DRAW_BOUNDARY_VARIANTS, *PARTIAL_DRAW_VARIANTS, *FORWARD_BUFFER_VARIANTS,
                 *USER_LEVEL_VARIANTS)

#: Per variant: sketch size, sigma and the path's own size (why: docs/audit.md).
PATH_DEFAULTS = {
    "accumulation_canary": {"sketch_size": 32, "sigma": 1.0, "micro_batches": 4, "sample_rate": 0.25},
    "hand_built": {"sketch_size": 4, "sigma": 4.0, "episode_steps": 4},
    "reused_layer": {"sketch_size": 32, "sigma": 1.0, "uses": 2, "sample_rate": 0.25},
    "reentrant_split": {"sketch_size": 4, "sigma": 2.0, "micro_batches": 4, "sketching": "per_example"},
    **{v: {"sketch_size": 32, "sigma": 1.0} for v in FUSED_HEAD_VARIANTS},
    # per-example and draw-boundary variants: k only sets the shapes
    **{v: {"sketch_size": 4, "sigma": 1.0} for v in (*PER_EXAMPLE_VARIANTS, *FORWARD_BUFFER_VARIANTS,
                                                      *DRAW_BOUNDARY_VARIANTS, *PARTIAL_DRAW_VARIANTS)},
    **{v: {"sketch_size": 4, "sigma": 2.0, "user_rows": 8, "replicas": 64} for v in USER_LEVEL_VARIANTS},
}
#: the fused-head control's steps at most: its unclipped canary is found at any size
FUSED_HEAD_MAX_STEPS = 40
#: the command runs a fifth of the requested steps for a per-example variant (one backward
#: pass per example)...
PER_EXAMPLE_STEP_SHARE = 5
#: ...and at most this many for its control
PER_EXAMPLE_MAX_STEPS = 40
#: the draw-boundary control's steps at most (its canary shifts by 2 C, charged as C)
DRAW_BOUNDARY_MAX_STEPS = 20
#: the user-level control's steps at most (its canary user shifts by ``user_rows`` C Z, charged as C Z)
USER_LEVEL_MAX_STEPS = 20
#: the variants the command runs for a fifth of the requested steps (:func:`per_example_steps`)...
REDUCED_STEP_VARIANTS = (*PER_EXAMPLE_VARIANTS, *DRAW_BOUNDARY_VARIANTS, *PARTIAL_DRAW_VARIANTS, *USER_LEVEL_VARIANTS)
#: ...and the most steps of those with a cap
_MAX_STEPS = {"per_example_unchecked": PER_EXAMPLE_MAX_STEPS, "user_level_per_row": USER_LEVEL_MAX_STEPS,
              **dict.fromkeys((*DRAW_BOUNDARY_VARIANTS, *PARTIAL_DRAW_VARIANTS), DRAW_BOUNDARY_MAX_STEPS)}
#: the accumulation loop's k: ``step()`` every k physical batches (the draws of
#: :func:`accumulation_draws` are built for k = 2)
ACCUMULATION_EVERY = 2


@dataclass(frozen=True)
class PathAuditConfig(AuditConfig):
    """One side-path audit: the fields of :class:`~opacus_rc.audit.AuditConfig` and these.

    Args:
        variant: one of :data:`PATH_VARIANTS`.
        steps: logical steps, or episodes of ``episode_steps`` steps (hand-built).
        micro_batches: m, micro-batches summed into each step (accumulation); physical
            batches of the step's one draw (reentrant split).
        sample_rate: q, each micro-batch's Poisson rate (accumulation, reused layer).
        uses: L, applications of the layer per forward pass (reused layer).
        episode_steps: S, optimizer steps per trial (hand-built).
        secure_mode: hand-built objects in secure mode (sketches and noise from
            :mod:`opacus_rc.csprng`: not reproducible, seeds unused).
        user_rows: rows of each canary user, all removed in the neighbour, and the
            contribution bound ``max_examples_per_user`` (user level).
    """

    variant: str = "accumulation_canary"
    steps: int = 200
    micro_batches: int = 4
    sample_rate: float = 0.25
    episode_steps: int = 4
    uses: int = 2
    secure_mode: bool = False
    user_rows: int = 8

    def __post_init__(self) -> None:
        self._check(PATH_VARIANTS)
        check_ints(self, (("micro_batches", 2), ("episode_steps", 1), ("uses", 2), ("user_rows", 2)))
        in_rate = lambda v: isinstance(v, (int, float)) and 0.0 < v <= 1.0  # noqa: E731
        check_fields(self, ("sample_rate",), in_rate, "a float in (0, 1]")

    @property
    def base(self) -> AuditConfig:
        """The one-step audit's configuration with the same shared fields (shapes, data)."""
        return AuditConfig(**{f.name: getattr(self, f.name) for f in fields(AuditConfig) if f.name != "variant"})


@dataclass
class PathAuditResult(AuditResult):
    """:class:`~opacus_rc.audit.AuditResult` plus the side path's own numbers.

    ``eps_exact``: the exact epsilon of the audited pair (independent of the accountant).
    ``eps_old_charge``: accumulation only, the pre-fix charge (one draw at ``min(1, q m)``).
    ``refusal``: the plugin's error (``fused_head``, ``draw_boundary``, ``forward_buffer``;
    empty when the step ran)."""

    eps_exact: float = float("nan")
    eps_old_charge: float = float("nan")
    micro_batches: int = 1
    sample_rate: float = 1.0
    episode_steps: int = 1
    user_rows: int = 1
    history: tuple = ()
    refusal: str = ""


# --- accumulation_canary, reused_layer: Poisson micro-batches at the audit's own rate q --------


def old_charge_epsilon(config: PathAuditConfig, record: StepRecord) -> float:
    """What the pre-fix convention reported for one accumulated step: a single Poisson
    draw at rate ``min(1, q m)`` with the same sketch."""
    accountant = RCPRVAccountant()
    single = replace(record, micro_batches=1)
    accountant.history = [(config.sigma, min(1.0, config.sample_rate * config.micro_batches), 1, single)]
    return accounted_epsilon(accountant, config.delta)


def _accumulation(config: PathAuditConfig, progress: Progress, start: float) -> PathAuditResult:
    """Each "in" canary joins each of the step's m micro-batches (``reused_layer``: one, through
    the layer applied L times) with probability q; the score is ``N(J Z / sigma, 1)``."""
    reused = config.variant == "reused_layer"
    micro = 1 if reused else config.micro_batches
    exp = build_experiment(config.base, uses=config.uses if reused else 1)
    # the audit samples every micro-batch itself at q (Poisson), never from the loader: the engine's
    # accountant hook again, at q (it records each step's micro-batches)
    exp.optimizer.attach_step_hook(exp.accountant.get_optimizer_hook_fn(sample_rate=config.sample_rate))
    copies = []

    def scores_of(include: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        member = include[None, :] & (rng.random((micro, config.replicas)) < config.sample_rate)
        copies.append(member.sum(axis=0))
        return _released(exp, [_batch(exp, row) for row in member])

    # reused layer: whatever the step is charged as, the threshold test judges it
    record = {} if reused else {"micro_batches": micro}
    trials = run_trials(config, exp, scores_of, lambda h: check_one_step(h, config.sample_rate, **record), progress)
    copies = np.array(copies, dtype=float)[trials.included].sum()
    return PathAuditResult(
        **trials.fields(config, start), sketching=config.sketching,
        # mean contribution of an "in" canary per copy, in units of C
        mean_score_in=float(trials.scores[trials.included].sum() * config.sigma / max(copies, 1)),
        eps_exact=accumulation_exact_epsilon(
            config.estimator, config.sketch_size, config.sigma, micro, config.sample_rate, config.delta,
            config.canary_norm,
        ),
        eps_old_charge=old_charge_epsilon(config, trials.history[0][3]) if micro > 1 else math.nan,
        micro_batches=micro, sample_rate=config.sample_rate, history=trials.history,
    )


# --- hand_built: the objects built by hand, episodes of S steps --------------------------------


def build_hand_built(config: PathAuditConfig, noise_multiplier: Optional[float] = None) -> _Experiment:
    """The grad-sample module, optimizer, criterion and accountant built by hand
    (``noise_multiplier`` overrides ``config.sigma``, e.g. 0 to compare sketches)."""
    import opacus_rc  # noqa: F401
    from ..forms.two_pass import DPLossRandomizedClipping
    from ..grad_sample import GradSampleModuleRandomizedClipping
    from ..optimizer import RandomizedClippingOptimizer

    layer, background, canaries = audit_layer(config)
    sketch_config = SketchConfig(
        estimator=config.estimator, sketch_size=config.sketch_size, sketching=config.sketching,
        exact_when_cheaper=False,
    )
    secure = config.secure_mode
    model = GradSampleModuleRandomizedClipping(
        layer, batch_first=True, loss_reduction="sum", max_grad_norm=config.max_grad_norm,
        sketch_config=sketch_config, sketch_seed=None if secure else config.seed + 2, secure_mode=secure,
    )
    optimizer = RandomizedClippingOptimizer(
        torch.optim.SGD(layer.parameters(), lr=0.0),
        noise_multiplier=config.sigma if noise_multiplier is None else noise_multiplier,
        max_grad_norm=config.max_grad_norm,
        expected_batch_size=config.background + config.replicas // 2,
        loss_reduction="sum",
        generator=None if secure else torch.Generator().manual_seed(config.seed + 1),
        secure_mode=secure,
        sketch_config=sketch_config,
    )
    model.follow_steps(optimizer)
    accountant = RCPRVAccountant()
    optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=1.0))
    criterion = DPLossRandomizedClipping(model, optimizer, InnerProductLoss(reduction="sum"), "sum")
    return _Experiment(accountant, model, optimizer, criterion, layer.weight, background, canaries)


def _check_episode(history, config: PathAuditConfig) -> None:
    """S steps at q = 1 of this sketch (consecutive equal steps are merged into one entry)."""
    ok = sum(e[2] for e in history) == config.episode_steps and all(
        e[0] == config.sigma and e[1] == 1.0 and isinstance(e[3], StepRecord)
        and e[3].sketch_size == config.sketch_size and e[3].micro_batches == 1
        for e in history
    )
    if not ok:
        raise RuntimeError(
            f"expected {config.episode_steps} steps at q=1 with sketch_size={config.sketch_size} in the rc_prv "
            f"history, got {history}"
        )


def _hand_built(config: PathAuditConfig, progress: Progress, start: float) -> PathAuditResult:
    """A trial is an episode of S steps on one batch; the score sums the S released entries
    over ``sqrt(S)``: ``N(sum_s Z_s / (sigma sqrt(S)), 1)`` with the canary."""
    exp, s = build_hand_built(config), config.episode_steps

    def scores_of(include: np.ndarray, _rng: np.random.Generator) -> np.ndarray:
        batch = _batch(exp, include)
        return sum(_released(exp, [batch]) for _ in range(s)) / math.sqrt(s)

    trials = run_trials(config, exp, scores_of, lambda h: _check_episode(h, config), progress)
    copies = float(s * trials.included.sum())
    return PathAuditResult(
        **trials.fields(config, start), sketching=config.sketching,
        # mean contribution of an "in" canary per step, in units of C
        mean_score_in=float(trials.scores[trials.included].sum() * config.sigma / max(copies, 1)) * math.sqrt(s),
        eps_exact=composed_sum_epsilon(
            config.estimator, config.sketch_size, config.sigma, s, config.delta, config.canary_norm
        ),
        episode_steps=s, history=trials.history,
    )


# --- reentrant_split: the physical batches of one draw under a reentrant checkpoint ------------


class _ReentrantRegion(nn.Module):
    """``checkpoint(layer, x, use_reentrant=True)``, its input requiring grad (as
    ``enable_input_require_grads()`` makes it)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.layer, x.detach().requires_grad_(True), use_reentrant=True)


def build_reentrant_split(config: PathAuditConfig) -> _Experiment:
    """``make_private(..., grad_sample_mode="ghost", sketching="per_example")`` on the audit's
    layer inside a reentrant checkpoint region (:func:`split_step` makes the companions)."""
    return private_experiment(
        config, _ReentrantRegion, grad_sample_mode="ghost", sketching="per_example", exact_when_cheaper=False
    )[0]


def split_step(exp: _Experiment, include: np.ndarray, physical_batches: int) -> torch.Tensor:
    """One draw in ``physical_batches`` equal physical batches, split as BatchMemoryManager
    splits: the canaries (zero-gradient examples where not ``include``d) in the first, their
    companions at the same indices in the others; returns the released ``W.grad``."""
    (xb, yb), (xc, yc) = exp.background, exp.canaries
    keep = torch.from_numpy(include)[:, None, None]
    first = (torch.cat([xb, xc * keep]), torch.cat([yb, yc * keep]))
    # companions: input coordinate d - 2 instead of d - 1, the same output coordinate
    rest = (torch.cat([xb, xc.roll(-1, dims=-1)]), torch.cat([yb, yc]))
    return draw_step(exp, _same_draw(exp.optimizer, [first] + [rest] * (physical_batches - 1)))


def _same_draw(optimizer, batches):
    """The physical batches of one draw with BatchMemoryManager's signals:
    ``signal_skip_step(do_skip=True, same_draw=True)`` before every one but the last."""
    for batch in batches[:-1]:
        optimizer.signal_skip_step(do_skip=True, same_draw=True)
        yield batch
    yield batches[-1]


def draw_step(exp: _Experiment, physical_batches) -> torch.Tensor:
    """One logical step over the physical batches of one draw (forward, criterion, backward,
    ``step()``, ``zero_grad()`` per batch; whoever yields them signals the skipped steps): the
    released ``W.grad`` of the step that was not skipped."""
    released = None
    for x, y in physical_batches:
        exp.criterion(exp.model(x), y).backward()
        exp.optimizer.step()
        if not exp.optimizer._is_last_step_skipped:
            released = exp.weight.grad.detach().clone()
        exp.optimizer.zero_grad()
    if released is None:
        raise RuntimeError("the draw's physical batches took no step")
    return released


def _reentrant_split(config: PathAuditConfig, progress: Progress, start: float) -> PathAuditResult:
    """The score is the likelihood-ratio statistic ``mu+ (s - mu+ / 2)`` of the canary's entry
    s given the m - 1 companions' estimate ``mu+`` of ``Z / sigma`` (units of sigma C)."""
    exp = build_reentrant_split(config)
    d, m, r = exp.canaries[0].shape[-1], config.micro_batches, config.replicas
    scale = 1.0 / (config.sigma * config.max_grad_norm)
    entries = []

    def scores_of(include: np.ndarray, _rng: np.random.Generator) -> np.ndarray:
        released = split_step(exp, include, m)
        s = released[:r, d - 1].double().numpy() * scale
        mu_hat = np.maximum(released[:r, d - 2].double().numpy() * scale / (m - 1), 0.0)
        entries.append(s)
        return mu_hat * (s - mu_hat / 2) / scale

    check = lambda h: check_one_step(h, sigma=config.sigma, micro_batches=1, sketching="per_example")  # noqa: E731
    trials = run_trials(config, exp, scores_of, check, progress)
    return PathAuditResult(
        **trials.fields(config, start), sketching="per_example",
        mean_score_in=float(np.array(entries)[trials.included].mean() * config.sigma),  # E Z, units of C
        eps_exact=exact_epsilon(config.estimator, config.sketch_size, config.sigma, "honest", config.delta,
                                config.canary_norm),
        micro_batches=m, history=trials.history,
    )


# --- fused_head: a loss that goes around the hooks (checkpointed model) ------------------------


class _CheckpointedHead(nn.Module):
    """The audit's layer as the LM head of a model with activation checkpointing on (its input
    goes through a checkpointed region): ``make_private`` runs two passes from its output."""

    def __init__(self, head: nn.Linear) -> None:
        super().__init__()
        self.head = head
        self.gradient_checkpointing = True

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(torch.clone, x, use_reentrant=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(x))


def build_fused_head(config: PathAuditConfig) -> _Experiment:
    """``make_private(..., grad_sample_mode="hooks")`` on :class:`_CheckpointedHead`, with the
    fused loss ``sum_i <y_i, F.linear(h_i, W)>`` (the head never called); the control switches
    the optimizer's clipped-pass check off."""
    exp, _ = private_experiment(
        config, _CheckpointedHead, grad_sample_mode="hooks", sketching=config.sketching, exact_when_cheaper=False
    )
    if exp.model.output_passes is None:
        raise RuntimeError("fused_head: expected the two passes from the output (a checkpointed model)")
    if config.variant == "fused_head_unchecked":
        exp.optimizer.clip_guard.check = lambda **_: None  # the broken control
    inner = InnerProductLoss(reduction="sum")

    def fused_loss(h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # TRL-style fused head
        return inner(torch.nn.functional.linear(h, exp.weight), target)

    return exp._replace(model=exp.model._module.hidden, criterion=fused_loss)  # the head is never called


def _refusal(
    config: PathAuditConfig, exp: _Experiment, attempt: Callable[[], Any], progress: Progress, start: float,
    released: Optional[Callable[[], bool]] = None, **fields: Any,
) -> Optional[PathAuditResult]:
    """``attempt()``, a step the plugin must refuse: on its ValueError, nothing released or charged
    (else RuntimeError; ``released()``, default: the weight changed), the refusal's result: eps_lower =
    eps_accounted = 0 and no trial (``fields`` over :func:`result_fields`). None if the step ran."""
    before = exp.weight.detach().clone()
    try:
        attempt()
    except ValueError as error:
        if exp.accountant.history or (released() if released else not torch.equal(exp.weight, before)):
            raise RuntimeError(f"{config.variant}: the refused step released or charged something")
        if progress is not None:
            progress(config.steps)
        return PathAuditResult(**{**result_fields(config, None, 0.0, 0, start), **fields}, refusal=str(error))
    return None


def _fused_head(config: PathAuditConfig, progress: Progress, start: float) -> PathAuditResult:
    """``fused_head``: the plugin must refuse the step (:func:`_refusal`); a step taken instead, and
    the control, are audited."""
    config = replace(config, steps=min(config.steps, FUSED_HEAD_MAX_STEPS))
    exp = build_fused_head(config)
    if config.variant == "fused_head":
        attempt = lambda: _released(exp, [_batch(exp, np.ones(config.replicas, dtype=bool))])  # noqa: E731
        refused = _refusal(config, exp, attempt, progress, start, sketching=config.sketching)
        if refused is not None:
            return refused
        exp = build_fused_head(config)  # the step was taken: audit it (a fresh accountant)
    trials = one_step_trials(config, exp, progress)
    return PathAuditResult(
        **trials.fields(config, start), sketching=config.sketching, mean_score_in=trials.mean_in(config.sigma),
        history=trials.history,
    )


# --- per_example: the per-example form (one example per backward pass, exact clipping) ---------


def per_example_steps(variant: str, steps: int) -> int:
    """The steps the command runs for a variant of :data:`REDUCED_STEP_VARIANTS` (per-example:
    a backward pass per example; user level: ``user_rows`` rows per canary) when ``steps``
    are requested."""
    share = max(2, steps // PER_EXAMPLE_STEP_SHARE)
    return min(share, _MAX_STEPS.get(variant, share))


class _DrawSampler(torch.utils.data.Sampler):
    """A batch sampler of one batch per pass: ``draw``, set by the audit before each step."""

    def __init__(self) -> None:
        self.draw: list = []

    def __iter__(self):
        yield list(self.draw)

    def __len__(self) -> int:
        return 1


class _LoaderExperiment(NamedTuple):
    """The experiment, the loader ``make_private`` returned and what feeds it: the sampler under
    it (per-example) or its dataset's tensors ``(x, y)``, D's rows then each canary user's
    ``user_rows`` rows (user level)."""

    exp: _Experiment
    loader: DataLoader
    sampler: Optional[_DrawSampler] = None
    rows: Optional[Batch] = None
    user_rows: int = 1


def build_per_example(config: PathAuditConfig) -> _LoaderExperiment:
    """``make_private(..., per_example_backward=True)`` on the audit's layer over ``D + partners +
    canaries`` (a partner: its canary's target times -1/2) read through a :class:`_DrawSampler`;
    the control switches the form's batch check off and splits the draw into pairs."""
    from ..forms import FORMS, PER_EXAMPLE, form_of
    from ._broken import unchecked_batches

    sampler = _DrawSampler()

    def loader_of(background, canaries) -> DataLoader:
        (xb, yb), (xc, yc) = background, canaries
        return DataLoader(TensorDataset(torch.cat([xb, xc, xc]), torch.cat([yb, -yc / 2, yc])), batch_sampler=sampler)

    exp, loader = private_experiment(
        config, loader_of=loader_of, per_example_backward=True,
        expected_batch_size=config.background + config.replicas + config.replicas // 2,
    )
    if form_of(exp.optimizer) is not FORMS[PER_EXAMPLE]:
        raise RuntimeError(f"per_example: expected the per-example form, got {type(exp.optimizer).__name__}")
    if config.variant == "per_example_unchecked":  # the broken control
        unchecked_batches(exp.model)
        loader.batch_sampler.max_batch_size = 2
    return _LoaderExperiment(exp, loader, sampler)


def per_example_step(built: _LoaderExperiment, include: np.ndarray) -> torch.Tensor:
    """One step through the loader ``make_private`` returned (each "in" canary right after its
    partner, then the other partners, then D): the released ``W.grad``."""
    nb, r = len(built.exp.background[0]), len(include)
    pairs = [i for j in np.flatnonzero(include) for i in (nb + j, nb + r + j)]
    built.sampler.draw = pairs + [nb + j for j in np.flatnonzero(~include)] + list(range(nb))
    return draw_step(built.exp, built.loader)


def _per_example(config: PathAuditConfig, progress: Progress, start: float) -> PathAuditResult:
    """Charged one exact-clipping step at q = 1; the canary shifts its entry by C (the control:
    ``(1 + 1/sqrt(2)) C``), and ``eps_exact`` is the Gaussian mechanism's for that shift."""
    shift = 1.0 + math.sqrt(0.5) if config.variant == "per_example_unchecked" else 1.0
    built = build_per_example(config)
    return _exact_step_audit(config, built, per_example_step, shift, progress, start)


def _entry_trials(config: PathAuditConfig, built: Any, step: Callable, check: Callable, progress: Progress) -> Trials:
    """:func:`run_trials` of ``step(built, include)`` (the released ``W.grad``), scored at the
    canaries' entries ``W.grad[r, d-1]``."""
    d = built.exp.canaries[0].shape[-1]

    def scores_of(include: np.ndarray, _rng: np.random.Generator) -> np.ndarray:
        return step(built, include)[: config.replicas, d - 1].double().numpy()

    return run_trials(config, built.exp, scores_of, check, progress)


def _exact_step_audit(
    config: PathAuditConfig, built: Any, step: Callable, shift: float, progress: Progress, start: float
) -> PathAuditResult:
    """:func:`_entry_trials` of one exact-clipping step at q = 1; ``eps_exact`` is the Gaussian
    mechanism's for a canary shift of ``shift`` C."""
    check = lambda h: check_one_step(h, randomized=False, micro_batches=1)  # noqa: E731
    trials = _entry_trials(config, built, step, check, progress)
    scores, included = trials.scores, trials.included
    return PathAuditResult(
        **{**trials.fields(config, start), "estimator": "exact", "sketch_size": 0},
        mean_score_in=float((scores[included].mean() - scores[~included].mean()) * config.sigma),
        eps_exact=mixture_epsilon(np.array([shift / config.sigma]), config.delta),
        history=trials.history,
    )


# --- forward_buffer: a running statistic of the inputs, changed in place by the forward pass -----


class _RunningInput(nn.Module):
    """The audit's layer, keeping the running sum of its inputs in a buffer (in place, in
    its forward pass): the buffer reaches the released model without noise."""

    def __init__(self, layer: nn.Linear) -> None:
        super().__init__()
        self.layer = layer
        self.register_buffer("seen", torch.zeros(layer.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(x.detach().reshape(-1, x.shape[-1]).sum(0))
        return self.layer(x)


def _forward_buffer(config: PathAuditConfig, progress: Progress, start: float) -> PathAuditResult:
    """``forward_buffer``: the plugin must refuse the step (ValueError), nothing released or
    charged (eps_lower = eps_accounted = 0, no trial). The control switches the refusal off: the
    buffer released with the canaries differs from the one without them, exactly (no noise):
    eps_lower is infinite whatever the trials (a step taken on the honest variant reads the same)."""
    released, eps_accounted = [], 0.0
    for include in (True, False):
        exp = private_experiment(config, _RunningInput, grad_sample_mode="ghost")[0]
        if config.variant == "forward_buffer_unchecked":
            exp.optimizer._check_forward_changes = lambda: None  # the broken control
        attempt = lambda: _released(exp, [_batch(exp, np.full(config.replicas, include))])  # noqa: E731
        refused = _refusal(config, exp, attempt, progress, start, sketching=config.sketching, eps_exact=0.0,
                           eps_accounted=eps_accounted)
        if refused is not None:
            return refused
        released.append(exp.model._module.seen.clone())
        eps_accounted = accounted_epsilon(exp.accountant, config.delta)
    if progress is not None:
        progress(config.steps)
    fields = result_fields(config, None, eps_accounted, 2, start)
    if not torch.equal(*released):  # told apart without error: no finite epsilon
        fields["eps_lower"] = math.inf
    return PathAuditResult(**fields, sketching=config.sketching, eps_exact=math.inf)


# --- draw_boundary: step() every k physical batches of the per-example loader --------------


def build_draw_boundary(config: PathAuditConfig) -> _LoaderExperiment:
    """:func:`build_per_example`'s honest objects; the control switches the optimizer's
    draw-boundary check off (:func:`~opacus_rc.audit._broken.unchecked_draw_boundary`)."""
    from ._broken import unchecked_draw_boundary

    built = build_per_example(config)
    if config.variant == "draw_boundary_unchecked":  # the broken control
        unchecked_draw_boundary(built.exp.optimizer)
    return built


def accumulation_draws(built: _LoaderExperiment, include: np.ndarray) -> List[List[int]]:
    """Two draws of the loader (one per epoch): the "in" canaries then D, and the same one
    example longer (why: docs/audit.md, "draw_boundary_unchecked")."""
    nb, r = len(built.exp.background[0]), len(include)
    first = [nb + r + j for j in np.flatnonzero(include)] + list(range(nb))
    return [first, first + [0]]


def accumulation_step(built: _LoaderExperiment, include: np.ndarray) -> torch.Tensor:
    """A script's accumulation loop over the loader ``make_private`` returned (``step()``, ``zero_grad()``
    every :data:`ACCUMULATION_EVERY` physical batches across epochs) until a step is not skipped: its
    released ``W.grad``. The skip signals still queued are dropped (every round releases the same examples)."""
    exp, delivered = built.exp, 0
    try:
        for draw in accumulation_draws(built, include):
            built.sampler.draw = draw
            for x, y in built.loader:
                exp.criterion(exp.model(x), y).backward()
                delivered += 1
                if delivered % ACCUMULATION_EVERY == 0:
                    exp.optimizer.step()
                    released = None if exp.optimizer._is_last_step_skipped else exp.weight.grad.detach().clone()
                    exp.optimizer.zero_grad()
                    if released is not None:
                        return released
    finally:
        exp.optimizer._step_skip_queue.clear()
    raise RuntimeError("draw_boundary: the loop took no step")


def _draw_boundary(config: PathAuditConfig, progress: Progress, start: float) -> PathAuditResult:
    """``draw_boundary``: the plugin must refuse the loop's first ``step()`` (:func:`_refusal`); a step
    taken instead, and the control, are audited: each "in" canary twice (a shift of 2 C), charged as C."""
    built = build_draw_boundary(config)
    if config.variant == "draw_boundary":
        refused = _refusal(
            config, built.exp, lambda: accumulation_step(built, np.ones(config.replicas, dtype=bool)), progress, start,
            released=lambda: built.exp.weight.grad is not None, estimator="exact", sketch_size=0,
        )
        if refused is not None:
            return refused
        built = build_draw_boundary(config)  # the step was taken: audit it (a fresh accountant)
    return _exact_step_audit(config, built, accumulation_step, 2.0, progress, start)


# --- partial_draw: a loop stopped inside a draw, then the loader iterated again (issue 46, path 1) ---


def build_partial_draw(config: PathAuditConfig) -> _LoaderExperiment:
    """:func:`build_per_example`'s honest objects; the control carries a draw left incomplete
    into the next draw's release (:func:`~opacus_rc.audit._broken.carried_partial_draw`)."""
    from ._broken import carried_partial_draw

    built = build_per_example(config)
    if config.variant == "partial_draw_carried":  # the broken control
        carried_partial_draw(built.exp.optimizer)
    return built


def partial_draw_step(built: _LoaderExperiment, include: np.ndarray) -> torch.Tensor:
    """A loop over the loader ``make_private`` returned stopped after the "in" canaries of a draw (the
    canaries then D), then one whole draw of the same rows: the released ``W.grad`` (honest: the
    stopped draw's clipped sums dropped, each canary once; the control: twice, charged once)."""
    nb, r = len(built.exp.background[0]), len(include)
    canaries = [nb + r + j for j in np.flatnonzero(include)]
    built.sampler.draw = canaries + list(range(nb))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the dropped draw's warning
        for x, y in itertools.islice(built.loader, len(canaries)):  # `if i == stop: break`
            built.exp.criterion(built.exp.model(x), y).backward()
            built.exp.optimizer.step()
            built.exp.optimizer.zero_grad()
        return draw_step(built.exp, built.loader)


def _partial_draw(config: PathAuditConfig, progress: Progress, start: float) -> PathAuditResult:
    """``partial_draw``: one exact-clipping step at q = 1 whose canary shifts by C; the control's by
    2 C (the stopped draw's canary carried into the next release), charged as C."""
    shift = 2.0 if config.variant == "partial_draw_carried" else 1.0
    return _exact_step_audit(config, build_partial_draw(config), partial_draw_step, shift, progress, start)


# --- user_level: a canary user of several rows, privacy_unit="user" (book-keeping) ----------------


def user_level_data(config: PathAuditConfig, background: Batch, canaries: Batch) -> Tuple[Batch, List[int]]:
    """D's rows (row i owned by background user ``i // 2``) then the R canary users' rows
    (canary r repeated ``user_rows`` times, owned by user ``-1 - r``): the tensors and the
    ``user_ids``."""
    (xb, yb), (xc, yc) = background, canaries
    m = config.user_rows
    rows = (torch.cat([xb, xc.repeat_interleave(m, 0)]), torch.cat([yb, yc.repeat_interleave(m, 0)]))
    owners = [i // 2 for i in range(len(xb))] + [-1 - r for r in range(len(xc)) for _ in range(m)]
    return rows, owners


def build_user_level(config: PathAuditConfig) -> _LoaderExperiment:
    """``make_private(..., grad_sample_mode="hooks", privacy_unit="user", user_ids=...,
    max_examples_per_user=user_rows)`` over :func:`user_level_data`, every user at every step (q_u = 1);
    the control clips each row alone (:func:`~opacus_rc.audit._broken.per_row_clipping`)."""
    from ._broken import per_row_clipping

    layer, background, canaries = audit_layer(config)
    rows, owners = user_level_data(config, background, canaries)
    loader = DataLoader(TensorDataset(*rows), batch_size=len(set(owners)))
    engine, model, optimizer, criterion, loader = make_private_rc(
        config, layer, loader, "sum", config.seed, grad_sample_mode="hooks", sketching=config.sketching,
        exact_when_cheaper=False, privacy_unit="user", user_ids=owners, max_examples_per_user=config.user_rows,
    )
    if config.variant == "user_level_per_row":  # the broken control
        per_row_clipping(optimizer)
    exp = _Experiment(engine.accountant, model, optimizer, criterion, layer.weight, background, canaries)
    return _LoaderExperiment(exp, loader, rows=rows, user_rows=config.user_rows)


def user_level_step(built: _LoaderExperiment, include: np.ndarray) -> torch.Tensor:
    """One step through the loader ``make_private`` returned, each canary user's rows zeroed
    where not ``include``d (a zero gradient: its clipped mean is 0, as if the user and all
    their rows were removed; the normaliser is public): the released ``W.grad``."""
    (x, y), (xc, yc) = built.rows, built.exp.canaries
    m, nb = built.user_rows, len(built.exp.background[0])
    keep = torch.from_numpy(include).repeat_interleave(m)[:, None, None]
    x[nb:] = xc.repeat_interleave(m, 0) * keep
    y[nb:] = yc.repeat_interleave(m, 0) * keep
    return draw_step(built.exp, built.loader)


def _user_level(config: PathAuditConfig, progress: Progress, start: float) -> PathAuditResult:
    """Charged one sketched step at q_u = 1: the canary user's entry shifts by C Z (the control,
    each row clipped alone: ``user_rows`` C Z with a shared sketch)."""
    check = lambda h: check_one_step(h, sigma=config.sigma, micro_batches=1, sketch_size=config.sketch_size)  # noqa
    trials = _entry_trials(config, build_user_level(config), user_level_step, check, progress)
    return PathAuditResult(
        **trials.fields(config, start), sketching=config.sketching, mean_score_in=trials.mean_in(config.sigma),
        eps_exact=user_level_exact_epsilon(config), user_rows=config.user_rows, history=trials.history,
    )


def user_level_exact_epsilon(config: PathAuditConfig) -> float:
    """The exact epsilon of the canary user's pair: a shift of C Z (honest), of ``user_rows``
    C Z with a shared sketch (control: one Z for every row), of the sum of ``user_rows``
    independent C Z_i with per-example sketches (control: one sketch per row; Monte Carlo)."""
    estimator, k, sigma, m = config.estimator, config.sketch_size, config.sigma, config.user_rows
    if config.variant == "user_level":
        return exact_epsilon(estimator, k, sigma, "honest", config.delta, config.canary_norm)
    if config.sketching == "shared":
        atoms = sensitivity_atoms(estimator, k, "honest", config.canary_norm)
        return mixture_epsilon(m * atoms / sigma, config.delta)
    # composed_sum_epsilon scores sum_i Z_i / (sigma' sqrt(m)): sigma' = sigma / sqrt(m) gives sum_i Z_i / sigma
    return composed_sum_epsilon(estimator, k, sigma / math.sqrt(m), m, config.delta, config.canary_norm, draws=4000)


_AUDITS = {
    "accumulation_canary": _accumulation, "hand_built": _hand_built, "reused_layer": _accumulation,
    "reentrant_split": _reentrant_split, **dict.fromkeys(FUSED_HEAD_VARIANTS, _fused_head),
    **dict.fromkeys(PER_EXAMPLE_VARIANTS, _per_example),
    **dict.fromkeys(FORWARD_BUFFER_VARIANTS, _forward_buffer),
    **dict.fromkeys(DRAW_BOUNDARY_VARIANTS, _draw_boundary),
    **dict.fromkeys(PARTIAL_DRAW_VARIANTS, _partial_draw),
    **dict.fromkeys(USER_LEVEL_VARIANTS, _user_level),
}


def run_path_audit(config: PathAuditConfig, progress: Progress = None) -> PathAuditResult:
    """Audit one side path (see the module docstring)."""
    return _AUDITS[config.variant](config, progress, time.perf_counter())
