"""The noise mechanism in the private Trainer (``PrivacyArguments(noise=...)``,
:mod:`opacus_rc.noises`): its sampler at the Trainer's public rate and, for a numbered mechanism
(cyclic Poisson draws, e.g. ``noise="banded"``), each physical batch's draw number carried to the
optimizer (the mechanism's time) and the numbering continued from the optimizer's state at every
``train()`` (a resume too), on every rank."""

from __future__ import annotations

from typing import Any, Optional

from transformers import Trainer

from .arguments import PrivacyArguments
from .data import poisson_sampler_of, take_draw_step


def check_noise_sampling(trainer: Trainer) -> None:
    """The mechanism's sampler at the Trainer's rate ``q``: cyclic draws over ``parts`` parts need
    at most the logical steps of an epoch, each part sampled at ``parts x q <= 1``
    (:meth:`~opacus_rc.noises.NoiseSpec.check_sampling`)."""
    if trainer.train_dataset is None and trainer.privacy.sample_rate is None:
        return  # the rate is known at train(); make_private refuses parts above the epoch's draws
    trainer.privacy.noise_spec().check_sampling(
        poisson_sampling=True, draws=trainer.steps_per_epoch, sample_rate=trainer.sample_rate,
        draws_are="logical steps", hint=" (or a lower sample_rate, a smaller batch)",
    )


def check_draw_step(privacy: PrivacyArguments, step: Optional[int], skipping: bool = False) -> Optional[int]:
    """``step``, the draw number a physical batch carried; a numbered mechanism's batch must carry
    it (from the private Trainer's cyclic Poisson loader: the mechanism's time is its draw's).
    ``skipping``: as :func:`~opacus_rc.hf.checks.check_units`."""
    if step is None and privacy.noise_spec().parts is not None:
        if skipping:
            raise ValueError(
                f"noise={privacy.noise!r}: the run resumed mid-epoch, and the Trainer skips the epoch's first batches "
                "through a loader of its own, whose batches carry no draw numbers (the noise's time); set "
                "TrainingArguments(ignore_data_skip=True): every Poisson draw is fresh, there is nothing to skip, "
                "and the draws continue the noise's numbering from the checkpoint's optimizer state"
            )
        raise ValueError(
            f"noise={privacy.noise!r}: a physical batch came without its draw's number (it is not from the "
            "private Trainer's cyclic Poisson loader), and the noise needs each step's draw; an override of "
            "get_train_dataloader must return super().get_train_dataloader() unchanged"
        )
    return step


def signal_draw_step(trainer: Trainer, optimizer: Any, inputs: Any, skipping: bool) -> None:
    """Take the draw number off ``inputs`` (it never reaches the model) and, for a numbered
    mechanism, name it to ``optimizer``: the next release's noise step (``signal_draw_step``)."""
    step = check_draw_step(trainer.privacy, take_draw_step(inputs), skipping)
    if step is not None:
        optimizer.signal_draw_step(step)


def continue_numbering(trainer: Trainer) -> None:
    """A cyclic sampler serves the mechanism's run from its next step (a mechanism loaded without
    its secret state restarts: :meth:`~opacus_rc.units.CyclicPoissonSampler.serve`). Under
    several processes every rank calls this at ``train()``: the ranks' next steps and draw numbers
    are compared, and rank 0's partition of the units and run are taken on every rank."""
    sampler = poisson_sampler_of(trainer._dp_loader)
    mechanism = getattr(trainer._dp_optimizer, "noise_mechanism", None)
    if sampler is not None and mechanism is not None:
        sampler.serve(mechanism)


__all__ = ["check_draw_step", "check_noise_sampling", "continue_numbering", "signal_draw_step"]
