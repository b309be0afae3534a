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
import functools
import hashlib
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
from .row_order import Collated, RowOrderCollate, follows_rows, tensors_in
from .units import EXAMPLES, CyclicPoissonSampler, RowUnits, UserIndex, UserPoissonSampler
from .values import EXAMPLE_UNIT


class Draw:
    """One Poisson draw, cut into ``batches`` physical batches (compared by identity).
    ``signalled``: its end is told by Opacus's skip signals (``signal_skip_step``: the private
    Trainer, a script that accumulates by hand), not by its batches. ``step``: its number in a
    cyclic Poisson sampler's sequence (a numbered noise mechanism's time, :mod:`opacus_rc.noises`;
    None for other samplers)."""

    __slots__ = ("batches", "signalled", "step", "__weakref__")

    def __init__(self, batches: int, signalled: bool = False, step: Optional[int] = None) -> None:
        self.batches, self.signalled, self.step = batches, signalled, step


@dataclass(frozen=True, eq=False)
class Batch:
    """A physical batch: physical batch ``index`` of ``draw`` and its rows' ``units``; ``segments``:
    the examples packed in its rows (:mod:`opacus_rc.packing`), then the units are the segments'
    and every layer splits its rows into them (None: each row an example)."""

    draw: Draw
    index: int
    units: RowUnits
    segments: Optional[Any] = None

    @property
    def last(self) -> bool:
        """It completes its draw: the step after it releases the draw."""
        return self.index == self.draw.batches - 1

    def units_of(self, rows: int) -> RowUnits:
        """Its units, for a layer that saw ``rows`` rows (refused when they differ)."""
        if len(self.units) != rows:
            raise ValueError(
                f"a layer saw {rows} rows where the forward's batch, the next one the loader make_private returned "
                f"delivered, has {len(self.units)}: each training forward takes the loader's next batch, in "
                "delivery order (a batch skipped, or a forward on other data?), and every trainable layer must see "
                "its whole batch along the batch dimension (one forward per batch)"
            )
        return self.units

    def reordered(self, order: Optional[List[int]]) -> "Batch":
        """This batch with its rows in ``order`` (``order[i]``: the row that is now row ``i``; a
        collate that sorts); itself for None."""
        return self if order is None else Batch(self.draw, self.index, self.units.take(order), self.segments)


def signalled_batches(units: RowUnits, one_row_each: bool, segments: Any = None) -> List[Batch]:
    """The private Trainer's physical batch of ``units`` (its draw's end told by Opacus's skip
    signals) as the batches its forwards take: the whole batch (its rows' packed ``segments``, if
    any, the units'), or one row each (the per-example form: a unit's running sum spans them; a
    packed batch is unpacked first, a segment a row)."""
    parts = [units.rows(i, i + 1) for i in range(len(units))] if one_row_each else [units]
    draw = Draw(len(parts), signalled=True)
    return [Batch(draw, i, part, None if one_row_each else segments) for i, part in enumerate(parts)]


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


# --- which delivered batch a training forward takes ---------------------------------------

def _holds(refs: List["weakref.ref"], tensors: List[torch.Tensor]) -> bool:
    """Some of ``tensors`` is a delivered tensor (alive, in ``refs``) or shares its storage (a view)."""
    for ref in refs:
        delivered = ref()
        if delivered is None or delivered.numel() == 0:
            continue
        pointer = delivered.untyped_storage().data_ptr()
        if any(t is delivered or (t.device == delivered.device and t.numel() > 0
                                  and t.untyped_storage().data_ptr() == pointer) for t in tensors):
            return True
    return False


