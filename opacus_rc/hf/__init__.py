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
(:mod:`opacus_rc.forms.output_passes`; :mod:`opacus_rc.recompute` tells the recomputation from the
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

The package: :mod:`~opacus_rc.hf.arguments` (:class:`PrivacyArguments`),
:mod:`~opacus_rc.hf.data` (the Poisson sampler and collator), :mod:`~opacus_rc.hf.losses`
(per-example losses, position ids), :mod:`~opacus_rc.hf.checks` (the refusals),
:mod:`~opacus_rc.hf.engine` (the ``make_private`` call and ``rc_prv`` accounting) and
:mod:`~opacus_rc.hf.trainer` (the mixin, :class:`DPTrainer`, :func:`private_trainer`, the
callback and the checkpoint state).
"""

try:
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("opacus_rc.hf needs transformers: pip install 'opacus_rc[hf]'") from exc

from .arguments import CLIPPINGS, DENOISERS, PrivacyArguments
from .checks import DP_STATE_NAME
from .data import PoissonAccumulationSampler, is_empty_batch
from .losses import per_example_sequence_loss, per_example_token_loss
from .trainer import LOSS_LOG_KEYS, PRIVATE_LOG_KEYS, DPTrainer, DPTrainerMixin, private_trainer

__all__ = [
    "DPTrainer", "DPTrainerMixin", "PrivacyArguments", "PoissonAccumulationSampler", "private_trainer",
    "per_example_token_loss", "per_example_sequence_loss", "DP_STATE_NAME",
]
