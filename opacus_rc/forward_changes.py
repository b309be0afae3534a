"""Refusing a step after a forward pass changed the model in place (docs/forms.md, "What every
form enforces").

A change a forward pass makes to a parameter or buffer depends on the example it saw and
reaches the released model without noise (``nn.Embedding(max_norm=...)``, a running statistic
kept in a buffer). :class:`ForwardChanges` watches the model's parameters and buffers across
each outermost forward pass (each tensor's version counter and identity; a buffer registered
during the forward counts too); the optimizer refuses the next ``step()`` by name. Changes
between forward passes are not watched. :func:`check_no_max_norm` refuses
``nn.Embedding(max_norm=...)`` at ``make_private``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

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


#: (what, name, the module's dict of them, key) of a watched tensor
_Slot = Tuple[str, str, Dict[str, Any], str]


def _sharded(model: nn.Module) -> bool:
    """Whether FSDP2's ``fully_shard`` wraps a module of ``model`` (its forward swaps the
    parameters' shards in and out)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


class ForwardChanges:
    """Watches ``model``'s parameters (``parameters=False``: buffers only, for FSDP2,
    whose forward swaps the shards of the parameters in and out) and buffers across its
    outermost forward passes; :meth:`take` returns what they changed.

    Args:
        model: the user's model (see :func:`watched_model`).
        parameters: whether parameters are watched as well as buffers (None: unless
            FSDP2 shards the model).
    """

    def __init__(self, model: nn.Module, parameters: Optional[bool] = None) -> None:
        if parameters is None:
            parameters = not _sharded(model)
        self._slots: List[_Slot] = []
        self._containers: List[Dict[str, Any]] = []
        for prefix, module in model.named_modules(remove_duplicate=False):
            kinds = [("buffer", module._buffers)] + ([("parameter", module._parameters)] if parameters else [])
            for what, container in kinds:
                self._containers.append(container)
                for key in container:
                    self._slots.append((what, f"{prefix}.{key}" if prefix else key, container, key))
        self._depth = 0
        self._before: List[Any] = []
        self._sizes: List[int] = []
        self._changed: List[str] = []
        self._handles = [
            model.register_forward_pre_hook(self._forward_starts),
            model.register_forward_hook(self._forward_ends, always_call=True),
        ]

    def remove(self) -> None:
        """Stop watching (removes the hooks)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def take(self) -> List[str]:
        """What forward passes changed since the last call (``"buffer 'm.running' was changed
        in place"``, ...); the list starts empty again."""
        changed, self._changed = self._changed, []
        return changed

    def _forward_starts(self, _module: nn.Module, _args: Any) -> None:
        self._depth += 1
        if self._depth == 1:
            self._before = [self._state(slot) for slot in self._slots]
            self._sizes = [len(container) for container in self._containers]

    def _forward_ends(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth:
            return
        for slot, before in zip(self._slots, self._before):
            change = _change(slot, before, self._state(slot))
            if change is not None and change not in self._changed:
                self._changed.append(change)
        if [len(container) for container in self._containers] != self._sizes:
            self._changed.append("a parameter or buffer was registered")
        self._before = []

    @staticmethod
    def _state(slot: _Slot) -> Tuple[Any, int]:
        tensor = slot[2].get(slot[3])
        return tensor, (-1 if tensor is None else tensor._version)

    @staticmethod
    def refusal(changed: List[str]) -> ValueError:
        """The step's refusal for what :meth:`take` returned."""
        return ValueError(
            "optimizer.step() refused: " + "; ".join(changed) + " during the forward pass: a change "
            "made from the data reaches the released model without noise (a running statistic "
            "kept in a buffer, nn.Embedding(max_norm=...)). Compute such values outside the "
            "model's forward pass, keep them out of the model, or freeze them. Nothing was "
            "released or charged; call optimizer.zero_grad() before the next step"
        )


def _change(slot: _Slot, before: Tuple[Any, int], after: Tuple[Any, int]) -> Any:
    what, name = slot[0], slot[1]
    if before[0] is not after[0]:
        return f"{what} {name!r} was replaced"
    if before[1] != after[1]:
        return f"{what} {name!r} was changed in place"
    return None


__all__ = ["ForwardChanges", "check_no_max_norm", "watched_model"]
