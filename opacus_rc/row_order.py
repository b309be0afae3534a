"""Which delivered row each row of a collated batch is: carried through the user's collate.

At ``privacy_unit="user"`` a batch's rows are clipped in their users' units, so the plugin must
know which sampled row each collated row came from, also when the collate function sorts the
rows (longest first, as ``pack_padded_sequence`` needs) or pads them. :class:`RowOrderCollate`
wraps the loader's collate function: before it, each row carries its position in the draw (a
key of a mapping row, and every tensor of the row as a :class:`RowTag`, which torch's functions
carry through ``stack``, ``cat``, ``pad_sequence``, casts, copies and any function of one row);
after it, the positions are read off the batch (:func:`carried_order`) and stripped, so the
model and the script never see them. A collate that keeps no position (it builds its tensors
outside torch's functions and drops unknown keys) falls back to matching a mapping batch's rows
to the rows it was given by their values (:func:`order_by_values`); otherwise it is refused by
name, as is a collate that drops, duplicates or adds rows.

torch's ``default_collate`` keeps the rows in order by construction: it is not wrapped.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.data import default_collate

from .packing import SEGMENTS_KEY

#: the key a mapping row carries its position under, through the collate
ROW_KEY = "opacus_rc_row"

#: a tag: the row a tensor is computed from (int), or the rows of its slices along a dimension
Tag = Union[int, Tuple[int, Tuple[int, ...]]]

#: torch functions that keep a stacked tensor's rows where they are (copies, casts, moves)
_ROW_KEEPING = frozenset(
    getattr(torch.Tensor, name) for name in (
        "to", "clone", "contiguous", "detach", "cpu", "cuda", "float", "double", "half", "bfloat16", "long", "int",
        "short", "bool", "byte", "char", "type", "pin_memory", "requires_grad_", "share_memory_", "__deepcopy__",
    ) if hasattr(torch.Tensor, name)
)
#: torch functions that stack a sequence of one-row tensors along a dimension (``dim`` argument)
_STACKING = {torch.stack: 0, torch.cat: 0, torch.concat: 0, torch.concatenate: 0, torch.nn.utils.rnn.pad_sequence: None}


class RowTag(torch.Tensor):
    """A tensor that knows which delivered row(s) it is computed from (:data:`Tag`); torch's
    functions propagate it (a result computed from one row's tensors is that row's; stacking
    one-row tensors records their rows along the stacked dimension)."""

    row_tag: Optional[Tag] = None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.as_subclass:  # (how tags are put on and taken off)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        tag = _result_tag(func, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        return tree_map(lambda t: _tagged(t, tag) if isinstance(t, torch.Tensor) else t, out)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "RowTag":
        return _tagged(self.as_subclass(torch.Tensor).__deepcopy__(memo), self.row_tag)

    def __reduce_ex__(self, protocol: int) -> Any:  # pickled (a worker's queue, torch.save) as a plain tensor
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


def _tagged(tensor: torch.Tensor, tag: Optional[Tag]) -> torch.Tensor:
    if tag is None:
        return tensor.as_subclass(torch.Tensor) if isinstance(tensor, RowTag) else tensor
    out = tensor.as_subclass(RowTag)
    out.row_tag = tag
    return out


def _tags(values: Any) -> List[Optional[Tag]]:
    return [getattr(v, "row_tag", None) for v in tree_flatten(values)[0] if isinstance(v, torch.Tensor)]


def _result_tag(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Optional[Tag]:
    """The tag of ``func(*args, **kwargs)``: see :class:`RowTag`."""
    if func in _STACKING and args and isinstance(args[0], (list, tuple)):
        rows = [getattr(t, "row_tag", None) for t in args[0]]
        if rows and all(isinstance(r, int) for r in rows):
            dim = _stacked_dim(func, args, kwargs)
            return None if dim is None else (dim, tuple(rows))
        return None
    tags = [t for t in _tags((args, kwargs)) if t is not None]
    if not tags or any(t != tags[0] for t in tags):
        return None
    if isinstance(tags[0], int) or func in _ROW_KEEPING:
        return tags[0]
    return None


def _stacked_dim(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Optional[int]:
    """The dimension ``func`` stacks its sequence of one-row tensors along (None: it does not
    put one row per index: ``cat`` of tensors of several rows)."""
    if func is torch.nn.utils.rnn.pad_sequence:
        batch_first = kwargs.get("batch_first", args[1] if len(args) > 1 else False)
        return 0 if batch_first else 1
    dim = kwargs.get("dim", kwargs.get("axis", args[1] if len(args) > 1 else 0))
    if func is torch.stack:
        return dim if dim >= 0 else None
    return dim if dim >= 0 and all(t.dim() > dim and t.shape[dim] == 1 for t in args[0]) else None


def tensors_in(obj: Any) -> List[torch.Tensor]:
    """The tensors of a batch or a forward's arguments: in tuples, lists, dicts and any other
    mapping (transformers' ``BatchEncoding``)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for value in obj.values() for t in tensors_in(value)]
    if isinstance(obj, (list, tuple)):
        return [t for value in obj for t in tensors_in(value)]
    return []


def _untagged(obj: Any) -> Any:
    """``obj`` with every :class:`RowTag` a plain tensor again (a mutable mapping in place,
    tuples and lists rebuilt as their type)."""
    if isinstance(obj, RowTag):
        return obj.as_subclass(torch.Tensor)
    if isinstance(obj, MutableMapping):
        for key, value in list(obj.items()):
            obj[key] = _untagged(value)
        return obj
    if isinstance(obj, Mapping):
        return {key: _untagged(value) for key, value in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(_untagged(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_untagged(v) for v in obj)
    return obj


def tag_row(row: Any, position: int) -> Any:
    """``row`` carrying ``position``: its tensors as :class:`RowTag`, and a mapping row the key
    :data:`ROW_KEY` as well (a 0-d tensor: collates that stack every field stack it too)."""
    row = tree_map(lambda t: _tagged(t, position) if isinstance(t, torch.Tensor) else t, row)
    if isinstance(row, Mapping) and not isinstance(row, MutableMapping):
        row = dict(row)
    if isinstance(row, MutableMapping):
        row = copy.copy(row)  # (the dataset's own mapping is not changed)
        row[ROW_KEY] = torch.tensor(position)
    return row


def carried_order(batch: Any, rows: int) -> Tuple[Any, Optional[List[int]]]:
    """``batch`` without the positions it carries, and the order of its rows: ``order[i]`` the
    position (in the list given to the collate) of its row ``i``, read from :data:`ROW_KEY`
    or else from any :class:`RowTag` that stacks ``rows`` rows; None where none is carried.

    Raises:
        ValueError: the carried positions are not each of the ``rows`` rows once (the collate
            dropped, duplicated or added rows), or two of them disagree.
    """
    found: List[List[int]] = []
    if isinstance(batch, MutableMapping) and ROW_KEY in batch:
        key = batch.pop(ROW_KEY)
        found.append([int(v) for v in (key.reshape(-1).tolist() if isinstance(key, torch.Tensor) else key)])
    for leaf in tensors_in(batch):
        tag = getattr(leaf, "row_tag", None)
        if isinstance(tag, tuple) and len(tag[1]) == rows:
            found.append(list(tag[1]))
    batch = _untagged(batch)
    if not found:
        return batch, None
    order = found[0]
    if sorted(order) != list(range(rows)) or any(f != order for f in found[1:]):
        raise ValueError(
            f"privacy_unit='user': the collate function returned a batch of rows {order} (positions in the list it "
            f"was given, of {rows} rows): a collate must return each row it is given once (sorting and padding "
            "are fine; dropping, duplicating or adding rows is not), with every field in the same row order"
        )
    return batch, order


def order_by_values(features: List[Any], batch: Any) -> Optional[List[int]]:
    """For a collate that carries no position: the rows of a mapping ``batch`` matched to the
    mapping ``features`` it was given, by the fields it passes on (under their names, or ``label``
    as ``labels``): their values without padding (where ``attention_mask`` is 1, else ``-100``
    trimmed). Rows whose fields match several features are taken in order only when those
    features are identical. None when ``batch`` is not a mapping of ``len(features)`` rows.

    Raises:
        ValueError: a collated row matches no feature (the collate changed, dropped or added
            rows, or passes no field on), or matches features that differ.
    """
    n = len(features)
    if not isinstance(batch, Mapping) or not all(isinstance(f, Mapping) for f in features):
        return None
    if n < 2:
        return list(range(n))
    mask = batch.get("attention_mask")
    mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == n else None
    named = [(k, _RENAMED.get(k, k)) for k in features[0] if k != ROW_KEY]
    fields = [(k, b) for k, b in named
              if isinstance(batch.get(b), torch.Tensor) and batch[b].dim() > 0 and batch[b].shape[0] == n]
    # a field padded where attention_mask is 0: of the mask's shape, each row as long as its input_ids
    aligned = [mask is not None and batch[b].shape == mask.shape and all(
        "input_ids" in f and torch.as_tensor(f[k]).shape == torch.as_tensor(f["input_ids"]).shape for f in features)
        for k, b in fields]

    def feature_key(f: Mapping) -> tuple:
        own = f.get("attention_mask")
        return tuple(_content(torch.as_tensor(f[k], dtype=batch[b].dtype),
                              (torch.ones(len(f[k])) if own is None else torch.as_tensor(own)) if a else None)
                     for (k, b), a in zip(fields, aligned))

    groups: Dict[tuple, List[int]] = {}
    why = "it passes no field of the rows on under their names" if not fields else None
    for i, f in enumerate(features if why is None else ()):
        groups.setdefault(feature_key(f), []).append(i)
    for rows in groups.values():
        if len({_frozen(features[i]) for i in rows}) > 1:
            why = f"rows {rows} differ only in fields the collate does not pass on"
    order: List[int] = []
    for j in range(n if why is None else 0):
        rows = groups.get(tuple(_content(batch[b][j], mask[j] if a else None) for (_, b), a in zip(fields, aligned)))
        if not rows:
            why = f"its row {j} matches none of the rows it was given (changed, dropped or added)"
            break
        order.append(rows.pop(0))
    if why is not None:
        raise ValueError(
            f"privacy_unit='user': the collate function's batch cannot be matched to the rows it was given ({why}); "
            f"it carries no row position either (it drops the key {ROW_KEY!r} of mapping rows and builds its "
            "tensors outside torch's functions). Accepted: a collate that pads and stacks the rows' fields with "
            f"torch, in any order, or that passes the key {ROW_KEY!r} on (tokenize in the dataset, e.g. with "
            "dataset.map, not in the collate; no random masking)"
        )
    return order


#: feature keys a collate passes on under another name (transformers' collators: "labels")
_RENAMED = {"label": "labels", "label_ids": "labels"}


def _frozen(value: Any) -> Any:
    """``value`` (a feature's field) as a hashable value compared by content."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.reshape(-1).tolist()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, Mapping):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    return value


def _content(value: torch.Tensor, mask: Optional[torch.Tensor]) -> tuple:
    """A row's field without its padding: its values where ``mask`` is nonzero (a mask of
    its shape), else with ``-100`` (the label padding) trimmed from both ends."""
    if mask is not None and mask.shape == value.shape:
        return tuple(value[mask != 0].tolist())
    flat = value.reshape(-1).tolist()
    start, stop = 0, len(flat)
    while start < stop and flat[start] == -100:
        start += 1
    while stop > start and flat[stop - 1] == -100:
        stop -= 1
    return tuple(flat[start:stop])


@dataclass
class Collated:
    """A collated batch and the order of its rows (None: the draw's order)."""

    data: Any
    order: Optional[List[int]]

    def pin_memory(self) -> "Collated":
        from torch.utils.data._utils.pin_memory import pin_memory

        return Collated(pin_memory(self.data), self.order)


class RowOrderCollate:
    """The loader's collate function ``collate``, returning :class:`Collated`: the batch and
    the order of its rows (:func:`carried_order`, else :func:`order_by_values`).

    Raises (when called):
        ValueError: the rows' order cannot be followed (no position carried, a batch that is
            not a mapping), or the collate dropped, duplicated or added rows.
    """

    def __init__(self, collate: Callable[[List[Any]], Any]) -> None:
        self.collate = collate

    def __call__(self, rows: List[Any]) -> Collated:
        if not rows:  # an empty draw: nothing to follow
            return Collated(self.collate(rows), None)
        tagged = [tag_row(row, i) for i, row in enumerate(rows)]
        batch, order = carried_order(self.collate(tagged), len(rows))
        if order is None and isinstance(batch, Mapping) and SEGMENTS_KEY in batch:
            order = list(range(len(rows)))  # packed rows: each given row found in its place (opacus_rc.hf.packing)
        if order is None:
            order = order_by_values(rows, batch)
        if order is None:
            raise ValueError(
                f"privacy_unit='user': the collate function returned a {type(batch).__name__} whose rows cannot be "
                "followed to the rows it was given (a user's rows are clipped together, so the plugin must know "
                f"where each row went): it builds its tensors outside torch's functions and returns no mapping "
                f"with the key {ROW_KEY!r}. Accepted: a collate that stacks or pads with torch (torch.stack, "
                "pad_sequence; sorting is fine), one that passes a mapping row's extra key on, or the default one"
            )
        return Collated(batch, None if order == list(range(len(rows))) else order)


def follows_rows(collate: Optional[Callable[[List[Any]], Any]]) -> bool:
    """Whether ``collate`` needs :class:`RowOrderCollate`: any but torch's ``default_collate``
    (alone, or inside Opacus's empty-batch wrapper), which keeps the rows in order."""
    from opacus.data_loader import CollateFnWithEmpty

    if isinstance(collate, CollateFnWithEmpty):
        collate = collate.wrapped_collator_fn
    return collate is not None and collate is not default_collate


__all__ = [
    "Collated", "ROW_KEY", "RowOrderCollate", "RowTag", "carried_order", "follows_rows", "order_by_values", "tag_row",
    "tensors_in",
]
