"""opacus_rc: randomized clipping (DP-SGD-RC), rc_prv accounting and spectral denoising
for Opacus.

Importing the package registers the plugin with Opacus: ``opacus.PrivacyEngine`` becomes
:class:`opacus_rc.PrivacyEngine` (Opacus's engine plus ``clipping="randomized"`` and the
plugin's options, parsed into :class:`opacus_rc.Options`), the ``"rc_prv"`` accountant and
the norm samplers are registered, and two torch warnings about backward hooks that say
nothing a user can act on are silenced; nothing else runs at import.
"""

import warnings as _warnings

from . import integration as _integration
from .bookkeeping import DistributedRandomizedClippingBookkeepingOptimizer, RandomizedClippingBookkeepingOptimizer
from .config import SketchConfig
from .estimators import hutchinson_sq_norms, hutchpp_sq_norms
from .grad_sample import GradSampleHooksRandomizedClipping, GradSampleModuleRandomizedClipping
from .integration import PrivacyEngine
from .norm_samplers import register_randomized_norm_sampler
from .optimizer import DistributedRandomizedClippingOptimizer, RandomizedClippingOptimizer
from .options import Options
from .sketch import Sketcher

_integration.install()

# Opacus's grad-sample hooks on a model whose first layer's input needs no gradient (token
# ids), and on modules whose forward has several autograd nodes: torch's notes about them
# ask nothing of the user.
_warnings.filterwarnings(
    "ignore", message="Full backward hook is firing when gradients are computed with respect to "
    "module outputs since no inputs require gradients", category=UserWarning,
)
_warnings.filterwarnings(
    "ignore", message="Using a non-full backward hook when the forward contains multiple autograd "
    "Nodes", category=FutureWarning,
)

__all__ = [
    "PrivacyEngine",
    "Options",
    "SketchConfig",
    "Sketcher",
    "hutchinson_sq_norms",
    "hutchpp_sq_norms",
    "GradSampleModuleRandomizedClipping",
    "GradSampleHooksRandomizedClipping",
    "RandomizedClippingOptimizer",
    "DistributedRandomizedClippingOptimizer",
    "RandomizedClippingBookkeepingOptimizer",
    "DistributedRandomizedClippingBookkeepingOptimizer",
    "register_randomized_norm_sampler",
]
__version__ = "0.1.0"
