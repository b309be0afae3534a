"""Audits of privacy side paths: gradient accumulation, hand-built objects and a layer
reused within one forward pass.

Both reuse the one-step audit's model, data and canaries (:mod:`opacus_rc.audit.experiment`:
one ``nn.Linear`` sketched on its output side, R canaries on distinct output coordinates,
score ``W.grad[r, d-1] / (sigma C)``) and its held-out Clopper-Pearson threshold test.

``accumulation_canary``
    One logical step sums ``m`` micro-batches (``m`` times forward, criterion,
    ``loss.backward()``, then one ``optimizer.step()``), built by ``make_private(...,
    clipping="randomized", grad_sample_mode="ghost", poisson_sampling=False)`` with the
    engine's accountant hook re-attached at rate q (the audit draws the Poisson
    micro-batches itself and never iterates the loader; ``make_private`` refuses a
    ``sample_rate`` that is not the loader's own rate). Each step puts a
    random half of the canaries "in the data set"; each of those lands in each micro-batch
    independently with probability q (Poisson sampling of every micro-batch), so in
    ``J ~ Bin(m, q)`` of them; the others in none. With the canary the score is
    ``N(J Z / sigma, 1)`` (the micro-batches of a step share its sketch, so every copy has
    the same Z), without it ``N(0, 1)``. ``eps_accounted`` comes from the engine's own
    ``rc_prv`` history after the first step, which must read ``(sigma, q, 1, record)``
    with ``record["micro_batches"] == m``. ``eps_old_charge`` is what the pre-fix
    convention charged for the same step: one draw at rate ``min(1, q m)``.

``hand_built``
    The step is built by hand, as for secure mode without ``make_private``:
    :class:`~opacus_rc.grad_sample.GradSampleModuleRandomizedClipping`,
    :class:`~opacus_rc.optimizer.RandomizedClippingOptimizer`,
    :class:`~opacus_rc.forms.two_pass.DPLossRandomizedClipping` and an
    :class:`~opacus_rc.accounting.accountant.RCPRVAccountant` attached by
    ``optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=1.0))``.
    One trial is an *episode* of S steps on the same batch (q = 1): a random half of the
    canaries is present in all S steps, the others in none; the score is the sum of the S
    released entries over ``sigma C sqrt(S)`` (``N(0, 1)`` without the canary,
    ``N(sum_s Z_s / (sigma sqrt(S)), 1)`` with it, Z_s drawn from the step's own sketch).
    ``eps_accounted`` is the accountant's epsilon after the first episode (its history
    must hold S steps ``(sigma, 1, steps, record)``).

``reused_layer``
    Book-keeping (``grad_sample_mode="hooks"``) on a model that applies the layer L times
    in one forward pass (``sum_l layer(x)``, as an RNN cell or a weight-shared stack
    would). One Poisson draw per step at rate q: an "in" canary joins it with probability
    q. Its per-example gradient is the sum of its L uses' and is clipped once, so with the
    canary the score is ``N(Z / sigma, 1)`` and the step is charged one micro-batch at q
    (history ``(sigma, q, 1, record)``, ``micro_batches`` 1). One clip factor per use
    would give ``L Z / sigma`` while charging L independent micro-batches: the audit
    finds eps_lower above eps_accounted.

``reentrant_split``
    One Poisson draw (q = 1) split into ``m`` physical batches of equal size, as
    BatchMemoryManager splits it (``signal_skip_step(same_draw=True)`` before every
    physical batch but the last), on the audit's layer run inside
    ``checkpoint(..., use_reentrant=True)`` (every trainable layer in a reentrant region,
    as LoRA with a frozen embedding and head), with per-example sketches (always: the
    variant is about them). Physical batch 1 holds, at index ``b + r`` (after the b
    background examples), canary r if it is "in", else an example of zero gradient (its
    clipped contribution is exactly 0: the released step has the distribution of the step
    without it); batches 2..m hold, at the same index, a companion of canary r: the same
    output coordinate r, input coordinate ``d - 2`` (released entry ``W.grad[r, d-2]``),
    always present. With fresh per-example sketches the companions are independent of the
    canary; had the physical batches reused the first batch's sketches, the m - 1
    companions would share the canary's Z and reveal it: ``mu_hat = W.grad[r, d-2] /
    (sigma C (m - 1)) = Z / sigma + N(0, 1 / (m - 1)^2)``. The score is the likelihood
    ratio statistic of the canary's entry given that estimate, ``mu_hat+ (s - mu_hat+ /
    2)``, ``s = W.grad[r, d-1] / (sigma C)``, ``mu_hat+ = max(mu_hat, 0)``. Charged one
    micro-batch at q = 1 with the hidden-Z analysis; ``eps_exact`` is the one-step hidden-Z
    pair's (the statistic cannot do better while the sketches are fresh), while a revealed
    Z would allow up to 2.18 at k = 4, sigma = 2 (above the 1.62 charged).

``per_example`` (and its control ``per_example_unchecked``)
    The per-example form, ``make_private(..., per_example_backward=True)``, on the real
    objects it returns, its loader included (one example per physical batch of each draw,
    the same-draw signals of its splitter); details at :data:`PER_EXAMPLE_VARIANTS`. Each
    canary has an always-present partner whose gradient is the canary's times ``-1/2``:
    clipped alone, the pair shifts the canary's entry by C, the sensitivity the accountant
    charges (one exact-clipping step at q = 1); the control, with the batch check off and
    two examples per backward pass, clips the canary with its partner and shifts it by
    ``(1 + 1/sqrt(2)) C``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, fields, replace
from typing import Callable, NamedTuple, Optional

import numpy as np
import torch
from torch import nn

from ..accounting.accountant import StepRecord
from ..config import ESTIMATORS, SKETCHINGS, SketchConfig
from .checks import check_choices, check_fields, check_ints
from .experiment import (
    AuditConfig, AuditResult, TrialSettings, InnerProductLoss, _batch, _data, _Experiment, _released, accounted_epsilon,
    build_experiment, one_step_trials, result_fields, run_trials,
)
from .reference import accumulation_exact_epsilon, composed_sum_epsilon

PATH_VARIANTS = ("accumulation_canary", "hand_built", "reused_layer", "reentrant_split")

#: Per variant: sketch size, sigma and the path's own size. Accumulation: Hutchinson
#: k = 32, sigma = 1 (the one-step audit's k = 32 row) and q m = 1, where the old q x m
#: charge (2.62) is far below the exact epsilon (5.58) and the new charge is 7.88.
#: Hand-built: k = 4 (heavy-tailed Z, where sketch draws matter most), 4 steps per trial,
#: sigma = 4 (the sum over 4 steps has the signal-to-noise ratio of one step at sigma = 2).
PATH_DEFAULTS = {
    "accumulation_canary": {"sketch_size": 32, "sigma": 1.0, "micro_batches": 4, "sample_rate": 0.25},
    "hand_built": {"sketch_size": 4, "sigma": 4.0, "episode_steps": 4},
    "reused_layer": {"sketch_size": 32, "sigma": 1.0, "uses": 2, "sample_rate": 0.25},
    # k = 4, sigma = 2: hidden-Z charge 1.62, a revealed Z up to 2.18 (exact); m = 4
    # physical batches: 3 companions estimate Z / sigma to 1/3
    "reentrant_split": {"sketch_size": 4, "sigma": 2.0, "micro_batches": 4, "sketching": "per_example"},
}


@dataclass(frozen=True)
class PathAuditConfig(TrialSettings):
    """One side-path audit.

    Args:
        variant: one of :data:`PATH_VARIANTS` (``"accumulation_canary"``, ``"hand_built"``, ``"reused_layer"``,
            ``"reentrant_split"``, ``"fused_head"``, ``"per_example"`` and the controls).
        estimator, sketch_size, sketching: the sketch.
        sigma: noise multiplier.
        steps: logical steps (accumulation) or episodes of ``episode_steps`` steps
            (hand-built); the first half chooses the threshold, the second gives the bound.
        replicas: canaries per step (trials per step or episode).
        micro_batches: m, micro-batches summed into each step (accumulation); physical
            batches of the step's one Poisson draw (reentrant split).
        sample_rate: q, each micro-batch's Poisson rate (accumulation, reused layer).
        uses: L, applications of the layer per forward pass (reused layer).
        episode_steps: S, optimizer steps per trial (hand-built).
        secure_mode: hand-built objects in secure mode (sketches and noise from
            :mod:`opacus_rc.csprng`: not reproducible, seeds unused).
        delta, alpha, seed, canary_norm, background, max_grad_norm: as in
            :class:`~opacus_rc.audit.AuditConfig`.
    """

    variant: str = "accumulation_canary"
    estimator: str = SketchConfig.estimator
    sketch_size: int = SketchConfig.sketch_size
    sigma: float = 1.0
    sketching: str = "shared"
    steps: int = 200
    replicas: int = 256
    micro_batches: int = 4
    sample_rate: float = 0.25
    episode_steps: int = 4
    uses: int = 2
    secure_mode: bool = False

    def __post_init__(self) -> None:
        check_choices(
            ("variant", self.variant, PATH_VARIANTS),
            ("estimator", self.estimator, ESTIMATORS),
            ("sketching", self.sketching, SKETCHINGS),
        )
        check_ints(self, (("micro_batches", 2), ("episode_steps", 1), ("uses", 2)))
        in_rate = lambda v: isinstance(v, (int, float)) and 0.0 < v <= 1.0  # noqa: E731
        check_fields(self, ("sample_rate",), in_rate, "a float in (0, 1]")
        _ = self.base  # the shared fields are checked by AuditConfig

    @property
    def base(self) -> AuditConfig:
        """The one-step audit's configuration with the same shared fields (shapes, data)."""
        return AuditConfig(**{f.name: getattr(self, f.name) for f in fields(AuditConfig) if f.name != "variant"})


