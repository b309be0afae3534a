"""The private Trainer's training data: every logical step is one Poisson draw
(:class:`PoissonAccumulationSampler`), collated by the Trainer's collator, an empty draw
becoming a marker batch (:func:`is_empty_batch`)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Iterator, List

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..sketch import entropy_seed

_EMPTY = "__opacus_rc_empty_batch__"


class PoissonAccumulationSampler(Sampler[List[int]]):
    """Batch sampler of the private Trainer: every logical step is ONE Poisson draw (each
    row joins independently with probability ``sample_rate``), split into
    ``micro_batches`` consecutive physical batches of nearly equal size (some may be empty).

    ``len()`` is ``steps x micro_batches``, a function of public values only. The masks come
    from a ``torch.Generator`` seeded from ``os.urandom`` (``secure_mode``: the CSPRNG), never
    from the global generator. Distributed: rank ``r`` samples the fixed share
    ``r, r + world_size, ...`` at the same rate (the union over ranks is one Poisson draw).
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
    ) -> None:
        self.num_samples = int(num_samples)
        self.sample_rate = float(sample_rate)
        self.micro_batches = int(micro_batches)
        self.steps = int(steps)
        self.rank, self.world_size = int(rank), int(world_size)
        self.secure_mode = secure_mode
        self.share = len(range(self.rank, self.num_samples, self.world_size))
        self._generator = None if secure_mode else torch.Generator().manual_seed(entropy_seed())
        self.draws = 0  #: logical steps drawn so far (the loader check: this sampler is iterated)

    def __len__(self) -> int:
        return self.steps * self.micro_batches

    def _mask(self) -> torch.Tensor:
        if self.secure_mode:
            from ..csprng import secure_bernoulli

            return secure_bernoulli(self.sample_rate, self.share)
        return torch.rand(self.share, generator=self._generator) < self.sample_rate

    def __iter__(self) -> Iterator[List[int]]:
        for _ in range(self.steps):
            local = self._mask().nonzero().reshape(-1)
            self.draws += 1
            rows = local * self.world_size + self.rank
            for part in torch.tensor_split(rows, self.micro_batches):
                yield part.tolist()

    def __getstate__(self):
        raise TypeError("the Poisson sampler's generator is a secret: it is never pickled or saved")


def _collate_or_mark(collate: Callable, rows: List[Any]) -> Any:
    """The Trainer's collator; an empty Poisson batch becomes a marker (no forward pass)."""
    return {_EMPTY: True} if len(rows) == 0 else collate(rows)


def is_empty_batch(inputs: Any) -> bool:
    return isinstance(inputs, dict) and inputs.get(_EMPTY, False) is True


def one_row_batches(inputs: Dict[str, Any]) -> List[Dict[str, Any]]:
    """A collated batch as batches of one row each: every tensor with the batch's rows along
    dimension 0 sliced, everything else kept (the per-example form's physical batch)."""
    rows = next((v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim() > 0), 0)

    def row(value: Any, i: int) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
            return value[i:i + 1]
        return value

    return [{k: row(v, i) for k, v in inputs.items()} for i in range(rows)]


def poisson_loader(
    dataset: Dataset, collator: Callable, *, num_workers: int, pin_memory: bool, **sampler: Any
) -> DataLoader:
    """The private Trainer's training loader: ``dataset`` drawn by a
    :class:`PoissonAccumulationSampler` (``sampler``: its arguments but ``num_samples``),
    collated by ``collator`` (an empty batch: the marker of :func:`is_empty_batch`)."""
    return DataLoader(
        dataset,
        batch_sampler=PoissonAccumulationSampler(num_samples=len(dataset), **sampler),
        collate_fn=functools.partial(_collate_or_mark, collator),
        num_workers=num_workers,
        pin_memory=pin_memory,
    )


__all__ = ["PoissonAccumulationSampler", "is_empty_batch", "one_row_batches", "poisson_loader"]
