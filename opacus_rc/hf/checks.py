"""The refusals of the private Trainer: its set-up, the loader it trains on and each physical
batch. Each raises a ``ValueError`` (``FloatingPointError`` for a non-finite batch) naming the
parameter and the accepted values (the list: docs/hf_trainer.md).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.utils.checkpoint
from opacus.optimizers import DPOptimizer
from torch import nn
from torch.utils.data import DataLoader
from transformers import Trainer

from ..accounting.accountant import RCPRVAccountant
from ..clip_guard import complete_unused
from ..finite import all_finite
from ..forms import form_of
from ..per_parameter import set_grad_sample
from ..ranks import FLAG_TRUE, agree_flag, agreed, world_size
from ..units import RowUnits, UserIndex, check_same_on_ranks
from ..values import RANDOMIZED, check_choice
from .arguments import PrivacyArguments
from .noise import check_noise_sampling
from .data import poisson_sampler_of
from .losses import _base_model
from .packing import check_packed_attention


#: file of the privacy state in every checkpoint and saved model folder
DP_STATE_NAME = "dp_state.json"

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


_LOADING_ACCEPTED = (
    "Customise loading with data_collator= (the collator of each Poisson batch), a transform of "
    "train_dataset, or TrainingArguments(dataloader_num_workers=, dataloader_pin_memory=); an "
    "override of get_train_dataloader must return super().get_train_dataloader() unchanged; "
    "_get_train_sampler is never used"
)


def check_arguments(privacy: Any, optimizers: Any) -> None:
    """The private Trainer's own arguments: ``privacy=`` and a plain ``optimizers=``."""
    if not isinstance(privacy, PrivacyArguments):
        raise ValueError(
            f"privacy={privacy!r} is invalid; accepted values: an opacus_rc.hf.PrivacyArguments"
        )
    if optimizers and isinstance(optimizers[0], DPOptimizer):
        raise ValueError(
            "optimizers=(DPOptimizer, ...) is invalid: pass the plain torch optimizer "
            "(or none); the private Trainer makes it private itself"
        )


