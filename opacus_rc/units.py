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
import logging
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Sampler

from .estimators import as_sequence
from .ranks import agree_values, collective_device
from .sketch import entropy_seed
from .values import EXAMPLE_UNIT, PRIVACY_UNITS, USER_UNIT, positive_int

logger = logging.getLogger(__name__)

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
        #: each user's canonical key (:func:`user_key`), by user number: the user's stable identity
        self.keys: List[Any] = list(position)
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


def check_same_on_ranks(index: Optional[UserIndex], failed: bool = False) -> None:
    """Under ``torch.distributed``, refuse ranks given different rows or ids: the sampler
    splits one user index over the ranks, so a user in two ranks' shards would be drawn and
    clipped on both (2 C). A rank check (:mod:`opacus_rc.ranks`): one all-reduce (MAX) of
    ``[failed, d, -d]``, ``d`` = (whether the call is at user level, the dataset length, the
    :attr:`UserIndex.digest` bytes; zeros at example level): equal on every rank iff max = -max(-d).
    ``failed``: this rank raised before the check (the others then raise).

    Raises:
        ValueError: the ranks' privacy units, dataset lengths or ``user_ids`` differ.
        RefusedOnAnotherRank: another rank raised before the check.
    """
    values = [0] * 34 if index is None else [1, len(index.user_of_row), *index.digest]
    agreed = agree_values(values, "make_private's check of the options and user ids across ranks", failed)
    if agreed is not None and agreed[0] != agreed[1] and not failed:
        raise ValueError(
            "privacy_unit='user' under torch.distributed: the ranks were given different rows or user_ids (the "
            "privacy unit, the dataset's length or its ids differ between ranks); accepted values: every rank "
            "passes the whole dataset and the same user_ids (the returned loader shards the users itself: rank r "
            "draws users r, r + world_size, ...)"
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

    def secret(self) -> bytes:
        """32 secret bytes (a key) from the generator."""
        if isinstance(self.generator, torch.Generator):
            words = torch.randint(0, 1 << 62, (4,), generator=self.generator, dtype=torch.int64)
            return b"".join(int(w).to_bytes(8, "little") for w in words.tolist())
        return self.generator.random_bytes(32)


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
        self.keys = range(n)

    def rows_of(self, unit: int) -> torch.Tensor:
        return torch.tensor([unit])


def unit_parts(keys: Sequence[Any], bands: int, secret: bytes) -> torch.Tensor:
    """Each unit's part of the cycle, from its stable key: ``BLAKE2b_secret(repr(key)) mod bands``
    (64 bits). Under a secret drawn for the run the parts are uniform and independent, and a
    unit's part depends on its own key only: adding or removing a unit moves no other unit."""
    digest = hashlib.blake2b
    return torch.tensor(
        [int.from_bytes(digest(repr(k).encode(), key=secret, digest_size=8).digest(), "little") % bands for k in keys],
        dtype=torch.long,
    )


def _from_rank_zero(words: List[int]) -> List[int]:
    """``words`` (int64s) of rank 0, on every rank (one broadcast)."""
    tensor = torch.tensor(words, dtype=torch.int64, device=collective_device())
    dist.broadcast(tensor, src=0)
    return tensor.tolist()


class CyclicPoissonSampler(UserPoissonSampler):
    """Cyclic Poisson sampling (the sampler of a numbered noise mechanism, e.g. amplified banded
    matrix factorisation, :mod:`opacus_rc.noises`):
    the units (users, or rows at example level: ``index=None`` and ``num_units``) are split into
    ``bands`` parts, each unit's part drawn uniformly and independently for the run
    (:func:`unit_parts` of its stable key under a secret from ``generator``: the canonical user
    key, or the row); draw ``t`` samples part ``t mod bands`` only, each of its units with
    probability ``sample_rate`` (the rate inside a part), so a unit's draws are always ``bands``
    apart. Draws are numbered across epochs (:meth:`numbered_draws`).

    The partition serves one run of the noise mechanism (:meth:`serve`, at every iteration of
    the loader): a run that released steps under another partition (a new loader, a resume
    without ``include_rng_state=True``) restarts. The secret, the run and the numbering are
    restored with the generators' states (:meth:`state_dict`); at example level only onto the
    same rows in the same order (:attr:`identity`).

    Distributed: every rank has the same parts (rank 0's secret, broadcast) and takes every
    ``world_size``-th unit of each (the union over ranks is one Poisson draw of the part); every
    rank yields every draw; the ranks' draw numbers are compared at every iteration.
    """

    def __init__(self, index: Optional[UserIndex], sample_rate: float, bands: int, generator: Any = None,
                 steps: Optional[int] = None, rank: int = 0, world_size: int = 1, num_units: int = 0) -> None:
        super().__init__(index if index is not None else _ExampleRows(num_units), sample_rate, generator, steps)
        self.bands = bands
        self.rank, self.world_size = rank, world_size
        #: the number of the next draw (all epochs)
        self.next_draw = 0
        #: the noise run the partition serves (None: none yet)
        self.run: Optional[int] = None
        #: a digest of the data the unit keys stand for, where the keys are positions (example level)
        self.identity: Optional[Callable[[], bytes]] = None
        self._partition(self.uniform.secret())

    def _partition(self, secret: bytes) -> None:
        self._secret = secret
        parts = unit_parts(self.index.keys, self.bands, secret)
        units = torch.arange(len(parts))
        self.parts = [units[parts == part][self.rank::self.world_size] for part in range(self.bands)]

    def serve(self, noise: Any) -> None:
        """Number the next draw from ``noise``'s next step (at least) and serve its run
        (``noise``: the optimizer's :class:`~opacus_rc.noises.NoiseMechanism`): a run that
        released steps under another partition restarts (a warning says so), a partition that
        served another run is drawn anew. Distributed: the ranks' draw numbers must agree
        (else ValueError on every rank); a new run takes rank 0's secret and run."""
        self.next_draw = max(self.next_draw, int(noise.next_step))
        binding = self.run != noise.run_id
        agreed = agree_values([noise.next_step, self.next_draw, int(binding)], "the loader's check of its draws")
        if agreed is not None and agreed[0][:2] != agreed[1][:2]:
            raise ValueError(
                f"noise={noise.name!r} under torch.distributed: the ranks' {noise.name} noise is at steps {agreed[1][0]} to "
                f"{agreed[0][0]} and their loaders at draws {agreed[1][1]} to {agreed[0][1]}; every rank must run "
                "the same steps: load the same checkpoint on every rank (PrivacyEngine.load_checkpoint, each rank "
                "its own file with include_rng_state=True) and iterate the loader on every rank"
            )
        if not (binding or (agreed is not None and agreed[0][2])):
            return
        if self.run is not None:
            self._partition(self.uniform.secret())  # this partition served another run
        if noise.started:
            logger.warning(
                "noise=%r: the loader's partition of the units is not the one the noise's run used (a new loader, "
                "or a resume without include_rng_state=True): the mechanism restarts at step %d (a new run, charged "
                "on its own)", noise.name, noise.next_step,
            )
            noise.restart()
        if agreed is not None:
            words = _from_rank_zero([noise.run_id, *_words(self._secret)])
            noise.run_id = words[0]
            self._partition(b"".join(w.to_bytes(8, "little", signed=True) for w in words[1:]))
        self.run = noise.run_id

    def continue_at(self, step: int) -> None:
        """Number the next draw at least ``step``."""
        self.next_draw = max(self.next_draw, int(step))

    def numbered_draws(self) -> Iterator[Tuple[int, List[int]]]:
        """An epoch's ``(draw number, rows)``; draw ``t`` samples part ``t mod bands``."""
        for _ in range(self.steps):
            step, self.next_draw = self.next_draw, self.next_draw + 1
            yield step, self.draw_from(self.parts[step % self.bands])

    def __iter__(self) -> Iterator[List[int]]:
        for _, rows in self.numbered_draws():
            yield rows

    def state_dict(self) -> dict:
        """The partition's secret, its run and the numbering (secrets: ``include_rng_state=True``)."""
        return {"secret": self._secret, "run": self.run, "next_draw": self.next_draw,
                "identity": None if self.identity is None else self.identity()}

    def load_state_dict(self, state: dict) -> None:
        """Restore a saved partition (:meth:`check_state_dict` first)."""
        self.check_state_dict(state)
        self._partition(bytes(state["secret"]))
        self.run, self.next_draw = state["run"], int(state["next_draw"])

    def check_state_dict(self, state: dict) -> None:
        """Refuse (ValueError) a saved partition when the data its keys stand for changed."""
        if self.identity is not None and state["identity"] != self.identity():
            raise ValueError(
                "the cyclic Poisson sampler: this checkpoint's partition of the units is of other rows (or of these "
                "rows in another order): at example level a unit's key is its row, so a resumed run must have the "
                "same dataset rows in the same order to continue the noise's run with include_rng_state=True; resume "
                "from a checkpoint without it (the noise restarts, charged as a new run) or restore the rows"
            )


def _words(secret: bytes) -> List[int]:
    return [int.from_bytes(secret[i:i + 8], "little", signed=True) for i in range(0, len(secret), 8)]


@dataclass(frozen=True)
class RowUnits:
    """The units of a delivered batch's rows: ``users`` (B,) the owner of each row (example
    level: the row itself), ``sizes`` (B,) its owner's ``m_u`` (the rows the owner contributes
    to the draw; 1 for an example), and ``last`` (B,) whether the row is its owner's last one in
    the batch (kept by :meth:`rows`: of a whole draw's rows, the owner's last in the draw)."""

    users: torch.Tensor
    sizes: torch.Tensor
    last: Optional[torch.Tensor] = None
    #: each unit is one row of one (:meth:`singletons`: examples): a unit is its row
    single_rows: bool = field(default=False, compare=False)
    #: :meth:`layout` per device, computed and checked once per batch (every layer reads it)
    _layouts: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.last is None:  # each row is its owner's last in the batch when no later row is the owner's
            _, owner = torch.unique(self.users, return_inverse=True)
            rows = torch.arange(len(self))
            final = torch.full((int(owner.max()) + 1 if len(self) else 0,), -1).scatter_reduce_(0, owner, rows, "amax")
            object.__setattr__(self, "last", final[owner] == rows)

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
        of the draw (in any order).

        Raises:
            ValueError: a user split across physical batches.
        """
        key = torch.device("cpu") if device is None else torch.device(device)
        if key not in self._layouts:
            cpu = self._layouts.get(torch.device("cpu")) or self._cpu_layout()
            self._layouts[torch.device("cpu")] = cpu
            self._layouts[key] = (cpu[0].to(key), cpu[1].to(key), cpu[2])
        return self._layouts[key]

    def _cpu_layout(self) -> Tuple[torch.Tensor, torch.Tensor, int]:
        """Units in order of first appearance; a unit's rows need not be adjacent (a collate that
        sorts moves them), but must be all its rows of the draw."""
        users, owner = torch.unique(self.users, return_inverse=True)
        rows = torch.arange(len(self))
        first = torch.full((len(users),), len(self)).scatter_reduce_(0, owner, rows, "amin")
        rank = torch.empty_like(first)
        rank[torch.argsort(first)] = torch.arange(len(users))
        slot = rank[owner]
        counts = torch.bincount(slot, minlength=len(users))
        sizes = torch.zeros_like(counts).scatter_(0, slot, self.sizes)
        if not torch.equal(counts, sizes):
            raise ValueError(
                "privacy_unit='user' with a physical batch that holds part of a user's rows: book-keeping "
                "and the two-pass forms clip a user within one physical batch (the returned loader's "
                "batches, or BatchMemoryManager's, which cut draws between users); per_example_backward=True "
                "spreads a user's rows over backward passes"
            )
        by_slot = torch.argsort(slot, stable=True)
        start = torch.cumsum(counts, 0) - counts
        position = torch.empty_like(slot)
        position[by_slot] = rows - start[slot[by_slot]]
        return slot, position, len(users)

    def grouped(self) -> List[int]:
        """The rows in an order that puts each unit's rows next to each other (units in order
        of first appearance): the per-example form passes a unit's rows one after another."""
        return torch.argsort(self.layout()[0], stable=True).tolist()

    def take(self, order: List[int]) -> "RowUnits":
        """The units of the batch's rows taken in ``order`` (a collate that sorts its rows)."""
        index = torch.as_tensor(order, dtype=torch.long)
        if self.single_rows:
            return RowUnits.singletons(len(index), self.users[index])
        return RowUnits(self.users[index], self.sizes[index])

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
    "unit_layout", "unit_parts", "unit_sizes", "user_key", "user_epoch_draws", "check_same_on_ranks",
]
