"""Physical batches of Poisson draws, delivered in step with ``optimizer.step()``.

A loader that cuts each Poisson draw into physical batches tells the optimizer, through
Opacus's skip signals (a queue popped by each ``step()``), which batch ends its draw; a script
calling ``step()`` every ``k`` batches would pop them out of step with its batches, and a
release would hold part of a draw, or a draw twice. :class:`DrawLoader` counts the physical
batches it delivers (in the main process), and the plugin's optimizer refuses a ``step()``
that does not follow exactly one of them
(:meth:`~opacus_rc.optimizer.RandomizedClippingMixin.check_draw_boundary`): one release, one
Poisson draw (docs/forms.md). It also hands each batch to the per-example form's module
(``note_batch``), which holds every forward to the batch in hand.

``import opacus_rc`` makes ``opacus.utils.batch_memory_manager.wrap_data_loader``
(BatchMemoryManager's) :func:`split_draws` (:data:`opacus_rc.registration.PATCHES`).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional

from opacus.utils.batch_memory_manager import BatchSplittingSampler
from torch.utils.data import DataLoader

from .optimizer import RandomizedClippingMixin
from .units import RecordingBatchSampler, UserDataLoader, UserIndex, delivered_units


#: the options of a loader its split keeps (as Opacus's ``wrap_data_loader``)
_LOADER_OPTIONS = (
    "num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context", "generator",
    "prefetch_factor", "persistent_workers",
)


def _split_loader_kwargs(data_loader: DataLoader, max_batch_size: int, optimizer: Any) -> Dict[str, Any]:
    """Opacus's ``wrap_data_loader``: ``data_loader`` with its batch sampler split (a
    recording wrapper of a user-level loader's unwrapped: the new loader records its own)."""
    sampler = data_loader.batch_sampler
    if isinstance(sampler, RecordingBatchSampler):
        sampler = sampler.batch_sampler
    split = BatchSplittingSampler(sampler=sampler, max_batch_size=max_batch_size, optimizer=optimizer)
    options = {name: getattr(data_loader, name) for name in _LOADER_OPTIONS}
    return dict(dataset=data_loader.dataset, batch_sampler=split, **options)


class UserBatchSplittingSampler(BatchSplittingSampler):
    """BatchMemoryManager's split of a user-level draw (``max_batch_size > 1``): physical batches
    of whole users, packed in draw order up to ``max_batch_size`` rows (a form clipping the users
    of one physical batch sees each whole); draw boundaries signalled as Opacus's splitter does.

    Raises:
        ValueError: ``max_batch_size`` below ``max_examples_per_user`` (a user could not fit).
    """

    def __init__(self, *, sampler: Any, max_batch_size: int, optimizer: Any, index: UserIndex) -> None:
        if max_batch_size < index.max_examples_per_user:
            raise ValueError(
                f"max_physical_batch_size={max_batch_size} is below max_examples_per_user="
                f"{index.max_examples_per_user}: at privacy_unit='user' a physical batch holds whole users; "
                "accepted values: max_physical_batch_size >= max_examples_per_user, or 1 with "
                "per_example_backward=True (one row per backward pass)"
            )
        super().__init__(sampler=sampler, max_batch_size=max_batch_size, optimizer=optimizer)
        self.index = index

    def __len__(self) -> int:
        return len(self.sampler)  # at least one physical batch per draw (their number is random)

    def __iter__(self) -> Iterator[List[int]]:
        for draw in self.sampler:
            chunks = self._whole_users(draw) or [[]]
            for chunk in chunks[:-1]:
                self.optimizer.signal_skip_step(do_skip=True, same_draw=True)
                yield chunk
            self.optimizer.signal_skip_step(do_skip=False)
            yield chunks[-1]

    def _whole_users(self, draw: List[int]) -> List[List[int]]:
        """``draw`` cut between users (a user's rows are contiguous) into chunks of at most
        ``max_batch_size`` rows."""
        chunks: List[List[int]] = []
        users = self.index.user_of_row[list(draw)].tolist() if draw else []
        start = 0
        for end in range(1, len(draw) + 1):
            if end < len(draw) and users[end] == users[end - 1]:
                continue  # inside one user's rows
            if chunks and len(chunks[-1]) + end - start <= self.max_batch_size:
                chunks[-1].extend(draw[start:end])
            else:
                chunks.append(list(draw[start:end]))
            start = end
        return chunks


class DrawLoader(DataLoader):
    """``data_loader`` with its batch sampler split into physical batches of at most
    ``max_batch_size`` rows (Opacus's :class:`BatchSplittingSampler`, which signals the draw
    boundaries), each delivered batch reported to ``optimizer`` (a plugin optimizer) and to
    the per-example module it follows, if any."""

    def __init__(self, *, data_loader: DataLoader, max_batch_size: int, optimizer: Any) -> None:
        kwargs = _split_loader_kwargs(data_loader, max_batch_size, optimizer)
        #: a user-level loader's index: each physical batch's users are announced
        self.user_index: Optional[UserIndex] = (
            data_loader.user_index if isinstance(data_loader, (UserDataLoader, DrawLoader)) else None
        )
        if self.user_index is not None:
            if isinstance(data_loader, UserDataLoader) and max_batch_size > 1:  # whole users per batch
                kwargs["batch_sampler"] = UserBatchSplittingSampler(
                    sampler=kwargs["batch_sampler"].sampler, max_batch_size=max_batch_size, optimizer=optimizer,
                    index=self.user_index,
                )
            kwargs["batch_sampler"] = RecordingBatchSampler(kwargs["batch_sampler"])
        super().__init__(**kwargs)
        self.draw_optimizer = optimizer

    @property
    def rows_per_batch(self) -> int:
        """The most dataset rows a delivered batch holds (the smallest of nested splits)."""
        sizes, sampler = [], self.batch_sampler
        if isinstance(sampler, RecordingBatchSampler):
            sampler = sampler.batch_sampler
        while isinstance(sampler, BatchSplittingSampler):
            sizes.append(sampler.max_batch_size)
            sampler = sampler.sampler
        return min(sizes)

    def __iter__(self) -> Iterator[Any]:
        optimizer = self.draw_optimizer
        bound = optimizer.bound_module()
        module = bound if self.rows_per_batch == 1 else None  # every form's module takes note_batch
        source = object()  # this iteration
        batches = super().__iter__()
        if self.user_index is not None:
            batches = delivered_units(batches, self.batch_sampler, self.user_index, optimizer.note_units)
        optimizer.start_physical_batches()
        try:
            for batch in batches:
                optimizer.note_physical_batch()
                if module is not None:
                    module.note_batch(batch, source)
                yield batch
        finally:
            optimizer.end_physical_batches()
            if module is not None:
                module.note_batch(None, source)


def split_draws(*, data_loader: DataLoader, max_batch_size: int, optimizer: Any) -> DataLoader:
    """Opacus's ``wrap_data_loader`` (BatchMemoryManager's): a :class:`DrawLoader` for a
    plugin optimizer, Opacus's own loader otherwise."""
    if not isinstance(optimizer, RandomizedClippingMixin):  # Opacus's optimizer: Opacus's loader
        return DataLoader(**_split_loader_kwargs(data_loader, max_batch_size, optimizer))
    return DrawLoader(data_loader=data_loader, max_batch_size=max_batch_size, optimizer=optimizer)


__all__ = ["DrawLoader", "UserBatchSplittingSampler", "split_draws"]
