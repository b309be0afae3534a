"""One Poisson draw, one value from the loader to the noise.

The plugin's loaders (the user-level loader, the per-example form's and BatchMemoryManager's
splits) deliver each physical batch with a :class:`Batch`: its :class:`Draw` (an identity
and its number of physical batches), its place in it (``index`` of ``draw.batches``) and its
rows' units (:class:`~opacus_rc.units.RowUnits`; example level: each row its own unit). The
script still unpacks ``x, y``: the loader hands the batch's tensors and their :class:`Batch`
to the optimizer's :class:`Delivered`, and a training forward finds its :class:`Batch` again
by the tensors it takes (:meth:`Delivered.find`). The clipped sums belong to a draw: a step
releases exactly one complete draw, and a draw left incomplete when another begins is
dropped, never released (docs/forms.md, "One draw, one release").

``import opacus_rc`` makes ``opacus.utils.batch_memory_manager.wrap_data_loader``
(BatchMemoryManager's) :func:`split_draws` (:data:`opacus_rc.registration.PATCHES`).
"""

from __future__ import annotations

import collections
import math
import weakref
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Deque, Iterator, List, Optional, Tuple

import numpy as np
import torch
from opacus.utils.batch_memory_manager import BatchSplittingSampler
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader, Dataset, Sampler

from .csprng import init_poisson_loader, rank_share
from .units import EXAMPLES, CyclicPoissonSampler, RowUnits, UserIndex, UserPoissonSampler
from .values import EXAMPLE_UNIT


class Draw:
    """One Poisson draw, cut into ``batches`` physical batches (compared by identity).
    ``signalled``: its end is told by Opacus's skip signals (``signal_skip_step``: the private
    Trainer, a script that accumulates by hand), not by its batches. ``step``: its number in a
    cyclic Poisson sampler's sequence (the banded noise's time, :mod:`opacus_rc.correlated`;
    None for other samplers)."""

    __slots__ = ("batches", "signalled", "step", "__weakref__")

    def __init__(self, batches: int, signalled: bool = False, step: Optional[int] = None) -> None:
        self.batches, self.signalled, self.step = batches, signalled, step


@dataclass(frozen=True, eq=False)
class Batch:
    """A physical batch: physical batch ``index`` of ``draw`` and its rows' ``units``."""

    draw: Draw
    index: int
    units: RowUnits

    @property
    def last(self) -> bool:
        """It completes its draw: the step after it releases the draw."""
        return self.index == self.draw.batches - 1

    def units_of(self, rows: int) -> RowUnits:
        """Its units, for a layer that saw ``rows`` rows (refused when they differ)."""
        if len(self.units) != rows:
            raise ValueError(
                f"a layer saw {rows} rows of a batch of {len(self.units)} that the loader make_private returned "
                "delivered: every trainable layer must see the whole batch along dimension 0 (train on the "
                "returned loader's batches, one forward each)"
            )
        return self.units


def signalled_batches(units: RowUnits, one_row_each: bool) -> List[Batch]:
    """The private Trainer's physical batch of ``units`` (its draw's end told by Opacus's skip
    signals) as the batches its forwards take: the whole batch, or one row each (the per-example
    form: a unit's running sum spans them)."""
    parts = [units.rows(i, i + 1) for i in range(len(units))] if one_row_each else [units]
    draw = Draw(len(parts), signalled=True)
    return [Batch(draw, i, part) for i, part in enumerate(parts)]


class Rows(Batch):
    """A batch no plugin loader delivered (example level): each row a unit, its draw's end told
    by Opacus's skip signals (each step a draw of its own unless signalled otherwise)."""

    def __init__(self) -> None:
        super().__init__(Draw(1, signalled=True), 0, RowUnits.singletons(0))

    def units_of(self, rows: int) -> RowUnits:
        return RowUnits.singletons(rows)


class NoBatch(Batch):
    """Before a training forward of the model took a batch: no layer can be clipped."""

    def __init__(self) -> None:
        super().__init__(Draw(1, signalled=True), 0, RowUnits.singletons(0))

    def units_of(self, rows: int) -> RowUnits:
        raise unannounced_batch_error()


