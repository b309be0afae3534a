"""The plugin's registration with Opacus: :func:`install` (run by ``import opacus_rc``) and
:func:`uninstall`.

Opacus has no registry of engines or clipping modes, nor a same-draw signal, so
:func:`install` replaces five names (:data:`PATCHES`): ``from opacus import PrivacyEngine``
gives :class:`opacus_rc.integration.PrivacyEngine`, BatchMemoryManager's sampler
declares its physical batches one Poisson draw, and its loader holds every ``step()`` to
one physical batch (:mod:`opacus_rc.draws`). The ``rc_prv`` accountant goes through
Opacus's own registry. :func:`uninstall` restores every replaced name (:data:`ORIGINALS`).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import opacus
import opacus.privacy_engine
import opacus.utils.batch_memory_manager as batch_memory_manager
from opacus.accountants import register_accountant
from opacus.utils.batch_memory_manager import BatchSplittingSampler

from .accounting.accountant import RCPRVAccountant
from .draws import split_draws, split_twice_error
from .integration import OpacusPrivacyEngine, PrivacyEngine
from .forms import form_of
from .optimizer import RandomizedClippingMixin
from .values import RC_PRV

#: Opacus's own ``__init__`` of its engine and ``__iter__`` of BatchMemoryManager's sampler
_OPACUS_INIT = OpacusPrivacyEngine.__init__
_OPACUS_SPLITTING_ITER = BatchSplittingSampler.__iter__


@functools.wraps(_OPACUS_INIT)
def _init_plugin_engine(self, *args: Any, **kwargs: Any) -> None:
    """``__init__`` of Opacus's engine: ``opacus.privacy_engine.PrivacyEngine(...)`` builds the
    plugin's :class:`PrivacyEngine`; subclasses of Opacus's, and the plugin's own
    ``super().__init__()``, run Opacus's ``__init__`` (docs/development.md: not ``__new__``)."""
    if type(self) is OpacusPrivacyEngine:
        self.__class__ = PrivacyEngine
        PrivacyEngine.__init__(self, *args, **kwargs)
    else:
        _OPACUS_INIT(self, *args, **kwargs)


class _SameDrawSignals:
    """The optimizer as a :class:`BatchSplittingSampler` signals it: every skipped step it
    signals cuts one Poisson draw into physical batches (``same_draw=True``)."""

    def __init__(self, optimizer: RandomizedClippingMixin) -> None:
        self.optimizer = optimizer

    def signal_skip_step(self, do_skip: bool = True) -> None:
        self.optimizer.signal_skip_step(do_skip=do_skip, same_draw=do_skip)


def _splitting_iter(self: BatchSplittingSampler):
    """``BatchSplittingSampler.__iter__`` (BatchMemoryManager's physical batches): Opacus's
    own, on a copy whose plugin optimizer hears its skipped steps as continuations of the
    same Poisson draw (:meth:`~opacus_rc.optimizer.RandomizedClippingMixin.signal_skip_step`).
    Over a loader split already (the per-example form's), its own batches and signals: two
    splitters would each signal the end of a draw. Opacus's optimizers hear what they did."""
    if form_of(self.optimizer) is None:
        return _OPACUS_SPLITTING_ITER(self)
    if isinstance(self.sampler, BatchSplittingSampler):  # over a loader that splits already
        if self.sampler.max_batch_size > self.max_batch_size:
            raise split_twice_error(self.max_batch_size, self.sampler.max_batch_size)
        return iter(self.sampler)  # its batches fit; it signals the draws itself
    splitter = copy.copy(self)
    splitter.optimizer = _SameDrawSignals(self.optimizer)
    return _OPACUS_SPLITTING_ITER(splitter)


#: ``(owner, name, value)``: every name of Opacus that :func:`install` replaces, and why
#: Opacus offers no extension point for it.
PATCHES = (
    # Opacus has no engine registry: the name is how scripts reach the engine.
    (opacus, "PrivacyEngine", PrivacyEngine),
    # The same name, imported from its defining module.
    (opacus.privacy_engine, "PrivacyEngine", PrivacyEngine),
    # A name bound before `import opacus_rc` (isort's order: `from opacus import
    # PrivacyEngine` above it) still builds the plugin's engine.
    (OpacusPrivacyEngine, "__init__", _init_plugin_engine),
    # BatchMemoryManager's sampler signals its optimizer signal_skip_step(do_skip=True),
    # with no way to say that its physical batches are one Poisson draw: it says so to the
    # plugin's optimizers (same_draw=True), which charge them as one micro-batch.
    (BatchSplittingSampler, "__iter__", _splitting_iter),
    # BatchMemoryManager's loader: Opacus's skip signals are a queue popped by each step(),
    # with no check that a step falls on a draw boundary; the plugin's loader counts the
    # batches it delivers, and its optimizers refuse a step that does not follow exactly one.
    (batch_memory_manager, "wrap_data_loader", split_draws),
)

#: what each of :data:`PATCHES` replaced, as Opacus defines it (read before install)
ORIGINALS = tuple(vars(owner)[name] for owner, name, _ in PATCHES)


def install() -> None:
    """Make ``opacus.PrivacyEngine`` the plugin's engine and register the ``rc_prv``
    accountant with Opacus (idempotent)."""
    for owner, name, value in PATCHES:
        setattr(owner, name, value)
    register_accountant(RC_PRV, RCPRVAccountant, force=True)


def uninstall() -> None:
    """Undo :func:`install`: every name of :data:`PATCHES` is Opacus's again
    (:data:`ORIGINALS`; the accountant stays registered; :class:`PrivacyEngine` itself
    keeps working). :func:`install` makes them the plugin's again."""
    for (owner, name, _), original in zip(PATCHES, ORIGINALS):
        setattr(owner, name, original)


__all__ = ["install", "uninstall", "PATCHES", "ORIGINALS"]
