"""Packed rows: several examples as token ranges of one row (TRL's ``padding_free=True``).

A padding-free collate concatenates a batch's sequences into one row, the position ids restarting
at 0 at each sequence, and the model keeps the sequences apart by those position ids (its attention
does not cross a restart: checked once per model, :func:`opacus_rc.hf.packing.check_packed_attention`).
Each sequence is then its own example: its *segment*, a token range of a row. The privacy units of
such a batch are its segments (or their users), and every layer's per-example values are taken
per segment: the layer's input and output gradient, one entry per token of the packed rows, are
split into one row per segment (:meth:`Segments.split`, zero-padded to the longest), so that a
segment is seen exactly as the same example alone in a batch of one row each:

    grad_s = sum_{t in segment s} G[t]^T A[t]   (each segment's tokens, and no other's)

Tokens of the packed rows outside every segment (padding after the last one) carry no loss and no
attention from any segment's token: their gradient is zero, and they are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

#: the key a packed batch carries its :class:`Segments` under, from the collate to the step
SEGMENTS_KEY = "__opacus_rc_segments__"

#: the fields of a padding-free batch that describe its packing (TRL's collator; the varlen kernels')
PACKING_FIELDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


@dataclass(frozen=True, eq=False)
class Segments:
    """The examples of a batch of packed rows: segment ``s`` is tokens ``[start[s], start[s] +
    length[s])`` of row ``row[s]`` (segments in the order of the examples given to the collate);
    ``tokens``: the packed rows' length."""

    row: torch.Tensor
    start: torch.Tensor
    length: torch.Tensor
    tokens: int
    #: :meth:`_gather` per device
    _index: Dict[Any, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return int(self.row.shape[0])

    @property
    def longest(self) -> int:
        return int(self.length.max()) if len(self) else 0

    @classmethod
    def of_rows(cls, position_ids: torch.Tensor, lengths: Sequence[int]) -> "Segments":
        """The segments of packed rows whose ``position_ids`` (R, N) restart at 0 at each sequence,
        holding sequences of ``lengths`` in order (row by row; any tokens after them: padding).

        Raises:
            ValueError: the position ids do not restart at 0 at each of the sequences, count up by 1
                within it, or the rows cannot hold them.
        """
        pos = torch.as_tensor(position_ids).detach().to("cpu", torch.long)
        if pos.dim() != 2:
            raise ValueError(f"packed rows need position_ids of shape (rows, tokens); got {tuple(pos.shape)}")
        rows, starts, kept = [], [], []
        row, at = 0, 0
        for n in (int(x) for x in lengths):
            if n <= 0:
                continue  # an empty sequence: no token, no segment
            if at + n > pos.shape[1]:
                row, at = row + 1, 0
            if row >= pos.shape[0] or not torch.equal(pos[row, at:at + n], torch.arange(n)):
                raise ValueError(
                    "a packed batch (padding_free=True) must hold each example as one run of position_ids "
                    "0, 1, ..., length - 1 (restarting at each example, in the order the collate was given "
                    f"them); a sequence of {n} tokens at row {row}, token {at} does not: the model would not "
                    "keep the examples apart"
                )
            rows.append(row)
            starts.append(at)
            kept.append(n)
            at += n
        as_long = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
        return cls(as_long(rows), as_long(starts), as_long(kept), int(pos.shape[1]))

    def _gather(self, device: Any) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(rows, columns, inside)`` (S, L): the packed position of each segment's token ``j``
        (``j`` beyond its length: position 0, ``inside`` False)."""
        key = torch.device(device) if device is not None else torch.device("cpu")
        if key not in self._index:
            j = torch.arange(self.longest)
            inside = j[None, :] < self.length[:, None]
            columns = torch.where(inside, self.start[:, None] + j[None, :], torch.zeros((), dtype=torch.long))
            rows = self.row[:, None].expand_as(columns)
            self._index[key] = (rows.to(key), columns.to(key), inside.to(key))
        return self._index[key]

    def split(self, t: torch.Tensor, fill: Any = 0) -> torch.Tensor:
        """``t`` (R, N, ...) of the packed rows as one row per segment: (S, L, ...), the segment's
        tokens first and ``fill`` after them (differentiable: a gather).

        Raises:
            ValueError: ``t`` is not (rows, tokens, ...) of the packed rows.
        """
        if t.dim() < 2 or t.shape[1] != self.tokens or (len(self) and t.shape[0] <= int(self.row.max())):
            raise ValueError(f"shape {tuple(t.shape)}")
        rows, columns, inside = self._gather(t.device)
        out = t[rows, columns]
        mask = inside.reshape(*inside.shape, *([1] * (t.dim() - 2)))
        return torch.where(mask, out, torch.as_tensor(fill, dtype=t.dtype, device=t.device))

    def token_segment(self, device: Any = None) -> torch.Tensor:
        """(R, N): the segment of each packed token, -1 outside every segment."""
        rows, columns, inside = self._gather(device)
        out = torch.full((int(self.row.max()) + 1 if len(self) else 0, self.tokens), -1, dtype=torch.long,
                         device=rows.device)
        segment = torch.arange(len(self), device=rows.device)[:, None].expand_as(rows)
        out[rows[inside], columns[inside]] = segment[inside]
        return out

    def unpacked(self, batch: Dict[str, Any]) -> List[Dict[str, Any]]:
        """``batch`` (a packed batch's fields) as one batch per segment, each a row of its own tokens
        (the per-example form's backward passes): every (R, N, ...) field cut to the segment's
        range, the packing fields dropped (one sequence each), the rest kept."""
        out = []
        for s in range(len(self)):
            r, a, n = int(self.row[s]), int(self.start[s]), int(self.length[s])
            out.append({
                k: v[r:r + 1, a:a + n] if _per_token(v, self.tokens) else v
                for k, v in batch.items() if k not in PACKING_FIELDS
            })
        return out


def _per_token(value: Any, tokens: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == tokens


def take_segments(batch: Any) -> Optional[Segments]:
    """Remove and return the segments a packed batch carries (None: not packed)."""
    return batch.pop(SEGMENTS_KEY, None) if isinstance(batch, dict) or hasattr(batch, "pop") else None


def segment_sums(values: torch.Tensor, segments: Segments) -> torch.Tensor:
    """``values`` (R, N) of the packed tokens summed per segment: (S,)."""
    return segments.split(values).sum(dim=1)


__all__ = ["PACKING_FIELDS", "SEGMENTS_KEY", "Segments", "segment_sums", "take_segments"]
