"""Composition over steps by FFT and epsilon from the composed PMF (Gopi et al. 2021),
with this package's conservative changes (module :mod:`opacus_rc.accounting.prv`)."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
from scipy import fft as sp_fft
from scipy.signal import lfilter

from .discretise import _discretise
from .domain import _make_domain
from .prvs import PRVStep

#: ``f ** n`` of numpy: repeated multiplication for integer ``|n| < 100``, else
#: ``cexp(n clog f)``, which is exactly 0 where ``n log|f| < -745`` (exp underflows).
_CPOW_COUNT = 100


def _spectrum_power(f: np.ndarray, count: int) -> np.ndarray:
    """``f ** count``, elementwise, evaluated only where ``|f|^count >= e^-800``.

    For ``count >= 100`` numpy computes ``cexp(count clog f)``, exactly 0 wherever
    ``count log|f| < -745``; those entries (nearly all of a long composition's spectrum)
    are set to 0 directly, with a margin of ``e^-55``: the same floats as ``f ** count``.
    """
    if count < _CPOW_COUNT:
        return f ** count
    live = f.real * f.real + f.imag * f.imag >= math.exp(-1600.0 / count)
    out = np.zeros_like(f)
    out[live] = f[live] ** count
    return out


def _epsilon_from_pmf(
    pmf: np.ndarray, ts: np.ndarray, beyond: float, delta_target: float
) -> float:
    """Smallest eps with ``sum_t pmf (1 - e^{eps - t})_+ + beyond <= delta_target``."""
    target = delta_target - beyond
    if target <= 0:
        return math.inf
    dt = ts[1] - ts[0]
    rev = pmf[::-1]
    d1 = np.cumsum(rev)[::-1]
    # D2_i = sum_{j>=i} pmf_j e^{-(t_j - t_i)} = pmf_i + e^{-dt} D2_{i+1}
    d2 = lfilter([1.0], [1.0, -math.exp(-dt)], rev)[::-1]
    delta_at = d1 - d2  # delta(t_i), non-increasing in i
    i = int(np.searchsorted(-delta_at, -target, side="left"))
    if i >= len(ts):
        return math.inf
    if i == 0:
        return max(float(ts[0]), 0.0)
    if d1[i] <= target or d2[i] <= 0:
        return float(ts[i])
    return float(ts[i] + math.log((d1[i] - target) / d2[i]))


def _compose_direction(
    steps: Sequence[PRVStep],
    counts: Sequence[int],
    direction: str,
    delta: float,
    eps_error: float,
    delta_error: float,
) -> float:
    """Epsilon upper bound of one direction of the composition (see ``compose_epsilon``)."""
    dom = _make_domain(steps, counts, eps_error, delta_error)
    total = sum(counts)
    n_fft = sp_fft.next_fast_len(dom.n + dom.n // 8, real=True)
    log_finite = 0.0
    spectrum = None
    shift_total = 0.0
    for step, count in zip(steps, counts):
        pmf, shift, pm_inf = _discretise(step, direction, dom)
        log_finite += count * math.log1p(-pm_inf) if pm_inf < 1 else -math.inf
        f = _spectrum_power(sp_fft.rfft(pmf, n_fft), count)
        spectrum = f if spectrum is None else spectrum * f
        shift_total += count * shift
    delta_inf = -math.expm1(log_finite)
    if delta_inf >= delta - delta_error:
        return math.inf
    composed = sp_fft.irfft(spectrum, n_fft)
    offset = (total - 1) * (-dom.i0)  # sum of indices of the window's first point
    composed = np.maximum(np.roll(composed, -(offset % n_fft)), 0.0)
    window = composed[: dom.n]
    beyond = float(composed[dom.n :].sum())  # left the window: counted as infinite
    ts = dom.centres + shift_total
    delta_fin = (delta - delta_inf) / (1.0 - delta_inf)
    if np.finfo(np.longdouble).eps * dom.n > delta_fin - delta_error:
        raise ValueError(
            f"delta={delta} is too small for the floating point accuracy of the PRV "
            "composition; increase delta"
        )
    return _epsilon_from_pmf(window, ts, beyond, delta_fin - delta_error) + dom.eps_error


def compose_epsilon(
    steps: Sequence[PRVStep],
    counts: Sequence[int],
    delta: float,
    eps_error: float = 0.01,
    delta_error: Optional[float] = None,
) -> float:
    """Upper bound on epsilon of the composition of ``counts[g]`` copies of ``steps[g]``.

    ``eps = max over directions of eps_hat(delta_fin - delta_error) + eps_error`` with
    ``delta_fin = (delta - delta_inf) / (1 - delta_inf)`` (Gopi et al. Thm 5.5).
    """
    if delta_error is None:
        delta_error = delta / 1000.0
    pairs = [
        (s, int(c)) for s, c in zip(steps, counts) if c > 0 and s.q > 0 and math.isfinite(s.sigma)
    ]
    if not pairs:
        return 0.0
    steps, counts = zip(*pairs)
    if any(s.sigma <= 0 for s in steps):
        return math.inf
    eps = _compose_direction(steps, counts, "remove", delta, eps_error, delta_error)
    # The add direction is usually far below: bound it on a 10x coarser mesh first (a
    # valid upper bound, with its own eps error) and refine only when it could matter.
    coarse = _compose_direction(steps, counts, "add", delta, 10 * eps_error, delta_error)
    if coarse > eps:
        eps = max(eps, _compose_direction(steps, counts, "add", delta, eps_error, delta_error))
    return eps