@dataclass
class PathAuditResult(AuditResult):
    """:class:`~opacus_rc.audit.AuditResult` plus the side path's own numbers.

    ``eps_exact``: the exact epsilon of the audited pair (accumulation: the mixture over J
    and Z; hand-built: of the sum statistic, a Monte Carlo quadrature). ``eps_old_charge``:
    accumulation only, the pre-fix charge (one draw at ``min(1, q m)``)."""

    eps_exact: float = float("nan")
    eps_old_charge: float = float("nan")
    micro_batches: int = 1
    sample_rate: float = 1.0
    episode_steps: int = 1
    history: tuple = ()


def build_reused(config: PathAuditConfig):
    """Book-keeping ``make_private(..., grad_sample_mode="hooks", sample_rate=q)`` on the
    audit's layer applied ``config.uses`` times per forward pass."""
    return build_accumulation(config, uses=config.uses)


def build_accumulation(config: PathAuditConfig, uses: int = 1) -> _Experiment:
    """``make_private(..., clipping="randomized", poisson_sampling=False)`` on the audit's
    model, its accountant hook at the audit's own Poisson rate q (the engine's accountant
    records each step's micro-batches); ``uses > 1``: the layer applied that many times
    per pass, by book-keeping."""
    exp = build_experiment(config.base, uses=uses)
    # the audit samples every micro-batch itself at q (Poisson); the loader is never used
    exp.optimizer.attach_step_hook(exp.accountant.get_optimizer_hook_fn(sample_rate=config.sample_rate))
    return exp


