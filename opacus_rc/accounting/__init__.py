"""Privacy accounting for randomized clipping (``rc_prv``).

Nothing is registered with Opacus here; ``opacus_rc.registration`` registers
``RCPRVAccountant`` under the name ``"rc_prv"``.
"""

from .accountant import RCPRVAccountant, StepRecord, get_noise_multiplier_rc, sketch_record
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
    "get_noise_multiplier_rc",
    "sketch_record",
]
