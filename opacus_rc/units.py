"""The privacy unit: what one clip bounds, what the sampler draws, what epsilon protects.

``privacy_unit="example"`` (the default) protects one dataset row. ``privacy_unit="user"``
protects a person with all their rows (user-level DP by user-level sampling, "ULS" in
Charles et al. 2024, "user-wise DP-SGD" in Chua et al. 2024):

* sampling: Poisson over users at the public rate ``q_u``; a sampled user contributes
  ``m_u = min(k, n_u)`` of their ``n_u`` rows, chosen uniformly at random without
  replacement, fresh at each draw (``k``: ``max_examples_per_user``);
* clipping: one clip per user, of the mean of their selected rows' gradients,
  ``g_u = clip_C((1/m_u) sum_{r in u} g_r)``; the update is
  ``(sum_u g_u + N(0, sigma^2 C^2)) / E[U]`` (the public expected number of users);
* accounting: adding or removing one user changes one unit of one draw by at most C, so
  ``rc_prv`` charges each step at ``q_u`` as it charges examples at ``q``.

The forms honour the unit through :class:`RowUnits` alone (what a delivered batch's rows are in
units); the design and its checks: docs/privacy_unit.md.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Sampler

from .estimators import as_sequence
from .sketch import entropy_seed
from .values import EXAMPLE_UNIT, PRIVACY_UNITS, USER_UNIT, positive_int

#: default contribution bound k: the rows a sampled user contributes to one step
DEFAULT_MAX_EXAMPLES_PER_USER = 8


def check_privacy_unit(privacy_unit: Any) -> str:
    """``privacy_unit=``: ``"example"`` or ``"user"`` (else a ValueError naming the parameter)."""
    if privacy_unit not in PRIVACY_UNITS:
        raise ValueError(
            f"privacy_unit={privacy_unit!r} is invalid; accepted values: "
            + ", ".join(repr(u) for u in PRIVACY_UNITS)
        )
    return privacy_unit


def check_max_examples_per_user(k: Any) -> int:
    """``max_examples_per_user=``: a positive int (else a ValueError naming the parameter)."""
    if not positive_int(k):
        raise ValueError(
            f"max_examples_per_user={k!r} is invalid; accepted values: a positive int (the rows "
            f"a sampled user contributes to one step; default {DEFAULT_MAX_EXAMPLES_PER_USER})"
        )
    return int(k)


class UserIndex:
    """Which user owns each dataset row.

    Args:
        user_ids: one id per dataset row (``len(user_ids) == len(dataset)``), each read as its
            :func:`user_key` (ids equal as values are one user).
        dataset_size: the dataset's length.
        max_examples_per_user: the contribution bound k.

    Raises:
        ValueError: naming ``user_ids`` (missing, wrong length) or ``user_ids[row]`` (:func:`user_key`).
    """

    def __init__(self, user_ids: Any, dataset_size: int, max_examples_per_user: int) -> None:
        if user_ids is None:
            raise ValueError(
                "privacy_unit='user' needs user_ids=: one id per dataset row (any hashable: "
                "an int, a string), the person who wrote it"
            )
        if isinstance(user_ids, torch.Tensor):
            user_ids = user_ids.tolist()
        if isinstance(user_ids, (str, bytes)):
            raise ValueError(f"user_ids={user_ids!r} is invalid; accepted values: a sequence of hashable ids, "
                             "one per dataset row (not a column name)")
        try:
            ids = list(user_ids)
        except TypeError:
            raise ValueError(f"user_ids={type(user_ids).__name__} is invalid; accepted values: a sequence of "
                             "hashable ids, one per dataset row") from None
        if len(ids) != dataset_size:
            raise ValueError(
                f"user_ids has {len(ids)} ids for a dataset of {dataset_size} rows; accepted values: "
                "one id per dataset row"
            )
        position: dict = {}
        owner = []
        digest = hashlib.sha256()
        for row, uid in enumerate(ids):
            key = user_key(uid, row)
            digest.update(repr(key).encode() + b"\0")  # repr escapes NUL: one reading per list
            owner.append(position.setdefault(key, len(position)))
        #: sha256 of the rows' keys in row order (the same on ranks given the same user_ids)
        self.digest = digest.digest()
        self.user_of_row = torch.tensor(owner, dtype=torch.long)
        self.num_users = len(position)
        counts = torch.bincount(self.user_of_row, minlength=self.num_users)
        order = torch.argsort(self.user_of_row, stable=True)
        self._rows = list(torch.split(order, counts.tolist()))  # rows of each user, ascending
        self.max_examples_per_user = check_max_examples_per_user(max_examples_per_user)
        #: m_u: the rows a sampled user contributes (min(k, n_u)), per user
        self.contributed = counts.clamp(max=self.max_examples_per_user)

    def rows_of(self, user: int) -> torch.Tensor:
        """The dataset rows of ``user`` (ascending)."""
        return self._rows[user]

    def units_of(self, rows: Sequence[int]) -> "RowUnits":
        """The users of dataset ``rows`` (a delivered batch) and their ``m_u``."""
        users = self.user_of_row[torch.as_tensor(list(rows), dtype=torch.long)]
        return RowUnits(users=users, sizes=self.contributed[users])


#: what :func:`user_key` accepts as one row's id
ACCEPTED_USER_IDS = (
    "accepted values: an int, a str, bytes, a bool, an integral float (3.0 is the int 3), a numpy scalar of these, "
    "or a tuple of them (ids in a tensor: the tensor itself or tensor.tolist())"
)


def _canonical(uid: Any) -> Any:
    """:func:`user_key` of ``uid``, None where it has no stable value."""
    if isinstance(uid, np.generic):
        uid = uid.item()  # a numpy scalar: its Python value
    if isinstance(uid, tuple):
        parts = tuple(_canonical(part) for part in uid)
        return None if None in parts else parts
    if isinstance(uid, (str, bytes)):  # a subclass (an enum's member): its plain value
        return str.__str__(uid) if isinstance(uid, str) else bytes(uid)
    if isinstance(uid, numbers.Integral):  # bool and int: True == 1 in Python, one key
        return int(uid)
    if isinstance(uid, numbers.Real) and math.isfinite(uid) and float(uid).is_integer():
        return int(uid)
    return None


def user_key(uid: Any, row: int = 0) -> Any:
    """The canonical key of ``user_ids[row]``: equal ids give equal keys (``3``, ``3.0``,
    ``np.int64(3)``: the int 3; ``True``: 1; tuples part by part), plain ints, strs, bytes and
    tuples whose ``repr`` is the same in every process.

    Raises:
        ValueError: naming ``user_ids[row]``, an id with no stable value (one person would
            be several units, each clipped to C): None, NaN or another non-integer float
            (anywhere in a tuple too), a tensor element, any other object.
    """
    key = _canonical(uid)
    if key is None:
        raise ValueError(
            f"user_ids[{row}]={uid!r} is invalid (None, NaN, a non-integer float, a tensor element or another "
            f"object, anywhere in the id, is no stable user: a missing id?); {ACCEPTED_USER_IDS}"
        )
    return key


class ExampleUnits:
    """Example level as a :class:`UserIndex`: each dataset row is its own unit (``m = 1``)."""

    max_examples_per_user = 1

    def units_of(self, rows: Sequence[int]) -> "RowUnits":
        """The units of dataset ``rows``: the rows themselves."""
        rows = torch.as_tensor(list(rows), dtype=torch.long)
        return RowUnits.singletons(len(rows), rows)


#: the units of example level
EXAMPLES = ExampleUnits()


def check_same_on_ranks(index: UserIndex) -> None:
    """Under ``torch.distributed``, refuse ranks given different rows or ids: the sampler
    splits one user index over the ranks, so a user in two ranks' shards would be drawn and
    clipped on both (2 C). One all-reduce (MAX) of ``[d, -d]``, ``d`` = (dataset length, the
    :attr:`UserIndex.digest` bytes): equal on every rank iff max = -max(-d).

    Raises:
        ValueError: the ranks' dataset lengths or ``user_ids`` differ."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    mine = torch.tensor([len(index.user_of_row), *index.digest], dtype=torch.int64, device=device)
    both = torch.cat([mine, -mine])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    if not torch.equal(both[: len(mine)], -both[len(mine):]):
        raise ValueError(
            "privacy_unit='user' under torch.distributed: the ranks were given different rows or user_ids (the "
            "dataset's length or its ids differ between ranks); accepted values: every rank passes the whole "
            "dataset and the same user_ids (the returned loader shards the users itself: rank r draws users "
            "r, r + world_size, ...)"
        )