def build_hand_built(config: PathAuditConfig, noise_multiplier: Optional[float] = None) -> _Experiment:
    """The grad-sample module, optimizer, criterion and accountant built by hand
    (``noise_multiplier`` overrides ``config.sigma``, e.g. 0 to compare sketches)."""
    import opacus_rc  # noqa: F401
    from ..accounting.accountant import RCPRVAccountant
    from ..grad_sample import GradSampleModuleRandomizedClipping
    from ..forms.two_pass import DPLossRandomizedClipping
    from ..optimizer import RandomizedClippingOptimizer

    base = config.base
    d, p, _ = base.shapes
    layer = nn.Linear(d, p, bias=False)
    background, canaries = _data(base, torch.Generator().manual_seed(config.seed))
    sketch_config = SketchConfig(
        estimator=config.estimator,
        sketch_size=config.sketch_size,
        sketching=config.sketching,
        exact_when_cheaper=False,
    )
    secure = config.secure_mode
    model = GradSampleModuleRandomizedClipping(
        layer,
        batch_first=True,
        loss_reduction="sum",
        max_grad_norm=config.max_grad_norm,
        sketch_config=sketch_config,
        sketch_seed=None if secure else config.seed + 2,
        secure_mode=secure,
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


def _check_history(history, config: PathAuditConfig) -> None:
    """The accountant recorded what the audited path ran (else: RuntimeError)."""
    if config.variant in ("accumulation_canary", "reused_layer"):
        micro = _micro_batches(config)
        ok = (
            len(history) == 1
            and history[0][1] == config.sample_rate
            and history[0][2] == 1
            and isinstance(history[0][3], StepRecord)
            # reused layer: whatever the step is charged as, the threshold test judges it
            and (config.variant == "reused_layer" or history[0][3].micro_batches == micro)
        )
        expected = f"one step at q={config.sample_rate} with micro_batches={micro}"
    else:
        # consecutive equal steps are merged into one entry with a step count
        ok = sum(e[2] for e in history) == config.episode_steps and all(
            e[0] == config.sigma and e[1] == 1.0 and isinstance(e[3], StepRecord)
            and e[3].sketch_size == config.sketch_size
            and e[3].micro_batches == 1
            for e in history
        )
        expected = f"{config.episode_steps} steps at q=1 with sketch_size={config.sketch_size}"
    if not ok:
        raise RuntimeError(f"expected {expected} in the rc_prv history, got {history}")


def _micro_batches(config: PathAuditConfig) -> int:
    """Independent Poisson micro-batches per step: m (accumulation), else 1."""
    return config.micro_batches if config.variant == "accumulation_canary" else 1


def old_charge_epsilon(config: PathAuditConfig, record: StepRecord) -> float:
    """What the pre-fix convention reported for one accumulated step: a single Poisson
    draw at rate ``min(1, q m)`` with the same sketch."""
    from ..accounting.accountant import RCPRVAccountant

    accountant = RCPRVAccountant()
    single = dataclasses.replace(record, micro_batches=1)
    accountant.history = [
        (config.sigma, min(1.0, config.sample_rate * config.micro_batches), 1, single)
    ]
    return accounted_epsilon(accountant, config.delta)


def run_path_audit(
    config: PathAuditConfig, progress: Optional[Callable[[int], None]] = None
) -> PathAuditResult:
    """Audit one side path (see the module docstring)."""
    if config.variant == "reentrant_split":
        return run_reentrant_split_audit(config, progress)
    if config.variant in FUSED_HEAD_VARIANTS:
        return run_fused_head_audit(config, progress)
    if config.variant in PER_EXAMPLE_VARIANTS:
        return run_per_example_audit(config, progress)
    start = time.perf_counter()
    accumulation = config.variant in ("accumulation_canary", "reused_layer")
    micro = _micro_batches(config)
    build = {"accumulation_canary": build_accumulation, "reused_layer": build_reused}.get(
        config.variant, build_hand_built
    )
    exp = build(config)
    copies = []

    def scores_of(include: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        if accumulation:
            # every "in" canary joins each micro-batch independently with probability q
            member = include[None, :] & (rng.random((micro, config.replicas)) < config.sample_rate)
            copies.append(member.sum(axis=0))
            return _released(exp, [_batch(exp, row) for row in member])
        copies.append(include * config.episode_steps)
        batch = _batch(exp, include)
        return sum(_released(exp, [batch]) for _ in range(config.episode_steps)) / math.sqrt(config.episode_steps)

    scores, included, history, eps_accounted, test = run_trials(
        config, exp, scores_of, lambda h: _check_history(h, config), progress
    )
    copies = np.array(copies, dtype=float)
    if accumulation:
        eps_exact = accumulation_exact_epsilon(
            config.estimator, config.sketch_size, config.sigma, micro,
            config.sample_rate, config.delta, config.canary_norm,
        )
        eps_old = old_charge_epsilon(config, history[0][3]) if micro > 1 else math.nan
    else:
        eps_exact = composed_sum_epsilon(
            config.estimator, config.sketch_size, config.sigma, config.episode_steps,
            config.delta, config.canary_norm,
        )
        eps_old = math.nan
    return PathAuditResult(
        **result_fields(config, test, eps_accounted, int(scores.size)),
        sketching=config.sketching,
        # mean contribution of an "in" canary per copy, in units of C
        mean_score_in=float(scores[included].sum() * config.sigma / max(copies[included].sum(), 1))
        * (1.0 if accumulation else math.sqrt(config.episode_steps)),
        seconds=time.perf_counter() - start,
        eps_exact=eps_exact,
        eps_old_charge=eps_old,
        micro_batches=micro,
        sample_rate=config.sample_rate if accumulation else 1.0,
        episode_steps=1 if accumulation else config.episode_steps,
        history=history,
    )


# --- reentrant_split: the physical batches of one draw under a reentrant checkpoint ---------


class _ReentrantRegion(nn.Module):
    """``checkpoint(layer, x, use_reentrant=True)``: the layer, the only trainable one, runs
    its forward without gradients and again in the backward pass (its input requires
    grad, as ``enable_input_require_grads()`` makes it)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.layer, x.detach().requires_grad_(True), use_reentrant=True)


def _audit_layer(config: PathAuditConfig):
    """The audit's bias-free layer (d -> p), its background and canary data (seeded by
    ``config.seed``) and a loader of one background batch: ``(base, layer, background,
    canaries, loader)``."""
    base = config.base
    d, p, _ = base.shapes
    background, canaries = _data(base, torch.Generator().manual_seed(config.seed))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*background), batch_size=config.background)
    return base, nn.Linear(d, p, bias=False), background, canaries, loader


def build_reentrant_split(config: PathAuditConfig) -> _Experiment:
    """``make_private(..., grad_sample_mode="ghost", sketching="per_example")`` on the audit's
    layer inside a reentrant checkpoint region (the audit's data; :func:`split_step` makes
    the canaries' companions)."""
    from .experiment import make_private_rc

    base, layer, background, canaries, loader = _audit_layer(config)
    engine, model, optimizer, criterion, _ = make_private_rc(
        base, _ReentrantRegion(layer), loader, "sum", config.seed,
        poisson_sampling=False, grad_sample_mode="ghost", sketching="per_example", exact_when_cheaper=False,
    )
    return _Experiment(engine.accountant, model, optimizer, criterion, layer.weight, background, canaries)


def split_step(exp: _Experiment, include: np.ndarray, physical_batches: int) -> torch.Tensor:
    """One step of the ``reentrant_split`` audit: one draw in ``physical_batches`` physical
    batches of equal size (the canaries, or zero-gradient examples where ``include`` is
    False, in the first; their companions in the others, at the same indices), split as
    BatchMemoryManager splits; returns the released gradient ``W.grad``."""
    (xb, yb), (xc, yc) = exp.background, exp.canaries
    keep = torch.from_numpy(include)[:, None, None]
    first = (torch.cat([xb, xc * keep]), torch.cat([yb, yc * keep]))
    # companions: input coordinate d - 2 instead of d - 1, the same output coordinate
    rest = (torch.cat([xb, xc.roll(-1, dims=-1)]), torch.cat([yb, yc]))
    return draw_step(exp, _same_draw(exp.optimizer, [first] + [rest] * (physical_batches - 1)))


def _same_draw(optimizer, batches):
    """The physical batches of one draw with BatchMemoryManager's signals:
    ``signal_skip_step(do_skip=True, same_draw=True)`` before every one but the last."""
    for j, batch in enumerate(batches):
        if j < len(batches) - 1:
            optimizer.signal_skip_step(do_skip=True, same_draw=True)
        yield batch


def draw_step(exp: _Experiment, physical_batches) -> torch.Tensor:
    """One logical step over the physical batches of one draw: per batch ``(x, y)``, forward,
    criterion, ``loss.backward()``, ``optimizer.step()`` and ``optimizer.zero_grad()``, the
    skipped steps signalled by whoever yields the batches (BatchMemoryManager's sampler, the
    per-example form's loader, :func:`_same_draw`); returns the released gradient ``W.grad``
    of the step that was not skipped."""
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


def _check_split_history(history, config: PathAuditConfig) -> None:
    ok = (
        len(history) == 1 and history[0][:3] == (config.sigma, 1.0, 1) and isinstance(history[0][3], StepRecord)
        and history[0][3].micro_batches == 1 and history[0][3].sketching == "per_example"
    )
    if not ok:
        raise RuntimeError(
            f"expected one step at q=1 with micro_batches=1 and per-example sketches in the rc_prv "
            f"history, got {history}"
        )


def run_reentrant_split_audit(
    config: PathAuditConfig, progress: Optional[Callable[[int], None]] = None
) -> PathAuditResult:
    """The ``reentrant_split`` audit (see the module docstring)."""
    from .reference import exact_epsilon

    start = time.perf_counter()
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

    scores, included, history, eps_accounted, test = run_trials(
        config, exp, scores_of, lambda h: _check_split_history(h, config), progress
    )
    entries = np.array(entries)
    return PathAuditResult(
        **result_fields(config, test, eps_accounted, int(scores.size)),
        sketching="per_example",
        mean_score_in=float(entries[included].mean() * config.sigma),  # E Z, units of C
        seconds=time.perf_counter() - start,
        eps_exact=exact_epsilon(
            config.estimator, config.sketch_size, config.sigma, "honest", config.delta, config.canary_norm
        ),
        micro_batches=m,
        sample_rate=1.0,
        history=history,
    )



# --- fused_head: a loss that goes around the hooks (checkpointed model) ---------------------

#: ``fused_head``: the plugin's step on a loss that reads the trainable head's weight
#: outside its module (``F.linear(h, W)``, a TRL-style fused head) on a model with
#: activation checkpointing (two passes from the output): it must be refused, nothing
#: released or charged. ``fused_head_unchecked``: the deliberately broken control, the same
#: step with the optimizer's clipped-pass check switched off (the pre-fix behaviour): the
#: canary's gradient is released unclipped (``canary_norm`` C) and the threshold test finds
#: eps_lower far above the one step it is charged as.
FUSED_HEAD_VARIANTS = ("fused_head", "fused_head_unchecked")
#: the control's steps at most: its unclipped canary (``canary_norm`` C) is found at any size
FUSED_HEAD_MAX_STEPS = 40
PATH_VARIANTS += FUSED_HEAD_VARIANTS
PATH_DEFAULTS.update({v: {"sketch_size": 32, "sigma": 1.0} for v in FUSED_HEAD_VARIANTS})


class _CheckpointedHead(nn.Module):
    """The audit's layer as the LM head (``get_output_embeddings``) of a model with Hugging
    Face activation checkpointing on (``gradient_checkpointing``): its input goes through a
    checkpointed (parameter-free) region, and ``make_private(grad_sample_mode="hooks")``
    runs two passes from the head's output."""

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


@dataclass
class FusedHeadAuditResult(PathAuditResult):
    """``refusal``: the plugin's error (``fused_head``; empty when the step ran)."""

    refusal: str = ""


def build_fused_head(config: PathAuditConfig) -> _Experiment:
    """``make_private(..., grad_sample_mode="hooks")`` on :class:`_CheckpointedHead` (two
    passes from the output); the experiment's criterion is the fused loss
    ``sum_i <y_i, F.linear(h_i, W)>`` that never calls the head; the control switches the
    optimizer's clipped-pass check off."""
    from .experiment import make_private_rc

    base, layer, background, canaries, loader = _audit_layer(config)
    engine, model, optimizer, _, _ = make_private_rc(
        base, _CheckpointedHead(layer), loader, "sum", config.seed, poisson_sampling=False,
        grad_sample_mode="hooks", sketching=config.sketching, exact_when_cheaper=False,
    )
    if getattr(model, "output_passes", None) is None:
        raise RuntimeError("fused_head: expected the two passes from the output (a checkpointed model)")
    if config.variant == "fused_head_unchecked":
        optimizer.check_clipped_passes = lambda **_: None  # the broken control
    inner = InnerProductLoss(reduction="sum")

    def hidden(x: torch.Tensor) -> torch.Tensor:  # the "model": the head is never called
        return model._module.hidden(x)

    def fused_loss(h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # TRL-style fused head
        return inner(torch.nn.functional.linear(h, layer.weight), target)

    return _Experiment(engine.accountant, hidden, optimizer, fused_loss, layer.weight, background, canaries)


def run_fused_head_audit(
    config: PathAuditConfig, progress: Optional[Callable[[int], None]] = None
) -> FusedHeadAuditResult:
    """``fused_head``: one step of the fused loss; the plugin must refuse it (ValueError)
    with nothing released or charged: eps_lower 0, eps_accounted 0, no trial. A step taken
    instead is audited like the control. ``fused_head_unchecked``: the threshold test over
    ``config.steps`` steps, charged one step at q = 1 each."""
    start = time.perf_counter()
    config = replace(config, steps=min(config.steps, FUSED_HEAD_MAX_STEPS))
    exp = build_fused_head(config)
    refusal = ""
    if config.variant == "fused_head":
        before = exp.weight.detach().clone()
        try:
            _released(exp, [_batch(exp, np.ones(config.replicas, dtype=bool))])
        except ValueError as error:
            refusal = str(error)
        if refusal:
            if exp.accountant.history or not torch.equal(exp.weight, before):
                raise RuntimeError("fused_head: the refused step released or charged something")
            if progress is not None:
                progress(config.steps)
            return FusedHeadAuditResult(
                estimator=config.estimator, sketch_size=config.sketch_size, sigma=float(config.sigma),
                variant=config.variant, eps_lower=0.0, eps_accounted=0.0, sketching=config.sketching,
                delta=config.delta, alpha=config.alpha, trials=0,
                seconds=time.perf_counter() - start, refusal=refusal,
            )
        exp = build_fused_head(config)  # the step was taken: audit it (a fresh accountant)

    fields, history = one_step_trials(config, exp, progress, start)
    return FusedHeadAuditResult(**fields, history=history)


# --- per_example: the per-example form (one example per backward pass, exact clipping) ------

#: ``per_example``: the objects of ``make_private(..., clipping="randomized",
#: per_example_backward=True)``, its loader included (one example per physical batch, one
#: draw per step). Every replica r has a *partner* in D, always present: the canary's input
#: with half its target negated (gradient ``-canary_norm C / 2`` on the canary's entry, so
#: clipped to ``-C``); the draw holds each "in" canary right after its partner. Each example
#: is clipped alone: the entry reads ``-C`` without the canary and ``0`` with it, a shift of
#: C (the Gaussian mechanism of sensitivity C that ``rc_prv`` charges: exact clipping, one
#: step at q = 1). ``per_example_unchecked``: the deliberately broken control, the same
#: objects with the form's batch check off and its loader split into physical batches of
#: two, so the canary and its partner share one backward pass and one clip: their sum,
#: ``+canary_norm C / 2``, is clipped to ``+C``; the other partners share theirs in pairs
#: (two equal norms: each clipped to ``C / sqrt(2)``), so the shift is ``(1 + 1 / sqrt(2)) C``.
PER_EXAMPLE_VARIANTS = ("per_example", "per_example_unchecked")
#: one per-example step runs ``3 R / 2 + background`` backward passes (388 at R = 256,
#: 0.16 to 0.2 s here): the command runs a fifth of the requested steps (80 at --quick)...
PER_EXAMPLE_STEP_SHARE = 5
#: ...and the control at most this many: its larger shift is found at this size
PER_EXAMPLE_MAX_STEPS = 40
PATH_VARIANTS += PER_EXAMPLE_VARIANTS
# sigma = 1: the exact Gaussian mechanism's epsilon is 2.32 at delta = 1e-2; k = 4 only sets
# the shapes (d = 6, T = 12): the form sketches nothing
PATH_DEFAULTS.update({v: {"sketch_size": 4, "sigma": 1.0} for v in PER_EXAMPLE_VARIANTS})


def per_example_steps(variant: str, steps: int) -> int:
    """The steps the command runs for a per-example variant when ``steps`` are requested."""
    share = max(2, steps // PER_EXAMPLE_STEP_SHARE)
    return min(share, PER_EXAMPLE_MAX_STEPS) if variant == "per_example_unchecked" else share


class _DrawSampler(torch.utils.data.Sampler):
    """A batch sampler of one batch per pass: ``draw``, the indices of the step's draw (set
    by the audit before each step)."""

    def __init__(self) -> None:
        self.draw: list = []

    def __iter__(self):
        yield list(self.draw)

    def __len__(self) -> int:
        return 1


class _PerExampleExperiment(NamedTuple):
    """The experiment, the loader ``make_private`` returned and the sampler under it."""

    exp: _Experiment
    loader: torch.utils.data.DataLoader
    sampler: _DrawSampler


def build_per_example(config: PathAuditConfig) -> _PerExampleExperiment:
    """``make_private(..., per_example_backward=True, poisson_sampling=False)`` on the audit's
    layer over the data set ``background + partners + canaries`` (indices in that order),
    read through a :class:`_DrawSampler` (one batch per step: the sample rate is 1); the
    control switches the form's batch check off and splits the draw into physical batches
    of two."""
    from ..forms.per_example import PerExampleOptimizer
    from ._broken import unchecked_batches
    from .experiment import make_private_rc

    base, layer, background, canaries, _ = _audit_layer(config)
    (xb, yb), (xc, yc) = background, canaries
    sampler = _DrawSampler()
    data = torch.utils.data.TensorDataset(torch.cat([xb, xc, xc]), torch.cat([yb, -yc / 2, yc]))
    engine, model, optimizer, criterion, loader = make_private_rc(
        base, layer, torch.utils.data.DataLoader(data, batch_sampler=sampler), "sum", config.seed,
        poisson_sampling=False, per_example_backward=True,
        expected_batch_size=config.background + config.replicas + config.replicas // 2,
    )
    if not isinstance(optimizer, PerExampleOptimizer):
        raise RuntimeError(f"per_example: expected the per-example form, got {type(optimizer).__name__}")
    if config.variant == "per_example_unchecked":  # the broken control
        unchecked_batches(model)
        loader.batch_sampler.max_batch_size = 2
    exp = _Experiment(engine.accountant, model, optimizer, criterion, layer.weight, background, canaries)
    return _PerExampleExperiment(exp, loader, sampler)


def per_example_step(built: _PerExampleExperiment, include: np.ndarray) -> torch.Tensor:
    """One step of the per-example audit: the draw (each "in" canary right after its partner,
    then the other partners, then the background) through the loader ``make_private``
    returned; returns the released gradient ``W.grad``."""
    nb, r = len(built.exp.background[0]), len(include)
    pairs = [i for j in np.flatnonzero(include) for i in (nb + j, nb + r + j)]
    built.sampler.draw = pairs + [nb + j for j in np.flatnonzero(~include)] + list(range(nb))
    return draw_step(built.exp, built.loader)


def _check_per_example_history(history) -> None:
    ok = len(history) == 1 and history[0][1:3] == (1.0, 1) and isinstance(history[0][3], StepRecord) and (
        not history[0][3].randomized and history[0][3].micro_batches == 1
    )
    if not ok:
        raise RuntimeError(f"expected one exact-clipping step at q=1 with micro_batches=1, got {history}")


def run_per_example_audit(
    config: PathAuditConfig, progress: Optional[Callable[[int], None]] = None
) -> PathAuditResult:
    """The ``per_example`` audit and its control (see :data:`PER_EXAMPLE_VARIANTS`): the
    threshold test on the canaries' entries over ``config.steps`` steps, charged by the
    engine's own accountant (one exact-clipping step at q = 1). ``mean_score_in``: the
    canary's mean shift of its entry (units of C: 1 honest, 1.707 for the control);
    ``eps_exact``: the Gaussian mechanism's epsilon for that shift."""
    from .reference import mixture_epsilon

    start = time.perf_counter()
    built = build_per_example(config)
    d = built.exp.canaries[0].shape[-1]

    def scores_of(include: np.ndarray, _rng: np.random.Generator) -> np.ndarray:
        return per_example_step(built, include)[: config.replicas, d - 1].double().numpy()

    scores, included, history, eps_accounted, test = run_trials(
        config, built.exp, scores_of, _check_per_example_history, progress
    )
    shift = 1.0 + math.sqrt(0.5) if config.variant == "per_example_unchecked" else 1.0
    return PathAuditResult(
        **{**result_fields(config, test, eps_accounted, int(scores.size)), "estimator": "exact", "sketch_size": 0},
        mean_score_in=float((scores[included].mean() - scores[~included].mean()) * config.sigma),
        seconds=time.perf_counter() - start,
        eps_exact=mixture_epsilon(np.array([shift / config.sigma]), config.delta),
        history=history,
    )
