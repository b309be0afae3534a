"""Differentially private training with the Hugging Face ``Trainer`` and TRL's ``SFTTrainer``.

``DPTrainer`` is a :class:`transformers.Trainer` whose training is DP-SGD with randomized
(or flat) per-example clipping, and ``private_trainer(TrainerClass)`` makes the same private
subclass of any ``Trainer`` subclass (TRL's ``SFTTrainer`` first)::

    from opacus_rc.hf import DPTrainer, PrivacyArguments

    trainer = DPTrainer(model=model, args=training_args, train_dataset=train, data_collator=collator,
                        privacy=PrivacyArguments(target_epsilon=8.0, delta=1e-5, max_grad_norm=1.0))
    trainer.train()                      # log_history carries "epsilon" at every logging step

How the Trainer is made private (each point is a place where the plain Trainer would break
the guarantee or crash):

* **Sampling.** The training loader is replaced by a Poisson loader at a public rate ``q``
  (``PrivacyArguments.sample_rate``, else ``1 / ceil(len(train_dataset) / B)``). The logical
  batch has ``B = per_device_train_batch_size x gradient_accumulation_steps x world_size``
  rows in expectation; each logical step is ONE Poisson draw split into
  ``gradient_accumulation_steps`` physical batches (as Opacus's BatchMemoryManager does), so it
  is charged once at rate ``q``. The privacy unit is one row of the training dataset (with
  packing: one packed row).
* **Clipping and noise.** Book-keeping (``grad_sample_mode="hooks"``, ``wrap_model=False``):
  one plain backward per physical batch; the clipped sum of the logical step is assembled in
  the optimizer step, noise is added once and the sum is divided by the public ``B``, never by
  the realised batch size or ``num_items_in_batch``. Per-example losses (mean over the row's
  supervised tokens) replace the model's batch-level token mean.
* **What the Trainer would leak or break**: its own gradient clipping (``max_grad_norm``) is
  off (per-example clipping replaces it); ``grad_norm`` is never computed; the training loss
  and other per-batch statistics of the private batches are not logged (opt in with
  ``log_train_loss=True``: not covered by epsilon); the DP optimizer's ``zero_grad`` runs every
  step; ``total_flos`` and token counts (functions of the realised batch sizes) are not kept;
  evaluation, prediction and ``generate`` run under ``no_grad`` and neither record nor charge.
* **Randomness.** Noise and Poisson sampling use generators seeded from ``os.urandom`` (or the
  CSPRNG in ``secure_mode``), never the global generators that ``set_seed(args.seed)`` seeds and
  the Trainer's ``rng_state.pth`` restores. Checkpoints store the accountant's history
  (``dp_state.json``) and no generator state or seed; a resumed run reports the same epsilon and
  draws fresh noise.

Gradient checkpointing (``gradient_checkpointing=True``, or a model on which
``gradient_checkpointing_enable()`` was called) runs in the form the user chose, reentrant or
non-reentrant (Hugging Face's default), as two passes from the model's output
(:mod:`opacus_rc.output_passes`; :mod:`opacus_rc.recompute` tells the recomputation from the
forward pass).

Refused with a ``ValueError`` naming the parameter and the accepted values: fp16 (loss
scaling would scale the per-example gradients before clipping), a checkpoint function or
option the package does not recognise (selective checkpointing's ``context_fn``, ``offload``,
a custom ``_gradient_checkpointing_func``), gradient checkpointing with flat clipping,
DataParallel, DeepSpeed/FSDP, auto batch size,
token counting, ``compute_loss_func``/label smoothing/custom ``compute_loss`` (override
:meth:`DPTrainerMixin.per_example_loss` instead), padding-free batches, a trainable
parameter whose gradient no hook saw (e.g. a fused LM head reading ``lm_head.weight``
directly), OPT (``model_type='opt'``), left padding with a model that takes no
``position_ids`` (position ids are otherwise counted per row from the attention mask), a
``get_train_dataloader`` whose loader is not the Poisson loader (checked at the first batch)
and one the private Trainer would ignore (on the class given to :func:`private_trainer`, or
``_get_train_sampler``). A non-finite step raises ``FloatingPointError`` (a fused optimizer's
device-side refusal right after its step, before anything is logged or saved).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple, Type

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

try:
    from transformers import Trainer, TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("opacus_rc.hf needs transformers: pip install 'opacus_rc[hf]'") from exc

from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from opacus.optimizers import DPOptimizer

from .accounting.accountant import RCPRVAccountant, get_noise_multiplier_rc, sketch_record
from .bookkeeping import BookkeepingClippingMixin, Record
from .config import SketchConfig
from .finite import agree_across_ranks, all_finite
from .integration import PrivacyEngine, per_rank_normaliser  # registers clipping="randomized" and rc_prv
from .options import DENOISERS as ENGINE_DENOISERS
from .sketch import entropy_seed

logger = logging.getLogger(__name__)

CLIPPINGS = ("randomized", "flat")
DENOISERS = (None, *ENGINE_DENOISERS)
#: file of the privacy state in every checkpoint and saved model folder
DP_STATE_NAME = "dp_state.json"
#: keys of the Trainer's (and TRL's) training logs that are statistics of the private
#: batches before noise (removed); "loss"/"train_loss" stay with log_train_loss=True
PRIVATE_LOG_KEYS = (
    "grad_norm", "num_input_tokens_seen", "train_tokens_per_second", "entropy",
    "mean_token_accuracy", "num_tokens", "aux_loss", "total_flos",
)
LOSS_LOG_KEYS = ("loss", "train_loss")
_EMPTY = "__opacus_rc_empty_batch__"


# ----------------------------------------------------------------------------- arguments


@dataclass
class PrivacyArguments:
    """The privacy options of :class:`DPTrainer` (everything else stays in ``TrainingArguments``).

    Args:
        target_epsilon: calibrate the noise multiplier with ``rc_prv`` so that the planned
            run (``max_steps``, or ``num_train_epochs`` at the public rate) spends this epsilon
            at ``delta``. Exactly one of ``target_epsilon`` and ``noise_multiplier``.
        noise_multiplier: sigma (noise std over ``max_grad_norm``).
        delta: the delta of every reported epsilon (required).
        max_grad_norm: the per-example clipping bound C (replaces the Trainer's own
            ``max_grad_norm``, which would clip the noisy average).
        clipping: ``"randomized"`` (default: estimated norms, :mod:`opacus_rc`) or ``"flat"``
            (Opacus's exact per-sample gradients).
        estimator, sketch_size, sketching: the randomized-clipping sketch (see ``make_private``).
        denoise: ``None`` or ``"spectral"`` (post-processing of the noisy gradient).
        secure_mode: noise, sketches and Poisson masks from :mod:`opacus_rc.csprng`.
        sample_rate: the public Poisson rate; ``None``: ``1 / ceil(len(train_dataset) / B)``
            (Opacus's ``1 / len(loader)``; it treats the number of batches per epoch as public).
        stop_at_epsilon: stop training before a step would make epsilon exceed this value.
        log_train_loss: also log the training loss of the private batches (an un-noised
            statistic that epsilon does not cover; off by default).
    """

    target_epsilon: Optional[float] = None
    noise_multiplier: Optional[float] = None
    delta: Optional[float] = None
    max_grad_norm: float = 1.0
    clipping: str = "randomized"
    estimator: str = "hutchinson"
    sketch_size: int = 32
    sketching: str = "per_example"
    denoise: Optional[str] = None
    secure_mode: bool = False
    sample_rate: Optional[float] = None
    stop_at_epsilon: Optional[float] = None
    log_train_loss: bool = False

    def __post_init__(self) -> None:
        if (self.target_epsilon is None) == (self.noise_multiplier is None):
            raise ValueError(
                f"target_epsilon={self.target_epsilon!r}, noise_multiplier={self.noise_multiplier!r}: "
                "give exactly one; accepted values: target_epsilon a float > 0 (sigma is "
                "calibrated with rc_prv) or noise_multiplier a float >= 0"
            )
        self._refuse_invalid(
            ("target_epsilon", self.target_epsilon is None or _positive(self.target_epsilon), "a float > 0"),
            ("noise_multiplier",
             self.noise_multiplier is None or (_real(self.noise_multiplier) and self.noise_multiplier >= 0),
             "a float >= 0"),
            ("delta", _real(self.delta) and 0.0 < self.delta < 1.0,
             "a float in (0, 1), e.g. 1e-5 (below 1 / number of training rows); it is required"),
            ("max_grad_norm", _positive(self.max_grad_norm), "a float > 0"),
        )
        if self.clipping not in CLIPPINGS:
            raise ValueError(
                f"clipping={self.clipping!r} is not supported; accepted values: "
                f"{', '.join(repr(c) for c in CLIPPINGS)}"
            )
        if self.clipping == "randomized":
            SketchConfig(self.estimator, self.sketch_size, self.sketching)  # validates
        if self.denoise not in DENOISERS:
            raise ValueError(f"denoise={self.denoise!r} is not supported; accepted values: None, 'spectral'")
        self._refuse_invalid(
            ("sample_rate", self.sample_rate is None or (_real(self.sample_rate) and 0.0 < self.sample_rate <= 1.0),
             "a float in (0, 1] or None"),
            ("stop_at_epsilon", self.stop_at_epsilon is None or _positive(self.stop_at_epsilon), "a float > 0 or None"),
            ("secure_mode", isinstance(self.secure_mode, bool), "True, False"),
            ("log_train_loss", isinstance(self.log_train_loss, bool), "True, False"),
        )

    def _refuse_invalid(self, *checks: Tuple[str, bool, str]) -> None:
        for name, ok, accepted in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid; accepted values: {accepted}")

    @property
    def sketch_config(self) -> Optional[SketchConfig]:
        """The sketch the accountant charges (None: flat, deterministic clipping)."""
        return SketchConfig(self.estimator, self.sketch_size, self.sketching) if self.clipping == "randomized" else None


#: model families whose layers do not keep one row per example (``config.model_type``)
_REFUSED_MODEL_TYPES = ("opt",)

_CHECKPOINTING_ACCEPTED = (
    "False with clipping='flat' (the recomputed forward would record per-sample activations "
    "twice); with clipping='randomized' it runs as two passes from the model's output"
)


#: ``activation_checkpointing_kwargs`` keys the private Trainer runs: torch's checkpoint form and
#: options that leave the recomputation a plain replay, and the Trainer's ``every_n_layers``
_CHECKPOINT_OPTIONS = ("use_reentrant", "preserve_rng_state", "determinism_check", "debug", "early_stop", "every_n_layers")
_CHECKPOINT_OPTIONS_ACCEPTED = ", ".join(
    ("use_reentrant=True or False (unset: Hugging Face's non-reentrant default)",
     "preserve_rng_state=True (torch's default)") + _CHECKPOINT_OPTIONS[2:]
)


def _checkpoint_options_error(options: Dict[str, Any]) -> Optional[str]:
    """Why ``activation_checkpointing_kwargs`` cannot run exactly, or None. Selective
    checkpointing (``context_fn``, TRL's ``selective``) replays under dispatch modes and
    ``offload`` under saved-tensor hooks that the privacy hooks were not verified under."""
    unknown = sorted(k for k in options if k not in _CHECKPOINT_OPTIONS)
    if unknown:
        return f"the keys {unknown} are not supported"
    if "use_reentrant" in options and not isinstance(options["use_reentrant"], bool):
        return f"use_reentrant={options['use_reentrant']!r} is not a bool"
    if options.get("preserve_rng_state", True) is not True:
        return (
            f"preserve_rng_state={options['preserve_rng_state']!r}: with checkpointing the private "
            "Trainer runs the two-pass form, whose two backward passes would recompute each region "
            "with other dropout masks"
        )
    return None


def _recognised_checkpoint_function(func: Any) -> bool:
    """True for ``functools.partial(torch.utils.checkpoint.checkpoint, **kw)`` (what
    ``gradient_checkpointing_enable()`` installs) with ``kw`` in the accepted options."""
    return (
        isinstance(func, functools.partial)
        and func.func is torch.utils.checkpoint.checkpoint
        and not func.args
        and "every_n_layers" not in func.keywords  # the Trainer's key, never torch's
        and _checkpoint_options_error(func.keywords) is None
    )


def _real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _positive(x: Any) -> bool:
    return _real(x) and x > 0


# ------------------------------------------------------------------------ Poisson loader


class PoissonAccumulationSampler(Sampler[List[int]]):
    """Batch sampler of the private Trainer: every logical step is ONE Poisson draw (each
    row joins independently with probability ``sample_rate``), split into
    ``micro_batches`` consecutive physical batches of nearly equal size (some may be empty).

    ``len()`` is ``steps x micro_batches``, a function of public values only. The masks come
    from a ``torch.Generator`` seeded from ``os.urandom`` (``secure_mode``: the CSPRNG), never
    from the global generator. Distributed: rank ``r`` samples the fixed share
    ``r, r + world_size, ...`` at the same rate (the union over ranks is one Poisson draw).
    """

    def __init__(
        self,
        *,
        num_samples: int,
        sample_rate: float,
        micro_batches: int,
        steps: int,
        rank: int = 0,
        world_size: int = 1,
        secure_mode: bool = False,
    ) -> None:
        self.num_samples = int(num_samples)
        self.sample_rate = float(sample_rate)
        self.micro_batches = int(micro_batches)
        self.steps = int(steps)
        self.rank, self.world_size = int(rank), int(world_size)
        self.secure_mode = secure_mode
        self.share = len(range(self.rank, self.num_samples, self.world_size))
        self._generator = None if secure_mode else torch.Generator().manual_seed(entropy_seed())
        self.draws = 0  #: logical steps drawn so far (the loader check: this sampler is iterated)

    def __len__(self) -> int:
        return self.steps * self.micro_batches

    def _mask(self) -> torch.Tensor:
        if self.secure_mode:
            from .csprng import secure_bernoulli

            return secure_bernoulli(self.sample_rate, self.share)
        return torch.rand(self.share, generator=self._generator) < self.sample_rate

    def __iter__(self) -> Iterator[List[int]]:
        for _ in range(self.steps):
            local = self._mask().nonzero().reshape(-1)
            self.draws += 1
            rows = local * self.world_size + self.rank
            for part in torch.tensor_split(rows, self.micro_batches):
                yield part.tolist()

    def __getstate__(self):
        raise TypeError("the Poisson sampler's generator is a secret: it is never pickled or saved")


_LOADING_ACCEPTED = (
    "Customise loading with data_collator= (the collator of each Poisson batch), a transform of "
    "train_dataset, or TrainingArguments(dataloader_num_workers=, dataloader_pin_memory=); an "
    "override of get_train_dataloader must return super().get_train_dataloader() unchanged; "
    "_get_train_sampler is never used"
)


class _EmptySafeCollator:
    """The Trainer's collator; an empty Poisson batch becomes a marker (no forward pass)."""

    def __init__(self, collate) -> None:
        self.collate = collate

    def __call__(self, rows):
        return {_EMPTY: True} if len(rows) == 0 else self.collate(rows)


def is_empty_batch(inputs: Any) -> bool:
    return isinstance(inputs, dict) and inputs.get(_EMPTY, False) is True


# ------------------------------------------------------------------- per-example losses


def per_example_token_loss(logits: torch.Tensor, labels: torch.Tensor, *, shift: bool) -> torch.Tensor:
    """Per-row loss of a token-level task: the mean cross-entropy over the row's supervised
    tokens (labels != -100; a row without any gives 0), computed in float32. ``shift``: causal
    language modelling (logits at t predict labels at t + 1)."""
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    batch, steps = labels.shape[:2]
    tokens = F.cross_entropy(
        logits.reshape(batch * steps, -1).float(), labels.reshape(-1), ignore_index=-100, reduction="none"
    ).view(batch, steps)
    valid = (labels != -100).sum(dim=1)
    return tokens.sum(dim=1) / valid.clamp(min=1)


def per_example_sequence_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-row loss of sequence classification (cross-entropy) or regression (one output: MSE)."""
    if logits.shape[-1] == 1 and labels.is_floating_point():
        return (logits.reshape(-1).float() - labels.reshape(-1).float()).pow(2)
    return F.cross_entropy(logits.float(), labels.reshape(-1), reduction="none")


def _accepts(model: nn.Module, name: str) -> bool:
    forward = getattr(model, "forward", None)
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _row_positions(input_ids: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Per-row position ids of shape (B, T): counted over each row's own tokens (the cumulative
    sum of its attention mask minus 1, clamped at 0, as Hugging Face's generation does), so a
    left-padded row has the positions it has alone, whatever the longest row of its batch.
    Without a mask: ``arange(T)`` for every row (a (1, T) tensor broadcast over the batch has no
    per-row gradient)."""
    if mask is None:
        return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    return (mask.long().cumsum(dim=1) - 1).clamp(min=0)


def _left_padded(mask: torch.Tensor) -> bool:
    """Some row has a padded (0) position before a token (1)."""
    return bool(((mask[:, :-1] == 0) & (mask[:, 1:] != 0)).any())


def _unwrap(model: nn.Module) -> nn.Module:
    while isinstance(model, DPDDP):
        model = model.module
    return model


def _base_model(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


# ----------------------------------------------------------------------- the mixin


class _DPCallback(TrainerCallback):
    """Runs the DP optimizer's zero_grad after every step and the budget stop."""

    def __init__(self, trainer: "DPTrainerMixin") -> None:
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


class DPTrainerMixin:
    """The private part of :class:`DPTrainer`; put it first in the bases of a Trainer
    subclass (:func:`private_trainer` does)."""

    #: compute_loss implementations the mixin knows to replace in training (they reduce the
    #: batch with num_items_in_batch; per-example losses replace them)
    _REPLACEABLE_COMPUTE_LOSS: Tuple[Any, ...] = ()

    def __init__(self, *args: Any, privacy: Optional[PrivacyArguments] = None, **kwargs: Any) -> None:
        if not isinstance(privacy, PrivacyArguments):
            raise ValueError(
                f"privacy={privacy!r} is invalid; accepted values: an opacus_rc.hf.PrivacyArguments"
            )
        self.privacy = privacy
        optimizers = kwargs.get("optimizers", (None, None))
        if optimizers and isinstance(optimizers[0], DPOptimizer):
            raise ValueError(
                "optimizers=(DPOptimizer, ...) is invalid: pass the plain torch optimizer "
                "(or none); the private Trainer makes it private itself"
            )
        self._dp_engine: Optional[PrivacyEngine] = None
        self._dp_optimizer: Optional[DPOptimizer] = None
        self._dp_hooks = None
        self._dp_ddp: Optional[DPDDP] = None
        self._dp_max_steps: Optional[int] = None
        self._dp_micro = 0
        self._dp_loader: Optional[DataLoader] = None
        self._dp_loader_checked = False
        self._dp_sigma: Optional[float] = None
        self._dp_resumed_history: Optional[list] = None
        super().__init__(*args, **kwargs)
        self._dp_check_setup()
        self.add_callback(_DPCallback(self))

    # ---- configuration checks --------------------------------------------------------
    def _dp_check_setup(self) -> None:
        args = self.args
        if args.max_grad_norm not in (None, 0, 1.0) and args.max_grad_norm != self.privacy.max_grad_norm:
            raise ValueError(
                f"TrainingArguments.max_grad_norm={args.max_grad_norm!r} would clip the noisy "
                "average (no privacy effect) and differs from the per-example bound; set the bound "
                "with PrivacyArguments(max_grad_norm=...); accepted values for "
                "TrainingArguments.max_grad_norm: 0, the default 1.0, or the same value"
            )
        args.max_grad_norm = 0.0  # per-example clipping replaces the Trainer's clipping
        # Activation checkpointing works with randomized clipping: make_private runs the two
        # passes from the model's output on a checkpointed model (opacus_rc.output_passes).
        refuse_checkpointing = self.privacy.clipping != "randomized"
        base = _base_model(self.model)
        checks = [
            (args.fp16, "fp16", "False (use bf16=True: no loss scaling)"),
            (refuse_checkpointing
             and (getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False)),
             "gradient_checkpointing", _CHECKPOINTING_ACCEPTED),
            (args.n_gpu > 1, "n_gpu (nn.DataParallel)", "one device per process (torchrun)"),
            (getattr(args, "deepspeed", None), "deepspeed", "None"),
            (getattr(args, "fsdp", None), "fsdp", "'' (no FSDP)"),
            (args.auto_find_batch_size, "auto_find_batch_size", "False (the batch size fixes the public rate)"),
            (args.include_num_input_tokens_seen not in ("no", False, None), "include_num_input_tokens_seen",
             "'no' (token counts of Poisson batches are not private)"),
            (args.label_smoothing_factor != 0, "label_smoothing_factor", "0"),
            (getattr(self, "compute_loss_func", None) is not None, "compute_loss_func",
             "None (override per_example_loss(model, inputs) instead)"),
            (args.world_size > 1 and args.parallel_mode.value != "distributed", "parallel_mode",
             "'distributed' (one process per device, torchrun)"),
            (getattr(args, "use_liger_kernel", False), "use_liger_kernel", "False (fused kernels read weights outside their modules)"),
            (getattr(getattr(base, "config", None), "model_type", None) in _REFUSED_MODEL_TYPES,
             f"model_type={getattr(getattr(base, 'config', None), 'model_type', None)!r}",
             "a model family whose layers keep the batch dimension (e.g. GPT-2, Llama); OPT's decoder "
             "layers flatten batch and sequence before fc1/fc2 (the per-example hooks would see one "
             "example per token) and its learned positional embedding takes the attention mask as "
             "its input, not the positions"),
            (refuse_checkpointing and (getattr(base, "is_activation_checkpointing", False)
                                       or base.__dict__.get("is_gradient_checkpointing", False)),
             "gradient checkpointing enabled on the model",
             "model.gradient_checkpointing_disable() " + _CHECKPOINTING_ACCEPTED),
        ]
        if getattr(args, "activation_checkpointing", False) and not refuse_checkpointing:
            # Either form runs as the user set it (recompute.forward_replay tells each
            # replay from the forward pass): reentrant, the hooks capture in the replay;
            # non-reentrant (Hugging Face's default), in the forward pass, not in the replay.
            options = dict(getattr(args, "activation_checkpointing_kwargs", None) or {})
            why = _checkpoint_options_error(options)
            if why is not None:
                raise ValueError(
                    f"activation_checkpointing_kwargs (gradient_checkpointing_kwargs)={options!r} is not "
                    f"supported ({why}): the privacy hooks are verified under torch.utils.checkpoint's "
                    f"plain replays only; accepted keys: {_CHECKPOINT_OPTIONS_ACCEPTED}"
                )
        self._dp_check_checkpoint_functions()
        for bad, name, accepted in checks:
            if bad:
                raise ValueError(f"{name} is not supported by {type(self).__name__}; accepted value: {accepted}")
        if getattr(self, "padding_free", False):
            raise ValueError(
                "padding_free=True (also implied by packing=True with packing_strategy='bfd') is not "
                "supported: it flattens the batch into one row, so no per-row gradient exists; accepted "
                "values: padding_free=False with packing=False, or packing_strategy='wrapped' (each "
                "packed row is then one privacy unit)"
            )
        if getattr(args, "loss_type", "nll") != "nll":
            raise ValueError(f"loss_type={args.loss_type!r} is not supported; accepted values: 'nll'")
        if getattr(args, "activation_offloading", False):
            raise ValueError("activation_offloading=True is not supported; accepted values: False")
        compute_loss = type(self).compute_loss
        if compute_loss is not Trainer.compute_loss and compute_loss not in self._REPLACEABLE_COMPUTE_LOSS:
            raise ValueError(
                f"{type(self).__name__} overrides compute_loss: the private Trainer needs per-example "
                "losses and would not use it in training; override per_example_loss(model, inputs) "
                "(returns one loss per row) instead"
            )
        mro = type(self).__mro__
        for cls in mro[:mro.index(Trainer)]:
            ignored = [name for name in ("get_train_dataloader", "_get_train_sampler") if name in vars(cls)
                       and (name == "_get_train_sampler" or mro.index(cls) > mro.index(DPTrainerMixin))]
            if ignored and cls is not DPTrainerMixin:
                raise ValueError(
                    f"{cls.__name__}.{ignored[0]} would be ignored: the private Trainer trains on its own "
                    "Poisson loader (the batches epsilon is computed for). " + _LOADING_ACCEPTED
                )
        if isinstance(self.train_dataset, torch.utils.data.IterableDataset):
            raise ValueError("an IterableDataset train_dataset is not supported: Poisson sampling needs a map-style dataset")

    def _dp_check_checkpoint_functions(self) -> None:
        """Refuse a checkpointing function on the model that is not torch's checkpoint with
        accepted options (run at setup and again when the optimizer is made private: the
        Trainer enables ``gradient_checkpointing=True`` in ``train()``, after ``__init__``)."""
        for m in _base_model(self.model).modules():
            func = getattr(m, "_gradient_checkpointing_func", None)
            if getattr(m, "gradient_checkpointing", False) is True and func is not None:
                if not _recognised_checkpoint_function(func):
                    why = _checkpoint_options_error(getattr(func, "keywords", None) or {})
                    raise ValueError(
                        f"the model's gradient checkpointing function ({func!r} on {type(m).__name__}) is "
                        f"not recognised{f' ({why})' if why else ''}: the privacy hooks are verified under torch.utils.checkpoint's "
                        "plain replays only; accepted values: model.gradient_checkpointing_enable("
                        "gradient_checkpointing_kwargs=...) with keys "
                        f"{_CHECKPOINT_OPTIONS_ACCEPTED} (or none), or "
                        "TrainingArguments(gradient_checkpointing=True)"
                    )

    # ---- public sizes ----------------------------------------------------------------
    @property
    def expected_batch_size(self) -> int:
        """The public logical batch size B (the normaliser): per-device batch size x
        accumulation steps x world size."""
        return self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps * self.args.world_size

    @property
    def sample_rate(self) -> float:
        """The public Poisson rate every logical step samples at and is charged at."""
        if self.privacy.sample_rate is not None:
            return float(self.privacy.sample_rate)
        if self.train_dataset is None:
            raise ValueError("sample_rate=None needs a train_dataset (or give PrivacyArguments.sample_rate)")
        return 1.0 / math.ceil(len(self.train_dataset) / self.expected_batch_size)

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
        if isinstance(dataset, HFDataset):
            dataset = self._remove_unused_columns(dataset, description="Training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="Training")
        sampler = PoissonAccumulationSampler(
            num_samples=len(dataset),
            sample_rate=self.sample_rate,
            micro_batches=self.args.gradient_accumulation_steps,
            steps=self.steps_per_epoch,
            rank=self.args.process_index,
            world_size=self.args.world_size,
            secure_mode=self.privacy.secure_mode,
        )
        self._dp_loader = DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=_EmptySafeCollator(collator),
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )
        return self._dp_loader

    def _dp_check_loader(self) -> None:
        """At the first physical batch of ``train()``: the loader the training loop iterates is
        the one :meth:`get_train_dataloader` of this mixin made, its Poisson sampler is being
        drawn from, at the charged rate, split into the accumulation steps, on this rank's share
        (a subclass's ``get_train_dataloader`` may return another loader: refused)."""
        loader = getattr(self.callback_handler, "train_dataloader", None)
        sampler = getattr(loader, "batch_sampler", None)
        ok = isinstance(sampler, PoissonAccumulationSampler)
        why = (
            "the loader the training loop iterates is not the private Trainer's Poisson loader"
            if loader is None or loader is not self._dp_loader or not ok
            else "its Poisson sampler was not drawn from" if sampler.draws == 0
            else f"its sampler draws at rate {sampler.sample_rate}, not the charged {self.sample_rate}"
            if sampler.sample_rate != self.sample_rate
            else "its sampler's split, rank, world size or dataset size differ from the Trainer's"
            if (sampler.micro_batches, sampler.rank, sampler.world_size, sampler.num_samples)
            != (self.args.gradient_accumulation_steps, self.args.process_index, self.args.world_size,
                len(self.train_dataset))
            else None
        )
        if why is not None:
            raise ValueError(
                f"{type(self).__name__}: {why} (PoissonAccumulationSampler at the charged rate "
                f"q={self.sample_rate:.6g}); epsilon holds only for its batches. " + _LOADING_ACCEPTED
            )

    def num_examples(self, dataloader: DataLoader) -> int:
        """The expected number of rows per epoch (public; never ``len(dataset)``)."""
        if isinstance(getattr(dataloader, "batch_sampler", None), PoissonAccumulationSampler):
            return self.steps_per_epoch * self.expected_batch_size
        return super().num_examples(dataloader)

    # ---- the private optimizer -------------------------------------------------------
    def create_optimizer(self, model=None):
        if self._dp_optimizer is not None:
            return self.optimizer
        optimizer = super().create_optimizer(model) if self.optimizer is None else self.optimizer
        if isinstance(optimizer, DPOptimizer):
            raise ValueError("the optimizer is already a DPOptimizer: pass the plain torch optimizer")
        self.optimizer = self._dp_make_private(optimizer)
        return self.optimizer

    def _dp_noise_multiplier(self) -> float:
        p = self.privacy
        if p.noise_multiplier is not None:
            return float(p.noise_multiplier)
        sigma = get_noise_multiplier_rc(
            target_epsilon=p.target_epsilon,
            target_delta=p.delta,
            sample_rate=self.sample_rate,
            steps=self.planned_steps(),
            sketch_config=p.sketch_config,
        )
        logger.info("rc_prv calibrated noise_multiplier=%.4f for %d steps at q=%.6g", sigma, self.planned_steps(), self.sample_rate)
        return sigma

    def _dp_make_private(self, optimizer: torch.optim.Optimizer) -> DPOptimizer:
        p = self.privacy
        model = self.model
        self._dp_check_checkpoint_functions()
        trainable = [q for q in model.parameters() if q.requires_grad]
        if not trainable:
            raise ValueError("the model has no trainable parameter")
        self._dp_sigma = sigma = self._dp_noise_multiplier()
        batch = self.expected_batch_size
        engine = PrivacyEngine(accountant="rc_prv", secure_mode=p.secure_mode)
        if self.args.world_size > 1:
            # Opacus's DPDDP (parameters broadcast from rank 0, no gradient all-reduce in the
            # backward pass): the distributed DP optimizer sums the clipped sums across ranks
            # after rank 0 alone added the noise. The Trainer runs it instead of DDP.
            self._dp_ddp = model = DPDDP(model)
        # make_private needs a loader for its checks; the Trainer's Poisson loader is ours
        placeholder = DataLoader(TensorDataset(torch.zeros(1)), batch_size=batch)
        kwargs: Dict[str, Any] = dict(
            module=model, optimizer=optimizer, data_loader=placeholder, noise_multiplier=sigma,
            max_grad_norm=p.max_grad_norm, clipping=p.clipping, grad_sample_mode="hooks",
            wrap_model=False, poisson_sampling=True, loss_reduction="mean", batch_first=True,
        )
        if p.clipping == "randomized":
            kwargs.update(
                estimator=p.estimator, sketch_size=p.sketch_size, sketching=p.sketching,
                expected_batch_size=batch, sample_rate=self.sample_rate,
            )
        if p.clipping != "randomized" and not p.secure_mode:
            # Opacus's flat clipping would draw from torch's global generator, which the Trainer's
            # set_seed seeds; randomized clipping has its own os.urandom streams, one per device
            kwargs["noise_generator"] = torch.Generator(device=trainable[0].device).manual_seed(entropy_seed())
        if p.denoise is not None:
            kwargs["denoise"] = p.denoise
        was_training = model.training
        model.train()  # Opacus validates a module in training mode (evaluate() may have run first)
        try:
            hooks, dp_optimizer, _ = engine.make_private(**kwargs)
        finally:
            model.train(was_training)
        if p.clipping != "randomized":  # Opacus's own normaliser and rate read the placeholder
            dp_optimizer.expected_batch_size = per_rank_normaliser(batch, self.args.world_size > 1)
            dp_optimizer.attach_step_hook(engine.accountant.get_optimizer_hook_fn(sample_rate=self.sample_rate))
        if self._dp_resumed_history is not None:
            engine.accountant.history = list(self._dp_resumed_history)
        self._dp_engine, self._dp_optimizer, self._dp_hooks = engine, dp_optimizer, hooks
        self._dp_names = {id(q): n for n, q in model.named_parameters()}
        return dp_optimizer

    @property
    def privacy_engine(self) -> Optional[PrivacyEngine]:
        return self._dp_engine

    @property
    def accountant(self):
        return None if self._dp_engine is None else self._dp_engine.accountant

    def _dp_history(self) -> list:
        acc = self.accountant
        return acc.history if acc is not None else (self._dp_resumed_history or [])

    def privacy_steps(self) -> int:
        """Logical steps charged so far (resumed history included)."""
        return int(sum(entry[2] for entry in self._dp_history()))

    def get_epsilon(self) -> float:
        """Epsilon spent so far at ``privacy.delta`` (rc_prv)."""
        acc = self.accountant
        if acc is None:
            return self._dp_epsilon(self._dp_resumed_history or [])
        return float(acc.get_epsilon(delta=self.privacy.delta))

    def _dp_epsilon(self, history: list) -> float:
        """Epsilon of ``history`` at ``privacy.delta`` (0 for an empty history)."""
        probe = RCPRVAccountant()
        probe.history = list(history)
        return float(probe.get_epsilon(delta=self.privacy.delta))

    # ---- training --------------------------------------------------------------------
    def per_example_loss(self, model: nn.Module, inputs: Dict[str, Any]) -> torch.Tensor:
        """One loss per row of ``inputs`` (shape (B,)). Override for other tasks; every
        trainable weight must be used through its module's forward (the hooks see it)."""
        inputs = dict(inputs)
        labels = inputs.pop("labels", None)
        inputs.pop("num_items_in_batch", None)
        if labels is None:
            raise ValueError("the batch has no 'labels': override per_example_loss(model, inputs)")
        if any(k.startswith("cu_seq_lens") for k in inputs):
            raise ValueError(
                "padding-free batches (cu_seq_lens_*) merge rows: no per-row gradient; accepted values: "
                "padding_free=False (packing_strategy='wrapped' for packing)"
            )
        input_ids = inputs.get("input_ids")
        inner = _unwrap(model)
        if input_ids is not None and input_ids.dim() == 2 and "position_ids" not in inputs:
            mask = inputs.get("attention_mask")
            mask = mask if isinstance(mask, torch.Tensor) and mask.shape == input_ids.shape else None
            if _accepts(inner, "position_ids"):
                inputs["position_ids"] = _row_positions(input_ids, mask)
            elif mask is not None and _left_padded(mask):
                raise ValueError(
                    f"left padding with {type(_base_model(inner)).__name__}, whose forward takes no "
                    "position_ids: a row's positions would depend on the longest other row of its batch "
                    "(examples would interact); accepted values: padding_side='right' (tokenizer or "
                    "collator), or a model that takes position_ids"
                )
        if _accepts(inner, "use_cache") and "use_cache" not in inputs:
            inputs["use_cache"] = False
        outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        if logits.dim() == 3 and labels.dim() == 2:
            return per_example_token_loss(logits, labels, shift=self._dp_shifts_labels())
        if logits.dim() == 2:
            return per_example_sequence_loss(logits, labels)
        raise ValueError(
            f"cannot form per-row losses from logits of shape {tuple(logits.shape)} and labels of shape "
            f"{tuple(labels.shape)}: override per_example_loss(model, inputs)"
        )

    def _dp_shifts_labels(self) -> bool:
        shifts = getattr(self, "_loss_shifts_labels", None)
        if shifts is not None:
            return bool(shifts)
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        return type(_base_model(self.model)).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()

    def training_step(self, model: nn.Module, inputs: Dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        """One physical batch: per-example losses averaged over the realised physical batch
        (the hooks undo that factor; the update is divided by the public B only), one plain
        backward, and, except for the last physical batch of the logical step, clipping into
        the step's sum (BatchMemoryManager's skipped step). ``num_items_in_batch`` is ignored."""
        optimizer = self._dp_optimizer
        if optimizer is None:
            raise RuntimeError("the private optimizer was not created (train() creates it)")
        if not self._dp_loader_checked:
            self._dp_check_loader()
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
        if not is_empty_batch(inputs):
            inputs = self._prepare_inputs(inputs)
            offload = getattr(self, "maybe_activation_offload_context", None) or contextlib.nullcontext()
            with self.compute_loss_context_manager(), offload:
                losses = self.per_example_loss(model, inputs)
            del inputs
            if losses.dim() != 1:
                raise ValueError(f"per_example_loss must return shape (B,); got {tuple(losses.shape)}")
            rows = int(losses.shape[0])
            losses.mean().backward()
            if self.privacy.log_train_loss:
                # the Trainer sums what the accumulation steps return and averages the ranks'
                # sums: each returns its rows' share of the public batch size
                report = losses.detach().sum() / per_rank_normaliser(self.expected_batch_size, self.args.world_size > 1)
        if rows or last:
            self._dp_check_records(rows)
        if not hasattr(optimizer, "note_finite"):  # every batch, on every rank (an agreement)
            self._dp_refuse_non_finite(optimizer)
        if not last and rows:
            _signal_same_draw(optimizer)
            optimizer.step()  # clip into the step's sum; no noise, no charge, no update
            optimizer.zero_grad(set_to_none=True)
        if last:
            self._dp_micro = 0
        return report

    def _dp_check_records(self, rows: int) -> None:
        """Every trainable parameter must have per-example records (or Opacus per-sample
        gradients) for this batch. A parameter unused by the batch (or an empty batch)
        contributes exact zeros; one with a gradient that no hook saw is refused."""
        optimizer = self._dp_optimizer
        bookkept = isinstance(optimizer, BookkeepingClippingMixin)
        if not bookkept and getattr(self._dp_hooks, "output_passes", None) is not None:
            # two passes from the output (checkpointed model): the clipped sum is in p.grad;
            # the step refuses a gradient no clipped pass produced (check_clipped_passes).
            # An empty batch or an unused parameter contributes zeros.
            for p in optimizer.params:
                if p.grad is None and getattr(p, "summed_grad", None) is None:
                    optimizer.zero_contribution(p)  # accepted by the step's clipped-pass check
            return
        for p in optimizer.params:
            if getattr(p, "_bk_records", None) or getattr(p, "grad_sample", None) is not None:
                continue
            if p.grad is not None and rows:
                raise ValueError(
                    f"parameter {self._dp_names.get(id(p), '?')!r} received a gradient that no per-example "
                    "hook saw: its weight was used outside its module's forward (e.g. a fused LM head "
                    "reading lm_head.weight directly); use the "
                    "module (per_example_loss computes logits through the model's forward) or freeze "
                    "the parameter"
                )
            if bookkept:
                p._bk_records = [Record(torch.zeros(rows, device=p.device), _zero_sum(p))]
            else:
                p.grad_sample = torch.zeros(rows, *p.shape, device=p.device, dtype=p.dtype)

    def _dp_refuse_non_finite(self, optimizer: DPOptimizer) -> None:
        """Opacus's flat optimizer has no non-finite check: a NaN/inf per-sample gradient would
        be clipped to NaN and released (parameters NaN, the step charged). Refused before the
        batch is clipped (one host synchronisation per batch; agreed across ranks, so every rank
        takes part at every batch, empty or not)."""
        samples: List[Optional[torch.Tensor]] = []
        for p in optimizer.params:
            g = getattr(p, "grad_sample", None)
            samples.extend(g if isinstance(g, list) else [g])
        ok = all_finite(samples)
        if ok is None:  # an empty batch (or nothing recorded): nothing to refuse here
            ok = torch.ones((), dtype=torch.bool, device=self.args.device)
        if self.args.world_size > 1:
            ok = agree_across_ranks(ok)
        if not bool(ok):
            raise FloatingPointError(
                "non-finite per-sample gradient in this batch (clipping='flat'): the step is refused "
                "before it is clipped and noised; parameters and the privacy accountant are unchanged "
                "by it. A refusal must end the run"
            )

    def _dp_check_refused_steps(self) -> None:
        """Raise the refusal of a step that a fused optimizer skipped on the device
        (``found_inf``: parameters unchanged, the step charged), before anything computed from
        the model is logged, evaluated or saved: training must not go on, nor ``train()``
        return normally, after a data-dependent refusal. Waits for the flag of the step just
        taken (the Trainer reads its loss on the host at every batch anyway)."""
        check = getattr(self._dp_optimizer, "check_refused_steps", None)
        if check is not None:
            check()

    def _dp_after_step(self) -> None:
        if self._dp_optimizer is not None:
            self._dp_optimizer.zero_grad(set_to_none=True)

    def _dp_on_train_begin(self) -> None:
        self._dp_micro = 0
        self._dp_loader_checked = False
        self._dp_after_step()
        self._dp_max_steps = self._dp_budget_steps()
        if self._dp_max_steps is not None and self._dp_max_steps <= self.privacy_steps():
            raise ValueError(
                f"stop_at_epsilon={self.privacy.stop_at_epsilon}: the next step would exceed it "
                f"(epsilon so far {self.get_epsilon():.4g}); nothing to train"
            )

    def _dp_budget_steps(self) -> Optional[int]:
        """The largest total number of logical steps whose epsilon stays within
        ``stop_at_epsilon`` (steps as configured), by bisection; None without a budget."""
        budget = self.privacy.stop_at_epsilon
        if budget is None:
            return None
        base = list(self.accountant.history)
        sigma, q, sketch = self._dp_sigma, self.sample_rate, sketch_record(self.privacy.sketch_config)

        def eps_after(extra: int) -> float:
            return self._dp_epsilon(base + ([(sigma, q, extra, sketch)] if extra else []))

        done = self.privacy_steps()
        lo, hi = 0, max(1, self.planned_steps())
        if eps_after(hi) <= budget:  # hi >= planned_steps(): the plan fits in the budget
            return None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if eps_after(mid) <= budget else (lo, mid)
        return done + lo

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
        metrics = getattr(self, "_metrics", None)  # TRL's per-batch training metrics
        if isinstance(metrics, dict) and isinstance(metrics.get("train"), dict):
            metrics["train"].clear()
        super().log(logs, start_time)

    # ---- checkpoints -----------------------------------------------------------------
    def privacy_state(self) -> Dict[str, Any]:
        """What a checkpoint keeps of the privacy state: the accountant's history and the
        public parameters; no generator state, no seed."""
        return {
            "accountant": "rc_prv",
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
        path = os.path.join(checkpoint, DP_STATE_NAME)
        if not os.path.isfile(path):
            raise ValueError(
                f"resume_from_checkpoint={checkpoint!r} has no {DP_STATE_NAME}: its privacy history is "
                "unknown, so epsilon cannot be reported; accepted values: a checkpoint saved by a private Trainer"
            )
        with open(path) as f:
            state = json.load(f)
        history = [RCPRVAccountant.entry(e) for e in state["history"]]  # records checked
        self._dp_resumed_history = history
        if self._dp_engine is not None:
            self._dp_engine.accountant.history = list(history)


def _signal_same_draw(optimizer: DPOptimizer) -> None:
    """A skipped step whose next physical batch continues the same Poisson draw (charged
    once, averaged once). Optimizers without ``same_draw=`` (Opacus's flat one, older
    randomized ones) count a skipped step as part of the same logical step anyway."""
    same_draw = "same_draw" in inspect.signature(optimizer.signal_skip_step).parameters
    optimizer.signal_skip_step(do_skip=True, **({"same_draw": True} if same_draw else {}))


def _zero_sum(p: nn.Parameter):
    """A ``Record.clipped`` of a parameter the batch did not use: exact zeros."""
    return lambda c, keep=None: torch.zeros_like(p)


def _replaceable_compute_loss() -> Tuple[Any, ...]:
    try:
        from trl import SFTTrainer
    except Exception:  # TRL not installed
        return ()
    return (SFTTrainer.compute_loss,)


class DPTrainer(DPTrainerMixin, Trainer):
    """:class:`transformers.Trainer` trained with DP-SGD (see the module documentation);
    the privacy options come as ``privacy=PrivacyArguments(...)``."""


_PRIVATE_CLASSES: Dict[type, type] = {Trainer: DPTrainer}


def private_trainer(trainer_class: Type[Trainer]) -> Type[Trainer]:
    """A private subclass of ``trainer_class`` (a ``transformers.Trainer`` subclass, e.g.
    TRL's ``SFTTrainer``): ``private_trainer(SFTTrainer)(..., privacy=PrivacyArguments(...))``.

    In training, the class's ``compute_loss`` is replaced by per-example losses computed
    through the model's forward (TRL's fused LM head, which reads ``lm_head.weight``
    outside the module, is not used in training; evaluation keeps the class's own loss).
    A class with any other custom ``compute_loss`` is refused at construction (override
    ``per_example_loss`` instead).
    """
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise ValueError(f"trainer_class={trainer_class!r} is invalid; accepted values: a transformers.Trainer subclass")
    if issubclass(trainer_class, DPTrainerMixin):
        return trainer_class
    if trainer_class not in _PRIVATE_CLASSES:
        _PRIVATE_CLASSES[trainer_class] = type(
            f"DP{trainer_class.__name__}",
            (DPTrainerMixin, trainer_class),
            {"__module__": __name__, "_REPLACEABLE_COMPUTE_LOSS": _replaceable_compute_loss(),
             "__doc__": f"Private {trainer_class.__name__} (opacus_rc.hf.private_trainer)."},
        )
    return _PRIVATE_CLASSES[trainer_class]


__all__ = [
    "DPTrainer", "DPTrainerMixin", "PrivacyArguments", "PoissonAccumulationSampler", "private_trainer",
    "per_example_token_loss", "per_example_sequence_loss", "DP_STATE_NAME",
]