class _Uniform:
    """Uniform draws from a torch generator or the plugin's CSPRNG (secure mode); None: a
    generator of its own seeded from ``os.urandom`` (never torch's global one, which a
    script re-seeds)."""

    def __init__(self, generator: Any) -> None:
        if generator is None:
            generator = torch.Generator().manual_seed(entropy_seed())
        self.generator = generator

    def __call__(self, n: int) -> torch.Tensor:
        if isinstance(self.generator, torch.Generator):
            return torch.rand(n, generator=self.generator, dtype=torch.float64)
        return self.generator.uniform(n)


def user_epoch_draws(sample_rate: float) -> int:
    """Draws in one epoch over users at ``q_u = sample_rate``: ``max(1, round(1 / q_u))``."""
    return max(1, round(1.0 / sample_rate))


class UserPoissonSampler(Sampler[List[int]]):
    """Poisson sampling over users: each of ``steps`` draws holds every user independently
    with probability ``sample_rate``, and a sampled user's ``min(k, n_u)`` rows, chosen
    uniformly without replacement (fresh at each draw). A user's rows are contiguous in
    the draw. ``steps`` defaults to :func:`user_epoch_draws` (an epoch over users).

    Distributed (``world_size > 1``): rank ``r`` owns users ``r, r + world_size, ...``
    (a fixed split of the user index; each user's rows stay on one rank) and samples them
    at the same rate with its own generator, so the union over ranks is one Poisson draw
    of users at ``sample_rate``; every rank yields every draw (an empty one too).

    Args:
        index: the :class:`UserIndex`.
        sample_rate: q_u in (0, 1].
        generator: a ``torch.Generator`` or the plugin's CSPRNG (secure mode).
        steps: draws per epoch.
        rank, world_size: this process's share of the users.
    """

    def __init__(self, index: UserIndex, sample_rate: float, generator: Any = None,
                 steps: Optional[int] = None, rank: int = 0, world_size: int = 1) -> None:
        self.index = index
        self.sample_rate = float(sample_rate)
        self.uniform = _Uniform(generator)
        self.steps = steps if steps is not None else user_epoch_draws(self.sample_rate)
        self.users = torch.arange(index.num_users)[rank::world_size]  # this rank's users

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[List[int]]:
        for _ in range(self.steps):
            yield self.draw_from(self.users)

    def draw_from(self, users: torch.Tensor) -> List[int]:
        """The rows of one draw: each of ``users`` with probability ``sample_rate``, a sampled
        user's ``min(k, n_u)`` rows uniformly without replacement (contiguous)."""
        sampled = users[self.uniform(len(users)) < self.sample_rate]
        if isinstance(self.index, _ExampleRows):  # a unit is its row: no per-unit lookup
            return sampled.tolist()
        k = self.index.max_examples_per_user
        draw: List[int] = []
        for user in sampled.tolist():
            rows = self.index.rows_of(user)
            if len(rows) > k:  # a uniform k-subset: the k smallest of i.i.d. uniforms
                rows = rows[torch.argsort(self.uniform(len(rows)))[:k]]
            draw.extend(rows.tolist())
        return draw


