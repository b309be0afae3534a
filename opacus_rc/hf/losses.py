"""Per-example losses of the private Trainer: one loss per row (the mean over the row's
supervised tokens), computed through the model's forward with position ids counted per row."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from torch import nn


def per_example_token_loss(logits: torch.Tensor, labels: torch.Tensor, *, shift: bool) -> torch.Tensor:
    """Per-row loss of a token-level task: the mean cross-entropy over the row's supervised
    tokens (labels != -100; a row without any, e.g. a one-token row when ``shift``, gives 0),
    computed in float32. ``shift``: causal language modelling (logits at t predict labels at t + 1)."""
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    batch, steps = labels.shape[:2]
    # the class dimension by size, not -1: a batch of one-token rows has no position left
    # after the shift (0 elements)
    tokens = F.cross_entropy(
        logits.reshape(batch * steps, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100,
        reduction="none",
    ).view(batch, steps)
    valid = (labels != -100).sum(dim=1)
    return tokens.sum(dim=1) / valid.clamp(min=1)


def per_example_sequence_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-row loss of sequence classification (cross-entropy) or regression (one output: MSE)."""
    if logits.shape[-1] == 1 and labels.is_floating_point():
        return (logits.reshape(-1).float() - labels.reshape(-1).float()).pow(2)
    return F.cross_entropy(logits.float(), labels.reshape(-1), reduction="none")


def model_inputs(model: nn.Module, inputs: Dict[str, Any], packed: bool = False) -> Tuple[Dict[str, Any], torch.Tensor]:
    """The forward arguments of a batch and its labels: per-row ``position_ids`` (when the
    model takes them), ``use_cache=False``; left padding without position ids is refused (rows
    would interact), and so are padding-free fields (``cu_seq_lens_*``) in a batch whose examples
    were not found in its rows (``packed``: :mod:`opacus_rc.hf.packing`)."""
    inputs = dict(inputs)
    labels = inputs.pop("labels", None)
    inputs.pop("num_items_in_batch", None)
    if labels is None:
        raise ValueError("the batch has no 'labels': override per_example_loss(model, inputs)")
    if not packed and (any(k.startswith("cu_seq_lens") for k in inputs) or _restarts(inputs)):
        raise ValueError(
            "padding-free batches (cu_seq_lens_*, or position_ids restarting inside a row without an attention_mask: "
            "several examples packed in one row) whose examples were not found in their rows (not from the private "
            "Trainer's padding-free loader) would be clipped as one example; accepted values: TRL's "
            "padding_free=True with private_trainer(SFTTrainer), or a collator of one example per row"
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
    return inputs, labels


def row_losses(logits: torch.Tensor, labels: torch.Tensor, shift: Callable[[], bool], segments: Any = None) -> torch.Tensor:
    """Per-row losses from the model's logits: token-level (``shift()``: causal language
    modelling) or sequence-level; per packed segment with ``segments`` (:mod:`opacus_rc.hf.packing`)."""
    if segments is not None:
        from .packing import packed_token_losses

        return packed_token_losses(logits, labels, segments, shift=shift())
    if logits.dim() == 3 and labels.dim() == 2:
        return per_example_token_loss(logits, labels, shift=shift())
    if logits.dim() == 2:
        return per_example_sequence_loss(logits, labels)
    raise ValueError(
        f"cannot form per-row losses from logits of shape {tuple(logits.shape)} and labels of shape "
        f"{tuple(labels.shape)}: override per_example_loss(model, inputs)"
    )


def chunked_head_losses(model: nn.Module, inputs: Dict[str, Any], labels: torch.Tensor, *,
                        block_size: int, shift: bool, segments: Any = None) -> torch.Tensor:
    """Per-row losses of a causal LM through :class:`~opacus_rc.lm_head.ChunkedLMHeadLoss`:
    the decoder's hidden states (``get_decoder()``; PEFT adapters included) and the LM head
    ``block_size`` positions at a time, so the (T x V) logits are never materialised. With packed
    ``segments``, per segment: the hidden states and labels split into one row each (a label
    shifted within its segment only)."""
    from ..lm_head import ChunkedLMHeadLoss

    inner = _unwrap(model)
    get_decoder = getattr(inner, "get_decoder", None)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if not callable(get_decoder) or not isinstance(head, nn.Linear):
        raise ValueError(
            f"lm_head_block_size needs a causal LM with get_decoder() and an nn.Linear output "
            f"embedding; {type(_base_model(inner)).__name__} has not; accepted values: None"
        )
    hidden = get_decoder()(**inputs).last_hidden_state
    if segments is not None:
        hidden, labels = segments.split(hidden), segments.split(labels, fill=-100)
    loss = ChunkedLMHeadLoss(head, block_size, shift_labels=shift, reduction="none")
    return loss(hidden, labels)


def example_losses(model: nn.Module, inputs: Dict[str, Any], block_size: Optional[int], shift: Callable[[], bool],
                   segments: Any = None) -> torch.Tensor:
    """One loss per example of ``inputs`` (the private Trainer's ``per_example_loss``): per row, or
    per sequence packed in a padding-free batch (``segments``); through the chunked LM head with a
    ``block_size`` (:func:`chunked_head_losses`), else the model's logits (:func:`row_losses`)."""
    inputs, labels = model_inputs(model, inputs, packed=segments is not None)
    if block_size is not None:
        return chunked_head_losses(model, inputs, labels, block_size=block_size, shift=shift(), segments=segments)
    outputs = model(**inputs)
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
    return row_losses(logits, labels, shift, segments)


def causal_lm(model: nn.Module) -> bool:
    """The model (its base model for PEFT) is a causal language model: labels are shifted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return type(_base_model(model)).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def _accepts(model: nn.Module, name: str) -> bool:
    forward = getattr(model, "forward", None)
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _row_positions(input_ids: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Per-row position ids (B, T): ``clamp(cumsum(mask) - 1, 0)`` (as Hugging Face's generation),
    a row's positions whatever the longest row of its batch; ``arange(T)`` per row without a mask."""
    if mask is None:
        return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    return (mask.long().cumsum(dim=1) - 1).clamp(min=0)


def _restarts(inputs: Dict[str, Any]) -> bool:
    """Position ids that restart inside a row, with no attention mask: sequences packed in one row,
    which the model keeps apart (transformers' packed-sequence detection)."""
    pos, mask = inputs.get("position_ids"), inputs.get("attention_mask")
    if mask is not None or not isinstance(pos, torch.Tensor) or pos.dim() != 2 or pos.shape[1] < 2:
        return False
    return bool((pos[:, 1:] != pos[:, :-1] + 1).any())


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


__all__ = [
    "per_example_token_loss", "per_example_sequence_loss", "model_inputs", "row_losses", "causal_lm",
    "chunked_head_losses", "example_losses",
]
