"""The private Trainer's training data: every logical step is one Poisson draw
(:class:`PoissonAccumulationSampler`; at ``privacy_unit="user"`` a draw over users,
:class:`~opacus_rc.units.UserPoissonSampler`), collated by the Trainer's collator, an empty
draw becoming a marker batch (:func:`is_empty_batch`); at user level each batch carries its
rows' units (:func:`take_units`), in the order the collator put the rows in
(:class:`~opacus_rc.row_order.RowOrderCollate`). For a noise mechanism served by cyclic draws
(its spec's ``parts``, e.g. banded noise's ``bands=b``) the draws are cyclic
(:class:`~opacus_rc.units.CyclicPoissonSampler`: draw t from part t mod b of the units) and
each batch carries its draw's number (:func:`take_draw_step`), the mechanism's time."""

from __future__ import annotations

import functools
from collections.abc import Mapping, MutableMapping
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..sketch import entropy_seed
from ..draws import DrawSampler
from ..row_order import Collated, RowOrderCollate
from ..units import EXAMPLES, CyclicPoissonSampler, RowUnits, UserIndex, UserPoissonSampler

_EMPTY = "__opacus_rc_empty_batch__"
_UNITS = "__opacus_rc_row_units__"
_DRAW = "__opacus_rc_draw_step__"


class PoissonAccumulationSampler(Sampler[List[int]]):
    """Batch sampler of the private Trainer: every logical step is ONE Poisson draw (each
    row joins independently with probability ``sample_rate``), split into
    ``micro_batches`` consecutive physical batches of nearly equal size (some may be empty).

    ``len()`` is ``steps x micro_batches``, a function of public values only. The masks come
    from a ``torch.Generator`` seeded from ``os.urandom`` (``secure_mode``: the CSPRNG), never
    from the global generator. Distributed: rank ``r`` samples the fixed share
    ``r, r + world_size, ...`` at the same rate (the union over ranks is one Poisson draw).

    ``users`` (``privacy_unit="user"``): each draw is one draw of
    :class:`~opacus_rc.units.UserPoissonSampler` (users at ``sample_rate``, a sampled user's
    ``min(k, n_u)`` rows), split between users, never inside one (each physical batch holds
    whole users: book-keeping clips a user within one backward pass). Distributed: rank ``r``
    draws its share of the USERS, ``r, r + world_size, ...`` (a user's rows stay on one
    rank), with its own generator; the union over ranks is one Poisson draw of users.

    ``bands`` (the parts of a numbered noise mechanism's sampler, e.g. banded noise's): cyclic Poisson draws of
    :class:`~opacus_rc.units.CyclicPoissonSampler` over the units (rows, or ``users``): draw
    ``t`` samples part ``t mod bands`` only, at ``sample_rate`` (the rate inside a part, b
    times the overall rate); draws are numbered across epochs (:meth:`numbered_draws`,
    :meth:`serve`).
    """

    def __init__(
        self,
        *,
        num_samples: int,
        sample_rate: float,
        micro_batches: int,
        steps: int,
        rank: int = 0,
        world_size: int = 1,
        secure_mode: bool = False,
        users: Optional[UserIndex] = None,
        bands: Optional[int] = None,
    ) -> None:
        self.num_samples = int(num_samples)
        self.sample_rate = float(sample_rate)
        self.micro_batches = int(micro_batches)
        self.steps = int(steps)
        self.rank, self.world_size = int(rank), int(world_size)
        self.secure_mode = secure_mode
        self.share = len(range(self.rank, self.num_samples, self.world_size))
        self._generator = None if secure_mode else torch.Generator().manual_seed(entropy_seed())
        self.users = users
        self.bands = bands
        self._user_draws: Optional[UserPoissonSampler] = None
        if users is not None or bands is not None:
            from ..csprng import default_generator

            generator = default_generator() if secure_mode else self._generator
            share = dict(steps=1, rank=self.rank, world_size=self.world_size)
            self._user_draws = UserPoissonSampler(users, self.sample_rate, generator, **share) if bands is None else \
                CyclicPoissonSampler(users, self.sample_rate, bands, generator, num_units=self.num_samples, **share)
        self.draws = 0  #: logical steps drawn so far (the loader check: this sampler is iterated)

    def __len__(self) -> int:
        return self.steps * self.micro_batches

    def _mask(self) -> torch.Tensor:
        if self.secure_mode:
            from ..csprng import secure_bernoulli

            return secure_bernoulli(self.sample_rate, self.share)
        return torch.rand(self.share, generator=self._generator) < self.sample_rate

    def _draw(self) -> Tuple[Optional[int], List[torch.Tensor]]:
        """One logical step's number (cyclic draws; else None) and rows, split into
        ``micro_batches`` physical batches."""
        step = None
        if self._user_draws is None:
            rows = self._mask().nonzero().reshape(-1) * self.world_size + self.rank
            return step, list(torch.tensor_split(rows, self.micro_batches))
        if self.bands is None:
            drawn = next(iter(self._user_draws))
        else:
            step, drawn = next(self._user_draws.numbered_draws())
        rows = torch.tensor(drawn, dtype=torch.long)
        if self.users is None:
            return step, list(torch.tensor_split(rows, self.micro_batches))
        # a user's rows are contiguous: split the users, not the rows
        _, counts = torch.unique_consecutive(self.users.user_of_row[rows], return_counts=True)
        per_part = [int(c.sum()) for c in torch.tensor_split(counts, self.micro_batches)]
        return step, list(torch.split(rows, per_part))

    def serve(self, noise: Any) -> None:
        """The cyclic draws serve ``noise``'s run from its next step
        (:meth:`~opacus_rc.units.CyclicPoissonSampler.serve`)."""
        if self.bands is not None:
            self._user_draws.serve(noise)

    def numbered_draws(self) -> Iterator[Tuple[Optional[int], List[int]]]:
        """An epoch's physical batches, each with its logical step's draw number (cyclic draws;
        None otherwise): what :class:`~opacus_rc.draws.DrawSampler` reads."""
        for _ in range(self.steps):
            step, parts = self._draw()
            self.draws += 1
            for part in parts:
                yield step, part.tolist()

    def __iter__(self) -> Iterator[List[int]]:
        for _, rows in self.numbered_draws():
            yield rows

    def __getstate__(self):
        raise TypeError("the Poisson sampler's generator is a secret: it is never pickled or saved")