class _ExampleRows:
    """Example level as a user index of ``n`` rows for :class:`CyclicPoissonSampler`: unit
    ``u`` is row ``u``."""

    max_examples_per_user = 1

    def __init__(self, n: int) -> None:
        self.num_users = n

    def rows_of(self, unit: int) -> torch.Tensor:
        return torch.tensor([unit])


class CyclicPoissonSampler(UserPoissonSampler):
    """Cyclic Poisson sampling (amplified banded matrix factorisation, :mod:`opacus_rc.correlated`):
    the units (users, or rows at example level: ``index=None`` and ``num_units``) are split into
    ``bands`` fixed parts by a public rule, unit ``u`` in part ``u mod bands``; draw ``t`` samples
    part ``t mod bands`` only, each of its units with probability ``sample_rate`` (the rate
    inside a part), so a unit's draws are always ``bands`` apart. Draws are numbered across
    epochs (:meth:`numbered_draws`; :meth:`continue_at` resumes the sequence of a checkpoint).

    Distributed: every rank has the same parts and takes every ``world_size``-th unit of each
    (the union over ranks is one Poisson draw of the part); every rank yields every draw.
    """

    def __init__(self, index: Optional[UserIndex], sample_rate: float, bands: int, generator: Any = None,
                 steps: Optional[int] = None, rank: int = 0, world_size: int = 1, num_units: int = 0) -> None:
        super().__init__(index if index is not None else _ExampleRows(num_units), sample_rate, generator, steps)
        units = torch.arange(self.index.num_users)
        self.bands = bands
        self.parts = [units[part::bands][rank::world_size] for part in range(bands)]
        #: the number of the next draw (all epochs)
        self.next_draw = 0

    def continue_at(self, step: int) -> None:
        """Number the next draw at least ``step`` (a resumed run's: its noise's next step)."""
        self.next_draw = max(self.next_draw, int(step))

    def numbered_draws(self) -> Iterator[Tuple[int, List[int]]]:
        """An epoch's ``(draw number, rows)``; draw ``t`` samples part ``t mod bands``."""
        for _ in range(self.steps):
            step, self.next_draw = self.next_draw, self.next_draw + 1
            yield step, self.draw_from(self.parts[step % self.bands])

    def __iter__(self) -> Iterator[List[int]]:
        for _, rows in self.numbered_draws():
            yield rows


