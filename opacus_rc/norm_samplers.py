"""Per-layer norm samplers for randomized clipping.

A norm sampler has the signature of Opacus's ghost-clipping norm samplers plus the
run's :class:`~opacus_rc.sketch.Sketcher`:
``(layer, activations, backprops, sketcher) -> {parameter: per-sample norm (B,)}``.
Opacus combines the per-parameter norms with an L2 norm, so exact and estimated parts
add up in the squared norm. Layers without a randomized norm sampler go through
Opacus's exact per-sample gradient machinery (grad samplers or functorch).

* ``nn.Linear``: weight estimated by the sketch (exactly, by the ghost formula, when the
  sequence is no longer than the sketch, T <= k, and ``exact_when_cheaper`` is on: then
  exact is cheaper in FLOPs and memory); bias exact.
* ``nn.Embedding``: exact (sort and segment sums on the device, cheap).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Dict, List, Sequence, Tuple, Type, Union

import torch
from torch import nn

from .estimators import (
    as_sequences,
    at_least_float32,
    bias_grads,
    bias_sq_norms,
    embedding_sq_norms,
    ghost_sq_norms,
    sketched_product,
)
from .sketch import Sketcher

NormSampler = Callable[
    [nn.Module, List[torch.Tensor], torch.Tensor, Sketcher], Dict[nn.Parameter, torch.Tensor]
]
RANDOMIZED_NORM_SAMPLERS: Dict[Type[nn.Module], NormSampler] = {}


def _registering(table: Dict[Type[nn.Module], Callable], what: str):
    """A decorator factory registering functions in ``table`` for layer type(s)."""

    def register(target: Union[Type[nn.Module], Sequence[Type[nn.Module]]]):
        def decorator(fn: Callable) -> Callable:
            table.update(dict.fromkeys(target if isinstance(target, Sequence) else [target], fn))
            return fn

        return decorator

    register.__doc__ = f"Decorator registering {what} for layer type(s)."
    return register


register_randomized_norm_sampler = _registering(RANDOMIZED_NORM_SAMPLERS, "a randomized-clipping norm sampler")


def weight_sq_norms(activations: torch.Tensor, backprops: torch.Tensor, sketcher: Sketcher, key=None) -> torch.Tensor:
    """Per-sample ``||A_i^T G_i||_F^2``: sketched, or exact when T <= k (cheaper; T: the product
    of the input's middle dimensions, 1 for (B, d))."""
    config = sketcher.config
    if config.exact_when_cheaper and math.prod(activations.shape[1:-1]) <= config.sketch_size:
        return ghost_sq_norms(activations, backprops)
    return sketcher.estimate(activations, backprops, key=key)


@register_randomized_norm_sampler(nn.Linear)
def linear_norm_sample(
    layer: nn.Module,
    activations: List[torch.Tensor],
    backprops: torch.Tensor,
    sketcher: Sketcher,
) -> Dict[nn.Parameter, torch.Tensor]:
    """Norms for ``nn.Linear`` (and HF ``Conv1D``, whose (d x p) weight has the same
    per-sample gradient norm): activations[0] is (B, ..., d), backprops (B, ..., p)."""
    a = activations[0]
    norms = {}
    if layer.weight.requires_grad:
        norms[layer.weight] = weight_sq_norms(a, backprops, sketcher, key=layer.weight).sqrt()
    if layer.bias is not None and layer.bias.requires_grad:
        norms[layer.bias] = bias_sq_norms(backprops).sqrt()
    return norms


@register_randomized_norm_sampler(nn.Embedding)
def embedding_norm_sample(
    layer: nn.Embedding,
    activations: List[torch.Tensor],
    backprops: torch.Tensor,
    sketcher: Sketcher,
) -> Dict[nn.Parameter, torch.Tensor]:
    """Exact norms for ``nn.Embedding`` (:func:`~opacus_rc.estimators.embedding_sq_norms`:
    the same norms as Opacus's ghost norm sampler, without its data-dependent ``unique``,
    and without the padding row, which never receives gradient)."""
    if not layer.weight.requires_grad:
        return {}
    return {layer.weight: embedding_sq_norms(activations[0], backprops, layer.padding_idx).sqrt()}


# --- Parameters used more than once in a forward pass (tied weights; docs/maths.md) ---
#
# Every use contributes ``P^T grad_use`` with the SAME row sketch P, and the norm is taken
# of the sum. A projection returns, per trainable parameter of the layer, the per-sample
# (B, columns, k) sketched gradient (a 1-D bias: its exact (B, p) per-sample gradient).
# With ``exact_when_cheaper`` and a parameter of at most k rows, P is the identity: the
# projection is the per-sample gradient itself (B, columns, rows), no larger than a sketch,
# and the norm of the summed uses is exact.

Projection = Callable[[nn.Module, List[torch.Tensor], torch.Tensor, Sketcher], Dict[nn.Parameter, torch.Tensor]]
TIED_PROJECTIONS: Dict[Type[nn.Module], Projection] = {}


register_tied_projection = _registering(TIED_PROJECTIONS, "the sketched-gradient projection of tied uses")


def tied_row_sketch(param: nn.Parameter, batch: int, sketcher: Sketcher, device) -> torch.Tensor:
    """The step's sketch ``P`` of ``param``'s rows, shared by all its uses (``key=param``): Gaussian
    (rows x k, or (batch, rows, k) per example), or the identity (rows x rows, ``P P^T = I``: the
    summed uses' norm exact) when ``exact_when_cheaper`` and ``rows <= k``."""
    config, rows = sketcher.config, int(param.shape[0])
    if config.exact_when_cheaper and rows <= config.sketch_size:
        return torch.eye(rows, device=device)
    return sketcher.gaussian(batch, rows, config.sketch_size, device, key=param)


def _weight_projection(layer, activations, backprops, sketcher, transposed: bool):
    """Sketched per-sample weight gradients of a linear-type layer (plus exact bias
    gradients). ``nn.Linear``'s weight (p x d) has gradient ``G^T A``: ``P^T G^T A`` as
    (B, d, k) = ``A^T (G P)``; HF ``Conv1D``'s weight (d x p), ``transposed``, has
    ``A^T G``: ``P^T A^T G`` as (B, p, k) = ``G^T (A P)``."""
    a, g = as_sequences(activations[0], backprops)
    left, right = (g, a) if transposed else (a, g)
    out = {}
    if layer.weight.requires_grad:
        sketch = tied_row_sketch(layer.weight, a.shape[0], sketcher, a.device)
        out[layer.weight] = sketched_product(left, right, sketch)
    if layer.bias is not None and layer.bias.requires_grad:
        out[layer.bias] = bias_grads(backprops)
    return out


linear_projection = register_tied_projection(nn.Linear)(functools.partial(_weight_projection, transposed=False))


@register_tied_projection(nn.Embedding)
def embedding_projection(layer, activations, backprops, sketcher):
    """Weight (V x d), grad ``onehot(ids)^T G``: ``P^T`` of it as (B, d, k) = ``G^T P[ids]``."""
    ids = activations[0].reshape(activations[0].shape[0], math.prod(activations[0].shape[1:]))
    g = at_least_float32(backprops.reshape(*ids.shape, backprops.shape[-1]))
    sketch = tied_row_sketch(layer.weight, ids.shape[0], sketcher, g.device).to(g.dtype)
    rows = sketch[ids] if sketch.dim() == 2 else torch.gather(
        sketch, 1, ids[..., None].expand(-1, -1, sketch.shape[-1])
    )
    if layer.padding_idx is not None:  # the padding row never receives gradient
        rows = rows * (ids != layer.padding_idx)[..., None].to(rows.dtype)
    return {layer.weight: torch.matmul(g.transpose(1, 2), rows)}


# --- Hugging Face transformers' Conv1D (GPT-2): a linear layer with a (d_in, d_out) weight


conv1d_projection = functools.partial(_weight_projection, transposed=True)


def is_conv1d(layer: type) -> bool:
    """Hugging Face ``transformers``' ``Conv1D`` (recognised without importing the library)."""
    return layer.__name__ == "Conv1D" and layer.__module__.startswith("transformers")


def third_party_layers(model: nn.Module) -> Tuple[Dict[Type[nn.Module], NormSampler], Dict[Type[nn.Module], Projection]]:
    """The norm samplers and tied projections of third-party layer types found in
    ``model`` (without importing their libraries): Hugging Face ``Conv1D``, unless
    registered. For that model's grad-sample module only: the registries
    (:data:`RANDOMIZED_NORM_SAMPLERS`, :data:`TIED_PROJECTIONS`) are not changed."""
    samplers: Dict[Type[nn.Module], NormSampler] = {}
    projections: Dict[Type[nn.Module], Projection] = {}
    for module in model.modules():
        cls = type(module)
        if is_conv1d(cls):
            # Same norms as nn.Linear: the (d x p) weight's gradient is A^T G.
            if cls not in RANDOMIZED_NORM_SAMPLERS:
                samplers[cls] = linear_norm_sample
            if cls not in TIED_PROJECTIONS:
                projections[cls] = conv1d_projection
    return samplers, projections
