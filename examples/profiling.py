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
        self._preexisting: set = set()

    def _release(self, key: Any) -> None:
        self.live -= self._sizes.pop(key, 0)

    @staticmethod
    def _key(tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        if tensor.device.type == "meta":
            return id(storage)
        return (tensor.device, storage.data_ptr())

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = self._key(tensor)
        nbytes = storage.nbytes()
        if nbytes == 0 or key in self._sizes or key in self._preexisting:
            return  # empty, already counted, or a view of memory allocated before
        self._sizes[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and self._key(t) not in self._sizes:
                self._preexisting.add(self._key(t))
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


class NormSamplerMemory:
    """Records the peak bytes of every norm-sampler call of a fast-gradient-clipping
    grad-sample module (Opacus ghost or randomized): ``peak`` is the largest single
    layer's norm computation, ``total`` their sum over one backward pass.

    Usage: ``with NormSamplerMemory(module) as mem: loss.backward()``.
    """

    def __init__(self, module: Any) -> None:
        self.module = module
        self.calls: list = []

    def _measured(self, fn: Callable) -> Callable:
        def run(*args, **kwargs):
            with PeakAllocationCounter() as counter:
                out = fn(*args, **kwargs)
            self.calls.append(counter.peak)
            return out

        return run

    def __enter__(self) -> "NormSamplerMemory":
        self._had_instance_table = "NORM_SAMPLERS" in vars(self.module)
        self._saved = self.module.NORM_SAMPLERS
        self.module.NORM_SAMPLERS = {k: self._measured(f) for k, f in self._saved.items()}
        return self

    def __exit__(self, *exc) -> None:
        if self._had_instance_table:
            self.module.NORM_SAMPLERS = self._saved
        else:
            del self.module.NORM_SAMPLERS

    @property
    def peak(self) -> int:
        return max(self.calls, default=0)

    @property
    def total(self) -> int:
        return sum(self.calls)