@dataclass(frozen=True)
class RowUnits:
    """The units of a delivered batch's rows: ``users`` (B,) the owner of each row (example
    level: the row itself), ``sizes`` (B,) its owner's ``m_u`` (the rows the owner contributes
    to the draw; 1 for an example), and ``last`` (B,) whether the row is its owner's last one in
    the draw (from a whole draw's rows, where a unit's rows are contiguous; kept by :meth:`rows`)."""

    users: torch.Tensor
    sizes: torch.Tensor
    last: Optional[torch.Tensor] = None
    #: each unit is one row of one (:meth:`singletons`: examples): a unit is its row
    single_rows: bool = field(default=False, compare=False)
    #: :meth:`layout` per device, computed and checked once per batch (every layer reads it)
    _layouts: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.last is None:
            last = torch.ones(len(self), dtype=torch.bool)
            last[:-1] = self.users[1:] != self.users[:-1]
            object.__setattr__(self, "last", last)

    @classmethod
    def singletons(cls, rows: int, users: Optional[torch.Tensor] = None) -> "RowUnits":
        """``rows`` rows, each its own unit of one row (example level; ``users``: their ids)."""
        ones = torch.ones(rows, dtype=torch.long)
        units = cls(torch.arange(rows) if users is None else users, ones, torch.ones(rows, dtype=torch.bool), True)
        units._layouts[torch.device("cpu")] = (torch.arange(rows), torch.zeros(rows, dtype=torch.long), rows)
        return units

    def __len__(self) -> int:
        return int(self.users.shape[0])

    @property
    def one_row_each(self) -> bool:
        """Every unit of the batch is one row, in order: a regrouping is the identity."""
        return self.layout()[2] == len(self)

    def layout(self, device: Any = None) -> Tuple[torch.Tensor, torch.Tensor, int]:
        """``(slot, position, count)``: the unit slot of each row (users in order of first
        appearance), the row's position among its unit's rows (both on ``device``), and the
        number of units; checked once that every user's rows in the batch are all its rows
        of the draw, contiguous.

        Raises:
            ValueError: a user split across physical batches, or its rows interleaved.
        """
        key = torch.device("cpu") if device is None else torch.device(device)
        if key not in self._layouts:
            cpu = self._layouts.get(torch.device("cpu")) or self._cpu_layout()
            self._layouts[torch.device("cpu")] = cpu
            self._layouts[key] = (cpu[0].to(key), cpu[1].to(key), cpu[2])
        return self._layouts[key]

    def _cpu_layout(self) -> Tuple[torch.Tensor, torch.Tensor, int]:
        users, slot = torch.unique_consecutive(self.users, return_inverse=True)
        counts = torch.bincount(slot, minlength=len(users))
        sizes = torch.zeros_like(counts).scatter_(0, slot, self.sizes)
        if not torch.equal(counts, sizes) or len(torch.unique(users)) != len(users):
            raise ValueError(
                "privacy_unit='user' with a physical batch that holds part of a user's rows: book-keeping "
                "and the two-pass forms clip a user within one physical batch (the returned loader's "
                "batches, or BatchMemoryManager's, which cut draws between users); per_example_backward=True "
                "spreads a user's rows over backward passes"
            )
        start = torch.cumsum(counts, 0) - counts
        return slot, torch.arange(len(self)) - start[slot], len(users)

    def rows(self, start: int, stop: int) -> "RowUnits":
        """The units of rows ``start:stop`` of the batch (e.g. one row of a per-example pass)."""
        if self.single_rows:
            return RowUnits.singletons(len(self.users[start:stop]), self.users[start:stop])
        return RowUnits(self.users[start:stop], self.sizes[start:stop], self.last[start:stop])


# --- a batch's rows regrouped into its units -----------------------------------------------

