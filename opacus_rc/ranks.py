"""Rank checks: the collectives by which the ranks of a distributed run refuse together.

A *rank check* is one collective that every rank reaches at the same point of the run and that
agrees on a refusal: ``make_private``'s check of the options and user ids
(:func:`opacus_rc.units.check_same_on_ranks`), each step's check of its refusal flags
(:meth:`opacus_rc.finite.NonFiniteGuard.take`), a cyclic loader's check of its draw numbers. A
rank that raised before its check would leave the others waiting in it forever. So every check
carries a failure flag: a rank whose code raises before the check still takes part in it, with
the flag set (:func:`agreed`, :func:`join_failed`), and then raises its own error; every other
rank raises :class:`RefusedOnAnotherRank` from the check. No rank waits for one that is gone.

Two kinds of check: :func:`agree_values` (integers on the host, MAX of ``[failed, v, -v]``) and
:func:`agree_flag` (a device flag, MIN of a code; no host synchronisation).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

#: :func:`agree_flag`'s codes: the flag True, the flag False, a rank that raised
FLAG_TRUE, FLAG_FALSE, RAISED = 1, 0, -1


class RefusedOnAnotherRank(RuntimeError):
    """Another rank raised before a rank check: this rank refuses too (that rank's error says why)."""


def world_size() -> int:
    """Ranks of the default process group (1 without ``torch.distributed``)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def collective_device() -> torch.device:
    """Where the default group's collectives run: the current CUDA device under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def refused_on_another_rank(what: str) -> RefusedOnAnotherRank:
    """The refusal a rank raises when another rank raised before the check ``what``."""
    return RefusedOnAnotherRank(
        f"another rank raised an error before {what}: refused on this rank too (every rank refuses together; "
        "that rank's error says why). Nothing was released or charged by it"
    )


def agree_values(values: Sequence[int], what: str, failed: bool = False) -> Optional[Tuple[List[int], List[int]]]:
    """Under ``torch.distributed`` (else None): one all-reduce (MAX) of ``[failed, v, -v]``; returns
    the ranks' largest and smallest ``values``, element by element (equal iff every rank agrees).

    Raises:
        RefusedOnAnotherRank: another rank took part with ``failed`` (this one did not).
    """
    if world_size() == 1:
        return None
    mine = torch.tensor([int(failed), *values], dtype=torch.int64, device=collective_device())
    both = torch.cat([mine, -mine[1:]])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    agreed = both.tolist()
    if agreed[0] and not failed:
        raise refused_on_another_rank(what)
    n = len(values)
    return agreed[1:1 + n], [-v for v in agreed[1 + n:]]


def agree_flag(flag: torch.Tensor, failed: bool = False) -> torch.Tensor:
    """Under ``torch.distributed`` (else the code of ``flag`` itself): one all-reduce (MIN) of this
    rank's code, :data:`RAISED` when ``failed``, else :data:`FLAG_TRUE` or :data:`FLAG_FALSE` for
    the 0-d bool ``flag``: the agreed code (an int32 0-d tensor on ``flag``'s device) is positive iff
    every rank's flag is True and :data:`RAISED` iff a rank raised. NCCL reduces on the device
    without a host synchronisation; gloo needs a CPU tensor."""
    code = torch.where(flag, FLAG_TRUE, FLAG_FALSE).to(torch.int32)
    if failed:
        code = torch.full_like(code, RAISED)
    if world_size() == 1:
        return code
    value = code.to(collective_device()).reshape(1)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return value.to(flag.device).reshape(())


def join_failed(check: Callable[[bool], Any]) -> None:
    """This rank raised before the rank check ``check``: take part in it with the failure flag
    (``check(True)``), so that the other ranks refuse instead of waiting; an error of the check
    itself is logged (the rank's own error is the one raised)."""
    if world_size() == 1:
        return
    try:
        check(True)
    except Exception as error:  # noqa: BLE001 - the original error is re-raised by the caller
        logger.warning("a rank check after this rank's error failed too: %s", error)


@contextlib.contextmanager
def agreed(check: Callable[[bool], Any], active: bool = True) -> Iterator[None]:
    """Run the block, then the rank check ``check(failed)`` on every rank: ``failed`` is False when
    the block ended (the check may refuse), True when it raised (this rank then re-raises its own
    error, and the others raise :class:`RefusedOnAnotherRank` from the check). ``active=False``:
    no check (one process, or a call that has none)."""
    if not active:
        yield
        return
    try:
        yield
    except BaseException:
        join_failed(check)
        raise
    check(False)


__all__ = [
    "FLAG_FALSE", "FLAG_TRUE", "RAISED", "RefusedOnAnotherRank", "agree_flag", "agree_values", "agreed",
    "collective_device", "join_failed", "refused_on_another_rank", "world_size",
]
