"""Refusing a step after a forward pass changed the model (docs/forms.md, "What every form
enforces").

A change a forward pass makes to a parameter or buffer depends on the example it saw and
reaches the released model without noise (``nn.Embedding(max_norm=...)``, a running statistic
kept in a buffer). :class:`ForwardChanges` compares, at each step, the value of every
parameter, buffer and tensor kept in a module attribute with its value before the draw's first
forward pass, whoever wrote it (in place, through ``.data``, by reassignment, in a hook or a
backward pass): a bit-exact digest per tensor; the optimizer refuses the step by name. Changes
between a step and the next forward pass are the loop's own and are not refused.

A plain module attribute that a forward pass *assigns* (``self.last_attn = attn.detach()``) is
not a change of the model: it is watched from then on (:mod:`opacus_rc.carried_state`), and the
step is refused only when a later training forward pass reads the value an earlier one wrote.
An attribute's tensor changed in place (``self.memory.add_(...)``, ``self.memory.append(...)``)
stays refused: changing a kept value reads it.
:func:`check_no_max_norm` refuses ``nn.Embedding(max_norm=...)`` at ``make_private``.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Set, Tuple

import torch
from torch import nn

from .carried_state import (
    CARRIED, AttributeWatch, ForwardClock, Top, attribute_tops, describe, held_tensors, reassigned,
)
from .recompute import forward_replay


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


class Changes(NamedTuple):
    """What :meth:`ForwardChanges.take` saw: a tensor added, removed or of another kind (known on
    the host), whether a digest changed (a device bool; None: nothing compared), and the names."""

    structural: bool
    flag: Optional[torch.Tensor]
    names: Any  # () -> List[str]


class _Seen(NamedTuple):
    """A watched tensor as a snapshot saw it (held, so that identity stays meaningful)."""

    what: str  # "parameter", "buffer" or "attribute"
    tensor: torch.Tensor
    kind: Tuple[torch.dtype, Tuple[int, ...], torch.device]
    slot: int  # its digest's index among its device's
    top: Optional[str]  # an attribute's: the module attribute that holds it ("block.memory")


class _Snapshot(NamedTuple):
    """One walk of the watched tensors: each by name, their digests per device, and the plain
    attributes that hold them (:func:`~opacus_rc.carried_state.attribute_tops`)."""

    seen: Dict[str, _Seen]
    digests: Dict[torch.device, torch.Tensor]
    tops: Dict[str, Top]


class ForwardChanges:
    """Watches the values of ``model``'s parameters (``parameters=False``: not them, for
    FSDP2, whose forward swaps the parameters' shards in and out), buffers and tensors kept in
    module attributes, from the first forward pass after each :meth:`take` to the next;
    :meth:`take` returns what changed. A plain attribute a forward pass assigned is not a
    change: it is watched from then on, and :meth:`take` returns a training forward pass's read
    of a value an earlier forward pass wrote (:mod:`opacus_rc.carried_state`).

    Args:
        model: the user's model (see :func:`watched_model`).
        parameters: whether parameters are watched as well as buffers (None: unless
            FSDP2 shards the model).
        outer: the wrapper the loop calls (the grad-sample module; ignored unless a module),
            whose pre-hooks run before the model's; its ``forward_running()`` (when it has
            one) tells a forward pass of a submodule called alone.
    """

    def __init__(self, model: nn.Module, parameters: Optional[bool] = None, outer: Any = None) -> None:
        self._model = model
        self._parameters = not _sharded(model) if parameters is None else parameters
        self._before: Optional[_Snapshot] = None
        self._boundary: Dict[str, Top] = {}  # the attributes as the latest forward pass began
        running = getattr(outer, "forward_running", None)
        self._clock = ForwardClock(model, running if callable(running) else _never)
        self._attributes = AttributeWatch(self._clock)
        # first among the pre-hooks of the model and of the wrapper the loop calls (whose run before
        # the model's): a pre-hook registered before or after this one runs after it
        modules = {id(m): m for m in (outer, model) if isinstance(m, nn.Module)}
        self._handles = []
        for m in modules.values():
            self._handles.append(m.register_forward_pre_hook(self._forward_starts, prepend=True))
            self._handles.append(m.register_forward_hook(self._forward_ends, always_call=True))
        self._snapshot()  # the digests' weights and layouts made now, not inside a step

    def __getstate__(self) -> Dict[str, Any]:
        """A copy of the model (``copy.deepcopy``, ``torch.save``) copies its hooks, and so this
        object: the copy watches no attribute (the watch is this model's)."""
        return {**self.__dict__, "_attributes": None}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._attributes = AttributeWatch(self._clock)

    def remove(self) -> None:
        """Stop watching (removes the hooks; the watched attributes' classes get their own
        entries back)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._before = None
        self._attributes.remove()

    def _entries(self, tops: Dict[str, Top]) -> Iterator[Tuple[str, str, torch.Tensor, Optional[str]]]:
        """(what, name, tensor, the attribute holding it) of each watched tensor."""
        for prefix, module in self._model.named_modules(remove_duplicate=False):
            dot = f"{prefix}." if prefix else ""
            kinds = [("buffer", module._buffers)] + ([("parameter", module._parameters)] if self._parameters else [])
            for what, container in kinds:
                yield from ((what, dot + key, t, None) for key, t in container.items() if t is not None)
        for top_name, top in tops.items():
            if self._attributes.watching(top.module, top.key):
                continue  # its reads are watched: a change in place reads it (no digest needed)
            held: List[Tuple[str, torch.Tensor]] = []
            held_tensors(top.value, top_name, held)
            yield from (("attribute", name, t, top_name) for name, t in held)

    def _snapshot(self) -> _Snapshot:
        """Each watched tensor by name, their digests stacked per device (a tensor under
        several names is hashed once), and the attributes holding tensors."""
        tops = attribute_tops(self._model, _NOT_STATE)
        seen: Dict[str, _Seen] = {}
        slots: Dict[int, int] = {}
        unique: Dict[torch.device, List[torch.Tensor]] = {}
        for what, name, t, top in self._entries(tops):
            if t.layout != torch.strided:
                continue
            if id(t) not in slots:
                slots[id(t)] = len(unique.setdefault(t.device, []))
                unique[t.device].append(t)
            seen[name] = _Seen(what, t, (t.dtype, tuple(t.shape), t.device), slots[id(t)], top)
        return _Snapshot(seen, {device: digests(ts) for device, ts in unique.items()}, tops)

    def _watch_assigned(self, names: List[str], tops: Dict[str, Top]) -> Set[str]:
        """Watch the attributes assigned since the last walk (``names``; ``tops``: this walk) from
        now on; returns those no longer compared by value: watched, or gone (nothing to read)."""
        done = set()
        for name in names:
            top = tops.get(name)
            if top is None or self._attributes.watch(top.module, top.path, top.key):
                done.add(name)
        return done

    def take(self) -> "Changes":
        """What changed since the first forward pass after the last call, and the carried reads;
        watching starts again at the next forward pass. No host synchronisation: a change of
        value is a device flag."""
        carried = self._attributes.take_carried()
        if self._before is None:
            return Changes(bool(carried), None, lambda: list(carried))
        (before, old, tops), after = self._before, self._snapshot()
        self._before = None
        assigned = self._watch_assigned(reassigned(tops, after.tops), after.tops)
        was = {n: s for n, s in before.items() if s.top not in assigned}
        now = {n: s for n, s in after.seen.items() if s.top not in assigned}
        pairs = [(n, b.slot, now[n].slot, b.kind[2]) for n, b in was.items() if n in now and b.kind == now[n].kind]
        compared = {}  # device -> (names, whether each digest differs)
        for device, digest in old.items():
            on = [p for p in pairs if p[3] == device]
            if on:
                compared[device] = ([p[0] for p in on], digest[[p[1] for p in on]] != after.digests[device][[p[2] for p in on]])
        structural = bool(carried) or was.keys() != now.keys() or len(pairs) != len(was)
        flags = [ne.any() for _, ne in compared.values()]
        flag = None if not flags else torch.stack([f.to(flags[0].device) for f in flags]).any()

        def names() -> List[str]:  # (waits for the device: for the refusal's message only)
            differs = {n for names_on, ne in compared.values() for n, d in zip(names_on, ne.tolist()) if d}
            changed: List[str] = list(carried)
            for name in {**was, **now}:  # the names before the forward pass first
                b, a = was.get(name), now.get(name)
                if b is not None and a is not None and b.kind == a.kind and name not in differs:
                    continue
                message = _changed(b, a, name, tops, after.tops)
                if message not in changed:  # a list attribute: named once
                    changed.append(message)
            return changed

        return Changes(structural, flag, names)

    def _forward_starts(self, _module: nn.Module, _args: Any) -> None:
        """The first forward pass after a step takes the values compared at the step; each later
        one first watches the attributes the forward passes before it assigned."""
        clock = self._clock
        clock.depth += 1
        if clock.depth > 1 or forward_replay() is not None:
            return
        if self._before is None:
            self._before = self._snapshot()
            self._boundary = self._before.tops
        else:
            tops = attribute_tops(self._model, _NOT_STATE)
            self._watch_assigned(reassigned(self._boundary, tops), tops)
            self._boundary = tops
        clock.forwards += 1

    def _forward_ends(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        self._clock.depth = max(0, self._clock.depth - 1)

    @staticmethod
    def refusal(changed: List[str]) -> ValueError:
        """The step's refusal for what :meth:`take` returned."""
        made = [c for c in changed if CARRIED not in c]
        carried = [c for c in changed if CARRIED in c]
        parts = []
        if made:
            parts.append(
                "; ".join(made) + " during the forward pass (from the step's first forward pass to step(): in "
                "place, through .data, by reassignment, in a hook or a backward pass): a change made from the data "
                "reaches the released model without noise (a running statistic kept in a buffer, "
                "nn.Embedding(max_norm=...), state kept across forward passes). Compute such values outside the "
                "model's forward pass, keep them out of the model, or freeze them"
            )
        if any(c.startswith("attribute ") for c in made):
            parts.append(
                "A tensor kept in a module attribute and changed in place (self.x.add_(...), self.x.append(...)) "
                "carries what one forward pass wrote into the next ones; to keep a value for inspection, assign a "
                "new one (self.x = value.detach()): an attribute that a forward pass assigns and no later forward "
                "pass reads is allowed"
            )
        if carried:
            parts.append(
                "; ".join(carried) + ": a value written by one forward pass was read by a later one (state "
                "carried across forward passes, e.g. a recurrent state self.h = f(x, self.h), or an attribute "
                "cache that feeds the next forward pass), so one batch's examples would reach another batch's "
                "gradients without being clipped with them. Keep such state out of the model, or clear it between "
                "steps (del module.h, or module.h = None) when its value is not needed"
            )
        held = ", but the model holds the change: do not release it (restore a checkpoint taken before the step)"
        return ValueError(
            "optimizer.step() refused: " + ". ".join(parts) + ". Nothing was released or charged"
            + (held if made else "") + "; call optimizer.zero_grad() before the next step"
        )


def _never() -> bool:
    return False


def _changed(before: Optional[_Seen], after: Optional[_Seen], name: str, then: Dict[str, Top],
             now: Dict[str, Top]) -> str:
    """A refusal's item for a watched tensor that changed between two walks (``then``, ``now``:
    their attributes): a parameter's or buffer's by name, an attribute's by its module and name
    (one kept across the forward passes was changed in place; one assigned is watched instead,
    unless its class serves the name with a property)."""
    seen = before or after
    if seen.what == "attribute":
        top = then.get(seen.top) or now[seen.top]
        kept = seen.top in then and seen.top in now and then[seen.top].value is now[seen.top].value
        how = "changed in place" if kept else "assigned, and its class serves the name with a descriptor (not watched)"
        return f"{describe(top.path, top.key, top.module)} was {how}"
    if before is None or after is None:
        how = "added" if before is None else "removed"
    else:
        how = "changed in place" if before.tensor is after.tensor else "replaced"
    return f"{seen.what} {name!r} was {how}"


__all__ = ["ForwardChanges", "check_no_max_norm", "digests", "watched_model"]
