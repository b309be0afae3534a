"""Activation checkpointing: telling the training forward pass from its recomputations.

``torch.utils.checkpoint`` runs a checkpointed region's forward again during the backward
pass, and every layer's forward hooks fire a second time. :func:`forward_replay` says which
run a hook is in: a ``use_reentrant=False`` replay only rebuilds saved tensors (the original
call was captured, and its graph is backpropagated: capture nothing); a
``use_reentrant=True`` replay is the graph that is backpropagated (capture it, as part of the
step's pass: no new sketch pass). A layer input captured inside a region is saved through the
saved-tensors hooks in force (:class:`SavedInputs`), so that checkpointing frees it and the
backward hook gets it recomputed. The cases, memory and refusals: docs/robustness.md
("Activation checkpointing").
"""

from __future__ import annotations

import inspect
import logging
import contextlib
import sys
import warnings
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.utils.checkpoint as _checkpoint
from torch import nn

#: A forward replayed by ``checkpoint(use_reentrant=False)`` to rebuild saved tensors.
NON_REENTRANT = "non_reentrant"
#: A forward run during a backward pass otherwise (``checkpoint(use_reentrant=True)``).
REENTRANT = "reentrant"

_RECOMPUTATION_HOOK = getattr(_checkpoint, "_recomputation_hook", None)

logger = logging.getLogger(__name__)
_reported: set = set()


@contextlib.contextmanager
def quiet_hook_notes() -> Iterator[None]:
    """Within: torch's two notes about Opacus's grad-sample hooks that ask nothing of the
    user are not shown (a model whose first layer's input needs no gradient, token ids; a
    module whose forward has several autograd nodes). Local to the plugin's own backward
    passes: ``import opacus_rc`` sets no process-wide filter."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Full backward hook is firing when gradients are computed with respect to "
            "module outputs since no inputs require gradients", category=UserWarning,
        )
        warnings.filterwarnings(
            "ignore", message="Using a non-full backward hook when the forward contains multiple autograd "
            "Nodes", category=FutureWarning,
        )
        yield


def _report(kind: str) -> str:
    """Log, once per process and kind, that a checkpoint replay was recognised."""
    if kind not in _reported:
        _reported.add(kind)
        logger.info("activation checkpointing: %s recomputation recognised by the privacy hooks", kind)
    return kind


def _saved_tensors_pack_hooks() -> List[Callable]:
    """The pack hooks of this thread's saved-tensors hooks stack, innermost first. PyTorch
    exposes only the top of the stack: it is popped entry by entry and pushed back in the
    original order (the stack is thread-local; nothing runs in between)."""
    autograd = torch._C._autograd
    popped = []
    try:
        while True:
            top = autograd._top_saved_tensors_default_hooks(False)
            if top is None:
                break
            popped.append(top)
            autograd._pop_saved_tensors_default_hooks()
    finally:
        for pack, unpack in reversed(popped):
            autograd._push_saved_tensors_default_hooks(pack, unpack)
    return [pack for pack, _ in popped]


def _is_recomputation_hook(pack: Callable) -> bool:
    """True for the pack hook of ``torch.utils.checkpoint``'s ``_recomputation_hook``."""
    fn = inspect.unwrap(pack)
    return getattr(fn, "__module__", None) == _checkpoint.__name__ and getattr(
        fn, "__qualname__", ""
    ).startswith(f"{_RECOMPUTATION_HOOK.__qualname__}.")


def forward_replay() -> Optional[str]:
    """How the running forward relates to the step's forward pass.

    Returns:
        ``None`` for the forward pass itself; :data:`NON_REENTRANT` inside a replay by
        ``checkpoint(use_reentrant=False)`` (also a region nested in one): the original
        call was captured, capture nothing; :data:`REENTRANT` for any other forward run
        during a backward pass (``checkpoint(use_reentrant=True)``'s replay): capture it,
        as part of the running step.

    Raises:
        RuntimeError: if this PyTorch's ``torch.utils.checkpoint`` has no
            ``_recomputation_hook`` (non-reentrant replays could not be recognised).
    """
    hooks = _saved_tensors_pack_hooks()
    if hooks:
        if _RECOMPUTATION_HOOK is None:
            raise RuntimeError(
                "clipping='randomized' cannot recognise activation checkpointing's "
                f"recomputation in torch {torch.__version__} (torch.utils.checkpoint has no "
                "_recomputation_hook): use checkpoint(..., use_reentrant=True), or no "
                "activation checkpointing"
            )
        if any(_is_recomputation_hook(h) for h in hooks):
            return _report(NON_REENTRANT)
    if torch._C._current_graph_task_id() != -1:
        return _report(REENTRANT)
    return None


def _replays_preserving_rng() -> Optional[bool]:
    """Whether every ``torch.utils.checkpoint`` recomputation running now (nested ones
    too) restores the random state of its forward (``preserve_rng_state``): False if one
    does not, True if all do, None if none was found. Read from the replays' frames:
    ``CheckpointFunction.backward``'s ``ctx`` (``use_reentrant=True``), the
    ``recompute_fn`` closure (``use_reentrant=False``)."""
    found = None
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        preserve = None
        if code is _REENTRANT_BACKWARD:
            preserve = getattr(frame.f_locals.get("ctx"), "preserve_rng_state", None)
        elif code.co_name == "recompute_fn" and code.co_filename == _checkpoint.__file__:
            preserve = frame.f_locals.get("preserve_rng_state")
        if preserve is not None:
            if not preserve:
                return False
            found = True
        frame = frame.f_back
    return found


