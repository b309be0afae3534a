"""Refusing a step after a forward pass changed the model (docs/forms.md, "What every form
enforces").

A change a forward pass makes to a parameter or buffer depends on the example it saw and
reaches the released model without noise (``nn.Embedding(max_norm=...)``, a running statistic
kept in a buffer). :class:`ForwardChanges` compares, at each step, the value of every
parameter, buffer and tensor kept in a module attribute with its value before the draw's first
forward pass, whoever wrote it (in place, through ``.data``, by reassignment, in a hook or a
backward pass): a bit-exact digest per tensor; the optimizer refuses the step by name. Changes
between a step and the next forward pass are the loop's own and are not refused.
:func:`check_no_max_norm` refuses ``nn.Embedding(max_norm=...)`` at ``make_private``.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
from torch import nn


def check_no_max_norm(model: nn.Module) -> None:
    """Refuse an embedding with ``max_norm`` (ValueError naming it): its forward
    renormalises the looked-up rows in place, which releases which tokens were seen."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and module.max_norm is not None:
            raise ValueError(
                f"embedding {name or type(module).__name__!r} has max_norm={module.max_norm}: its "
                "forward pass renormalises the rows it looks up in place, which releases which "
                "tokens were seen, without noise. Use max_norm=None"
            )


def watched_model(module: nn.Module) -> nn.Module:
    """The user's model inside Opacus's and torch's wrappers (grad-sample module, DPDDP,
    DDP): the module whose forward passes :class:`ForwardChanges` watches."""
    while True:
        inner = getattr(module, "_module", None)
        if inner is None and isinstance(module, nn.Module) and hasattr(module, "module"):
            inner = module.module  # DDP / DPDDP: their own forward syncs buffers, outside the model's
        if not isinstance(inner, nn.Module):
            return module
        module = inner


def _sharded(model: nn.Module) -> bool:
    """Whether FSDP2's ``fully_shard`` wraps a module of ``model`` (its forward swaps the
    parameters' shards in and out)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


#: not state: a module's own bookkeeping in its ``__dict__`` (hooks, parameters, buffers,
#: submodules), and what Opacus's per-example hooks write and its clip consumes (inputs, FSDP norms)
_NOT_STATE = frozenset(nn.Module().__dict__) | {"activations", "norm_sample"}
#: large tensors are hashed alone, in chunks of ``_CHUNK`` elements (bounds the scratch memory);
#: smaller ones packed together in blocks of ``_BLOCK`` (a few kernels for all of them)
_CHUNK, _SMALL, _BLOCK = 1 << 22, 1 << 16, 128
_weights_cache: Dict[torch.device, torch.Tensor] = {}
_layouts: Dict[Tuple[Any, ...], Tuple[torch.Tensor, ...]] = {}


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """``n`` odd pseudo-random int32 weights on ``device`` (a splitmix-style mix of the index)."""
    w = _weights_cache.get(device)
    if w is None or len(w) < n:
        x = torch.arange(max(n, 1024), dtype=torch.int64, device=device) * -7046029254386353131
        x = (x ^ (x >> 31)) * -4658895280553007687  # wraps mod 2^64
        w = _weights_cache[device] = ((x ^ (x >> 29)) | 1).to(torch.int32)
    return w[:n]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``tensor`` read as int32 words (a view; a zero-padded copy if unaligned)."""
    x = tensor.detach()
    x = (torch.view_as_real(x) if x.is_complex() else x).reshape(-1).view(torch.uint8)
    if x.numel() % 4 or x.storage_offset() % 4:
        x = torch.cat([x, x.new_zeros(-x.numel() % 4)])
    return x.view(torch.int32)


