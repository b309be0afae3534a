"""Differentially private training with the Hugging Face ``Trainer`` and TRL's ``SFTTrainer``.

``DPTrainer`` is a :class:`transformers.Trainer` whose training is DP-SGD with randomized
(or flat) per-example clipping, and ``private_trainer(TrainerClass)`` makes the same private
subclass of any ``Trainer`` subclass (TRL's ``SFTTrainer`` first)::

    from opacus_rc.hf import DPTrainer, PrivacyArguments

    trainer = DPTrainer(model=model, args=training_args, train_dataset=train, data_collator=collator,
                        privacy=PrivacyArguments(target_epsilon=8.0, delta=1e-5, max_grad_norm=1.0))
    trainer.train()                      # log_history carries "epsilon" at every logging step

How each Trainer behaviour is made private (Poisson sampling at a public rate, per-example
clipping by book-keeping, noise once per logical step divided by the public batch size, no
un-noised statistic logged, own generators), what is refused and where the code lives:
docs/hf_trainer.md. The modules: :mod:`~opacus_rc.hf.arguments`, :mod:`~opacus_rc.hf.data`,
:mod:`~opacus_rc.hf.losses`, :mod:`~opacus_rc.hf.checks` (the refusals),
:mod:`~opacus_rc.hf.engine` and :mod:`~opacus_rc.hf.trainer`.
"""

import importlib
import importlib.util
from typing import Any

if importlib.util.find_spec("transformers") is None:  # pragma: no cover - exercised only without the extra
    raise ImportError("opacus_rc.hf needs transformers: pip install 'opacus_rc[hf]'")

from .arguments import CLIPPINGS, DENOISERS, LOSS_LOG_KEYS, PRIVATE_LOG_KEYS, PrivacyArguments
from .data import PoissonAccumulationSampler, is_empty_batch
from .losses import per_example_sequence_loss, per_example_token_loss

#: names whose modules import transformers (seconds): imported at first use (issue 48)
_LAZY = {"DPTrainer": "trainer", "DPTrainerMixin": "trainer", "private_trainer": "trainer", "DP_STATE_NAME": "checks"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "DPTrainer", "DPTrainerMixin", "PrivacyArguments", "PoissonAccumulationSampler", "private_trainer",
    "per_example_token_loss", "per_example_sequence_loss", "DP_STATE_NAME",
]
