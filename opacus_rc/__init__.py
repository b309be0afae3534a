"""opacus_rc: randomized clipping (DP-SGD-RC), rc_prv accounting and spectral denoising
for Opacus.

Importing the package registers the plugin with Opacus: ``opacus.PrivacyEngine`` becomes
:class:`opacus_rc.PrivacyEngine` (Opacus's engine plus ``clipping="randomized"`` and the
plugin's options, parsed into :class:`opacus_rc.Options`), the ``"rc_prv"`` accountant and
the norm samplers are registered, and BatchMemoryManager's sampler declares its physical
batches one Poisson draw (:data:`opacus_rc.registration.PATCHES`, undone by
:func:`opacus_rc.registration.uninstall`); nothing else runs at import: no warning filter is set.
"""

from . import registration as _registration
from .config import SketchConfig
from .estimators import hutchinson_sq_norms, hutchpp_sq_norms
from .forms.bookkeeping import DistributedRandomizedClippingBookkeepingOptimizer, RandomizedClippingBookkeepingOptimizer
from .forms.two_pass import DPLossRandomizedClipping
from .grad_sample import GradSampleHooksRandomizedClipping, GradSampleModuleRandomizedClipping
from .integration import PrivacyEngine
from .norm_samplers import register_randomized_norm_sampler
from .optimizer import DistributedRandomizedClippingOptimizer, RandomizedClippingOptimizer
from .options import Options
from .sketch import Sketcher

_registration.install()

__all__ = [
    "PrivacyEngine",
    "Options",
    "SketchConfig",
    "Sketcher",
    "hutchinson_sq_norms",
    "hutchpp_sq_norms",
    "GradSampleModuleRandomizedClipping",
    "GradSampleHooksRandomizedClipping",
    "DPLossRandomizedClipping",
    "RandomizedClippingOptimizer",
    "DistributedRandomizedClippingOptimizer",
    "RandomizedClippingBookkeepingOptimizer",
    "DistributedRandomizedClippingBookkeepingOptimizer",
    "register_randomized_norm_sampler",
]
__version__ = "0.1.0"