def unit_layout(units: RowUnits, batch: int, device: Any = None) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """:meth:`RowUnits.layout` of a batch of ``batch`` rows (on ``device``).

    Raises:
        ValueError: when ``units`` does not describe ``batch`` rows, or (:meth:`RowUnits.layout`)
            a user's rows in the batch are not all of its rows of the draw.
    """
    if len(units) != batch:
        raise ValueError(
            f"privacy_unit='user': a forward pass took {batch} rows, but the loader make_private "
            f"returned delivered a batch of {len(units)}: train on the batches of the returned loader"
        )
    return units.layout(device)


def regroup_rows(t: torch.Tensor, units: RowUnits) -> torch.Tensor:
    """``t`` (B, T, n) regrouped into its units: (U, L * T, n) where unit ``u``'s sequence is
    its rows' sequences one after another (zero-padded to the longest unit, L rows): a
    user's gradient ``sum_r A_r^T G_r`` is that of one sequence of all their tokens."""
    slot, position, count = unit_layout(units, t.shape[0], t.device)
    if count == len(units):  # one row each, in order: the identity
        return t
    longest = int(units.sizes.max())
    out = t.new_zeros((count, longest, *t.shape[1:]))
    out[slot, position] = t
    return out.reshape(count, longest * t.shape[1], *t.shape[2:])


def regroup_uses(module: nn.Module, a: torch.Tensor, g: torch.Tensor, units: RowUnits) -> Tuple[torch.Tensor, torch.Tensor]:
    """A layer's ``(A, G)`` of a batch regrouped into its users (:func:`regroup_rows`; an
    embedding's ``A`` is its ids): ``sum_{r in u} A_r^T G_r`` is the gradient of one
    sequence of all user ``u``'s tokens."""
    if unit_layout(units, a.shape[0])[2] == len(units):  # one row each, in order: as they are
        return a, g
    ids = isinstance(module, nn.Embedding)
    a = a.reshape(a.shape[0], math.prod(a.shape[1:])) if ids else as_sequence(a)
    return regroup_rows(a, units), regroup_rows(as_sequence(g), units)


def sum_rows_by_unit(t: torch.Tensor, units: RowUnits) -> torch.Tensor:
    """``t`` (B, ...) summed over each unit's rows: (U, ...)."""
    slot, _, count = unit_layout(units, t.shape[0], t.device)
    if count == len(units):  # one row each, in order: the identity
        return t
    return t.new_zeros((count, *t.shape[1:])).index_add_(0, slot, t)


def in_row_slots(values: torch.Tensor, rows: int) -> torch.Tensor:
    """Per-unit ``values`` (U, ...) in the first U of ``rows`` slots, zeros after: the shape
    of per-row values that Opacus's ghost-clipping hooks keep (a unit's norm in slot u)."""
    if values.shape[0] == rows:
        return values
    out = values.new_zeros((rows, *values.shape[1:]))
    out[: values.shape[0]] = values
    return out


def mean_clip_factors(norms: torch.Tensor, sizes: Any, max_grad_norm: float) -> torch.Tensor:
    """The factors on each unit's summed gradient ``S_u`` that clip its mean ``S_u / m_u``:
    ``min(1, C / (||S_u|| / m_u + 1e-6)) / m_u`` (``sizes``: m_u, or 1 for examples)."""
    return (max_grad_norm / (norms / sizes + 1e-6)).clamp(max=1.0) / sizes


def per_row(values: torch.Tensor, units: RowUnits) -> torch.Tensor:
    """Each row's value of its unit: ``values`` (U,) -> (B,)."""
    slot, _, _ = unit_layout(units, len(units), values.device)
    return values[slot]


def unit_sizes(units: RowUnits) -> torch.Tensor:
    """``m_u`` of each unit of the batch (U,), in slot order: its rows in the batch, which the
    layout's check proved to be all its rows of the draw."""
    slot, _, count = unit_layout(units, len(units))
    return torch.bincount(slot, minlength=count)


__all__ = [
    "CyclicPoissonSampler", "DEFAULT_MAX_EXAMPLES_PER_USER", "EXAMPLES", "EXAMPLE_UNIT", "USER_UNIT", "PRIVACY_UNITS",
    "ExampleUnits",
    "RowUnits", "UserIndex", "UserPoissonSampler", "check_max_examples_per_user", "check_privacy_unit",
    "in_row_slots", "mean_clip_factors", "per_row", "regroup_rows", "regroup_uses", "sum_rows_by_unit",
    "unit_layout", "unit_sizes", "user_key", "user_epoch_draws", "check_same_on_ranks",
]
