"""The private Trainer: :class:`DPTrainerMixin` (the private part of a Trainer), :class:`DPTrainer`,
:func:`private_trainer` and its checkpoint state (``dp_state.json``; callback: :mod:`.callback`)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from typing import Any, Dict, Optional, Tuple, Type

import torch
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from opacus.optimizers import DPOptimizer
from torch import nn
from torch.utils.data import DataLoader
from transformers import Trainer

from ..accounting.accountant import RCPRVAccountant
from ..draws import signalled_batches
from ..forms import Form, form_of
from ..integration import PrivacyEngine
from ..options import PublicSampling, per_rank_normaliser, user_sampling
from ..recompute import quiet_hook_notes
from ..units import UserIndex
from ..values import RC_PRV
from .arguments import LOSS_LOG_KEYS, PRIVATE_LOG_KEYS, PrivacyArguments
from .noise import continue_numbering, signal_draw_step
from .callback import DPCallback
from .checks import (
    DP_STATE_NAME, check_arguments, check_checkpoint_functions, check_loader, check_records, check_setup,
    refuse_non_finite, replaceable_compute_loss, resumed_history, check_units, user_index_of,
)
from .data import is_empty_batch, poisson_loader, poisson_sampler_of, take_units
from .engine import budget_steps, epsilon, make_private, signal_same_draw
from .losses import causal_lm, example_losses
from .packing import PackedCollate, check_example_losses, physical_batches, take_segments
from .search import SearchMixin


class DPTrainerMixin(SearchMixin):
    """The private part of :class:`DPTrainer` (``hyperparameter_search``: :mod:`.search`); put it
    first in the bases of a Trainer subclass (:func:`private_trainer` does)."""

    #: compute_loss implementations the mixin knows to replace in training (they reduce the
    #: batch with num_items_in_batch; per-example losses replace them)
    _REPLACEABLE_COMPUTE_LOSS: Tuple[Any, ...] = ()

    def __init__(self, *args: Any, privacy: Optional[PrivacyArguments] = None, **kwargs: Any) -> None:
        check_arguments(privacy, kwargs.get("optimizers", (None, None)))
        self.privacy = privacy
        self._dp_engine: Optional[PrivacyEngine] = None
        self._dp_optimizer: Optional[DPOptimizer] = None
        self._dp_hooks = None
        self._dp_form: Optional[Form] = None  # the optimizer's form (None: Opacus's flat optimizer)
        self._dp_ddp: Optional[DPDDP] = None
        self._dp_max_steps: Optional[int] = None
        self._dp_micro = 0
        self._dp_loader: Optional[DataLoader] = None
        self._dp_loader_checked = False
        self._dp_sigma: Optional[float] = None
        self._dp_resumed_history: Optional[list] = None
        self._dp_users: Optional[Tuple[Any, UserIndex]] = None  # (the dataset read, its users)
        self._dp_rate: Optional[float] = None  # the rate the accountant charges (set with the optimizer)
        self._dp_segments = None  # the examples packed in the physical batch (padding_free), while it trains
        super().__init__(*args, **kwargs)
        check_setup(self, DPTrainerMixin)
        self.add_callback(DPCallback(self))

    # ---- public sizes ----------------------------------------------------------------
    @property
    def expected_batch_size(self) -> int:
        """The public logical batch size B (the normaliser): per-device batch size x
        accumulation steps x world size (at ``privacy_unit="user"``: expected users)."""
        return self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps * self.args.world_size

    @property
    def sample_rate(self) -> float:
        """The public Poisson rate of every logical step (of users at ``privacy_unit="user"``: ``B / users``
        by default, B at most their number); a cyclic sampler (banded noise) charges ``parts`` times it inside a part."""
        if self.privacy.sample_rate is not None:
            return float(self.privacy.sample_rate)
        if self.train_dataset is None:
            raise ValueError("sample_rate=None needs a train_dataset (or give PrivacyArguments.sample_rate)")
        if self.privacy.user_level:
            return user_sampling(PublicSampling(self.expected_batch_size, 1.0), self.user_index()).sample_rate
        return 1.0 / math.ceil(len(self.train_dataset) / self.expected_batch_size)

    @property
    def privacy_unit(self) -> str:
        """What epsilon protects: ``"example"`` (a row) or ``"user"`` (a person, all their rows)."""
        return self.privacy.privacy_unit

    def user_index(self) -> Optional[UserIndex]:
        """The users of ``train_dataset`` (its ``privacy.user_column``; None at example level), read
        again when ``train_dataset`` was replaced (a cached index misassigns a reordered dataset's rows)."""
        if not self.privacy.user_level:
            return None
        if self._dp_users is None or self._dp_users[0] is not self.train_dataset:
            self._dp_users = (self.train_dataset, user_index_of(self.train_dataset, self.privacy))
        return self._dp_users[1]

    @property
    def steps_per_epoch(self) -> int:
        """Logical steps per epoch: ``int(1 / sample_rate)`` (Opacus's Poisson loader)."""
        return max(1, int(1.0 / self.sample_rate))

    def planned_steps(self) -> int:
        """The logical steps the run plans (what target_epsilon is calibrated for)."""
        if self.args.max_steps > 0:
            return int(self.args.max_steps)
        return int(math.ceil(self.args.num_train_epochs * self.steps_per_epoch))

    # ---- data ------------------------------------------------------------------------
    def get_train_dataloader(self) -> DataLoader:
        """The Poisson loader (never the Trainer's shuffled loader)."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        dataset, collator = self.train_dataset, self.data_collator
        try:
            from datasets import Dataset as HFDataset
        except ImportError:  # pragma: no cover
            HFDataset = ()
        users = self.user_index()
        if users is not None:  # the users are read; the column never reaches the collator or the model
            dataset = dataset.remove_columns(self.privacy.user_column)
        if isinstance(dataset, HFDataset):
            dataset = self._remove_unused_columns(dataset, description="Training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="Training")
        collator = PackedCollate(collator) if getattr(self, "padding_free", False) else collator  # TRL's
        self._dp_loader = poisson_loader(
            dataset, collator, sample_rate=self.privacy.charged_rate(self.sample_rate), bands=self.privacy.noise_spec().parts,
            micro_batches=self.args.gradient_accumulation_steps, steps=self.steps_per_epoch,
            rank=self.args.process_index, world_size=self.args.world_size, secure_mode=self.privacy.secure_mode,
            num_workers=self.args.dataloader_num_workers, pin_memory=self.args.dataloader_pin_memory, users=users,
        )
        return self._dp_loader

    def num_examples(self, dataloader: DataLoader) -> int:
        """The expected number of rows per epoch (public; never ``len(dataset)``)."""
        if poisson_sampler_of(dataloader) is not None:
            return self.steps_per_epoch * self.expected_batch_size
        return super().num_examples(dataloader)

    # ---- the private optimizer -------------------------------------------------------
    def create_optimizer(self, model=None):
        if self._dp_optimizer is not None:
            return self.optimizer
        optimizer = super().create_optimizer(model) if self.optimizer is None else self.optimizer
        if isinstance(optimizer, DPOptimizer):
            raise ValueError("the optimizer is already a DPOptimizer: pass the plain torch optimizer")
        # the engine at the Trainer's public sampling (opacus_rc.hf.engine.make_private)
        check_checkpoint_functions(self.model)
        private = make_private(
            self.model, optimizer, self.privacy, batch_size=self.expected_batch_size,
            sample_rate=self.sample_rate, steps=self.planned_steps(), world_size=self.args.world_size,
            physical_batch_size=self.args.per_device_train_batch_size, history=self._dp_resumed_history,
            user_ids=self.user_index().user_of_row.tolist() if self.privacy.user_level else None,
        )
        self._dp_engine, self._dp_hooks, self._dp_optimizer = private.engine, private.hooks, private.optimizer
        self._dp_rate = self.privacy.charged_rate(self.sample_rate)
        self._dp_form = form_of(private.optimizer)
        self._dp_ddp, self._dp_sigma = private.ddp, private.sigma
        model = self.model if private.ddp is None else private.ddp
        self._dp_names = {id(q): n for n, q in model.named_parameters()}
        self.optimizer = private.optimizer
        return self.optimizer

    @property
    def privacy_engine(self) -> Optional[PrivacyEngine]:
        return self._dp_engine

    @property
    def accountant(self):
        return None if self._dp_engine is None else self._dp_engine.accountant

    def _dp_history(self) -> list:
        return self.accountant.history if self.accountant is not None else (self._dp_resumed_history or [])

    def privacy_steps(self) -> int:
        """Logical steps charged so far (resumed history included)."""
        return int(sum(entry[2] for entry in self._dp_history()))

    def get_epsilon(self) -> float:
        """Epsilon spent so far at ``privacy.delta`` (rc_prv), per :attr:`privacy_unit`
        (a row, or a user with all their rows)."""
        if self._dp_engine is None:
            return epsilon(self._dp_resumed_history or [], self.privacy.delta)
        return float(self._dp_engine.get_epsilon(delta=self.privacy.delta))

    # ---- training --------------------------------------------------------------------
    def per_example_loss(self, model: nn.Module, inputs: Dict[str, Any]) -> torch.Tensor:
        """One loss per example of ``inputs`` (shape (B,)): per row, or per sequence packed in a
        padding-free batch (``self._dp_segments``). Override for other tasks; every trainable weight
        must be used through its module's forward (the hooks see it)."""
        return example_losses(model, inputs, self.privacy.lm_head_block_size, self._dp_shifts_labels, self._dp_segments)

    def _dp_shifts_labels(self) -> bool:
        shifts = getattr(self, "_loss_shifts_labels", None)
        return causal_lm(self.model) if shifts is None else bool(shifts)

    def training_step(self, model: nn.Module, inputs: Dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        """One physical batch: per-example losses summed (no 1/n in any example's gradient; the update
        is divided by the public B only), one plain backward (one per row in
        the per-example form), then, but for the logical step's last physical batch, clipping into
        the step's sum (a same-draw skipped step; torch's notes on Opacus's hooks not shown)."""
        optimizer = self._dp_optimizer
        if optimizer is None:
            raise RuntimeError("the private optimizer was not created (train() creates it)")
        if not self._dp_loader_checked:
            check_loader(self, self._dp_loader)
            self._dp_loader_checked = True
        self._dp_micro += 1
        last = self._dp_micro == self.args.gradient_accumulation_steps
        if last != bool(self.accelerator.sync_gradients):
            raise RuntimeError(
                "physical batches are out of step with the Trainer's accumulation groups "
                f"(batch {self._dp_micro} of {self.args.gradient_accumulation_steps})"
            )
        model.train()
        report = torch.zeros((), device=self.args.device)
        rows = 0
        skipping = self._dp_resumed_history is not None and not self.args.ignore_data_skip
        units = check_units(self.privacy, take_units(inputs), skipping)  # removed: they never reach the model
        segments = take_segments(inputs)  # padding_free: the examples are the sequences packed in a row
        signal_draw_step(self, optimizer, inputs, skipping)  # a numbered noise: its step is the draw's number
        if not is_empty_batch(inputs):
            inputs = self._prepare_inputs(inputs)
            per_example = self._dp_form is not None and self._dp_form.one_example_per_backward
            batches, units, self._dp_segments = physical_batches(inputs, units, segments, per_example)
            del inputs
            total = torch.zeros((), device=self.args.device)
            parts = None if units is None else signalled_batches(units, per_example, self._dp_segments)
            with self._dp_hooks.one_physical_batch() if per_example else contextlib.nullcontext():
                for i, batch in enumerate(batches):  # the per-example form: one row, one backward pass each
                    if parts is not None:  # the users of the rows this backward pass holds, found by its tensors
                        optimizer.ledger.deliver(batch, parts[i])
                    losses = self._dp_losses(model, batch)
                    rows += int(losses.shape[0])
                    with quiet_hook_notes():
                        losses.sum().backward()  # (the hooks run at "sum", the optimizer divides by B: engine.py)
                    total = total + losses.detach().sum()
            del batches
            self._dp_segments = None  # (per_example_loss outside a step: the rows' own)
            if self.privacy.log_train_loss:
                # the Trainer sums what the accumulation steps return and averages the ranks'
                # sums: each returns its rows' share of the public batch size
                report = total / per_rank_normaliser(self.expected_batch_size, self.args.world_size > 1)
        if rows or last:
            check_records(optimizer, rows, self._dp_names)
        if self._dp_form is None:  # every batch, on every rank (an agreement)
            refuse_non_finite(self, optimizer)
        if not last and rows:
            signal_same_draw(optimizer)
            optimizer.step()  # clip into the step's sum; no noise, no charge, no update
            optimizer.zero_grad(set_to_none=True)
        if last:
            self._dp_micro = 0
        return report

    def _dp_losses(self, model: nn.Module, inputs: Dict[str, Any]) -> torch.Tensor:
        """``per_example_loss`` under the Trainer's loss context, checked to be one per row."""
        offload = getattr(self, "maybe_activation_offload_context", None) or contextlib.nullcontext()
        with self.compute_loss_context_manager(), offload:
            losses = self.per_example_loss(model, inputs)
        check_example_losses(losses, self._dp_segments)
        return losses

    def _dp_check_refused_steps(self) -> None:
        """Raise a step a fused optimizer refused on the device (``found_inf``; waits for the
        flag), before anything computed from the model is logged, evaluated or saved."""
        if self._dp_form is not None:
            self._dp_optimizer.check_refused_steps()

    def _dp_after_step(self) -> None:
        if self._dp_optimizer is not None:
            self._dp_optimizer.zero_grad(set_to_none=True)

    def _dp_on_train_begin(self) -> None:
        self._dp_micro, self._dp_loader_checked = 0, False
        self._dp_after_step()
        continue_numbering(self)  # a numbered noise: the draws numbered from its next step, on every rank
        self._dp_max_steps = self._dp_budget_steps()
        if self._dp_max_steps is not None and self._dp_max_steps <= self.privacy_steps():
            raise ValueError(
                f"stop_at_epsilon={self.privacy.stop_at_epsilon}: the next step would exceed it "
                f"(epsilon so far {self.get_epsilon():.4g}); nothing to train"
            )

    def _dp_budget_steps(self) -> Optional[int]:
        """The largest total number of logical steps whose epsilon stays within
        ``stop_at_epsilon`` (steps as configured); None without a budget."""
        budget = self.privacy.stop_at_epsilon
        if budget is None:
            return None
        record = self.privacy.step_record(self.args.per_device_train_batch_size)
        further = budget_steps(list(self.accountant.history), self._dp_sigma, self._dp_rate, record,
                               delta=self.privacy.delta, budget=budget, planned=self.planned_steps())
        return None if further is None else self.privacy_steps() + further

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if training and self._dp_ddp is not None:
            return self._dp_ddp  # not the Trainer's DDP (it would average un-clipped gradients)
        return super()._wrap_model(model, training, dataloader)

    # ---- what the Trainer would compute from un-noised values --------------------------
    def _clip_grad_norm(self, model):
        return None

    def _get_grad_norm(self, model, grad_norm=None):
        return None  # the norm of the clipped, un-noised sum: never computed or logged

    def _get_num_items_in_batch(self, batch_samples, device):
        return None  # the realised token count is not the normaliser

    def floating_point_ops(self, inputs) -> int:
        return 0  # a function of the realised batch sizes

    def log(self, logs: Dict[str, float], start_time: Optional[float] = None) -> None:
        """The Trainer's log without un-noised statistics, with ``epsilon`` (at
        ``privacy.delta``) added at every logging step."""
        for key in PRIVATE_LOG_KEYS + (() if self.privacy.log_train_loss else LOSS_LOG_KEYS):
            logs.pop(key, None)
        if self._dp_engine is not None or self._dp_resumed_history:
            logs["epsilon"] = self.get_epsilon()
            if self.privacy.user_level:
                logs["privacy_unit"] = self.privacy_unit  # epsilon is per user, not per row
        metrics = getattr(self, "_metrics", None)  # TRL's per-batch training metrics
        if isinstance(metrics, dict) and isinstance(metrics.get("train"), dict):
            metrics["train"].clear()
        super().log(logs, start_time)

    # ---- checkpoints -----------------------------------------------------------------
    def privacy_state(self) -> Dict[str, Any]:
        """What a checkpoint keeps of the privacy state: the accountant's history and the
        public parameters; no generator state, no seed."""
        return {
            "accountant": RC_PRV,
            "history": [list(RCPRVAccountant.stored(entry)) for entry in self._dp_history()],
            "delta": self.privacy.delta,
            "epsilon": self.get_epsilon(),
            "noise_multiplier": self._dp_sigma,
            "sample_rate": self.sample_rate if self.train_dataset is not None or self.privacy.sample_rate else None,
            "expected_batch_size": self.expected_batch_size,
            "privacy": dataclasses.asdict(self.privacy),
        }

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if output_dir is None or not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, DP_STATE_NAME), "w") as f:
            json.dump(self.privacy_state(), f, indent=1)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        history = resumed_history(checkpoint)
        self._dp_resumed_history = history
        if self._dp_engine is not None:
            self._dp_engine.accountant.history = list(history)


