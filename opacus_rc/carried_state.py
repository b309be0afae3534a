"""Module attributes that forward passes assign: allowed unless a later forward pass reads them
(docs/forms.md, "What every form enforces").

A value a forward pass keeps in a plain module attribute for inspection (``self.last_attn =
attn.detach()``) reaches no gradient. A value one forward pass writes and a later training
forward pass reads (a recurrent state ``self.h = f(x, self.h)``, an attribute cache that feeds
the next forward pass) carries one batch's examples into another batch's gradients, without
their clip: that step is refused by name.

:class:`AttributeWatch` is told which attributes were assigned (by
:class:`~opacus_rc.forward_changes.ForwardChanges`, at each forward pass after the step's first
and at the step: before any later forward pass runs) and from then on sees each read and write
of those names on those modules, through a data descriptor (:class:`_WatchedName`) put on the
module's class for that one name while it is watched. The module's type, its ``state_dict``,
``copy.deepcopy`` and ``torch.save`` are unchanged (the value stays in the instance's
``__dict__``; a copy is not watched); other attributes and other modules cost nothing.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

#: what a module attribute holds when it can hold a watched tensor
HOLDERS = (torch.Tensor, list, tuple, dict)
#: the words of a refusal's item for a read of a value an earlier forward pass wrote
CARRIED = "was read by a later training forward pass"
_MISSING = object()


def held_tensors(value: Any, name: str, out: List[Tuple[str, torch.Tensor]], depth: int = 0) -> None:
    """Append the tensors a module attribute holds, itself or in lists, tuples and dicts (3
    levels), to ``out``, each with its name (``name``, ``name[key]``, ...)."""
    if isinstance(value, torch.Tensor):
        if not isinstance(value, nn.Parameter):  # those: as parameters
            out.append((name, value))
    elif depth < 3:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if issubclass(type(item), HOLDERS):
                held_tensors(item, f"{name}[{key!r}]", out, depth + 1)


def holds_tensor(value: Any) -> bool:
    """Whether ``value`` (a module attribute) holds a tensor :func:`held_tensors` would find."""
    if not issubclass(type(value), HOLDERS):
        return False
    found: List[Tuple[str, torch.Tensor]] = []
    held_tensors(value, "", found)
    return bool(found)


def describe(path: str, key: str, module: Optional[nn.Module]) -> str:
    """``attribute 'key' of module 'path' (Class)``, the way refusals name an attribute."""
    kind = "" if module is None else f" ({type(module).__name__})"
    where = "of the model" if not path else f"of module {path!r}"
    return f"attribute {key!r} {where}{kind}"


class ForwardClock:
    """The watched model's forward passes: how many began (outermost calls of the model, a
    checkpoint's replay not counted), whether one is running, and the carried reads seen.

    Args:
        model: the user's model (its ``training`` flag tells a training forward pass).
        running: whether a forward pass of any of the model's modules runs (a submodule called
            alone, e.g. a chunked head); the model's own calls are counted here.
    """

    def __init__(self, model: nn.Module, running: Callable[[], bool]) -> None:
        self.model = model
        self.forwards = 0
        self.depth = 0
        self._running = running
        #: the step's refusal items: reads of a value an earlier forward pass wrote
        self.carried: List[str] = []

    def in_forward(self) -> bool:
        """A forward pass of the model (or of a module of it called alone) is running."""
        return self.depth > 0 or self._running()

    def in_training_forward(self) -> bool:
        """A forward pass whose reads can reach a gradient: in train mode, gradients on."""
        return self.model.training and torch.is_grad_enabled() and self.in_forward()


class _Marks:
    """One watched module: its name in the model and, per watched attribute, the number of the
    forward pass that wrote its value (None: none did, or it holds no tensor)."""

    __slots__ = ("module", "path", "written", "clock")

    def __init__(self, module: nn.Module, path: str, clock: ForwardClock) -> None:
        self.module = weakref.ref(module)
        self.path = path
        self.written: Dict[str, Optional[int]] = {}
        self.clock = clock

    def read(self, key: str) -> None:
        """A read of ``key``: noted for the step's refusal when a training forward pass reads
        a value that an earlier forward pass wrote."""
        written, clock = self.written.get(key), self.clock
        if written is not None and written < clock.forwards and clock.in_training_forward():
            item = (f"{describe(self.path, key, self.module())} {CARRIED} (forward pass {clock.forwards} since "
                    f"make_private) than the one that wrote its value ({written})")
            if item not in clock.carried:
                clock.carried.append(item)

    def wrote(self, key: str, value: Any) -> None:
        """A write of ``key``: a forward pass's marks the value as its own. A write outside any
        forward pass (the loop's) keeps the mark unless it leaves no tensor: a tensor the loop
        assigns may carry an earlier forward pass's value (``model.h = model.h.detach()``)."""
        if not holds_tensor(value):
            self.written[key] = None
        elif self.clock.in_forward():
            self.written[key] = self.clock.forwards


class _WatchedName:
    """A data descriptor put on a watched module's class for one attribute name: it keeps the
    value in the instance's ``__dict__``, as Python would, and tells the instance's
    :class:`_Marks` (when it is watched) of each read, write and deletion. Instances that are
    not watched, and reads of the class itself, see what they saw before."""

    def __init__(self, cls: type, key: str) -> None:
        self.cls, self.key = cls, key
        self.shadowed = cls.__dict__.get(key, _MISSING)  # put back when the last watch ends
        self.marks: Dict[int, _Marks] = {}

    def _marks_of(self, obj: Any) -> Optional[_Marks]:
        marks = self.marks.get(id(obj))
        return marks if marks is not None and marks.module() is obj else None

    def __get__(self, obj: Any, objtype: Optional[type] = None) -> Any:
        if obj is None:
            return self._inherited(objtype or self.cls, None)
        try:
            value = obj.__dict__[self.key]
        except KeyError:
            return self._inherited(type(obj), obj)
        marks = self._marks_of(obj)
        if marks is not None:
            marks.read(self.key)
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.key] = value
        marks = self._marks_of(obj)
        if marks is not None:
            marks.wrote(self.key, value)

    def __delete__(self, obj: Any) -> None:
        try:
            del obj.__dict__[self.key]
        except KeyError:
            raise AttributeError(self.key) from None
        marks = self._marks_of(obj)
        if marks is not None:
            marks.written[self.key] = None

    def _inherited(self, cls: type, obj: Any) -> Any:
        """What the class gives for the name without this descriptor: its own entry, then its
        bases' (an AttributeError, for ``nn.Module.__getattr__``, when there is none)."""
        found = self.shadowed
        if found is _MISSING:
            mro = cls.__mro__
            found = next((base.__dict__[self.key] for base in mro[mro.index(self.cls) + 1:]
                          if self.key in base.__dict__), _MISSING)
        if found is _MISSING:
            raise AttributeError(self.key)
        get = getattr(type(found), "__get__", None)
        return found if get is None else get(found, obj, cls)


