"""``noise="banded"`` in the private Trainer (:mod:`opacus_rc.correlated`): where it runs, and
each physical batch's draw number carried to the optimizer (the banded noise's time)."""

from __future__ import annotations

from typing import Any, Optional

from transformers import Trainer

from .arguments import PrivacyArguments
from .data import poisson_sampler_of, take_draw_step


def check_banded(trainer: Trainer) -> None:
    """``noise="banded"`` where the Trainer runs it: one process (not verified under DDP), and
    ``bands`` parts each sampled at ``bands * q <= 1`` (at most the logical steps of an epoch)."""
    bands = trainer.privacy.bands
    if trainer.args.world_size > 1:
        raise ValueError(
            f"noise='banded' is not supported by {type(trainer).__name__} with world_size={trainer.args.world_size} "
            "(not verified across ranks); accepted: one process, or the plain make_private loop "
            "(make_private(..., noise='banded', bands=b) returns a cyclic Poisson loader that shards the units)"
        )
    if trainer.train_dataset is None and trainer.privacy.sample_rate is None:
        return  # the rate is known at train(); make_private refuses bands above the epoch's draws
    q = trainer.sample_rate
    if bands > trainer.steps_per_epoch or bands * q > 1.0:
        raise ValueError(
            f"bands={bands} is above the {trainer.steps_per_epoch} logical steps of an epoch (sample rate {q:.6g}): "
            f"each of the {bands} parts would be sampled at a rate above 1; accepted values: "
            f"1 <= bands <= {trainer.steps_per_epoch} (or a lower sample_rate, a smaller batch)"
        )


def check_draw_step(privacy: PrivacyArguments, step: Optional[int], skipping: bool = False) -> Optional[int]:
    """``step``, the draw number a physical batch carried; a banded run's batch must carry it
    (from the private Trainer's cyclic Poisson loader: the banded noise's time is its draw's).
    ``skipping``: as :func:`check_units`."""
    if privacy.banded and step is None:
        if skipping:
            raise ValueError(
                "noise='banded': the run resumed mid-epoch, and the Trainer skips the epoch's first batches "
                "through a loader of its own, whose batches carry no draw numbers (the banded noise's time); "
                "set TrainingArguments(ignore_data_skip=True): every Poisson draw is fresh, there is nothing to "
                "skip, and the draws continue the noise's recursion from the checkpoint's optimizer state"
            )
        raise ValueError(
            "noise='banded': a physical batch came without its draw's number (it is not from the private "
            "Trainer's cyclic Poisson loader), and banded noise needs each step's draw; an override of "
            "get_train_dataloader must return super().get_train_dataloader() unchanged"
        )
    return step


def signal_draw_step(trainer: Trainer, optimizer: Any, inputs: Any, skipping: bool) -> None:
    """Take the draw number off ``inputs`` (it never reaches the model) and, for a banded run,
    name it to ``optimizer``: the next release's noise step (``signal_draw_step``)."""
    step = check_draw_step(trainer.privacy, take_draw_step(inputs), skipping)
    if step is not None:
        optimizer.signal_draw_step(step)


def continue_numbering(trainer: Trainer) -> None:
    """A banded run's sampler serves the noise's run from its next step (a resumed recursion
    without its kept vectors restarts: :meth:`~opacus_rc.units.CyclicPoissonSampler.serve`)."""
    sampler = poisson_sampler_of(trainer._dp_loader)
    if trainer.privacy.banded and sampler is not None:
        sampler.serve(trainer._dp_optimizer.banded)


__all__ = ["check_banded", "check_draw_step", "continue_numbering", "signal_draw_step"]
