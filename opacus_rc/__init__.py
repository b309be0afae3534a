"""opacus_rc: randomized clipping (DP-SGD-RC), rc_prv accounting and spectral denoising
for Opacus.

Importing the package registers the plugin with Opacus (norm samplers, the
``clipping="randomized"`` option of ``PrivacyEngine.make_private`` and the ``"rc_prv"``
accountant); nothing else runs at import.
"""

from . import integration as _integration
from .config import SketchConfig
from .estimators import hutchinson_sq_norms, hutchpp_sq_norms
from .grad_sample import GradSampleHooksRandomizedClipping, GradSampleModuleRandomizedClipping
from .norm_samplers import register_randomized_norm_sampler
from .optimizer import (
    DistributedRandomizedClippingBookkeepingOptimizer,
    DistributedRandomizedClippingOptimizer,
    RandomizedClippingBookkeepingOptimizer,
    RandomizedClippingOptimizer,
)
from .sketch import Sketcher

_integration.install()

__all__ = [
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
