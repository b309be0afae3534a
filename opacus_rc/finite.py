"""Refusing a step that met a non-finite value, without stalling the device.

Every check (per-sample loss, per-sample norm, clipped gradient) folds into a device-side flag
(:class:`NonFiniteGuard`), decided once per step after clipping and before the update: an
optimizer that can skip an update on the device (``found_inf``: PyTorch's fused SGD, Adam and
AdamW) gets the flag, and a refusal is raised at the next ``step()``; any other costs one host
synchronisation per step and raises at once. In a distributed run the flag is agreed (MIN
all-reduce, a rank check of :mod:`opacus_rc.ranks`), so every rank refuses together, and a rank
that raised before it makes the others refuse. Why and how: docs/robustness.md.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch

from .ranks import FLAG_TRUE, RAISED, agree_flag, join_failed

#: What the flags watch, in the order a refusal names them. The fourth is not a finiteness
#: check: the norm pass's in-module gradient check (a parameter used outside its module's
#: forward), decided with the others, refused as a ValueError.
OUTSIDE_USE = "in-module gradient"
#: Not a finiteness check either: a forward pass changed a parameter or buffer
#: (:mod:`opacus_rc.forward_changes`), decided here only when the ranks must agree.
FORWARD_CHANGE = "forward-pass change"
#: Nor this: another rank raised before the step's agreement (:mod:`opacus_rc.ranks`).
RANK_ERROR = "error on another rank"
KINDS = ("per-sample loss", "per-sample gradient norm", "clipped gradient", OUTSIDE_USE, FORWARD_CHANGE, RANK_ERROR)


def all_finite(tensors: Iterable[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    """A 0-d bool tensor on the first tensor's device: every entry of every tensor is
    finite (None when there is nothing to check). No host synchronisation."""
    flags = [torch.isfinite(local_shard(t)).all() for t in tensors if t is not None and t.numel() > 0]
    if not flags:
        return None
    return torch.stack([f.to(flags[0].device) for f in flags]).all()


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class NonFiniteGuard:
    """Device-side flags of one step, one per kind in :data:`KINDS`, and the refusals
    decided on the device whose report has not reached the host yet."""

    def __init__(self) -> None:
        self._flags: Dict[str, torch.Tensor] = {}
        self._pending: List[Tuple[torch.Tensor, Optional[torch.cuda.Event], Dict[str, torch.Tensor]]] = []

    def note(self, kind: str, tensors: Iterable[Optional[torch.Tensor]]) -> None:
        """Fold "every entry of ``tensors`` is finite" into the step's ``kind`` flag."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} is not supported; accepted values: {', '.join(map(repr, KINDS))}")
        ok = all_finite(tensors)
        if ok is None:
            return
        previous = self._flags.get(kind)
        self._flags[kind] = ok if previous is None else previous & ok.to(previous.device)

    def take(self, device: torch.device, distributed: bool) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """The step's combined flag (True: all finite; agreed across ranks when ``distributed``,
        a rank check of :mod:`opacus_rc.ranks`, whose :data:`RANK_ERROR` flag is False when
        another rank raised before it) and the per-kind flags; the guard starts the next step
        empty. No host synchronisation."""
        flags, self._flags = self._flags, {}
        ok = torch.ones((), dtype=torch.bool, device=device)
        for flag in flags.values():
            ok = ok & flag.to(device)
        if not distributed:
            return ok, flags
        code = agree_flag(ok)
        flags[RANK_ERROR] = code != RAISED
        return code == FLAG_TRUE, flags

    def join_failed(self, device: torch.device) -> None:
        """This rank raised before the step's rank check: it takes part with the failure flag
        (:func:`opacus_rc.ranks.join_failed`); the step's flags are dropped."""
        self._flags = {}
        join_failed(lambda failed: agree_flag(torch.ones((), dtype=torch.bool, device=device), failed=failed))

    def defer(self, ok: torch.Tensor, flags: Dict[str, torch.Tensor]) -> None:
        """Keep ``ok`` for a later report: copied to host memory without waiting (CUDA:
        pinned buffer, non-blocking copy and an event marking its arrival)."""
        if ok.device.type == "cuda":
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(ok, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending.append((host, event, flags))
        else:
            self._pending.append((ok.detach().cpu(), None, flags))

    def arrived_refusal(self, wait: bool = False) -> Optional[str]:
        """The failing kinds of the oldest deferred refusal whose flag has reached the
        host (a description), or None. Waits for the device only if ``wait``."""
        while self._pending:
            host, event, flags = self._pending[0]
            if event is not None and not event.query():
                if not wait:
                    return None
                event.synchronize()
            self._pending.pop(0)
            if not bool(host.numpy()):  # a host tensor: a plain memory read, no device synchronisation
                self._pending.clear()
                return failed_kinds(flags)
        return None


def failed_kinds(flags: Dict[str, torch.Tensor]) -> str:
    """The kinds whose flag is False ("on another rank" when none failed here). Reads
    device flags: only for a refusal already decided."""
    failed = [kind for kind in KINDS if kind in flags and not bool(flags[kind])]
    return " and ".join(failed) if failed else "value on another rank"