def check_setup(trainer: Trainer, mixin: type) -> None:
    """Refuse a set-up the private Trainer cannot run privately (run at construction;
    ``mixin``: the private Trainer's mixin class, whose own loader methods are accepted)."""
    args = trainer.args
    if args.max_grad_norm not in (None, 0, 1.0) and args.max_grad_norm != trainer.privacy.max_grad_norm:
        raise ValueError(
            f"TrainingArguments.max_grad_norm={args.max_grad_norm!r} would clip the noisy "
            "average (no privacy effect) and differs from the per-example bound; set the bound "
            "with PrivacyArguments(max_grad_norm=...); accepted values for "
            "TrainingArguments.max_grad_norm: 0, the default 1.0, or the same value"
        )
    args.max_grad_norm = 0.0  # per-example clipping replaces the Trainer's clipping
    # Activation checkpointing works with randomized clipping: make_private runs the two
    # passes from the model's output on a checkpointed model (opacus_rc.forms.output_passes).
    refuse_checkpointing = trainer.privacy.clipping != RANDOMIZED
    base = _base_model(trainer.model)
    model_type = getattr(getattr(base, "config", None), "model_type", None)
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
        (getattr(trainer, "compute_loss_func", None) is not None, "compute_loss_func",
         "None (override per_example_loss(model, inputs) instead)"),
        (args.world_size > 1 and args.parallel_mode.value != "distributed", "parallel_mode",
         "'distributed' (one process per device, torchrun)"),
        (getattr(args, "use_liger_kernel", False), "use_liger_kernel", "False (fused kernels read weights outside their modules)"),
        (model_type in _REFUSED_MODEL_TYPES, f"model_type={model_type!r}",
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
    check_checkpoint_functions(trainer.model)
    for bad, name, accepted in checks:
        if bad:
            raise ValueError(f"{name} is not supported by {type(trainer).__name__}; accepted value: {accepted}")
    if getattr(args, "packing", False):
        raise ValueError(
            f"packing=True (packing_strategy={getattr(args, 'packing_strategy', None)!r}) is not "
            "supported: 'wrapped' concatenates the dataset and cuts it into rows of max_length "
            "tokens, so a row mixes examples and removing one example shifts every later cut "
            "(epsilon would protect no dataset example); 'bfd' and 'bfd_split' flatten the batch "
            "into one row (no per-row gradient). Accepted value: packing=False (one dataset row "
            "per example)"
        )
    if getattr(trainer, "padding_free", False):  # TRL's: each packed sequence its own example
        check_packed_attention(trainer.model)
    check_choice("loss_type", getattr(args, "loss_type", "nll"), ("nll",))
    if getattr(args, "activation_offloading", False):
        raise ValueError("activation_offloading=True is not supported; accepted values: False")
    compute_loss = type(trainer).compute_loss
    if compute_loss is not Trainer.compute_loss and compute_loss not in trainer._REPLACEABLE_COMPUTE_LOSS:
        raise ValueError(
            f"{type(trainer).__name__} overrides compute_loss: the private Trainer needs per-example "
            "losses and would not use it in training; override per_example_loss(model, inputs) "
            "(returns one loss per row) instead"
        )
    mro = type(trainer).__mro__
    for cls in mro[:mro.index(Trainer)]:
        ignored = [name for name in ("get_train_dataloader", "_get_train_sampler") if name in vars(cls)
                   and (name == "_get_train_sampler" or mro.index(cls) > mro.index(mixin))]
        if ignored and cls is not mixin:
            raise ValueError(
                f"{cls.__name__}.{ignored[0]} would be ignored: the private Trainer trains on its own "
                "Poisson loader (the batches epsilon is computed for). " + _LOADING_ACCEPTED
            )
    if isinstance(trainer.train_dataset, torch.utils.data.IterableDataset):
        raise ValueError("an IterableDataset train_dataset is not supported: Poisson sampling needs a map-style dataset")
    if trainer.privacy.user_level and trainer.train_dataset is not None:
        # the user column read now: a bad one is refused at construction, as expected users per
        # step above the users and (several processes) ranks given different rows or ids
        index: List[UserIndex] = []  # a rank whose column is refused joins the check with its failure flag
        with agreed(lambda failed: check_same_on_ranks(None if failed else index[0], failed), world_size() > 1):
            index.append(trainer.user_index())
        trainer.sample_rate  # noqa: B018
    check_noise_sampling(trainer)  # the noise mechanism's sampler (e.g. banded noise's cyclic parts) at q


def user_index_of(dataset: Any, privacy: PrivacyArguments) -> UserIndex:
    """The :class:`~opacus_rc.units.UserIndex` of ``dataset``'s ``privacy.user_column``.

    Raises:
        ValueError: naming ``user_column``: the dataset is not a ``datasets.Dataset``, has no
            such column, or a row's user has no stable value (:func:`~opacus_rc.units.user_key`).
    """
    column = privacy.user_column
    names = getattr(dataset, "column_names", None)
    if names is None or not hasattr(dataset, "remove_columns"):
        raise ValueError(
            f"user_column={column!r} needs a datasets.Dataset train_dataset (got {type(dataset).__name__}); "
            "accepted values: the name of a column of a datasets.Dataset"
        )
    if column not in names:
        raise ValueError(f"user_column={column!r} is not a column of train_dataset; its columns: {names}")
    # the stored values, whatever the dataset's format (with_format("torch") would give 0-d
    # tensors, hashed by identity): ids compared by value, each read as its units.user_key
    ids = dataset.with_format(None)[column] if hasattr(dataset, "with_format") else dataset[column]
    try:
        return UserIndex(ids, len(dataset), privacy.max_examples_per_user)
    except ValueError as error:
        raise ValueError(f"user_column={column!r}: {error}") from None


def check_units(privacy: PrivacyArguments, units: Optional[RowUnits], skipping: bool = False) -> Optional[RowUnits]:
    """``units``, the units a physical batch carried; a user-level one must carry them (from
    the private Trainer's user-level loader). ``skipping``: the run resumed from a checkpoint
    without ``ignore_data_skip`` (the Trainer skips a resumed epoch's first batches through a
    loader of its own, whose batches carry no users)."""
    if privacy.user_level and units is None:
        if skipping:
            raise ValueError(
                "privacy_unit='user': the run resumed mid-epoch, and the Trainer skips the epoch's first "
                "batches through a loader of its own, whose batches carry no users; set "
                "TrainingArguments(ignore_data_skip=True): every Poisson draw is fresh, there is nothing to skip"
            )
        raise ValueError(
            "privacy_unit='user': a physical batch came without its users (it is not from the private "
            "Trainer's user-level Poisson loader). " + _LOADING_ACCEPTED
        )
    return units


def check_checkpoint_functions(model: nn.Module) -> None:
    """Refuse a checkpointing function on the model other than what
    ``gradient_checkpointing_enable()`` installs, ``functools.partial(torch.utils.checkpoint.checkpoint,
    **kw)`` with ``kw`` in the accepted options (run at setup and again when the optimizer is
    made private: the Trainer enables ``gradient_checkpointing=True`` in ``train()``)."""
    for m in _base_model(model).modules():
        func = getattr(m, "_gradient_checkpointing_func", None)
        if getattr(m, "gradient_checkpointing", False) is not True or func is None:
            continue
        why = _checkpoint_options_error(getattr(func, "keywords", None) or {})
        torch_checkpoint = (
            isinstance(func, functools.partial) and func.func is torch.utils.checkpoint.checkpoint
            and not func.args and "every_n_layers" not in func.keywords  # the Trainer's key, never torch's
        )
        if why is not None or not torch_checkpoint:
            raise ValueError(
                f"the model's gradient checkpointing function ({func!r} on {type(m).__name__}) is "
                f"not recognised{f' ({why})' if why else ''}: the privacy hooks are verified under torch.utils.checkpoint's "
                "plain replays only; accepted values: model.gradient_checkpointing_enable("
                "gradient_checkpointing_kwargs=...) with keys "
                f"{_CHECKPOINT_OPTIONS_ACCEPTED} (or none), or "
                "TrainingArguments(gradient_checkpointing=True)"
            )


def check_loader(trainer: Trainer, made: Optional[DataLoader]) -> None:
    """At the first physical batch of ``train()``: the loader the training loop iterates is
    the one the private Trainer's ``get_train_dataloader`` made (``made``), its Poisson sampler
    is being drawn from, at the charged rate, split into the accumulation steps, on this
    rank's share (a subclass's ``get_train_dataloader`` may return another loader: refused)."""
    loader = getattr(trainer.callback_handler, "train_dataloader", None)
    sampler = poisson_sampler_of(loader)
    ok = sampler is not None and (sampler.users is not None) == trainer.privacy.user_level
    why = (
        "the loader the training loop iterates is not the private Trainer's Poisson loader"
        if loader is None or loader is not made or not ok
        else "its Poisson sampler was not drawn from" if sampler.draws == 0
        else f"its sampler draws at rate {sampler.sample_rate}, not the charged {trainer._dp_rate} (train_dataset "
        "replaced between two train() calls? Construct a new private Trainer for a new dataset)"
        if sampler.sample_rate != trainer._dp_rate
        else "its sampler's split, rank, world size, dataset size or cyclic parts differ from the Trainer's"
        if (sampler.micro_batches, sampler.rank, sampler.world_size, sampler.num_samples, sampler.bands)
        != (trainer.args.gradient_accumulation_steps, trainer.args.process_index, trainer.args.world_size,
            len(trainer.train_dataset), trainer.privacy.noise_spec().parts)
        else None
    )
    if why is not None:
        raise ValueError(
            f"{type(trainer).__name__}: {why} (PoissonAccumulationSampler at the charged rate "
            f"q={trainer.sample_rate:.6g}); epsilon holds only for its batches. " + _LOADING_ACCEPTED
        )


def check_records(optimizer: DPOptimizer, rows: int, names: Dict[int, str]) -> None:
    """Every trainable parameter must have per-example values for this batch: the form's
    optimizer completes the batch (:meth:`~opacus_rc.optimizer.RandomizedClippingMixin.complete_batch`:
    a parameter the batch did not use contributes exact zeros); Opacus's flat optimizer
    gets zero per-sample gradients for those. A parameter with a gradient that no hook saw
    is refused (``names``: parameter names by ``id``)."""
    if form_of(optimizer) is not None:
        unseen = optimizer.complete_batch(rows)
    else:
        unseen = complete_unused(
            optimizer.params, rows, lambda p: getattr(p, "grad_sample", None) is not None,
            lambda p: set_grad_sample(p, torch.zeros(rows, *p.shape, device=p.device, dtype=p.dtype)),
        )
    if unseen:
        raise ValueError(
            f"parameter {names.get(id(unseen[0]), '?')!r} received a gradient that no per-example "
            "hook saw: its weight was used outside its module's forward (e.g. a fused LM head "
            "reading lm_head.weight directly); use the "
            "module (per_example_loss computes logits through the model's forward) or freeze "
            "the parameter"
        )


def refuse_non_finite(trainer: Trainer, optimizer: DPOptimizer) -> None:
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
        ok = torch.ones((), dtype=torch.bool, device=trainer.args.device)
    if trainer.args.world_size > 1:
        ok = agree_flag(ok) == FLAG_TRUE
    if not bool(ok):
        raise FloatingPointError(
            "non-finite per-sample gradient in this batch (clipping='flat'): the step is refused "
            "before it is clipped and noised; parameters and the privacy accountant are unchanged "
            "by it. A refusal must end the run"
        )


def resumed_history(checkpoint: str) -> List[Any]:
    """The accountant's history stored in ``checkpoint`` (its records checked); a checkpoint
    without :data:`DP_STATE_NAME` is refused (its privacy history is unknown)."""
    path = os.path.join(checkpoint, DP_STATE_NAME)
    if not os.path.isfile(path):
        raise ValueError(
            f"resume_from_checkpoint={checkpoint!r} has no {DP_STATE_NAME}: its privacy history is "
            "unknown, so epsilon cannot be reported; accepted values: a checkpoint saved by a private Trainer"
        )
    with open(path) as f:
        state = json.load(f)
    return [RCPRVAccountant.entry(e) for e in state["history"]]  # records checked


def replaceable_compute_loss() -> Tuple[Any, ...]:
    """The ``compute_loss`` of the Trainer subclasses the private Trainer replaces by
    per-example losses in training (TRL's ``SFTTrainer``)."""
    try:
        from trl import SFTTrainer
    except Exception:  # TRL not installed
        return ()
    return (SFTTrainer.compute_loss,)


__all__ = [
    "check_arguments", "check_setup", "check_units", "user_index_of", "check_checkpoint_functions", "check_loader",
    "check_records", "refuse_non_finite", "replaceable_compute_loss", "resumed_history", "DP_STATE_NAME",
]
