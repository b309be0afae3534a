"""The values of the plugin's options, each spelled once, and the checks of a value:
:func:`check_choice`, :func:`positive_int` and :func:`check_count`.

Code compares an option's value with these names, never with a literal string. This
module imports nothing from the package, so every module can import it (:mod:`opacus_rc.options`
cannot be imported from the forms, the optimizer or the sketches: it imports them).
"""

from __future__ import annotations

import difflib
import numbers
from typing import Any, Iterable, Tuple

# clipping=: Opacus's modes and the plugin's
FLAT, PER_LAYER, ADAPTIVE, RANDOMIZED = "flat", "per_layer", "adaptive", "randomized"

# estimator=
HUTCHINSON, HUTCHPP = "hutchinson", "hutchpp"
ESTIMATORS = (HUTCHINSON, HUTCHPP)

# sketching=
SHARED_SKETCH, PER_EXAMPLE_SKETCH = "shared", "per_example"
SKETCHINGS = (SHARED_SKETCH, PER_EXAMPLE_SKETCH)

# grad_sample_mode= (Opacus's names, and book-keeping's)
HOOKS, GHOST, BOOKKEEPING_MODE, FSDP_MODE = "hooks", "ghost", "bookkeeping", "ghost_fsdp"

# nonfinite=
RAISE, SKIP = "raise", "skip"
NONFINITE_MODES = (RAISE, SKIP)

# denoise= and denoise_svd=
SPECTRAL = "spectral"
DENOISERS = (SPECTRAL,)
SVD_AUTO, SVD_FULL, SVD_LOWRANK = "auto", "full", "lowrank"
SVD_METHODS = (SVD_AUTO, SVD_FULL, SVD_LOWRANK)

# PrivacyEngine(accountant=): the plugin's accountant
RC_PRV = "rc_prv"

# privacy_unit=: what one clip bounds and epsilon protects
EXAMPLE_UNIT, USER_UNIT = "example", "user"
PRIVACY_UNITS = (EXAMPLE_UNIT, USER_UNIT)

# noise=: its default, independent Gaussian noise at every step (DP-SGD); every value: opacus_rc.noises.NOISES
INDEPENDENT_NOISE = "independent"


def positive_int(x: Any) -> bool:
    """``x`` is an int >= 1 (not a bool)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 1


def check_count(value: Any, name: str, minimum: int = 1) -> int:
    """``value`` as an int; a ValueError naming ``name`` unless it is an integer >= ``minimum``."""
    valid = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (valid and int(value) == value and value >= minimum):
        raise ValueError(f"{name}={value!r}; accepted values: an integer >= {minimum}")
    return int(value)


def did_you_mean(given: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` with the nearest of ``choices`` to ``given``, else ``""``."""
    near = difflib.get_close_matches(given, sorted(choices), n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


def check_choice(name: str, value: Any, accepted: Tuple[Any, ...], hint: str = "") -> Any:
    """``value`` when it is one of ``accepted``, else a ValueError naming ``name=value``,
    ``hint`` and every accepted value."""
    if value not in accepted:
        raise ValueError(f"{name}={value!r} is not supported{hint}; accepted values: {', '.join(map(repr, accepted))}")
    return value
