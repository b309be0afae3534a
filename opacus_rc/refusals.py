"""Feature combinations no form computes exactly: the one table of their refusals (issue 53).

Every combination a form runs releases, at noise 0, exactly the brute-force sum: each unit's
gradient (an example's, or a user's mean over their rows; autograd on each example alone)
clipped to C. Where a combination cannot be computed that way, it is refused here, by name and
with the mathematical reason, never run with weaker privacy (a clip that bounds a sum of
several units' gradients, or misses part of one, lets a unit move the release by more than C).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict


@dataclass(frozen=True)
class Refusal:
    """One refused combination: ``what`` (named in the message), ``why`` (the mathematical
    reason its per-unit gradients cannot be computed exactly) and ``instead`` (what runs);
    ``{fields}`` are filled in by :func:`refusal`."""

    what: str
    why: str
    instead: str


#: the refused combinations, by key
REFUSALS: Dict[str, Refusal] = {
    "tied_layer": Refusal(
        what="parameter tying through {layer} with clipping='randomized' ({form})",
        why=(
            "a tied parameter's per-example gradient is the sum of its uses' gradients, and its norm "
            "is taken of that sum; each use must therefore give its per-example gradient in one common "
            "space (the projection P^T grad onto the parameter's row sketch), which only the layer "
            "types listed have: a norm taken use by use would bound each use, not their sum (up to "
            "L C for L uses)"
        ),
        instead="supported layers: {supported}; or per_example_backward=True (autograd sums the uses)",
    ),
}


def refusal(key: str, **fields: Any) -> ValueError:
    """The ``ValueError`` refusing :data:`REFUSALS`'s combination ``key`` (``fields``: its names)."""
    entry = REFUSALS[key]
    return ValueError(
        f"{entry.what.format(**fields)} is not supported: {entry.why.format(**fields)}. "
        f"Accepted instead: {entry.instead.format(**fields)}"
    )


__all__ = ["REFUSALS", "Refusal", "refusal"]
