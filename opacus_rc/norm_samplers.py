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
* ``nn.Embedding``: exact (Opacus's sparse-aware norm sampler, cheap).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Type, Union

import torch
from opacus.grad_sample.embedding_norm_sample import compute_embedding_norm_sample
from torch import nn

from .estimators import bias_sq_norms, ghost_sq_norms
from .sketch import Sketcher

NormSampler = Callable[
    [nn.Module, List[torch.Tensor], torch.Tensor, Sketcher], Dict[nn.Parameter, torch.Tensor]
]
RANDOMIZED_NORM_SAMPLERS: Dict[Type[nn.Module], NormSampler] = {}


def register_randomized_norm_sampler(
    target: Union[Type[nn.Module], Sequence[Type[nn.Module]]],
) -> Callable[[NormSampler], NormSampler]:
    """Decorator registering a randomized-clipping norm sampler for layer type(s)."""
    targets = target if isinstance(target, Sequence) else [target]

    def decorator(fn: NormSampler) -> NormSampler:
        for cls in targets:
            RANDOMIZED_NORM_SAMPLERS[cls] = fn
        return fn

    return decorator


def sequence_length(activations: torch.Tensor) -> int:
    """T of a (B, ..., d) input: the product of the middle dimensions (1 for (B, d))."""
    return activations[0].numel() // activations.shape[-1] if activations.shape[0] else 0


def weight_sq_norms(
    activations: torch.Tensor, backprops: torch.Tensor, sketcher: Sketcher
) -> torch.Tensor:
    """Per-sample ``||A_i^T G_i||_F^2``: sketched, or exact when T <= k (cheaper)."""
    config = sketcher.config
    if config.exact_when_cheaper and sequence_length(activations) <= config.sketch_size:
        return ghost_sq_norms(activations, backprops)
    return sketcher.estimate(activations, backprops)


@register_randomized_norm_sampler(nn.Linear)
def linear_norm_sample(
    layer: nn.Linear,
    activations: List[torch.Tensor],
    backprops: torch.Tensor,
    sketcher: Sketcher,
) -> Dict[nn.Parameter, torch.Tensor]:
    """Norms for ``nn.Linear``: activations[0] is (B, ..., d), backprops (B, ..., p)."""
    a = activations[0]
    norms = {}
    if layer.weight.requires_grad:
        norms[layer.weight] = weight_sq_norms(a, backprops, sketcher).sqrt()
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
    """Exact norms for ``nn.Embedding`` (Opacus's ghost norm sampler; token ids made
    contiguous first, since Opacus views them, which fails on sliced inputs)."""
    ids = [activations[0].contiguous(), *activations[1:]]
    return compute_embedding_norm_sample(layer, ids, backprops)
