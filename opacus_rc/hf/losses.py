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


def model_inputs(model: nn.Module, inputs: Dict[str, Any]) -> Tuple[Dict[str, Any], torch.Tensor]:
    """The forward arguments of a batch and its labels: per-row ``position_ids`` (when the
    model takes them), ``use_cache=False``; padding-free batches and left padding without
    position ids are refused (rows would interact)."""
    inputs = dict(inputs)
    labels = inputs.pop("labels", None)
    inputs.pop("num_items_in_batch", None)
    if labels is None:
        raise ValueError("the batch has no 'labels': override per_example_loss(model, inputs)")
    if any(k.startswith("cu_seq_lens") for k in inputs):
        raise ValueError(
            "padding-free batches (cu_seq_lens_*) merge rows: no per-row gradient; accepted values: "
            "padding_free=False and packing=False"
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


def row_losses(logits: torch.Tensor, labels: torch.Tensor, shift: Callable[[], bool]) -> torch.Tensor:
    """Per-row losses from the model's logits: token-level (``shift()``: causal language
    modelling) or sequence-level."""
    if logits.dim() == 3 and labels.dim() == 2:
        return per_example_token_loss(logits, labels, shift=shift())
    if logits.dim() == 2:
        return per_example_sequence_loss(logits, labels)
    raise ValueError(
        f"cannot form per-row losses from logits of shape {tuple(logits.shape)} and labels of shape "
        f"{tuple(labels.shape)}: override per_example_loss(model, inputs)"
    )


def chunked_head_losses(model: nn.Module, inputs: Dict[str, Any], labels: torch.Tensor, *,
                        block_size: int, shift: bool) -> torch.Tensor:
    """Per-row losses of a causal LM through :class:`~opacus_rc.lm_head.ChunkedLMHeadLoss`:
    the decoder's hidden states (``get_decoder()``; PEFT adapters included) and the LM head
    ``block_size`` positions at a time, so the (T x V) logits are never materialised."""
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
    loss = ChunkedLMHeadLoss(head, block_size, shift_labels=shift, reduction="none")
    return loss(hidden, labels)


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
    "chunked_head_losses",
]
