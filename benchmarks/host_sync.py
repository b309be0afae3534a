"""Count the operations that make the host wait for the device, on any device.

On CUDA, ``torch.cuda.set_sync_debug_mode`` reports host synchronisations; on a CPU there
is nothing to wait for, so the same code paths are checked by what they ask for instead:
a Python value read out of a tensor (``aten._local_scalar_dense``: ``.item()``,
``bool(t)``, ``int(t)``, ``if t:``) or an output whose *shape* depends on the data
(``nonzero``, ``unique``, ``masked_select``, boolean indexing, ...). On CUDA each of these
blocks the host until the device has caught up.

    with HostSyncCounter() as syncs:
        step()
    syncs.count, syncs.where   # how many, and the first frame outside torch of each

Reads of a host buffer filled by an asynchronous copy (``Tensor.numpy()`` on a CPU
tensor) are not operations on a device tensor and are not counted, as on CUDA.
"""

from __future__ import annotations

import traceback
from collections import Counter
from typing import Any, Dict, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten

#: Operations whose result the host must wait for (value or data-dependent shape).
SYNCING_OPS = {
    _aten._local_scalar_dense.default,
    _aten.is_nonzero.default,
    _aten.equal.default,
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten._unique.default,
    _aten._unique2.default,
    _aten.unique_dim.default,
    _aten.unique_consecutive.default,
    _aten.unique_dim_consecutive.default,
    _aten.repeat_interleave.Tensor,
}
_INDEXING_OPS = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default}


def _bool_index(args: Any) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def _caller() -> str:
    """The innermost frame outside torch's own modules: where the sync was asked for."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        name = frame.filename.replace("\\", "/")
        if "/torch/" not in name and not name.endswith("host_sync.py"):
            return f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{frame.lineno} {frame.name}"
    return "?"


class HostSyncCounter(TorchDispatchMode):
    """Counts syncing operations run while active (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.where: List[str] = []

    @property
    def count(self) -> int:
        return len(self.where)

    def by_site(self) -> Dict[str, int]:
        return dict(Counter(self.where))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCING_OPS or (func in _INDEXING_OPS and _bool_index(args)):
            self.where.append(f"{func.__name__} at {_caller()}")
        return func(*args, **(kwargs or {}))
