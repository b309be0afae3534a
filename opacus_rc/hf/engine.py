"""How the private Trainer enters the engine: one :meth:`opacus_rc.PrivacyEngine.make_private`
call with the Trainer's public sampling (its rate ``q`` and normaliser ``B``), made when the
Trainer creates its optimizer; the ``rc_prv`` calibration and epsilon the Trainer reports."""

from __future__ import annotations

import logging
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import torch
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from opacus.optimizers import DPOptimizer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ..accounting.accountant import RCPRVAccountant, noise_multiplier_for_record
from ..integration import PrivacyEngine
from ..forms import form_of
from ..options import per_rank_normaliser
from ..sketch import entropy_seed
from ..values import HOOKS, RANDOMIZED, RC_PRV
from .arguments import PrivacyArguments

logger = logging.getLogger(__package__)


def noise_multiplier(privacy: PrivacyArguments, sample_rate: float, steps: int, physical_batch_size: int) -> float:
    """``privacy.noise_multiplier``, else sigma calibrated with ``rc_prv`` so that ``steps``
    logical steps sampled at ``sample_rate`` (charged at :meth:`PrivacyArguments.charged_rate`:
    inside a part of a cyclic sampler) spend ``privacy.target_epsilon`` at ``privacy.delta``, each step
    of :meth:`PrivacyArguments.step_record` (the form's sketch: none for the per-example form; the
    noise mechanism's record), as ``make_private_with_epsilon`` does."""
    if privacy.noise_multiplier is not None:
        return float(privacy.noise_multiplier)
    record = privacy.step_record(physical_batch_size)
    rate = privacy.charged_rate(sample_rate)
    sigma = noise_multiplier_for_record(privacy.target_epsilon, privacy.delta, rate, None, steps, record)
    logger.info("rc_prv calibrated noise_multiplier=%.4f for %d steps charged at q=%.6g, %s",
                sigma, steps, rate, record)
    return sigma


def epsilon(history: List[Any], delta: float) -> float:
    """Epsilon of an ``rc_prv`` history at ``delta`` (0 for an empty history)."""
    probe = RCPRVAccountant()
    probe.history = list(history)
    return float(probe.get_epsilon(delta=delta))


def budget_steps(
    history: List[Any], sigma: float, sample_rate: float, sketch: Any, *, delta: float, budget: float, planned: int
) -> Optional[int]:
    """The largest number of further logical steps (sigma, sample rate and sketch record as
    configured) after ``history`` whose epsilon at ``delta`` stays within ``budget``, by
    bisection; None when the ``planned`` steps fit in it."""

    def eps_after(extra: int) -> float:
        return epsilon(history + ([(sigma, sample_rate, extra, sketch)] if extra else []), delta)

    lo, hi = 0, max(1, planned)
    if eps_after(hi) <= budget:  # hi >= planned: the plan fits in the budget
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if eps_after(mid) <= budget else (lo, mid)
    return lo


def public_loader(batch_size: int, rows: Optional[int] = None) -> DataLoader:
    """The ``data_loader`` make_private requires (the Trainer trains on its own Poisson
    loader): one batch of ``batch_size`` rows, from which Opacus's flat route derives the
    public normaliser ``int(B * 1.0) = B`` (per rank under DDP, divided once by Opacus);
    ``rows``: a placeholder dataset of that many rows instead (privacy_unit="user": the
    user ids are one per train_dataset row; the randomized route takes B explicitly)."""
    return DataLoader(TensorDataset(torch.zeros(batch_size if rows is None else rows)), batch_size=batch_size)


class Private(NamedTuple):
    """What :func:`make_private` made: the engine, its hooks and DP optimizer, the DPDDP
    module (``None`` in one process) and the noise multiplier."""

    engine: PrivacyEngine
    hooks: Any
    optimizer: DPOptimizer
    ddp: Optional[DPDDP]
    sigma: float