#: the descriptors installed, by (class, name): shared by every watch of a class's instances
_INSTALLED: Dict[Tuple[type, str], _WatchedName] = {}


def _watchable(cls: type, key: str) -> bool:
    """Whether reads of ``key`` on instances of ``cls`` can be watched: no data descriptor of
    the class's own (a property) serves the name."""
    for base in cls.__mro__:
        found = base.__dict__.get(key, _MISSING)
        if found is not _MISSING:
            return isinstance(found, _WatchedName) or not (
                hasattr(type(found), "__set__") or hasattr(type(found), "__delete__"))
    return True


class AttributeWatch:
    """The attributes forward passes of the model assigned, watched from when :meth:`watch`
    is called: a later training forward pass that reads a value an earlier one wrote is noted
    in ``clock.carried`` (the step refuses it)."""

    def __init__(self, clock: ForwardClock) -> None:
        self.clock = clock
        self._marks: Dict[int, _Marks] = {}
        self._installed: List[Tuple[_WatchedName, int]] = []

    def watch(self, module: nn.Module, path: str, key: str) -> bool:
        """Watch ``module.key`` from now on; its value was written by the latest forward pass
        (or by the loop after it: counted as that forward pass's). Already watched: its marks
        stay (they saw every write). False when it cannot be watched (:func:`_watchable`)."""
        if self.watching(module, key):
            return True
        marks = self._marks.get(id(module))
        cls = type(module)
        if not _watchable(cls, key):
            return False
        if marks is None or marks.module() is not module:
            marks = self._marks[id(module)] = _Marks(module, path, self.clock)
        descriptor = _INSTALLED.get((cls, key))
        if descriptor is None:
            descriptor = _INSTALLED[(cls, key)] = _WatchedName(cls, key)
            setattr(cls, key, descriptor)
        descriptor.marks[id(module)] = marks
        self._installed.append((descriptor, id(module)))
        marks.written[key] = self.clock.forwards if holds_tensor(module.__dict__.get(key)) else None
        return True

    def watching(self, module: nn.Module, key: str) -> bool:
        """Whether ``module.key`` is watched (its reads and writes seen: no digest needed)."""
        marks = self._marks.get(id(module))
        return marks is not None and marks.module() is module and key in marks.written

    def take_carried(self) -> List[str]:
        """The carried reads seen since the last call (the step's refusal items)."""
        carried, self.clock.carried = self.clock.carried, []
        return carried

    def remove(self) -> None:
        """Stop watching: each class gets its own entry back once no watch uses the name."""
        for descriptor, ident in self._installed:
            if ident in descriptor.marks and descriptor.marks[ident] is self._marks.get(ident):
                del descriptor.marks[ident]
            if not descriptor.marks and _INSTALLED.get((descriptor.cls, descriptor.key)) is descriptor:
                del _INSTALLED[(descriptor.cls, descriptor.key)]
                if descriptor.shadowed is _MISSING:
                    delattr(descriptor.cls, descriptor.key)
                else:
                    setattr(descriptor.cls, descriptor.key, descriptor.shadowed)
        self._installed, self._marks = [], {}


class Top(NamedTuple):
    """A plain module attribute that holds (or can hold) a tensor, as one walk of the model saw it."""

    module: nn.Module
    path: str  # the module's name in the model
    key: str
    value: Any  # held, so that identity stays meaningful


def attribute_tops(model: nn.Module, not_state: frozenset) -> Dict[str, Top]:
    """Each plain attribute (not a parameter, buffer, submodule or a name in ``not_state``) of
    ``model``'s modules that holds a tensor, or a list, tuple or dict that could (an empty list
    that a forward pass appends to is the same object after it), by its name in the model
    (``"block.h"``)."""
    tops: Dict[str, Top] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for key, value in module.__dict__.items():
            if key not in not_state and issubclass(type(value), HOLDERS):
                tops[f"{prefix}.{key}" if prefix else key] = Top(module, prefix, key, value)
    return tops


def reassigned(then: Dict[str, Top], now: Dict[str, Top]) -> List[str]:
    """The attributes assigned between two walks: another object now, added or removed."""
    return [name for name in {**then, **now}
            if name not in then or name not in now or then[name].value is not now[name].value]


__all__ = [
    "CARRIED", "HOLDERS", "AttributeWatch", "ForwardClock", "Top", "attribute_tops", "describe", "held_tensors",
    "holds_tensor", "reassigned",
]
