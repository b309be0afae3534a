"""Half precision: every clipped sum reaches the noise in float32 (issue 52).

Rounding a batch's clipped sum ``S = sum_i c_i g_i`` to bf16 (8 significant bits) moves it by up
to ``2^-9 ||S||``: with a thousand aligned examples, far more than the bound C that the noise
covers (removing one of 1,029 aligned rows moved the sum by 1.2 to 3.1 C on a linear model, 8 C
in the issue). Per-example values may stay in
half precision (each clipped one still has norm about C); the sums over examples, micro-batches
and ranks are float32 or wider (``torch.promote_types(p.dtype, float32)``). Under DDP the ranks'
float32 sums are all-reduced before they are rounded, under FSDP2 reduce-scattered in float32
(:mod:`opacus_rc.optimizer`, :mod:`opacus_rc.forms.fsdp`).

A *half-precision call* of a trainable layer is one that computes in half precision: a trainable
parameter of it is half precision, autocast runs a half dtype, or a floating input is half.
Autograd's own batch gradient in such a call is a half-precision sum, rounded once (a matmul) or
at every term (CPU's bf16 embedding and layer-norm kernels: 65% and 73% off at 1,029 rows), so in
such a call **autograd computes no parameter gradient inside the layer**, in either pass:

* linear layers (and Hugging Face ``Conv1D``) defer their weight gradient
  (:class:`opacus_rc.grad_sample._LinearDeferredWeightGrad`): the two-pass forms' clipped pass
  sums ``G^T A`` in float32 and hands it to the form (:meth:`ClippedPassSums.deliver`);
* every other trainable layer runs with its parameters behind :class:`_WithoutInModuleGrad`;
  the form computes their clipped sums from per-example values it has anyway (the two-pass
  forms: the norm pass's, times the clip factors; book-keeping: its records and Opacus's
  per-sample gradients).

Autograd's ``p.grad`` after such a pass holds only uses outside the layers: any nonzero entry
is refused by the clip guard, exactly (a comparison with a half-precision batch sum could not
tell an outside use from that sum's error).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

HALF = (torch.float16, torch.bfloat16)


def autocasts_to_half(device_type: str) -> bool:
    """Autocast is on for ``device_type`` with a half-precision dtype."""
    return torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) in HALF


def computes_in_half(params: Iterable[torch.Tensor], inputs: Any) -> bool:
    """Whether a call of a layer with trainable ``params`` on ``inputs`` computes in half precision
    (module docstring)."""
    params = list(params)
    if any(p.dtype in HALF for p in params):
        return True
    device = params[0].device.type if params else None
    if device is not None and torch.amp.is_autocast_available(device) and autocasts_to_half(device):
        return True
    return any(isinstance(t, torch.Tensor) and t.dtype in HALF for t in tree_leaves(inputs))


def in_function_transform() -> bool:
    """Inside a ``torch.func`` transform (Opacus's functorch per-sample gradients call the layer
    there): the layer runs as it is."""
    return torch._C._functorch.peek_interpreter_stack() is not None


class OwnerRef:
    """A weak reference to the grad-sample module a patched forward consults; a pickled or
    deep-copied layer (``torch.save(model)``, Opacus's functorch copies) holds a dead one, and
    runs as its own forward."""

    def __init__(self, owner: Any = None) -> None:
        self._ref = None if owner is None else weakref.ref(owner)

    def __call__(self) -> Any:
        return None if self._ref is None else self._ref()

    def __getstate__(self) -> dict:
        return {"_ref": None}

    def __deepcopy__(self, memo: dict) -> "OwnerRef":
        return OwnerRef()


class _WithoutInModuleGrad(torch.autograd.Function):
    """Identity on a parameter whose backward returns nothing: the layer's own use of it gives it
    no gradient (the layer's output still requires grad)."""

    @staticmethod
    def forward(ctx, param: torch.Tensor) -> torch.Tensor:
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> None:
        return None


def forward_without_in_module_grads(
    owner: OwnerRef, layer: nn.Module, original: Optional[Callable], *args: Any, **kwargs: Any
) -> Any:
    """The forward of a trainable layer (not a linear one): in a call whose in-module gradients the
    form computes itself (``owner().strips_in_module_grads``: a half-precision call of a training pass;
    book-keeping's tied parameters), its trainable parameters are behind :class:`_WithoutInModuleGrad`
    for the call; otherwise the layer's own forward, unchanged. ``original``: an instance-level
    forward the layer had, if any."""
    forward = original if original is not None else type(layer).forward.__get__(layer)
    module = owner()
    if module is None or in_function_transform() or not module.strips_in_module_grads(layer, (args, kwargs)):
        return forward(*args, **kwargs)
    params = layer._parameters
    own = {name: p for name, p in params.items() if p is not None and p.requires_grad}
    try:
        params.update({name: _WithoutInModuleGrad.apply(p) for name, p in own.items()})
        return forward(*args, **kwargs)
    finally:
        params.update(own)


def mixed_precision_error(layer: nn.Module) -> ValueError:
    """The refusal of a layer called in half precision and in float32 within one step."""
    return ValueError(
        f"{type(layer).__name__} was called both in half precision and in float32 (autocast on and off, "
        "or inputs of both precisions) between two optimizer steps: its clipped sum would come partly "
        "from autograd and partly from the privacy engine's float32 sums. Call each layer in one "
        "precision per step"
    )


def check_no_mean_in_half(loss_reduction: str, gradient: torch.Tensor, rows: int) -> None:
    """Refuse a half-precision output gradient of a loss averaged over ``rows > 1`` examples
    (``loss_reduction="mean"``): it carries the factor ``1/n`` of the realised batch, rounded to
    half precision with every example's gradient, so removing one example moves every other
    example's clipped contribution (4.4 C at 1,029 aligned rows). The plugin's own criteria and
    the private Trainer sum the losses in their backward passes and never meet this."""
    if loss_reduction == "mean" and rows > 1 and gradient.dtype in HALF:
        raise mean_in_half_error()


def mean_over_rows(per_sample: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """``per_sample`` averaged over its rows (``dim``: the batch dimension only; None: all), and
    0 over no rows: ``sum_i l_i / max(1, n)``. An empty Poisson share (an empty draw, a rank
    without rows under DDP or FSDP2) has the sum over no rows, not torch's ``0 / 0 = NaN``; its
    gradient, and so the release, is the same either way (there is no row to weight)."""
    if per_sample.shape[0] == 0:
        return per_sample.sum() if dim is None else per_sample.sum(dim=dim)
    return per_sample.mean() if dim is None else per_sample.mean(dim=dim)


def reduced_for_backward(per_sample: torch.Tensor, shown: str, backward: str) -> torch.Tensor:
    """The per-example losses reduced as ``shown`` (the value the script reads) with the gradient
    of their reduction as ``backward`` (the module's): under ``shown="mean"``, ``backward="sum"``
    the mean's value and the sum's gradient (no ``1/n`` in any example's gradient). The mean of
    no rows (an empty Poisson share or draw) is 0, not NaN (:func:`mean_over_rows`)."""
    total = per_sample.sum(dim=0)
    if backward == "mean":
        return mean_over_rows(per_sample, dim=0)
    if shown == "sum":
        return total
    return total - total.detach() + total.detach() / max(1, per_sample.shape[0])


def mean_in_half_error() -> ValueError:
    """:func:`check_no_mean_in_half`'s refusal."""
    return ValueError(
        "loss_reduction='mean' with a model that computes in half precision (bf16/fp16 parameters or "
        "autocast) and several examples per backward pass: the mean's factor 1/n (n the realised batch, "
        "which one example changes) is rounded to half precision into every example's gradient, so one "
        "example moves the others' clipped contributions (up to 4.4 C at 1,029 aligned rows), beyond the "
        "bound the noise covers. Accepted: the ghost criterion make_private returns (grad_sample_mode='ghost', "
        "or bookkeeping=True with it: it sums the losses in its backward pass), loss_reduction='sum' with a "
        "summed loss (the update is then the noisy sum: divide the learning rate by the expected batch size), "
        "per_example_backward=True (one example per backward pass), or a float32 model"
    )


class HalfPrecisionCalls:
    """The layers called in half precision since the last step (in call order: the same on every
    rank), and those called otherwise; a layer in both is refused (:func:`mixed_precision_error`)."""

    def __init__(self) -> None:
        self.layers: Dict[int, nn.Module] = {}
        self._other: Dict[int, nn.Module] = {}

    def note(self, layer: nn.Module, half: bool) -> bool:
        """A training call of ``layer``, in half precision or not; returns ``half``."""
        seen, other = (self.layers, self._other) if half else (self._other, self.layers)
        if id(layer) in other:
            raise mixed_precision_error(layer)
        seen[id(layer)] = layer
        return half

    def __contains__(self, layer: nn.Module) -> bool:
        return id(layer) in self.layers

    def clear(self) -> None:
        self.layers.clear()
        self._other.clear()


class ClippedPassSums:
    """The float32 clipped sums of one clipped pass, by (layer, parameter name), until the pass has
    ended (:meth:`take`) or failed (:meth:`clear`). A sharded form turns each into its shard as it
    is delivered (``shard``)."""

    def __init__(self, shard: Optional[Callable[[nn.Module, str, torch.Tensor], torch.Tensor]] = None) -> None:
        self._sums: Dict[Tuple[int, str], Tuple[nn.Module, str, torch.Tensor]] = {}
        self._shard = shard

    def deliver(self, layer: nn.Module, name: str, total: torch.Tensor) -> None:
        """``total``: the clipped sum of ``layer``'s parameter ``name`` over this pass's examples (one
        use of the layer; a later use adds to it)."""
        if self._shard is not None:
            total = self._shard(layer, name, total)
        key = (id(layer), name)
        held = self._sums.get(key)
        self._sums[key] = (layer, name, total if held is None else held[2].add_(total))

    def take(self) -> List[Tuple[nn.Module, str, torch.Tensor]]:
        """The pass's sums, ``(layer, name, sum)``; forgotten here."""
        sums, self._sums = list(self._sums.values()), {}
        return sums

    def clear(self) -> None:
        self._sums.clear()

    def __len__(self) -> int:
        return len(self._sums)


__all__ = [
    "HALF", "ClippedPassSums", "HalfPrecisionCalls", "OwnerRef", "autocasts_to_half", "computes_in_half",
    "forward_without_in_module_grads", "in_function_transform", "mean_over_rows", "mixed_precision_error",
]