class DPTrainer(DPTrainerMixin, Trainer):
    """:class:`transformers.Trainer` trained with DP-SGD (see the module documentation);
    the privacy options come as ``privacy=PrivacyArguments(...)``."""


_PRIVATE_CLASSES: Dict[type, type] = {Trainer: DPTrainer}


def private_trainer(trainer_class: Type[Trainer]) -> Type[Trainer]:
    """A private subclass of ``trainer_class`` (a ``transformers.Trainer`` subclass, e.g.
    TRL's ``SFTTrainer``): ``private_trainer(SFTTrainer)(..., privacy=PrivacyArguments(...))``.

    In training, per-example losses through the model's forward replace the class's
    ``compute_loss`` (TRL's, whose fused LM head reads ``lm_head.weight`` outside the module;
    evaluation keeps it); any other custom ``compute_loss`` is refused (docs/hf_trainer.md).
    """
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise ValueError(f"trainer_class={trainer_class!r} is invalid; accepted values: a transformers.Trainer subclass")
    if issubclass(trainer_class, DPTrainerMixin):
        return trainer_class
    if trainer_class not in _PRIVATE_CLASSES:
        _PRIVATE_CLASSES[trainer_class] = type(
            f"DP{trainer_class.__name__}",
            (DPTrainerMixin, trainer_class),
            {"__module__": __name__, "_REPLACEABLE_COMPUTE_LOSS": replaceable_compute_loss(),
             "__doc__": f"Private {trainer_class.__name__} (opacus_rc.hf.private_trainer)."},
        )
    return _PRIVATE_CLASSES[trainer_class]


__all__ = ["DPTrainer", "DPTrainerMixin", "private_trainer"]