def _chunks(units: RowUnits, max_rows: Optional[int]) -> List[Tuple[int, int]]:
    """A draw's rows cut into physical batches of at most ``max_rows`` (None: one batch):
    Opacus's ``np.array_split`` when each unit is one row, else whole units packed in order
    (``max_rows=1``: one row each, a unit's rows spread over batches: the per-example form)."""
    rows = len(units)
    if max_rows is None or rows == 0:
        return [(0, rows)]
    if max_rows == 1 or units.one_row_each:
        sizes = [len(part) for part in np.array_split(np.arange(rows), math.ceil(rows / max_rows))]
    else:
        sizes, last = [], units.last.tolist()
        start = 0
        for end in range(1, rows + 1):
            if not last[end - 1]:
                continue  # inside one unit's rows
            if sizes and sizes[-1] + end - start <= max_rows:
                sizes[-1] += end - start
            else:
                sizes.append(end - start)
            start = end
    bounds = np.cumsum([0] + sizes).tolist()
    return list(zip(bounds[:-1], bounds[1:]))


class DrawSampler(Sampler[List[int]]):
    """The physical batches of a Poisson batch sampler's draws (``max_batch_size`` rows at
    most; None: a draw is one batch), each with its :class:`Batch`, kept until the loader
    delivers it (:attr:`pending`: the loader fetches in order, its workers too)."""

    def __init__(self, poisson: Any, index: Any, max_batch_size: Optional[int] = None) -> None:
        if max_batch_size is not None and 1 < max_batch_size < index.max_examples_per_user:
            raise ValueError(
                f"max_physical_batch_size={max_batch_size} is below max_examples_per_user="
                f"{index.max_examples_per_user}: at privacy_unit='user' a physical batch holds whole users; "
                "accepted values: max_physical_batch_size >= max_examples_per_user, or 1 with "
                "per_example_backward=True (one row per backward pass)"
            )
        self.poisson, self.index, self.max_batch_size = poisson, index, max_batch_size
        self.pending: Deque[Batch] = collections.deque()

    def __len__(self) -> int:
        """Opacus's ``BatchSplittingSampler``'s: the expected number of physical batches."""
        if self.max_batch_size is None:
            return len(self.poisson)
        return BatchSplittingSampler.__len__(SimpleNamespace(sampler=self.poisson, max_batch_size=self.max_batch_size))

    def __iter__(self) -> Iterator[List[int]]:
        self.pending.clear()
        numbered = getattr(self.poisson, "numbered_draws", None)
        for step, rows in numbered() if numbered is not None else ((None, rows) for rows in self.poisson):
            rows = [int(r) for r in rows]
            units = self.index.units_of(rows)
            bounds = _chunks(units, self.max_batch_size)
            draw = Draw(len(bounds), step=step)
            for i, (start, stop) in enumerate(bounds):
                self.pending.append(Batch(draw, i, units.rows(start, stop)))
                yield rows[start:stop]

    def __getattr__(self, name: str) -> Any:  # sample_rate, ...: the Poisson sampler's
        if name in ("poisson", "index", "max_batch_size", "pending"):
            raise AttributeError(name)
        return getattr(self.poisson, name)


# --- finding a forward's batch by the tensors it takes ------------------------------------

def _same_memory(t: torch.Tensor, b: torch.Tensor) -> bool:
    return t.device == b.device and t.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _same_values(t: torch.Tensor, b: torch.Tensor) -> bool:
    """A copy of ``b`` (moved to a device, cast): the same elements in order."""
    return t.numel() == b.numel() and t.numel() > 0 and torch.equal(
        t.detach().reshape(-1), b.detach().reshape(-1).to(device=t.device, dtype=t.dtype)
    )


class Delivered:
    """The last ``keep`` batches a plugin loader delivered, found again by the tensors a
    forward takes (:meth:`find`): the tensor itself, a view of it, or a copy of it."""

    def __init__(self, keep: int = 8) -> None:
        self._recent: Deque[Tuple[List[torch.Tensor], Batch]] = collections.deque(maxlen=keep)
        #: a plugin loader delivered to this optimizer: every training forward must take its batches
        self.bound = False

    def add(self, data: Any, batch: Batch) -> None:
        self.bound = True
        self._recent.append(([t for t in tree_leaves(data) if isinstance(t, torch.Tensor)], batch))

    def latest_empty(self) -> Optional[Batch]:
        """The last delivered batch when it has no rows (an empty Poisson draw, on which a loop
        may step without a forward): the step's batch all the same."""
        if self._recent and len(self._recent[-1][1].units) == 0:
            return self._recent[-1][1]
        return None

    def find(self, inputs: Any, every: bool = False) -> Optional[Batch]:
        """The delivered :class:`Batch` whose tensors ``inputs`` (a forward's arguments) holds
        (None: none of them; ``every``: each tensor of ``inputs`` must be of it, else refused).
        Raises ValueError when several delivered batches match."""
        tensors = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
        for match in (lambda t, b: t is b, _same_memory, _same_values):
            found = {id(batch): (data, batch) for data, batch in self._recent
                     if any(match(t, b) for t in tensors for b in data)}
            if len(found) > 1:
                raise ValueError(
                    "a forward pass took tensors of several batches the loader make_private returned "
                    "delivered (or copies equal to several): each forward must take one batch"
                )
            if found:
                data, batch = found.popitem()[1]
                foreign = [t for t in tensors if not any(m(t, b) for m in (_same_memory, _same_values) for b in data)]
                if every and foreign and not batch.draw.signalled:  # (the Trainer adds position ids)
                    raise unannounced_batch_error(foreign[0])
                return batch
        return None