def _collate_or_mark(collate: Callable, rows: List[Any]) -> Any:
    """The Trainer's collator; an empty Poisson batch becomes a marker (no forward pass)."""
    return {_EMPTY: True} if len(rows) == 0 else collate(rows)


def take_units(inputs: Any) -> Optional[RowUnits]:
    """Remove and return the units a user-level batch carries (None: example level)."""
    return inputs.pop(_UNITS, None) if isinstance(inputs, MutableMapping) else None


def take_draw_step(inputs: Any) -> Optional[int]:
    """Remove and return the number of the cyclic draw a batch belongs to (None: a noise
    mechanism without numbered draws, or a batch from another loader)."""
    return inputs.pop(_DRAW, None) if isinstance(inputs, MutableMapping) else None


USER_AT, CYCLIC_AT = "privacy_unit='user'", "a noise= over cyclic Poisson draws (e.g. noise='banded')"


class UserPoissonLoader(DataLoader):
    """The private Trainer's loader at ``privacy_unit="user"`` or over cyclic draws: each
    delivered batch (a mapping, or the empty marker) carries its rows'
    :class:`~opacus_rc.units.RowUnits` (user level) and its draw's number (cyclic draws)
    under private keys, set in the main process (:class:`~opacus_rc.draws.DrawSampler`) and
    removed by :func:`take_units` and :func:`take_draw_step` before the model: the Trainer
    fetches a step's batches before training on them, so they travel with the batch, not
    beside it."""

    def __init__(self, dataset: Dataset, *, batch_sampler: PoissonAccumulationSampler, **kwargs: Any) -> None:
        index = EXAMPLES if batch_sampler.users is None else batch_sampler.users
        super().__init__(dataset, batch_sampler=DrawSampler(batch_sampler, index), **kwargs)
        self.user_index = batch_sampler.users

    def __iter__(self) -> Iterator[Any]:
        pending = self.batch_sampler.pending
        users, cyclic = self.user_index is not None, self.batch_sampler.poisson.bands is not None
        for batch in super().__iter__():
            delivered = pending.popleft()
            if isinstance(batch, Collated):  # user level: the rows' order after the collator
                batch, delivered = batch.data, delivered.reordered(batch.order)
            if not isinstance(batch, MutableMapping):
                raise ValueError(
                    f"{USER_AT if users else CYCLIC_AT}: the data_collator returned a "
                    f"{type(batch).__name__}; accepted values: a dict (or BatchEncoding) of the batch's tensors"
                )
            if users:
                batch[_UNITS] = delivered.units
            if cyclic:
                batch[_DRAW] = delivered.draw.step
            yield batch


