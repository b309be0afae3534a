"""The table of noise mechanisms: what ``noise=`` runs (``make_private`` and ``PrivacyArguments``).

A mechanism is one :class:`Noise` row of :data:`NOISES`: its name, the keywords it reads and
the function that parses them into its :class:`~opacus_rc.noises.base.NoiseSpec` (the
protocol: :mod:`opacus_rc.noises.base`). Everything else reads the spec and the mechanism
the optimizer builds from it: the loader (``spec.parts``: cyclic Poisson draws), the optimizer
(its step, its public and secret state), the accountant (``spec.record_fields()``), the
checkpoints and the private Trainer. A third mechanism is its class (a
:class:`~opacus_rc.noises.base.NoiseMechanism` and a parse function) and one row here.

=============== ====================================================================
noise=          what runs
=============== ====================================================================
``independent`` DP-SGD: fresh Gaussian noise at every step (:mod:`.base`)
``banded``      banded matrix factorisation over cyclic Poisson draws (:mod:`.banded`)
=============== ====================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Tuple

from ..values import INDEPENDENT_NOISE, check_choice, did_you_mean
from .banded import BANDED_KEYWORDS, BANDED_NOISE, parse_banded
from .base import INDEPENDENT, IndependentNoise, NoiseMechanism, NoiseSpec, draw_step_error, state_key

#: ``(name, default, annotation, doc)`` of a keyword a row reads (an Option of make_private)
Keyword = Tuple[str, Any, str, str]


@dataclass(frozen=True)
class Noise:
    """One noise mechanism of the plugin (a row of :data:`NOISES`).

    Attributes:
        name: the value of ``noise=``.
        parse: its keywords' values (every row's keyword, by name) and ``most`` (the largest
            number of the sampler's parts, in words) -> its spec; a ValueError names an invalid
            keyword and its accepted values.
        keywords: the keywords of ``make_private`` (and fields of ``PrivacyArguments``) it
            reads: a row's keyword is refused with another ``noise=``. Listed before
            :mod:`opacus_rc.options` is imported (they are in the public signatures).
    """

    name: str
    parse: Callable[[Mapping[str, Any], str], NoiseSpec]
    keywords: Tuple[Keyword, ...] = ()


#: name -> row: every ``noise=`` the plugin runs
NOISES: Dict[str, Noise] = {
    INDEPENDENT_NOISE: Noise(INDEPENDENT_NOISE, lambda given, most: INDEPENDENT),
    BANDED_NOISE: Noise(BANDED_NOISE, parse_banded, BANDED_KEYWORDS),
}


def noise_keywords() -> Iterator[Keyword]:
    """Every row's keywords, in table order."""
    for row in NOISES.values():
        yield from row.keywords


def parse_noise(noise: Any, given: Mapping[str, Any], denoise: Any, most: str) -> NoiseSpec:
    """``noise=`` with the rows' keywords ``given`` (by name; at their defaults when not given)
    and ``denoise=``: the run's spec. Refused by name: an unknown ``noise`` (with the nearest
    name), another row's keyword given, the row's own refusals, and ``denoise`` with a
    mechanism whose steps' noises are not fresh and independent (the spectral denoiser shrinks
    each step as if they were: it would undo their cancellation in the running sum)."""
    names = tuple(NOISES)
    row = NOISES[check_choice("noise", noise, names, did_you_mean(str(noise), names))]
    own = {k[0] for k in row.keywords}
    for name, default, _, _ in noise_keywords():
        if name not in own and given.get(name, default) != default:
            owners = [r.name for r in NOISES.values() if any(k[0] == name for k in r.keywords)]
            raise ValueError(
                f"{name}={given[name]!r} only applies with noise={' or '.join(map(repr, owners))}; got noise={noise!r}"
            )
    spec = row.parse(given, most)
    if denoise is not None and not spec.fresh_each_step:
        raise ValueError(
            f"noise={noise!r} is not supported with denoise={denoise!r}: the denoiser shrinks each step's noisy "
            f"gradient as if its noise were fresh, which undoes the cancellation of correlated noise in the running "
            f"sum; accepted: denoise=None with noise={noise!r}, or noise={INDEPENDENT_NOISE!r} with denoise"
        )
    return spec


def take_noise_state(mechanism: NoiseMechanism, state: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Remove every row's public state from an optimizer state ``state`` and return
    ``mechanism``'s (None for a mechanism without one). A state of another mechanism is refused
    by name (a state holding no row's state is independent noise's)."""
    saved = {name: state.pop(state_key(name)) for name in NOISES if state_key(name) in state}
    saved_name = next(iter(saved), INDEPENDENT_NOISE)
    expected = mechanism.state_dict() is not None
    if len(saved) > 1 or saved_name != mechanism.name and (saved or expected):
        raise ValueError(
            f"an optimizer state of a run with noise={'+'.join(saved) or saved_name} loaded into a run with "
            f"noise={mechanism.name}: resume with the same noise= and its options"
        )
    return saved.get(mechanism.name)


__all__ = [
    "INDEPENDENT", "IndependentNoise", "Keyword", "NOISES", "Noise", "NoiseMechanism", "NoiseSpec", "draw_step_error",
    "noise_keywords", "parse_noise", "take_noise_state",
]
