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
            "a tied parameter's per-example gradient is the sum of its uses' gradients (a parameter shared "
            "by several modules, or one of a layer applied several times in one forward pass), and its norm "
            "is taken of that sum; each use must therefore give its per-example gradient in one common "
            "space (the projection P^T grad onto the parameter's row sketch), which only the layer "
            "types listed have: a norm taken use by use would bound each use, not their sum (up to "
            "L C for L uses)"
        ),
        instead="supported layers: {supported}; or per_example_backward=True (autograd sums the uses)",
    ),
    "packed_rows_attention": Refusal(
        what="packed rows (TRL's padding_free=True) with {model}'s attention ({implementation})",
        why=(
            "a probe of the model found a sequence's outputs in a packed row differing from the same "
            "sequence alone ({detail}): its tokens attend across the sequence boundary, so each "
            "example's gradient would depend on its neighbours in the pack, and no clip of the example "
            "bounds its effect on them"
        ),
        instead=(
            "padding_free=False, or an attention implementation that keeps packed sequences apart "
            "(attn_implementation='sdpa', 'eager' or a flash-attention one on a model that reads "
            "position_ids)"
        ),
    ),
    "packed_rows_layer_input": Refusal(
        what="a packed row (several examples in one row) through {layer}, whose input has shape {shape}",
        why=(
            "the examples of a packed row are token ranges of it; a layer's per-example gradient is its "
            "per-token products summed over one example's tokens, which needs an input of one entry per "
            "token (the row's {tokens} tokens along dimension 1); this input is not one per token, so it "
            "cannot be split into the examples"
        ),
        instead="padding_free=False (one example per row)",
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