_REENTRANT_BACKWARD = inspect.unwrap(_checkpoint.CheckpointFunction.backward).__code__


def refuse_unpreserved_rng_replay(_module: Any = None, _inputs: Any = None) -> None:
    """Forward pre-hook of a method that backpropagates twice: refuse a checkpoint
    recomputation (:func:`forward_replay`) running now that does not restore its forward's
    random state: each backward pass recomputes the region with other random draws (dropout
    masks), and the first pass's clip factors would scale another gradient in the second.

    Raises:
        ValueError: ``preserve_rng_state=False``, naming the accepted alternatives.
        RuntimeError: a non-reentrant recomputation whose ``preserve_rng_state`` cannot be
            read in this PyTorch (fails closed).
    """
    replay = forward_replay()
    if replay is None:
        return
    preserve = _replays_preserving_rng()
    if preserve is False:
        raise ValueError(
            "activation checkpointing with preserve_rng_state=False is not supported by "
            "two-pass randomized clipping: each of its two backward passes recomputes the "
            "checkpointed region with other random draws (e.g. dropout masks), so the clip "
            "factor from the first pass would scale a different per-example gradient in the "
            "second, beyond max_grad_norm. Accepted: preserve_rng_state=True (torch's default; "
            "Hugging Face: leave 'preserve_rng_state' out of gradient_checkpointing_kwargs), or "
            "book-keeping, one backward pass (make_private(grad_sample_mode='bookkeeping'))"
        )
    if preserve is None and replay == NON_REENTRANT:
        raise RuntimeError(
            "clipping='randomized' cannot read preserve_rng_state of activation checkpointing's "
            f"recomputation in torch {torch.__version__}: use book-keeping "
            "(make_private(grad_sample_mode='bookkeeping')) or checkpoint(..., use_reentrant=True)"
        )


SavedTensorsHooks = Tuple[Callable, Callable]


def current_saved_tensors_hooks() -> Optional[SavedTensorsHooks]:
    """The (pack, unpack) hooks autograd would save a tensor through now, or None."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


class SavedInput:
    """One layer input saved through saved-tensors hooks; ``shape`` is known without
    unpacking (Opacus reads the batch size of pending inputs)."""

    __slots__ = ("shape", "_packed", "_unpack")

    def __init__(self, tensor: torch.Tensor, hooks: SavedTensorsHooks) -> None:
        pack, self._unpack = hooks
        self.shape = tensor.shape
        self._packed = pack(tensor.detach())

    def get(self) -> torch.Tensor:
        """The tensor (recomputed, under a non-reentrant checkpoint); once per pass."""
        return self._unpack(self._packed)


class SavedInputs(list):
    """A ``module.activations`` entry made of :class:`SavedInput` (one per input)."""


def save_inputs(forward_input: Sequence[torch.Tensor], hooks: SavedTensorsHooks) -> SavedInputs:
    """Save a layer's inputs through ``hooks`` (see the module docstring)."""
    return SavedInputs(SavedInput(t, hooks) for t in forward_input)


def resolve_last(module) -> None:
    """Unpack the entry the backward hook is about to pop from ``module.activations``."""
    entries = getattr(module, "activations", None)
    if entries and isinstance(entries[-1], SavedInputs):
        entries[-1] = [saved.get() for saved in entries[-1]]


def missing_per_sample_error(what: str, cause: str = "") -> ValueError:
    """The error for trainable parameters that got no per-sample norm or gradient in a
    backward pass (their layer's backward hook never ran), with its usual causes; ``cause``: a
    sentence naming another (:meth:`~opacus_rc.draws.BatchReader.no_backward_cause`)."""
    return ValueError(
        f"no per-sample gradient for {what}: the layer's backward hook did not run in this "
        f"backward pass. {cause + '. ' if cause else ''}Every trainable layer must take part in each forward and backward "
        "pass with clipping='randomized'. Under checkpoint(..., use_reentrant=True) this "
        "happens when no input of a checkpointed region requires grad (e.g. a frozen base "
        "model under LoRA): the region is then not differentiated at all. Use "
        "checkpoint(..., use_reentrant=False) (Hugging Face: gradient_checkpointing_enable() "
        "without arguments), or make the region's input require grad (Hugging Face: "
        "model.enable_input_require_grads())"
    )


def late_use_error(layer: str) -> ValueError:
    """The error for a parameter used inside a reentrant checkpoint region and after it."""
    return ValueError(
        f"a trainable parameter of a {layer} is used inside a checkpoint(..., use_reentrant=True) "
        "region and again after it: its per-sample norm was taken in the backward pass before "
        "the region recomputed its other use, so the norm would miss that use. Use "
        "checkpoint(..., use_reentrant=False) (Hugging Face: gradient_checkpointing_enable() "
        "without arguments), or keep every use of the parameter on one side of the region"
    )


def is_checkpointed(module: nn.Module) -> bool:
    """True if Hugging Face activation checkpointing is on in ``module`` (a submodule's
    ``gradient_checkpointing`` flag, set by ``gradient_checkpointing_enable()``)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in module.modules())