def digests(tensors: List[torch.Tensor]) -> torch.Tensor:
    """Bit-exact digests of ``tensors``' values (one device), as one int32 tensor, on the device
    (no host synchronisation): ``sum_i u_i b_i mod 2^32`` over the raw bits ``b`` read as int32
    words, ``u_i`` a product of odd pseudo-random weights of ``i``'s chunk or block and offset:
    a change to one element always changes it, any other change but for a 2^-32 chance."""
    device, bits = tensors[0].device, [_bits(t) for t in tensors]
    sizes = [b.numel() for b in bits]
    small = [i for i, n in enumerate(sizes) if n < _SMALL]
    large = [i for i, n in enumerate(sizes) if n >= _SMALL]
    key = (device, tuple(sizes))
    if key not in _layouts:  # per block of the small ones: its weight, the cumulative sums' ends
        blocks = [-(-sizes[i] // _BLOCK) for i in small]
        index = [_BLOCK + j for n in blocks for j in range(n)]
        ends = torch.tensor(blocks, dtype=torch.int64).cumsum(0)
        order = torch.tensor(small + large, dtype=torch.int64).argsort()
        if len(_layouts) > 16:
            _layouts.clear()
        _layouts[key] = tuple(t.to(device) for t in (torch.tensor(index, dtype=torch.int64), ends, order))
    index, ends, order = _layouts[key]
    w = _weights(max([_BLOCK + _SMALL // _BLOCK] + [min(sizes[i], _CHUNK) for i in large]), device)
    out = []
    if small:
        pad = torch.zeros(_BLOCK, dtype=torch.int32, device=device)
        packed = torch.cat([x for i in small for x in (bits[i], pad[: -sizes[i] % _BLOCK])]).view(-1, _BLOCK)
        sums = ((packed * w[:_BLOCK]).sum(1, dtype=torch.int32) * w[index]).cumsum(0, dtype=torch.int32)
        sums = torch.cat([sums.new_zeros(1), sums])
        out.append(sums[ends] - sums[torch.cat([ends.new_zeros(1), ends[:-1]])])
    for i in large:
        total = torch.zeros((), dtype=torch.int32, device=device)
        for c, chunk in enumerate(bits[i].split(_CHUNK)):
            part = w[: chunk.numel()]
            total += (torch.dot(chunk, part) if chunk.is_cpu else (chunk * part).sum(dtype=torch.int32)) * (2 * c + 1)
        out.append(total[None])
    return torch.cat(out)[order]


_HOLDERS = (torch.Tensor, list, tuple, dict)


class Changes(NamedTuple):
    """What :meth:`ForwardChanges.take` saw: a tensor added, removed or of another kind (known on
    the host), whether a digest changed (a device bool; None: nothing compared), and the names."""

    structural: bool
    flag: Optional[torch.Tensor]
    names: Any  # () -> List[str]


def _tensors(value: Any, name: str, out: List[Tuple[str, torch.Tensor]], depth: int = 0) -> None:
    """Append the tensors a module attribute holds, itself or in lists, tuples and dicts (3
    levels), to ``out``."""
    if isinstance(value, torch.Tensor):
        if not isinstance(value, nn.Parameter):  # those: as parameters
            out.append((name, value))
    elif depth < 3:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if issubclass(type(item), _HOLDERS):
                _tensors(item, f"{name}[{key!r}]", out, depth + 1)


class _Seen(NamedTuple):
    """A watched tensor as a snapshot saw it (held, so that identity stays meaningful)."""

    what: str  # "parameter", "buffer" or "attribute"
    tensor: torch.Tensor
    kind: Tuple[torch.dtype, Tuple[int, ...], torch.device]
    slot: int  # its digest's index among its device's


class ForwardChanges:
    """Watches the values of ``model``'s parameters (``parameters=False``: not them, for
    FSDP2, whose forward swaps the parameters' shards in and out), buffers and tensors kept in
    module attributes, from the first forward pass after each :meth:`take` to the next;
    :meth:`take` returns what changed.

    Args:
        model: the user's model (see :func:`watched_model`).
        parameters: whether parameters are watched as well as buffers (None: unless
            FSDP2 shards the model).
        outer: the wrapper the loop calls (the grad-sample module; ignored unless a module),
            whose pre-hooks run before the model's.
    """

    def __init__(self, model: nn.Module, parameters: Optional[bool] = None, outer: Any = None) -> None:
        self._model = model
        self._parameters = not _sharded(model) if parameters is None else parameters
        self._before: Optional[Tuple[Dict[str, _Seen], Dict[torch.device, torch.Tensor]]] = None
        # first among the pre-hooks of the model and of the wrapper the loop calls (whose run before
        # the model's): a pre-hook registered before or after this one runs after it
        modules = {id(m): m for m in (outer, model) if isinstance(m, nn.Module)}
        self._handles = [m.register_forward_pre_hook(self._forward_starts, prepend=True) for m in modules.values()]
        self._snapshot()  # the digests' weights and layouts made now, not inside a step

    def remove(self) -> None:
        """Stop watching (removes the hooks)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._before = None

    def _entries(self) -> Iterator[Tuple[str, str, torch.Tensor]]:
        """(what, name, tensor) of each watched tensor."""
        for prefix, module in self._model.named_modules(remove_duplicate=False):
            dot = f"{prefix}." if prefix else ""
            kinds = [("buffer", module._buffers)] + ([("parameter", module._parameters)] if self._parameters else [])
            for what, container in kinds:
                yield from ((what, dot + key, t) for key, t in container.items() if t is not None)
            held: List[Tuple[str, torch.Tensor]] = []
            for key, value in module.__dict__.items():
                if issubclass(type(value), _HOLDERS) and key not in _NOT_STATE:
                    _tensors(value, key, held)
            yield from (("attribute", dot + name, t) for name, t in held)

    def _snapshot(self) -> Tuple[Dict[str, _Seen], Dict[torch.device, torch.Tensor]]:
        """Each watched tensor by name, and their digests stacked per device (a tensor under
        several names is hashed once)."""
        seen: Dict[str, _Seen] = {}
        slots: Dict[int, int] = {}
        unique: Dict[torch.device, List[torch.Tensor]] = {}
        for what, name, t in self._entries():
            if t.layout != torch.strided:
                continue
            if id(t) not in slots:
                slots[id(t)] = len(unique.setdefault(t.device, []))
                unique[t.device].append(t)
            seen[name] = _Seen(what, t, (t.dtype, tuple(t.shape), t.device), slots[id(t)])
        return seen, {device: digests(ts) for device, ts in unique.items()}

    def take(self) -> "Changes":
        """What changed since the first forward pass after the last call; watching starts again
        at the next forward pass. No host synchronisation: a change of value is a device flag."""
        if self._before is None:
            return Changes(False, None, list)
        (before, digests), (after, now) = self._before, self._snapshot()
        self._before = None
        pairs = [(n, b.slot, after[n].slot, b.kind[2]) for n, b in before.items()
                 if n in after and b.kind == after[n].kind]
        compared = {}  # device -> (names, whether each digest differs)
        for device, old in digests.items():
            on = [p for p in pairs if p[3] == device]
            if on:
                compared[device] = ([p[0] for p in on], old[[p[1] for p in on]] != now[device][[p[2] for p in on]])
        structural = before.keys() != after.keys() or len(pairs) != len(before)
        flags = [ne.any() for _, ne in compared.values()]
        flag = None if not flags else torch.stack([f.to(flags[0].device) for f in flags]).any()

        def names() -> List[str]:  # (waits for the device: for the refusal's message only)
            differs = {n for names_on, ne in compared.values() for n, d in zip(names_on, ne.tolist()) if d}
            changed: List[str] = []
            for name in {**before, **after}:  # the names before the forward pass first
                b, a = before.get(name), after.get(name)
                if b is None or a is None:
                    how = "added" if b is None else "removed"
                elif b.kind != a.kind or name in differs:
                    how = "changed in place" if b.tensor is a.tensor else "replaced"
                else:
                    continue
                what = (b or a).what
                message = f"{what} {name.split('[')[0] if what == 'attribute' else name!r} was {how}"
                if message not in changed:  # a list attribute: named once
                    changed.append(message)
            return changed

        return Changes(structural, flag, names)

    def _forward_starts(self, _module: nn.Module, _args: Any) -> None:
        if self._before is None:
            self._before = self._snapshot()

    @staticmethod
    def refusal(changed: List[str]) -> ValueError:
        """The step's refusal for what :meth:`take` returned."""
        return ValueError(
            "optimizer.step() refused: " + "; ".join(changed) + " during the forward pass (from the "
            "step's first forward pass to step(): in place, through .data, by reassignment, in a "
            "hook or a backward pass): a change made from the data reaches the released model "
            "without noise (a running statistic kept in a buffer, nn.Embedding(max_norm=...), "
            "state kept across forward passes). Compute such values outside the model's forward "
            "pass, keep them out of the model, or freeze them. Nothing was released or charged, but "
            "the model holds the change: do not release it (restore a checkpoint taken before the "
            "step); call optimizer.zero_grad() before the next step"
        )


__all__ = ["ForwardChanges", "check_no_max_norm", "digests", "watched_model"]