#: a training-mode forward pass that no backward pass follows, and its remedy (:func:`no_backward_cause`)
_NO_BACKWARD = (
    "a training-mode forward pass whose output had no backward pass (e.g. a validation or monitoring "
    "forward with the model in train mode and gradients on)"
)
_NO_BACKWARD_FIX = "run such forward passes under torch.no_grad() or after model.eval() (model.train() to train again)"


#: what a refusal at a training forward pass adds: it may be a validation forward in train mode
EVALUATION_HINT = (
    "If this forward pass is a validation or monitoring one, run it under torch.no_grad() or after "
    "model.eval(): in train mode with gradients on it is taken as a training forward pass"
)


def no_backward_cause(seen: bool, likely: bool = True) -> str:
    """The sentence a refusal of forward and backward passes that do not pair up adds: the cause
    when it was seen (:meth:`BatchReader.no_backward_cause`), else the likely one (``likely``:
    when it is the likely one; else nothing)."""
    if seen:
        return f"Cause: {_NO_BACKWARD} ran before the next forward pass; {_NO_BACKWARD_FIX}"
    return f"A likely cause: {_NO_BACKWARD}; {_NO_BACKWARD_FIX}" if likely else ""


def unannounced_batch_error(tensor: Optional[torch.Tensor] = None) -> ValueError:
    """The refusal of a training forward on tensors no batch of the followed loader holds."""
    which = "tensors" if tensor is None else f"a tensor of shape {tuple(tensor.shape)}"
    return ValueError(
        f"a training forward pass took {which} of a batch the loader make_private returned did not deliver "
        "(privacy_unit='user', noise='banded', or a loader that splits Poisson draws: the per-example form's, "
        "BatchMemoryManager's): its rows' units and draw are unknown. Give the model the loader's batch "
        "(moved to the device, cast or sliced: any view or copy of it), one forward per batch; transform "
        f"the data in the dataset (loader.follow(optimizer) for objects built by hand). {EVALUATION_HINT}"
    )


def unfrozen_error(names: List[str]) -> ValueError:
    """The refusal of a training forward pass after parameters frozen at ``make_private`` were
    unfrozen: no per-example clipping was set up for them."""
    one = len(names) == 1
    which = ("parameter " if one else "parameters ") + ", ".join(repr(n) for n in names)
    was, it, its = ("was", "it", "its gradient") if one else ("were", "them", "their gradients")
    return ValueError(
        f"training forward pass refused: {which} {was} frozen (requires_grad=False) when make_private ran and "
        f"{'is' if one else 'are'} trainable now: make_private set up no per-example clipping for {it}, so {its} "
        f"would never be clipped. Unfreeze {it} before make_private, or run make_private again after unfreezing "
        f"{it} (with an optimizer over the parameters to train); or freeze {it} again. Nothing of this step was "
        "released or charged; a refusal must end the run"
    )


class _OutputReached:
    """Whether a backward pass reached a training forward pass's output (its gradient hooks)."""

    __slots__ = ("reached",)

    def __init__(self) -> None:
        self.reached = False

    def __call__(self, _grad: torch.Tensor) -> None:
        self.reached = True


