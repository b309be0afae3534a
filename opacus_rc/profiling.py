"""Allocation-level measurements that do not depend on wall time or the allocator.

:class:`PeakAllocationCounter` is a ``TorchDispatchMode`` that sees every tensor an
operator creates, adds its storage's bytes to a live total and subtracts them when the
storage is freed; ``peak`` is the largest live total (bytes newly allocated inside the
context, inputs excluded). It works on every device, including the meta device, so it
measures the memory of a norm computation at shapes that would not fit in RAM.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakAllocationCounter(TorchDispatchMode):
    """Counts the peak of live bytes allocated by operators run inside the context."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: Dict[Any, int] = {}

    def _release(self, key: Any) -> None:
        self.live -= self._sizes.pop(key, 0)

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr()) if tensor.device.type != "meta" else id(storage)
        nbytes = storage.nbytes()
        if nbytes == 0 or key in self._sizes:
            return
        self._sizes[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


def peak_allocated_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes newly allocated while running ``fn()`` (its result included)."""
    with PeakAllocationCounter() as counter:
        result = fn()
    del result
    return counter.peak
