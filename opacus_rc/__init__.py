"""opacus_rc: randomized clipping (DP-SGD-RC), rc_prv accounting and spectral denoising
for Opacus.

Importing the package registers the plugin with Opacus (norm samplers, the
``clipping="randomized"`` option and the ``"rc_prv"`` accountant); nothing else runs at
import.
"""

from .config import SketchConfig

__all__ = ["SketchConfig"]
__version__ = "0.1.0"
