"""Privacy accounting for randomized clipping (``rc_prv``).

Nothing is registered with Opacus here; ``opacus_rc.registration`` registers
``RCPRVAccountant`` under the name ``"rc_prv"``.
"""

from .accountant import RCPRVAccountant, StepRecord, get_noise_multiplier_rc, sketch_record
from .group import get_group_noise_multiplier, group_epsilon
from .prv import (
    DETERMINISTIC,
    SensitivityMixture,
    StepPRV,
    compose_epsilon,
    envelope_mixture,
)

__all__ = [
    "DETERMINISTIC",
    "RCPRVAccountant",
    "StepRecord",
    "SensitivityMixture",
    "StepPRV",
    "compose_epsilon",
    "envelope_mixture",
    "get_group_noise_multiplier",
    "get_noise_multiplier_rc",
    "group_epsilon",
    "sketch_record",
]
