"""The BLAS kernels the golden epsilons were recorded with, and their comparison.

NumPy's OpenBLAS picks its kernels by CPU (``OPENBLAS_CORETYPE`` overrides the choice), and
kernels of different CPU families round matrix products differently: under Haswell's
kernels (which OpenBLAS picks on some AVX-512 CPUs, e.g. AMD Zen 4) the recorded epsilons
move by 1-8 ulp, a calibrated sigma by 6e-9 relative. ``scripts/run_pytest.sh`` runs the
recorded kernels on every CPU with AVX-512; there the goldens hold bit for bit.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

#: OpenBLAS's core type when the golden values were recorded
RECORDED_BLAS = "SkylakeX"
#: the comparison under other kernels: 100x the largest difference measured (6e-9)
OTHER_KERNELS_RTOL = 1e-6


@functools.lru_cache(maxsize=None)
def blas_architecture() -> Optional[str]:
    """The core type of NumPy's OpenBLAS (None when it is not OpenBLAS)."""
    import numpy  # noqa: F401  (loads the BLAS threadpoolctl inspects)
    from threadpoolctl import threadpool_info

    for info in threadpool_info():
        if info.get("internal_api") == "openblas" and "numpy" in info.get("filepath", ""):
            return info.get("architecture")
    return None


def assert_golden(got: float, recorded_hex: str, hint: str = "") -> None:
    """``got`` equals the recorded value bit for bit under the recorded BLAS kernels, and
    within :data:`OTHER_KERNELS_RTOL` under others."""
    if blas_architecture() == RECORDED_BLAS:
        assert got.hex() == recorded_hex, hint
    else:
        want = float.fromhex(recorded_hex)
        assert math.isclose(got, want, rel_tol=OTHER_KERNELS_RTOL, abs_tol=0.0), (
            f"{hint} ({got!r} vs {want!r} under OpenBLAS {blas_architecture()} kernels; recorded "
            f"under {RECORDED_BLAS})"
        )
