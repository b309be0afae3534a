"""The private Trainer's callback: the DP optimizer's checks after every step, and the
stop at ``stop_at_epsilon``."""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

logger = logging.getLogger("opacus_rc.hf")


class DPCallback(TrainerCallback):
    """Runs the DP optimizer's zero_grad after every step and the budget stop."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):  # control unchanged: returns None
        self.trainer._dp_on_train_begin()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._dp_check_refused_steps()
        self.trainer._dp_after_step()

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer._dp_check_refused_steps()

    def on_step_end(self, args, state, control, **kwargs):
        limit = self.trainer._dp_max_steps
        if limit is not None and self.trainer.privacy_steps() >= limit and not control.should_training_stop:
            logger.info("stop_at_epsilon: the next step would exceed epsilon=%s; training stops", self.trainer.privacy.stop_at_epsilon)
            control.should_training_stop = True
            control.should_log = True
            if args.save_strategy != "no":
                control.should_save = True
        return control


__all__ = ["DPCallback"]