def accumulation_error(batches: int) -> ValueError:
    """The refusal of a ``step()`` that does not follow exactly one physical batch."""
    return ValueError(
        f"optimizer.step() refused: it followed {batches} physical batches of the loader that splits Poisson draws "
        "(the per-example form's loader, or BatchMemoryManager's); each physical batch must be "
        "followed by exactly one optimizer.step() (it only accumulates until the draw ends, then "
        "releases the whole draw), else a release holds part of a draw or one draw's examples "
        "twice, charged as fewer micro-batches. To accumulate a larger logical batch, raise the "
        "sampling rate (a larger batch_size of the loader given to make_private, with "
        "BatchMemoryManager(max_physical_batch_size=1) over the returned loader), or use "
        "DPTrainer's gradient_accumulation_steps; never call step() every k batches. Nothing "
        "was released or charged; a refusal must end the run"
    )



# --- the loaders ------------------------------------------------------------------------------

#: the options of a loader its split keeps (as Opacus's ``wrap_data_loader``)
_LOADER_OPTIONS = (
    "num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context", "generator",
    "prefetch_factor", "persistent_workers",
)


class DrawLoader(DataLoader):
    """A loader over a :class:`DrawSampler`: each physical batch handed, with its
    :class:`Batch`, to the optimizer it follows (:meth:`follow`) before the script gets it."""

    _followed: Optional[Any] = None

    def follow(self, optimizer: Any) -> None:
        """Deliver each batch to ``optimizer`` (``make_private`` links the pair it returns)."""
        self._followed = weakref.ref(optimizer)

    @property
    def user_index(self) -> Any:
        """Who owns each dataset row (:data:`~opacus_rc.units.EXAMPLES` at example level)."""
        return self.batch_sampler.index

    @property
    def rows_per_batch(self) -> Optional[int]:
        """The most dataset rows a delivered batch holds (None: a whole draw)."""
        return self.batch_sampler.max_batch_size

    def __iter__(self) -> Iterator[Any]:
        optimizer = None if self._followed is None else self._followed()
        if optimizer is None:
            raise ValueError(
                "this loader delivers each batch to the optimizer make_private returned with it "
                "(loader.follow(optimizer) for objects built by hand)"
            )
        continue_at = getattr(self.batch_sampler, "continue_at", None)
        if continue_at is not None:  # a cyclic sampler numbers its draws from the noise's next step
            continue_at(optimizer.next_noise_step)
        pending = self.batch_sampler.pending
        for data in super().__iter__():
            optimizer.delivered.add(data, pending.popleft())
            yield data


class UserDataLoader(DrawLoader):
    """The loader ``make_private(..., privacy_unit="user")`` returns: one batch per draw of
    :class:`~opacus_rc.units.UserPoissonSampler` (Opacus's ``DPDataLoader`` conventions: the
    collate function wrapped for empty draws).

    Args:
        dataset: the dataset.
        index: its :class:`~opacus_rc.units.UserIndex`.
        sample_rate: q_u.
        generator: of the masks and subsets (a ``torch.Generator``, or the CSPRNG); under
            DDP this rank's own.
        distributed: sample this rank's share of the users.
        **kwargs: the worker and collate settings of the loader it replaces.
    """

    def __init__(self, dataset: Dataset, *, index: UserIndex, sample_rate: float, generator: Any = None,
                 distributed: bool = False, **kwargs: Any) -> None:
        self.sample_rate = float(sample_rate)
        self.distributed = distributed
        sampler = UserPoissonSampler(index, sample_rate, generator, **rank_share(distributed))
        init_poisson_loader(self, dataset, DrawSampler(sampler, index), **kwargs)


class CyclicPoissonLoader(DrawLoader):
    """The loader ``make_private(..., noise="banded", bands=b)`` returns: one batch per draw of
    :class:`~opacus_rc.units.CyclicPoissonSampler` (draw ``t`` from part ``t mod b`` of the
    units), numbered for the banded noise; Opacus's ``DPDataLoader`` conventions otherwise.

    Args:
        dataset: the dataset.
        index: its :class:`~opacus_rc.units.UserIndex` (None: example level, each row a unit).
        bands: b, the number of parts.
        sample_rate: the rate inside a part (b times the overall rate).
        steps: draws per epoch.
        generator, distributed, **kwargs: as :class:`UserDataLoader`.
    """

    def __init__(self, dataset: Dataset, *, index: Optional[UserIndex], bands: int, sample_rate: float, steps: int,
                 generator: Any = None, distributed: bool = False, **kwargs: Any) -> None:
        self.sample_rate = float(sample_rate)
        self.distributed = distributed
        sampler = CyclicPoissonSampler(
            index, sample_rate, bands, generator, steps, num_units=len(dataset), **rank_share(distributed)
        )
        init_poisson_loader(self, dataset, DrawSampler(sampler, EXAMPLES if index is None else index), **kwargs)