def poisson_sampler_of(loader: Any) -> Optional[PoissonAccumulationSampler]:
    """The :class:`PoissonAccumulationSampler` ``loader`` draws with (None: another sampler)."""
    sampler = getattr(loader, "batch_sampler", None)
    if isinstance(sampler, DrawSampler):
        sampler = sampler.poisson
    return sampler if isinstance(sampler, PoissonAccumulationSampler) else None


def is_empty_batch(inputs: Any) -> bool:
    """The marker of an empty Poisson draw (a mapping: the script may have turned it into another)."""
    return isinstance(inputs, Mapping) and inputs.get(_EMPTY, False) is True


def one_row_batches(inputs: Dict[str, Any], units: Optional[RowUnits] = None
                    ) -> Tuple[List[Dict[str, Any]], Optional[RowUnits]]:
    """A collated batch as batches of one row each (the per-example form's physical batch): every
    tensor with the batch's rows along dimension 0 sliced, everything else kept; with ``units``,
    a unit's rows one after another (a collator may have sorted them apart) and the units so."""
    rows = next((v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim() > 0), 0)

    def row(value: Any, i: int) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
            return value[i:i + 1]
        return value

    order = list(range(rows)) if units is None else units.grouped()
    return [{k: row(v, i) for k, v in inputs.items()} for i in order], None if units is None else units.take(order)


def poisson_loader(
    dataset: Dataset, collator: Callable, *, num_workers: int, pin_memory: bool, **sampler: Any
) -> DataLoader:
    """The private Trainer's training loader: ``dataset`` drawn by a
    :class:`PoissonAccumulationSampler` (``sampler``: its arguments but ``num_samples``),
    collated by ``collator`` (an empty batch: the marker of :func:`is_empty_batch`); with
    ``users=`` or ``bands=`` a :class:`UserPoissonLoader`."""
    batch_sampler = PoissonAccumulationSampler(num_samples=len(dataset), **sampler)
    plain = batch_sampler.users is None and batch_sampler.bands is None
    collate = functools.partial(_collate_or_mark, collator)
    return (DataLoader if plain else UserPoissonLoader)(
        dataset,
        batch_sampler=batch_sampler,
        collate_fn=collate if batch_sampler.users is None else RowOrderCollate(collate),  # users: rows followed
        num_workers=num_workers,
        pin_memory=pin_memory,
    )


__all__ = [
    "PoissonAccumulationSampler", "UserPoissonLoader", "is_empty_batch", "one_row_batches", "poisson_loader",
    "poisson_sampler_of", "take_draw_step", "take_units",
]
