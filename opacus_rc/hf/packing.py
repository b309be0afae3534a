"""TRL's ``padding_free=True`` in the private Trainer: each packed sequence is its own example.

The padding-free collator concatenates a physical batch's rows into one row, position ids
restarting at 0 at each of them (:mod:`opacus_rc.packing`). Here:

* :class:`PackedCollate` finds the rows in the collated batch (each given row one run of position
  ids ``0..n-1``, in order, with its own token ids) and attaches their :class:`~opacus_rc.packing.
  Segments`, carried with the batch to the step (its units: the rows', or their users');
* :func:`check_packed_attention` probes the model once, at construction, on random tokens: a
  sequence's outputs in a packed row must equal its outputs alone and not move with its
  neighbours, or the model lets packed examples see each other (refused by name,
  :data:`~opacus_rc.refusals.REFUSALS`);
* :func:`packed_token_losses`: one loss per segment (the mean over its supervised tokens, a
  prediction across a segment boundary ignored), as each example alone would give;
* :func:`physical_batches`: the physical batch as the forwards take it (packed, or one segment per
  backward pass in the per-example form).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..packing import PACKING_FIELDS, SEGMENTS_KEY, Segments, take_segments
from ..refusals import refusal
from ..units import RowUnits
from .data import one_row_batches

#: the probe's sequences (lengths), and the neighbours it swaps in around the middle one
_PROBE, _NEIGHBOURS = (5, 3, 4), (2, 6)


class PackedCollate:
    """The Trainer's collator for padding-free batches: its batch, with the :class:`~opacus_rc.
    packing.Segments` of the rows it was given under :data:`~opacus_rc.packing.SEGMENTS_KEY`.

    Raises (when called):
        ValueError: naming ``data_collator``, a batch whose rows are not each one run of position
            ids ``0..n-1`` holding the given row's token ids, in the order given.
    """

    def __init__(self, collate: Callable[[List[Any]], Any]) -> None:
        self.collate = collate

    def __call__(self, rows: List[Any]) -> Any:
        batch = self.collate(rows)
        if not rows:
            return batch
        if not (isinstance(batch, Mapping) and "position_ids" in batch and "input_ids" in batch):
            raise ValueError("padding_free=True: the data_collator's batch has no input_ids and position_ids; "
                             "accepted values: TRL's padding-free collator (DataCollatorForLanguageModeling)")
        ids = [torch.as_tensor(row["input_ids"]).reshape(-1) for row in rows]
        segments = Segments.of_rows(batch["position_ids"], [len(i) for i in ids])
        packed = torch.as_tensor(batch["input_ids"]).cpu()
        if len(segments) != len(rows) or any(
            not torch.equal(packed[r, a:a + n].long(), i.long())
            for i, r, a, n in zip(ids, segments.row.tolist(), segments.start.tolist(), segments.length.tolist())
        ):
            raise ValueError(
                "padding_free=True: the data_collator's packed row does not hold the rows it was given, each as "
                "its own run of position ids, in order (a row without tokens has none); accepted values: a "
                "collator that concatenates the rows in the order given (TRL's padding-free collator), rows of "
                "one token or more"
            )
        batch[SEGMENTS_KEY] = segments
        return batch


def check_packed_attention(model: nn.Module) -> None:
    """Refuse ``model`` for packed rows when its outputs on one let a sequence see another: the
    middle of three random sequences (``_PROBE`` tokens each, public random ids) packed in one row
    must give its outputs alone, and the same with other neighbours (contents and lengths), up to
    float rounding (1e-3 of the outputs' scale; 5e-2 in half precision). Run once, in eval mode
    without gradients (the training flags restored).

    Raises:
        ValueError: :data:`~opacus_rc.refusals.REFUSALS` ``"packed_rows_attention"``; a model whose
            output is not one per token.
    """
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    param = next(model.parameters())
    if vocab is None:
        raise ValueError(f"padding_free=True needs a language model with config.vocab_size; "
                         f"{type(model).__name__} has none")
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in _PROBE]
    others = [torch.randint(0, vocab, (n,), generator=gen) for n in _NEIGHBOURS]
    training = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            packed = _packed_logits(model, seqs, param.device)
            moved = _packed_logits(model, [others[0], seqs[1], others[1]], param.device)
            alone = [_packed_logits(model, [s], param.device) for s in seqs]
    finally:
        for m, flag in training.items():
            m.training = flag
    ends = torch.tensor((0, *_PROBE)).cumsum(0).tolist()
    pairs = [(packed[ends[i]:ends[i + 1]], alone[i]) for i in range(len(seqs))]
    pairs.append((moved[_NEIGHBOURS[0]:_NEIGHBOURS[0] + _PROBE[1]], alone[1]))
    tolerance = 1e-3 if param.dtype in (torch.float32, torch.float64) else 5e-2
    worst = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-12)) for a, b in pairs)
    if not worst <= tolerance:
        implementation = getattr(config, "_attn_implementation", None)
        raise refusal("packed_rows_attention", model=type(model).__name__, implementation=implementation,
                      detail=f"by {worst:.3g} of their scale")


def _packed_logits(model: nn.Module, seqs: Sequence[torch.Tensor], device: Any) -> torch.Tensor:
    """The model's outputs (N, V) on ``seqs`` packed in one row, with the fields TRL's padding-free
    collator gives (position ids restarting at each, the cumulative lengths)."""
    ids = torch.cat(list(seqs))[None].to(device)
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None].to(device)
    cu = torch.tensor([0, *[len(s) for s in seqs]]).cumsum(0).to(device, torch.int32)
    longest = max(len(s) for s in seqs)
    out = model(input_ids=ids, position_ids=positions, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                max_length_q=longest, max_length_k=longest)
    logits = out["logits"] if isinstance(out, Mapping) else out[0]
    if logits.dim() != 3 or logits.shape[1] != ids.shape[1]:
        raise ValueError(f"padding_free=True needs a model with one output per token; {type(model).__name__} "
                         f"gives {tuple(logits.shape)} for {ids.shape[1]} tokens")
    return logits[0].float()


def packed_token_losses(logits: torch.Tensor, labels: torch.Tensor, segments: Segments, *, shift: bool) -> torch.Tensor:
    """One loss per segment (S,): the mean cross-entropy over its supervised tokens (labels !=
    -100; 0 for none), float32; ``shift`` (causal language modelling): a position predicts the
    next one's label, and a prediction across a segment boundary (or into the padding) is
    ignored, so each loss is that of the example alone."""
    if logits.dim() != 3 or labels.dim() != 2:
        raise ValueError(
            f"padding_free=True needs token-level logits and labels (one per packed token); got logits of shape "
            f"{tuple(logits.shape)} and labels {tuple(labels.shape)}: override per_example_loss(model, inputs)"
        )
    owner = segments.token_segment(logits.device)
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
        owner = torch.where(owner[:, :-1] == owner[:, 1:], owner[:, :-1], -1)
    tokens = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100,
                             reduction="none").view(labels.shape)
    kept = (labels != -100) & (owner >= 0)
    where, values = owner[kept], tokens[kept]
    sums = values.new_zeros(len(segments)).index_add(0, where, values)
    counts = values.new_zeros(len(segments)).index_add_(0, where, torch.ones_like(values))
    return sums / counts.clamp(min=1)


def check_example_losses(losses: torch.Tensor, segments: Optional[Segments]) -> None:
    """``per_example_loss``'s losses: one per example (B,), a packed batch's one per segment.

    Raises:
        ValueError: another shape (a packed row's one loss would clip its examples' sum, unweighted)."""
    examples = None if segments is None else len(segments)
    if losses.dim() != 1 or examples not in (None, losses.shape[0]):
        raise ValueError(f"per_example_loss must return shape (B,), one loss per example (a padding-free batch: one "
                         f"per packed sequence, {examples}); got {tuple(losses.shape)}")


def physical_batches(inputs: Any, units: Optional[RowUnits], segments: Optional[Segments], per_example: bool
                     ) -> Tuple[List[Any], Optional[RowUnits], Optional[Segments]]:
    """A physical batch as its forwards take it, with the units they clip and the segments the
    layers split the rows into: the whole batch (packed: its segments the units, each an example
    at example level), or one row per backward pass in the per-example form (packed: one segment,
    :meth:`~opacus_rc.packing.Segments.unpacked`; a unit's rows one after another)."""
    if segments is None:
        batches, units = one_row_batches(inputs, units) if per_example else ([inputs], units)
        return batches, units, None
    units = units if units is not None else RowUnits.singletons(len(segments))
    if not per_example:
        return [inputs], units, segments
    order, rows = units.grouped(), segments.unpacked(inputs)
    return [rows[i] for i in order], units.take(order), None


__all__ = [
    "PACKING_FIELDS", "PackedCollate", "check_example_losses", "check_packed_attention", "packed_token_losses",
    "physical_batches", "take_segments",
]