class Ledger:
    """What the plugin's loaders delivered to one optimizer, in delivery order, and the batch
    each training forward takes (docs/forms.md, "Which batch a forward takes"). Identity is
    carried, never re-found by value: a forward takes the oldest delivered batch not yet taken
    (the head), whatever the loop computed from it (a device copy, a cast, a normalisation, an
    augmentation, shifted labels, a re-tokenisation); a later forward before the step takes the
    same batch again (two views, a backbone called alone) unless a batch was delivered after it
    was taken (then it is that batch's: a second physical batch in one step, refused by the
    step). A forward on the very tensors (or views) of a later delivered batch takes that batch:
    the ones before it were skipped by the loop and are never released. The layers check that
    a forward's rows are the batch's (:meth:`Batch.units_of`)."""

    def __init__(self) -> None:
        self._queue: Deque[Tuple[List["weakref.ref"], Batch, int]] = collections.deque()  # (tensors, batch, source)
        self._deliveries = 0
        self._current: Optional[Tuple[List["weakref.ref"], Batch, int]] = None
        self._taken_at = 0  # deliveries when the current batch was taken
        #: a plugin loader delivered to this optimizer: every training forward must take its batches
        self.bound = False
        #: the batch delivered last
        self.latest: Optional[Batch] = None

    def deliver(self, data: Any, batch: Batch, source: Any = None) -> None:
        """A loader (``source``) hands ``data`` (what the script gets) with its :class:`Batch`."""
        self.bound, self.latest = True, batch
        self._queue.append(([weakref.ref(t) for t in tensors_in(data)], batch, id(source)))
        self._deliveries += 1

    def restart(self, source: Any) -> None:
        """``source`` starts a new iteration: its batches fetched and never taken by a forward
        (an abandoned iterator) are not trained, never released."""
        self._queue = collections.deque(entry for entry in self._queue if entry[2] != id(source))

    def take(self, inputs: Any) -> Optional[Batch]:
        """The batch of a training forward on ``inputs`` (None: no delivered batch is pending)."""
        tensors = tensors_in(inputs)
        later = next((i for i, (refs, *_) in enumerate(self._queue) if _holds(refs, tensors)), None)
        if later is not None:
            for _ in range(later):  # skipped by the loop: never released
                self._queue.popleft()
            return self._take_head()
        current = self._current
        if current is not None and (self._deliveries == self._taken_at or _holds(current[0], tensors)):
            return current[1]
        if any(t.numel() > 0 for t in tensors):
            while self._queue and len(self._queue[0][1].units) == 0:  # empty draws the loop did not forward
                self._queue.popleft()
        return self._take_head() if self._queue else None

    def _take_head(self) -> Batch:
        self._current, self._taken_at = self._queue.popleft(), self._deliveries
        return self._current[1]

    def take_empty(self) -> Optional[Batch]:
        """At a step without a forward: the head when it is an empty draw (a loop may step on one
        without a forward), taken; else None."""
        if self._queue and len(self._queue[0][1].units) == 0:
            return self._take_head()
        return None

    def end_step(self) -> None:
        """A step ended: the next training forward takes the next batch."""
        self._current = None


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


