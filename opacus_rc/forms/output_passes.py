"""Two passes from the model's output, for plain-loss scripts (``grad_sample_mode="hooks"``).

Book-keeping keeps every linear layer's input and output gradient until the step: on a model
with activation checkpointing, the memory checkpointing frees. The two-pass method keeps
nothing, but needs per-sample losses; here it runs under an ordinary ``loss.backward()``: a
forward hook on the module producing the output (the LM head of a causal LM, else the model)
hands the loss a *boundary* tensor. When the user's backward reaches it with the output
gradient ``g``, the boundary runs the two passes of
:class:`~opacus_rc.forms.two_pass.DPTensorRandomizedClipping` on the inner graph with the
pseudo per-sample loss ``l_i = n <y_i, g_i>`` (``y`` the output, ``g`` detached, ``n`` the
batch size): its mean has gradient ``g`` at ``y``, and ``sum_i c_i l_i`` has ``n c_i g_i``. In a
batch of packed rows the examples are its segments (:mod:`opacus_rc.packing`): ``l_s = S sum_{t in
s} <y_t, g_t>`` over segment ``s``'s tokens, ``S`` the number of segments.
A loss computed from anything but the boundary reaches the hooks outside the two passes:
refused (:meth:`OutputPasses.check_inside`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..packing import segment_sums
from ..recompute import forward_replay
from ..refusals import refusal
from .two_pass import DPTensorRandomizedClipping

logger = logging.getLogger(__name__)


class _Boundary(torch.autograd.Function):
    """Identity on the output values (a view, not a copy: autograd refuses editing it in
    place); its backward runs ``passes(g)`` and returns nothing into the model's graph (the
    anchor is a 0-element leaf that only makes the result require grad)."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, value: torch.Tensor, passes: Callable[[torch.Tensor], None]):
        ctx.passes = passes
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.passes(grad)
        return None, None, None


def output_module(model: nn.Module) -> nn.Module:
    """The module whose output the loss is computed from: a Hugging Face model's output
    embeddings (the LM head, so that a loss computed inside the model from ``labels=`` is
    still downstream of the boundary), else the model itself."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, nn.Module) else model


class OutputPasses:
    """Attaches the boundary to ``grad_sample_module``'s model output and runs the two
    passes with ``optimizer`` (a randomized-clipping two-pass optimizer)."""

    def __init__(self, grad_sample_module: Any, optimizer: Any, loss_reduction: str = "mean") -> None:
        self.module = grad_sample_module
        self.optimizer = optimizer
        self.loss_reduction = loss_reduction
        self._inside = 0
        self._anchor = torch.empty(0, requires_grad=True)
        self.target = output_module(grad_sample_module._module)
        self._handle = self.target.register_forward_hook(self._wrap_output)
        grad_sample_module.output_passes = self

    def remove(self) -> None:
        self._handle.remove()

    @property
    def inside(self) -> bool:
        """True while the boundary's two passes run."""
        return self._inside > 0

    def check_inside(self, layer: nn.Module) -> None:
        """Refuse a backward that reached a hooked layer without passing the boundary."""
        if not self.inside:
            raise ValueError(
                f"the backward pass reached {type(layer).__name__} without passing the output "
                "the privacy engine clips at (the loss was computed from a tensor it did not "
                "see, e.g. from lm_head.weight directly): compute the loss from the model's "
                "output (the logits), or use grad_sample_mode='ghost' with its criterion"
            )

    def _wrap_output(self, _module: nn.Module, _inputs: Any, output: Any) -> Any:
        # forward_replay(): activation checkpointing's recomputation, whose original call was wrapped
        if not (self.module.hooks_enabled and _module.training and torch.is_grad_enabled()) or forward_replay():
            return None
        if isinstance(output, torch.Tensor):
            return self._bounded(output)
        logits = getattr(output, "logits", None)
        if isinstance(logits, torch.Tensor):
            output["logits"] = self._bounded(logits)
            return output
        raise ValueError(
            f"the model's output ({type(output).__name__}) is neither a tensor nor has a "
            "'logits' tensor: the two-pass computation needs the output the loss is computed "
            "from; use grad_sample_mode='ghost' with its criterion"
        )

    def _bounded(self, value: torch.Tensor) -> torch.Tensor:
        if not value.requires_grad:
            return value
        return _Boundary.apply(self._anchor, value.detach(), lambda g: self._passes(value, g))

    def _passes(self, value: torch.Tensor, grad: torch.Tensor) -> None:
        """The two passes for the output ``value`` whose gradient is ``grad``."""
        self._inside += 1
        try:
            with torch.enable_grad():  # autograd runs a Function's backward without grad mode
                segments = self.module.batch.segments
                if segments is None:  # <value_i, grad_i> per example, without a (B, T, V) product
                    pseudo = torch.einsum("bn,bn->b", value.flatten(1), grad.detach().flatten(1))
                else:  # per packed segment: its tokens' <value_t, grad_t>
                    if value.dim() < 3 or value.shape[1] != segments.tokens:
                        raise refusal("packed_rows_layer_input", layer=f"the output of {type(self.target).__name__}",
                                      shape=tuple(value.shape), tokens=segments.tokens)
                    tokens = torch.einsum("btv,btv->bt", value.flatten(2), grad.detach().flatten(2))
                    pseudo = segment_sums(tokens, segments)
                if self.loss_reduction == "mean":
                    pseudo = pseudo * pseudo.shape[0]
                DPTensorRandomizedClipping(self.module, self.optimizer, pseudo, self.loss_reduction).backward()
        finally:
            self._inside -= 1


def attach_output_passes(module: Any, optimizer: Any, loss_reduction: str) -> Optional[OutputPasses]:
    """Attach :class:`OutputPasses` to a two-pass randomized grad-sample module."""
    passes = OutputPasses(module, optimizer, loss_reduction)
    logger.info(
        "randomized clipping: two passes from the output of %s (activation checkpointing: "
        "book-keeping would keep every linear layer's input until the step)", type(passes.target).__name__,
    )
    return passes