def split_draws(*, data_loader: DataLoader, max_batch_size: int, optimizer: Any) -> DataLoader:
    """Opacus's ``wrap_data_loader`` (BatchMemoryManager's): ``data_loader``'s draws cut into
    physical batches of at most ``max_batch_size`` rows (a :class:`DrawLoader` following
    ``optimizer``, a plugin optimizer); Opacus's own loader for Opacus's optimizers."""
    sampler = data_loader.batch_sampler
    if not hasattr(optimizer, "delivered"):  # Opacus's optimizer
        sampler = BatchSplittingSampler(sampler=sampler, max_batch_size=max_batch_size, optimizer=optimizer)
        return DataLoader(dataset=data_loader.dataset, batch_sampler=sampler, **_options(data_loader))
    if isinstance(sampler, DrawSampler):  # a loader of the plugin's: its draws, split (again)
        if sampler.max_batch_size is not None and sampler.max_batch_size > max_batch_size:
            raise ValueError(
                f"BatchMemoryManager(max_physical_batch_size={max_batch_size}) over a loader already split "
                f"into physical batches of up to {sampler.max_batch_size}: give the unsplit Poisson loader, "
                f"or a max_physical_batch_size of at least {sampler.max_batch_size}"
            )
        size = max_batch_size if sampler.max_batch_size is None else sampler.max_batch_size
        sampler = DrawSampler(sampler.poisson, sampler.index, size)
    else:
        sampler = DrawSampler(sampler, EXAMPLES, max_batch_size)
    loader = DrawLoader(dataset=data_loader.dataset, batch_sampler=sampler, **_options(data_loader))
    loader.follow(optimizer)
    return loader


def _options(data_loader: DataLoader) -> dict:
    return {name: getattr(data_loader, name) for name in _LOADER_OPTIONS}


# --- the module side: the batch each training forward took -------------------------------------