def make_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    privacy: PrivacyArguments,
    *,
    batch_size: int,
    sample_rate: float,
    steps: int,
    world_size: int,
    physical_batch_size: int,
    history: Optional[List[Any]] = None,
    user_ids: Optional[Sequence[Any]] = None,
) -> Private:
    """The private Trainer's engine: book-keeping hooks (``wrap_model=False``; the
    per-example form's when ``privacy.per_example(physical_batch_size)``) and a DP
    optimizer averaging by the public ``batch_size`` (summed over ranks), charging
    ``sample_rate``, with the noise multiplier of ``privacy`` (calibrated for ``steps``);
    ``history``: a resumed accountant history. A noise mechanism served by cyclic draws is
    charged ``parts * sample_rate``, the rate inside a part. At ``privacy.privacy_unit="user"``,
    ``user_ids`` (one per train_dataset row): ``batch_size`` counts expected users and
    ``sample_rate`` is the users' rate q_u (make_private clips per user)."""
    p = privacy
    trainable = [q for q in model.parameters() if q.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameter")
    sigma = noise_multiplier(p, sample_rate, steps, physical_batch_size)
    engine = PrivacyEngine(accountant=RC_PRV, secure_mode=p.secure_mode)
    ddp = None
    if world_size > 1:
        # Opacus's DPDDP (parameters broadcast from rank 0, no gradient all-reduce in the
        # backward pass): the distributed DP optimizer sums the clipped sums across ranks
        # after rank 0 alone added the noise. The Trainer runs it instead of DDP.
        ddp = model = DPDDP(model)
    users = p.user_level
    kwargs: Dict[str, Any] = dict(
        module=model, optimizer=optimizer, noise_multiplier=sigma,
        data_loader=public_loader(batch_size, len(user_ids) if users else None),
        max_grad_norm=p.max_grad_norm, clipping=p.clipping, grad_sample_mode=HOOKS,
        wrap_model=False, poisson_sampling=True, loss_reduction="sum", batch_first=True, denoise=p.denoise,
        criterion=nn.CrossEntropyLoss(reduction="sum"),  # (unused: the Trainer computes its losses; Opacus's check)
    )
    if p.clipping == RANDOMIZED:
        per_example = p.per_example(physical_batch_size)
        kwargs.update(
            estimator=p.estimator, sketch_size=p.sketch_size, sketching=p.sketching,
            expected_batch_size=batch_size, sample_rate=sample_rate, per_example_backward=per_example,
        )
        kwargs.update(p.noise_options())  # the optimizer's noise mechanism; its loader (cyclic draws) is the Trainer's
        if p.lm_head_block_size is not None and not per_example:
            kwargs["bookkeeping"] = True  # the chunked head's norms: one pass, checkpointed or not
        if users:
            kwargs.update(privacy_unit=p.privacy_unit, user_ids=user_ids, max_examples_per_user=p.max_examples_per_user)
    elif not p.secure_mode:
        # Opacus's flat clipping would draw from torch's global generator, which the Trainer's
        # set_seed seeds; randomized clipping has its own os.urandom streams, one per device
        kwargs["noise_generator"] = torch.Generator(device=trainable[0].device).manual_seed(entropy_seed())
    was_training = model.training
    model.train()  # Opacus validates a module in training mode (evaluate() may have run first)
    try:
        hooks, dp_optimizer, _ = engine.make_private(**kwargs)
    finally:
        model.train(was_training)
    # The Trainer backwards the summed per-example losses (trainer.py): its hooks run at "sum", so no
    # 1/n enters an example's gradient (half precision would round it with the batch's size), and the
    # optimizer divides by the public batch size, as under "mean".
    dp_optimizer.loss_reduction = "mean"
    if p.clipping != RANDOMIZED:
        # The engine refuses sample_rate= with clipping="flat" (Opacus's route) and Opacus
        # charges 1 / len(its loader), which cannot be every public q: the accountant's hook
        # is set to charge q (it replaces Opacus's; the normaliser came from the loader).
        dp_optimizer.attach_step_hook(engine.accountant.get_optimizer_hook_fn(sample_rate=sample_rate))
    if dp_optimizer.expected_batch_size != per_rank_normaliser(batch_size, world_size > 1):
        raise RuntimeError(
            f"make_private averages by {dp_optimizer.expected_batch_size!r}, not the public per-rank "
            f"normaliser {per_rank_normaliser(batch_size, world_size > 1)!r}"
        )
    if history is not None:
        engine.accountant.history = list(history)
    return Private(engine, hooks, dp_optimizer, ddp, sigma)


def signal_same_draw(optimizer: DPOptimizer) -> None:
    """A skipped step whose next physical batch continues the same Poisson draw (charged
    once, averaged once). Opacus's flat optimizer has no ``same_draw=``: it counts a
    skipped step as part of the same logical step anyway."""
    same_draw = {} if form_of(optimizer) is None else {"same_draw": True}
    optimizer.signal_skip_step(do_skip=True, **same_draw)


__all__ = ["Private", "budget_steps", "epsilon", "make_private", "noise_multiplier", "public_loader", "signal_same_draw"]
