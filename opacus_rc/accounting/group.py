"""Group privacy of an example-level run: epsilon for a person who owns up to ``k`` rows.

An example-level DP-SGD run protects one row. A person with ``k`` rows, each drawn
independently by Poisson sampling at rate ``q``, lands in a draw ``J ~ Bin(k, q)`` times;
each copy is clipped on its own, so the released sum moves by a vector of norm at most
``J * C`` (times ``Z``, the sensitivity multiplier of its sketch slot, for randomized
clipping). Per step the pair is

    ``sum_j Bin(j; k, q) N(j C, sigma^2 C^2)``  vs  ``N(0, sigma^2 C^2)``

(the vector mixture is dominated by the scalar one with the shifts' norms: Choquette-Choo,
Ganesh, Steinke, Thakurta 2023, "Privacy Amplification for Matrix Mechanisms", Cor. 4.7,
the argument dp_accounting's ``MixtureGaussianPrivacyLoss`` relies on), composed over the
steps by the PRV accountant. That is exactly the step :mod:`~opacus_rc.accounting.multiplicity`
accounts for ``m`` independently sampled micro-batches: a person's ``k`` rows are ``k``
independent draws at rate ``q`` of one unit, so a recorded step with ``micro_batches = m``
becomes one with ``m * k`` (the person's ``k`` rows in each of the ``m`` micro-batches:
``J ~ Bin(m k, q)``), and nothing else changes. It is neither ``k * eps`` (not an upper
bound at the same delta: the exact figure exceeds it from k = 2) nor the group-privacy
theorem's ``(k eps, k e^{(k-1) eps} delta)``, valid but loose (infinite for large k).

Sketched (randomized) records: ``Z_max`` is union-bounded over the ``m * k`` sketch slots
(one per row and micro-batch), ``P(Z_max > z) <= m k P(Z* > z)``, which holds whatever the
slots' dependence (a shared sketch gives the person's rows dependent estimates; per-example
sketches independent ones) and is treated as revealed, as for accumulation. It is
conservative: each copy's shift is ``C Z_i <= C Z_max``, and the hidden-Z credit of a
single per-example sketch is not taken once a person can appear twice. With
``group_size = 1`` the history is accounted unchanged: :func:`group_epsilon` equals
:meth:`RCPRVAccountant.get_epsilon` bit for bit.

Histories of Opacus's own accountants (``rdp``, ``prv``, ``gdp``) are ``(sigma, q, steps)``
tuples: read as exact clipping at rate ``q``, one draw per step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence, Tuple

from ..config import SketchConfig
from ..values import check_count
from .accountant import RCPRVAccountant, StepRecord, noise_multiplier_for_record
from .prv import DEFAULT_BIN_RATIO


def check_group_size(group_size: Any, name: str = "group_size") -> int:
    """``group_size`` as an int; a ValueError naming ``name`` unless it is an integer >= 1."""
    return check_count(group_size, name)


def group_record(record: StepRecord, group_size: int) -> StepRecord:
    """The record of a step seen by a person with ``group_size`` rows: ``micro_batches``
    multiplied by ``group_size`` (the sketch, if any, unchanged)."""
    k = check_group_size(group_size)
    if not record.dp_sgd and k > 1:
        raise ValueError(
            "group epsilon (max_examples_per_user > 1) of a run whose steps are charged as rounds of a cyclic "
            f"sampler's parts (bands={record.bands}: a noise= other than 'independent', e.g. noise='banded') is not "
            "computed: a person's rows may lie in different parts, so their draws are not bands= steps apart; train "
            "with privacy_unit='user' (the parts are parts of the users) for a per-person guarantee"
        )
    return dataclasses.replace(record, micro_batches=record.micro_batches * k)


def group_history(history: Sequence[Sequence[Any]], group_size: int) -> List[Tuple[float, float, int, StepRecord]]:
    """``history`` (entries of :class:`RCPRVAccountant` or ``(sigma, q, steps)`` of Opacus's
    accountants: exact clipping) with every record grouped by :func:`group_record`."""
    k = check_group_size(group_size)
    return [(sigma, q, n, group_record(record, k)) for sigma, q, n, record in map(RCPRVAccountant.entry, history)]


def group_epsilon(
    history: Sequence[Sequence[Any]],
    delta: float,
    group_size: int,
    *,
    eps_error: float = 0.01,
    delta_error: Optional[float] = None,
    bin_ratio: float = DEFAULT_BIN_RATIO,
) -> float:
    """Epsilon at ``delta`` for a person who owns at most ``group_size`` rows, after the
    steps of ``history`` of an example-level run (an upper bound with error ``eps_error``,
    as :meth:`RCPRVAccountant.get_epsilon`).

    Args:
        history: an accountant's history: ``RCPRVAccountant.history`` (its records' sketch
            and micro-batches) or ``(noise_multiplier, sample_rate, steps)`` tuples of
            Opacus's accountants (exact clipping).
        delta: target delta, in (0, 1).
        group_size: k >= 1, the most rows one person owns; 1 is the example-level epsilon.
        eps_error, delta_error: as :meth:`RCPRVAccountant.get_epsilon`.
        bin_ratio: relative width of the Z bins of sketched records
            (:attr:`RCPRVAccountant.bin_ratio`).

    Raises:
        ValueError: ``group_size`` not an integer >= 1, ``delta`` outside (0, 1), or a
            malformed history entry.
    """
    accountant = RCPRVAccountant()
    accountant.bin_ratio = bin_ratio
    accountant.history = group_history(history, group_size)
    return accountant.get_epsilon(delta, eps_error=eps_error, delta_error=delta_error)


def get_group_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    group_size: int,
    epochs: Optional[float] = None,
    steps: Optional[int] = None,
    sketch_config: Optional[SketchConfig] = None,
    micro_batches: int = 1,
    epsilon_tolerance: float = 0.01,
    eps_error: float = 0.01,
) -> float:
    """Smallest noise multiplier (to the tolerance) of an example-level run whose group
    epsilon for ``group_size`` rows (:func:`group_epsilon`) meets ``target_epsilon``.

    The search of :func:`~opacus_rc.accounting.accountant.get_noise_multiplier_rc` on the
    grouped record: the result's group epsilon lies in
    ``[target - epsilon_tolerance, target]``. Use it to compare an example-level run with a
    user-level one at the same per-person epsilon. ``group_size=1`` is
    ``get_noise_multiplier_rc``.

    Args:
        target_epsilon, target_delta, sample_rate, epochs, steps, sketch_config,
            epsilon_tolerance, eps_error: as ``get_noise_multiplier_rc`` (``sample_rate``:
            the rate of one micro-batch).
        group_size: k >= 1, the most rows one person owns.
        micro_batches: independently sampled micro-batches summed into each step.

    Raises:
        ValueError: an argument outside its accepted values (named).
    """
    return noise_multiplier_for_record(
        target_epsilon,
        target_delta,
        sample_rate,
        epochs,
        steps,
        group_record(StepRecord.from_config(sketch_config, micro_batches), group_size),
        epsilon_tolerance=epsilon_tolerance,
        eps_error=eps_error,
    )