def unannounced_batch_error(tensor: Optional[torch.Tensor] = None, bound: bool = True) -> ValueError:
    """The refusal of a training forward that no delivered batch is pending for (``bound``: the
    followed loader delivered before; else, at user level, the batches must come from it)."""
    which = "tensors" if tensor is None else f"a tensor of shape {tuple(tensor.shape)}"
    if bound:
        return ValueError(
            f"a training forward pass (the model in train mode, gradients on) took {which} while no batch of the "
            "loader make_private returned was pending: every batch it delivered was already taken by a forward "
            "(a validation or monitoring forward in train mode? run it under torch.no_grad() or after "
            "model.eval()); each forward takes the next batch the loader delivered, in delivery order"
        )
    return ValueError(
        f"privacy_unit='user': a training forward pass took {which}, but the loader make_private returned has "
        "not delivered a batch: a user's rows are clipped together, so the batches must come from that loader "
        "(it carries each row's user with it). Train on its batches (moved to the device, cast or transformed as "
        "you like); loader.follow(optimizer) for objects built by hand"
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


def split_twice_error(max_batch_size: int, split: int) -> ValueError:
    """The refusal of BatchMemoryManager(``max_batch_size``) over a loader that already splits
    its draws into physical batches of up to ``split`` rows, more than ``max_batch_size``."""
    return ValueError(
        f"BatchMemoryManager(max_physical_batch_size={max_batch_size}) over a loader already split into "
        f"physical batches of up to {split}: give the unsplit Poisson loader, or a max_physical_batch_size "
        f"of at least {split}"
    )


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
        serve = getattr(self.batch_sampler, "serve", None)
        if serve is not None:  # a cyclic sampler: the noise mechanism's run and next step
            serve(optimizer.noise_mechanism)
        pending = self.batch_sampler.pending
        optimizer.ledger.restart(self)
        for data in super().__iter__():
            batch = pending.popleft()
            if isinstance(data, Collated):  # the rows' order after the collate (privacy_unit="user")
                data, batch = data.data, batch.reordered(data.order)
            optimizer.ledger.deliver(data, batch, self)
            yield data

    def follow_rows(self) -> None:
        """At ``privacy_unit="user"``: the collate function tells where each row went
        (:class:`~opacus_rc.row_order.RowOrderCollate`; torch's default collate keeps the order)."""
        if self.user_index is not EXAMPLES and follows_rows(self.collate_fn) \
                and not isinstance(self.collate_fn, RowOrderCollate):
            self.collate_fn = RowOrderCollate(self.collate_fn)


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
        self.follow_rows()


class CyclicPoissonLoader(DrawLoader):
    """The loader ``make_private`` returns for a noise mechanism served by cyclic draws (its
    spec's ``parts``; e.g. ``noise="banded", bands=b``): one batch per draw of
    :class:`~opacus_rc.units.CyclicPoissonSampler` (draw ``t`` from part ``t mod b`` of the
    units), numbered (the mechanism's time); Opacus's ``DPDataLoader`` conventions otherwise.

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
        if index is None:  # example level: a unit's key is its row
            sampler.identity = functools.partial(dataset_digest, dataset)
        init_poisson_loader(self, dataset, DrawSampler(sampler, EXAMPLES if index is None else index), **kwargs)
        self.follow_rows()


def dataset_digest(dataset: Dataset) -> bytes:
    """sha256 of every row of ``dataset`` in order (each leaf: a tensor's dtype, shape and bytes,
    else its ``repr``): the identity of rows keyed by their position."""
    digest = hashlib.sha256()
    for i in range(len(dataset)):
        for leaf in tree_leaves(dataset[i]):
            if isinstance(leaf, torch.Tensor):
                flat = leaf.detach().cpu().contiguous().reshape(-1)
                digest.update(f"{flat.dtype}{tuple(leaf.shape)}".encode() + flat.view(torch.uint8).numpy().tobytes())
            else:
                digest.update(repr(leaf).encode())
        digest.update(b"\0")
    return digest.digest()


def split_draws(*, data_loader: DataLoader, max_batch_size: int, optimizer: Any) -> DataLoader:
    """Opacus's ``wrap_data_loader`` (BatchMemoryManager's): ``data_loader``'s draws cut into
    physical batches of at most ``max_batch_size`` rows (a :class:`DrawLoader` following
    ``optimizer``, a plugin optimizer); Opacus's own loader for Opacus's optimizers."""
    sampler = data_loader.batch_sampler
    if not hasattr(optimizer, "ledger"):  # Opacus's optimizer
        sampler = BatchSplittingSampler(sampler=sampler, max_batch_size=max_batch_size, optimizer=optimizer)
        return DataLoader(dataset=data_loader.dataset, batch_sampler=sampler, **_options(data_loader))
    if isinstance(sampler, DrawSampler):  # a loader of the plugin's: its draws, split (again)
        if sampler.max_batch_size is not None and sampler.max_batch_size > max_batch_size:
            raise split_twice_error(max_batch_size, sampler.max_batch_size)
        size = max_batch_size if sampler.max_batch_size is None else sampler.max_batch_size
        sampler = DrawSampler(sampler.poisson, sampler.index, size)
    else:
        sampler = DrawSampler(sampler, EXAMPLES, max_batch_size)
    loader = DrawLoader(dataset=data_loader.dataset, batch_sampler=sampler, **_options(data_loader))
    loader.follow_rows()
    loader.follow(optimizer)
    return loader


def _options(data_loader: DataLoader) -> dict:
    return {name: getattr(data_loader, name) for name in _LOADER_OPTIONS}


# --- the module side: the batch each training forward took -------------------------------------

class BatchReader:
    """What every form's module shares (its per-batch entry point, :meth:`take_batch`): the
    :class:`Batch` of the model's training forward, the one the followed optimizer's
    :class:`Ledger` says it takes, read by the layers' hooks (:attr:`batch`) and by the
    optimizer's step (:meth:`take_step_batches`)."""

    #: what the followed optimizer's steps protect (``"example"``/``"user"``; its ``bind_module`` sets it)
    privacy_unit: str = EXAMPLE_UNIT
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
            self._took_rows |= any(t.numel() > 0 for t in tensors_in((args, kwargs)))

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
        """The batch a training forward on ``inputs`` takes: the followed optimizer's
        :class:`Ledger`'s when a plugin loader delivers to it; else, at example level, a batch of
        rows (each its own unit; Opacus's loaders); else refused (ValueError)."""
        optimizer = None if self._batches_from is None else self._batches_from()
        ledger = getattr(optimizer, "ledger", None)
        bound = ledger is not None and ledger.bound
        batch = ledger.take(inputs) if bound else None
        if batch is not None:
            return batch
        if bound or self.privacy_unit != EXAMPLE_UNIT:
            tensors = tensors_in(inputs)
            raise unannounced_batch_error(tensors[0] if tensors else None, bound=bound)
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
        optimizer = None if self._batches_from is None else self._batches_from()
        ledger = getattr(optimizer, "ledger", None)
        if ledger is not None:
            ledger.end_step()
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
    "EVALUATION_HINT", "Batch", "BatchReader", "CyclicPoissonLoader", "Draw", "DrawLoader", "DrawSampler", "Ledger",
    "NoBatch", "Rows", "UserDataLoader",
    "accumulation_error", "dataset_digest", "no_backward_cause", "signalled_batches", "split_draws", "tensors_in",
    "unannounced_batch_error", "unfrozen_error",
]