class BatchReader:
    """What every form's module shares (its per-batch entry point, :meth:`take_batch`): the
    :class:`Batch` of the model's training forward, found by the tensors it takes among those
    the followed optimizer's loader delivered (:class:`Delivered`), read by the layers' hooks
    (:attr:`batch`) and by the optimizer's step (:meth:`take_step_batches`)."""

    #: what the followed optimizer's steps protect (``"example"``/``"user"``; its ``bind_module`` sets it)
    privacy_unit: str = EXAMPLE_UNIT
    #: every tensor argument of a forward must come from the delivered batch (the per-example form)
    one_batch_per_argument = False

    def watch_batches(self, root: torch.nn.Module) -> List[Any]:
        """Read the batch of every outermost forward of ``root``'s modules (the root's, or a
        submodule called alone, e.g. a chunked head's backbone); returns the hooks' handles."""
        self.batch: Batch = NoBatch()
        self._step_batches: List[Batch] = []
        self._batches_from: Optional[Any] = None  # weak reference to the followed optimizer
        self._forward_depth = 0
        self._took_rows = False  # a training forward since the last step took a non-empty tensor
        #: the same, for the step being taken (:meth:`take_step_batches`)
        self.step_took_rows = False
        self._root_id = id(root)  # (not the module itself: on a grad-sample module it would be a submodule)
        #: the parameters frozen now (make_private): one unfrozen later was never set up to be clipped
        self._frozen = [(name, p) for name, p in root.named_parameters() if not p.requires_grad]
        self._open_output = False  # a training forward of the root is running: track its output
        self._last_output: Optional[_OutputReached] = None  # the latest one's, reached by a backward pass?
        self._unbackwarded = False  # a training forward's output had no backward pass before the next one
        handles = []
        for module in root.modules():
            handles.append(module.register_forward_pre_hook(self._batch_hook, with_kwargs=True))
            handles.append(module.register_forward_hook(self._left_forward, always_call=True))
        return handles

    def read_batches_from(self, optimizer: Any) -> None:
        self._batches_from = weakref.ref(optimizer)

    def forward_running(self) -> bool:
        """A forward pass of one of the model's modules is running (the root's, or a submodule's
        called alone): :class:`~opacus_rc.forward_changes.ForwardChanges` reads it."""
        return self._forward_depth > 0

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_batches_from": None}  # (a weak reference: saved modules follow none)

    def _left_forward(self, _module: torch.nn.Module, _args: Any, output: Any) -> None:
        self._forward_depth = max(0, self._forward_depth - 1)
        if self._forward_depth == 0 and self._open_output:
            self._open_output = False
            self._track_output(output)

    def _batch_hook(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        self._forward_depth += 1
        if self._forward_depth > 1 or not (self.hooks_enabled and module.training and torch.is_grad_enabled()):
            return
        if not self.in_replay():
            self._check_unfrozen()
            if id(module) == self._root_id:
                self._note_previous_output()
            self.take_batch(self.find_batch((args, kwargs)))
            self._took_rows |= any(t.numel() > 0 for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))

    def _check_unfrozen(self) -> None:
        """Refuse a training forward pass once a parameter frozen at ``make_private`` requires a
        gradient (:func:`unfrozen_error`)."""
        unfrozen = [name for name, p in self._frozen if p.requires_grad]
        if unfrozen:
            self.refuse_step(unfrozen_error(unfrozen))

    def _note_previous_output(self) -> None:
        """At a training forward of the root: whether the previous one's output had no backward
        pass (:meth:`no_backward_cause`); this one's output is tracked when it ends."""
        if self._last_output is not None and not self._last_output.reached:
            self._unbackwarded = True
        self._last_output, self._open_output = None, True

    def _track_output(self, output: Any) -> None:
        """Hook the output tensors of the training forward that just ended (none needs a gradient:
        not tracked)."""
        leaves = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if leaves:
            self._last_output = _OutputReached()
            for leaf in leaves:
                leaf.register_hook(self._last_output)

    def no_backward_cause(self, likely: bool = True) -> str:
        """For a refusal of forward uses and backward hooks that do not pair up: the cause, when a
        training forward's output had no backward pass before the next training forward since
        the last step, else the likely one (``likely=False``: nothing; :func:`no_backward_cause`)."""
        return no_backward_cause(self._unbackwarded, likely)

    def in_replay(self) -> bool:
        """A checkpointed region's replay (no new batch)."""
        from .recompute import forward_replay

        return forward_replay() is not None

    def find_batch(self, inputs: Any) -> Batch:
        """The delivered batch ``inputs`` holds; else, for inputs computed in a graph, the batch a
        forward took since the last step (a chunked head's hidden states); a batch of rows when no
        plugin loader delivers to the followed optimizer at example level; else refused (ValueError)."""
        optimizer = None if self._batches_from is None else self._batches_from()
        delivered = getattr(optimizer, "delivered", None)
        batch = None if delivered is None else delivered.find(inputs, every=self.one_batch_per_argument)
        if batch is not None:
            return batch
        tensors = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
        if not isinstance(self.batch, NoBatch) and any(t.grad_fn is not None for t in tensors):
            return self.batch  # inputs the pass computed from its batch (a chunked head's hidden states)
        if self.privacy_unit != EXAMPLE_UNIT or (delivered is not None and delivered.bound):
            raise unannounced_batch_error(tensors[0] if tensors else None)
        return Rows()

    def take_batch(self, batch: Batch) -> None:
        """A training forward took ``batch``: the layers of its passes clip its units (one
        physical batch of the plugin's loaders per step: a second is refused)."""
        if not batch.draw.signalled and any(b is not batch and not b.draw.signalled for b in self._step_batches):
            self.refuse_step(accumulation_error(2))
        self.batch = batch
        if not any(b is batch for b in self._step_batches):
            self._step_batches.append(batch)

    def end_step(self) -> None:
        """The followed optimizer's step ended: the next layer needs the next forward's batch."""
        self.batch = NoBatch()
        self._unbackwarded, self._last_output = False, None

    def refuse_step(self, error: ValueError) -> None:
        """Raise ``error``; the followed optimizer drops its step and refuses every later one."""
        optimizer = None if self._batches_from is None else self._batches_from()
        if optimizer is not None:
            optimizer.refuse_steps(error)
        raise error

    def take_step_batches(self) -> List[Batch]:
        """The batches of the training forwards since the last call (the step's)."""
        batches, self._step_batches = self._step_batches, []
        self.step_took_rows, self._took_rows = self._took_rows, False
        return batches


__all__ = [
    "EVALUATION_HINT", "Batch", "BatchReader", "CyclicPoissonLoader", "Delivered", "Draw", "DrawLoader", "DrawSampler",
    "NoBatch", "Rows",
    "UserDataLoader",
    "accumulation_error", "no_backward_cause", "signalled_batches", "split_draws", "unannounced_batch_error",
    "unfrozen_error",
]
