"""Validation of the audits' configurations: one error message per kind of field, naming
the field and its accepted values."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Sequence, Tuple

from ..values import check_choice


def check_choices(*fields: Tuple[str, Any, Sequence[Any]]) -> None:
    """``(name, value, accepted)`` triples: ``value`` must be one of ``accepted`` (:func:`check_choice`)."""
    for field in fields:
        check_choice(*field)


def check_fields(config: Any, names: Iterable[str], ok: Callable[[Any], bool], accepted: str) -> None:
    """``ok(config.name)`` must hold for every name, else ValueError naming ``accepted``."""
    for name in names:
        value = getattr(config, name)
        if not ok(value):
            raise ValueError(f"{name}={value!r} is invalid; accepted values: {accepted}")


def check_ints(config: Any, fields: Iterable[Tuple[str, int]]) -> None:
    """``(name, minimum)`` pairs: ``config.name`` must be an int >= minimum."""
    for name, minimum in fields:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name}={value!r} is invalid; accepted values: an int >= {minimum}")


def check_positive(config: Any, names: Iterable[str]) -> None:
    """``config.name`` must be a finite float > 0."""
    check_fields(config, names, lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v > 0, "a float > 0")


def check_unit_interval(config: Any, names: Iterable[str]) -> None:
    """``config.name`` must lie in (0, 1)."""
    check_fields(config, names, lambda v: 0.0 < v < 1.0, "a float in (0, 1)")
