"""Spectral denoising of noised DP gradients (post-processing, costs no privacy).

A linear layer's noised gradient ``G`` (n x m, i.i.d. N(0, tau^2) noise per entry) is denoised
only if ``s_1 > kappa * tau * (sqrt n + sqrt m)`` (the edge of the noise bulk): its singular values
are shrunk by the Frobenius-optimal shrinker for a known noise level (Shabalin & Nobel 2013, Gavish
& Donoho 2017) and the result is rescaled to ``||G||_F``. The functions here read only the matrix
and public constants (``tau``, ``kappa``): applied to DP-SGD's released gradient they are
post-processing. :func:`attach_spectral_denoiser` installs the step on an Opacus ``DPOptimizer``.
The math, the noise level and where the step acts: docs/denoising.md.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .values import SVD_AUTO, SVD_LOWRANK, SVD_METHODS

logger = logging.getLogger(__name__)

#: Default gate factor ``kappa``: a layer is denoised only if its top singular value exceeds
#: ``kappa`` times the noise-bulk edge (docs/denoising.md: why 1.1, and the ablation).
DEFAULT_KAPPA: float = 1.1

#: ``svd="auto"`` uses the randomized truncated SVD only when the smaller side is at least this.
LOWRANK_MIN_DIM: int = 512

_DENOISER_ATTR = "_opacus_rc_spectral_denoiser"


# --- validation ---
def _check_float(name: str, value: Any, zero_allowed: bool) -> float:
    """``value`` as a float; ValueError unless it is a finite number > 0 (>= 0 if ``zero_allowed``)."""
    message = f"{name} must be a finite float {'>=' if zero_allowed else '>'} 0, got "
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(message + repr(value))
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_allowed):
        raise ValueError(message + repr(value))
    return value


def _check_svd(svd: str) -> str:
    if svd not in SVD_METHODS:
        raise ValueError(f"svd must be one of {SVD_METHODS}, got {svd!r}")
    return svd


# --- random-matrix quantities ---
def noise_edge(noise_std: float, n: int, m: int) -> float:
    """Edge of the singular-value bulk of an n x m matrix of N(0, tau^2) noise: tau (sqrt n + sqrt m)."""
    return noise_std * (math.sqrt(n) + math.sqrt(m))


def optimal_shrinker(s: torch.Tensor, noise_std: float, n: int, m: int) -> torch.Tensor:
    """Frobenius-optimal shrinker for known noise level, applied elementwise to singular values.

    ``eta(s) = sqrt((s^2 - tau^2 (n+m))^2 - 4 tau^4 n m) / s`` above the bulk edge, 0 at or below.
    For a spike of strength theta it maps the noisy value ``sqrt((theta^2+tau^2 n)(theta^2+tau^2 m))/theta``
    to ``theta * cos(u_hat, u) * cos(v_hat, v)``.
    """
    tau2 = noise_std * noise_std
    s2 = s * s
    disc = (s2 - tau2 * (n + m)) ** 2 - 4.0 * tau2 * tau2 * n * m
    above = s > noise_edge(noise_std, n, m)
    safe_s = torch.where(above, s, torch.ones_like(s))
    eta = torch.sqrt(torch.clamp(disc, min=0.0)) / safe_s
    return torch.where(above, eta, torch.zeros_like(s))


# --- SVD back-ends ---
# The thread count is the caller's (process-global state is left alone): on an
# oversubscribed CPU, multi-threaded LAPACK can stall a sub-millisecond SVD on a thread barrier
# for a scheduler slice, so such processes set torch.set_num_threads(1) once (docs/denoising.md).
def _svd_full(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD of a stack (B, n, m): U (B, n, k), S (B, k), V (B, m, k), k = min(n, m)."""
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    return u, s, vh.mT


def _svd_lowrank_adaptive(
    x: torch.Tensor, edge: float, niter: int = 4, q0: int = 16
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Randomized truncated SVD (Halko et al. 2011, ``torch.svd_lowrank``) of a stack, doubling the
    rank ``q`` until every matrix has at most ``q/2`` computed singular values above the noise edge
    (the other half is oversampling, which the flat noise bulk needs for accurate top values).
    Falls back to the full SVD once ``q`` would exceed half of min(n, m)."""
    k_max = min(x.shape[-2], x.shape[-1])
    q = min(q0, k_max)
    while 2 * q <= k_max:
        u, s, v = torch.svd_lowrank(x, q=q, niter=niter)
        if 2 * int((s > edge).sum(-1).max()) <= q:
            return u, s, v
        q *= 2
    return _svd_full(x)


# --- the denoiser ---
def _denoise_stack(grads: torch.Tensor, noise_std: float, kappa: float, svd: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Denoise a stack (B, n, m); returns (output, bool mask of denoised matrices). Matrices that
    fail the gate, or whose every singular value is at or below the bulk edge (possible when
    kappa < 1), are returned bit-for-bit unchanged."""
    n, m = grads.shape[-2:]
    untouched = torch.zeros(grads.shape[0], dtype=torch.bool, device=grads.device)
    if noise_std == 0.0 or grads.numel() == 0:
        return grads.clone(), untouched
    work = grads if grads.dtype in (torch.float32, torch.float64) else grads.float()
    edge = noise_edge(noise_std, n, m)
    lowrank = svd == SVD_LOWRANK or (svd == SVD_AUTO and min(n, m) >= LOWRANK_MIN_DIM)
    u, s, v = _svd_lowrank_adaptive(work, edge) if lowrank else _svd_full(work)
    eta = optimal_shrinker(s, noise_std, n, m)
    gate = (s[..., 0] > kappa * edge) & (eta[..., 0] > 0)
    if not bool(gate.any()):
        return grads.clone(), untouched
    k = int((eta > 0).sum(-1).max())
    denoised = (u[..., :k] * eta[..., None, :k]) @ v[..., :k].mT
    norm_in = torch.linalg.matrix_norm(work)
    norm_out = torch.linalg.matrix_norm(denoised)
    scale = torch.where(norm_out > 0, norm_in / torch.where(norm_out > 0, norm_out, 1.0), 0.0)
    denoised = (denoised * scale[..., None, None]).to(grads.dtype)
    return torch.where(gate[..., None, None], denoised, grads), gate


def spectral_denoise_batched(
    grads: torch.Tensor, noise_std: float, kappa: float = DEFAULT_KAPPA, svd: str = "full"
) -> torch.Tensor:
    """Spectral denoising of a stack of same-shaped matrices (..., n, m) through one batched SVD.

    Each matrix ``G`` is replaced by ``||G||_F * D / ||D||_F`` with ``D = sum_i eta(s_i) u_i v_i^T``
    when ``s_1(G) > kappa * noise_std * (sqrt n + sqrt m)``, and returned unchanged otherwise.

    Args:
        grads: tensor of shape (..., n, m), float16/bfloat16 (computed in float32), float32 or float64.
        noise_std: standard deviation ``tau`` of the i.i.d. Gaussian noise in each entry.
        kappa: gate factor (> 0); see :data:`DEFAULT_KAPPA`.
        svd: "full" (LAPACK/cuSOLVER thin SVD), "lowrank" (randomized truncated SVD grown until it
            reaches the noise edge) or "auto" (lowrank when min(n, m) >= ``LOWRANK_MIN_DIM``).
    """
    kappa = _check_float("kappa", kappa, zero_allowed=False)
    if isinstance(noise_std, torch.Tensor) and noise_std.numel() == 1:
        noise_std = noise_std.item()
    noise_std = _check_float("noise_std", noise_std, zero_allowed=True)
    _check_svd(svd)
    if not isinstance(grads, torch.Tensor) or grads.ndim < 2:
        raise ValueError("grads must be a tensor of shape (..., n, m) with at least 2 dimensions")
    out, _ = _denoise_stack(grads.reshape(-1, *grads.shape[-2:]), noise_std, kappa, svd)
    return out.reshape(grads.shape)


def spectral_denoise(
    grad: torch.Tensor, noise_std: float, kappa: float = DEFAULT_KAPPA, svd: str = "full"
) -> torch.Tensor:
    """Spectral denoising of one matrix (n, m); see :func:`spectral_denoise_batched`."""
    if not isinstance(grad, torch.Tensor) or grad.ndim != 2:
        raise ValueError("grad must be a 2-D tensor (n, m)")
    return spectral_denoise_batched(grad.unsqueeze(0), noise_std, kappa, svd).squeeze(0)


# --- Opacus optimizer integration ---
def _supported_optimizer_check(optimizer: Any) -> None:
    """ValueError unless ``optimizer`` is a DPOptimizer whose noise this module knows how to size."""
    from opacus.optimizers import (
        AdaClipDPOptimizer,
        DPOptimizer,
        DPPerLayerOptimizer,
        FSDPOptimizerFastGradientClipping,
    )

    unsupported = (AdaClipDPOptimizer, DPPerLayerOptimizer, FSDPOptimizerFastGradientClipping)
    if not isinstance(optimizer, DPOptimizer) or isinstance(optimizer, unsupported):
        raise ValueError(
            "optimizer must be an opacus DPOptimizer, DPOptimizerFastGradientClipping or one of their "
            f"Distributed variants (flat or ghost clipping); got {type(optimizer).__name__}"
        )


def _noise_std_before_scaling(optimizer: Any) -> float:
    """Std of the Gaussian noise Opacus adds to each entry of the summed clipped gradient:
    ``noise_multiplier * max_grad_norm`` (``_adjusted_noise_multiplier`` when adaptive clipping
    set one), or an optimizer's own ``denoise_noise_std()``."""
    from opacus.optimizers import DPOptimizerFastGradientClipping

    custom = getattr(optimizer, "denoise_noise_std", None)
    if callable(custom):
        return float(custom())
    multiplier = optimizer.noise_multiplier
    if isinstance(optimizer, DPOptimizerFastGradientClipping):
        multiplier = getattr(optimizer, "_adjusted_noise_multiplier", multiplier)
    return float(multiplier) * float(optimizer.max_grad_norm)


@dataclass
class DenoiseStats:
    """Counters kept by :class:`SpectralDenoiser` (for logging and experiments)."""

    steps: int = 0
    matrices_seen: int = 0
    matrices_denoised: int = 0
    seconds: float = 0.0
    last_noise_std: Optional[float] = None
    history: List[float] = field(default_factory=list)  # fraction denoised per step
    durations: List[float] = field(default_factory=list)  # seconds spent per step


class SpectralDenoiser:
    """Denoises ``params``' final gradients inside an Opacus ``DPOptimizer`` step: a step pre-hook
    on ``optimizer.original_optimizer``, which Opacus steps only after noise, ``scale_grad`` and
    the all-reduce, never on a skipped step (docs/denoising.md, "Where it acts"). ``scale_grad``
    is wrapped on the instance to record the divisor Opacus used in the step; ``tau`` is computed
    at step time from the optimizer's current attributes (noise schedulers may change them). The
    hook reads only ``p.grad`` and these constants.
    """

    def __init__(self, optimizer: Any, params: Sequence[torch.nn.Parameter], kappa: float, svd: str):
        _supported_optimizer_check(optimizer)
        self.kappa = _check_float("kappa", kappa, zero_allowed=False)
        self.svd = _check_svd(svd)
        self.optimizer = optimizer
        self.params = self._check_params(optimizer, params)
        self.stats = DenoiseStats()
        self._divisor: Optional[float] = None
        self._orig_scale_grad = optimizer.scale_grad
        optimizer.scale_grad = self._scale_grad
        self._handle = optimizer.original_optimizer.register_step_pre_hook(self._pre_step_hook)

    @staticmethod
    def _check_params(optimizer: Any, params: Sequence[torch.nn.Parameter]) -> List[torch.nn.Parameter]:
        params = list(params)
        dp_params = {id(p) for p in optimizer.params}
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor) or p.ndim != 2:
                raise ValueError(f"params[{i}] must be a 2-D weight (linear layer), got shape "
                                 f"{tuple(getattr(p, 'shape', ()))}")
            if id(p) not in dp_params:
                raise ValueError(f"params[{i}] (shape {tuple(p.shape)}) is not a trainable parameter "
                                 "of this DPOptimizer, so its gradient carries no known DP noise")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("params contains the same parameter twice")
        return params

    def _scale_grad(self) -> None:
        opt = self.optimizer
        self._divisor = (
            float(opt.expected_batch_size * opt.accumulated_iterations)
            if opt.loss_reduction == "mean" else 1.0
        )
        self._orig_scale_grad()

    def noise_std(self) -> Optional[float]:
        """Per-entry noise std of the released ``p.grad`` for the current step (None if unknown).
        Opacus's distributed optimizers add noise on rank 0 only, all-reduce (sum) and, for
        ``loss_reduction="mean"``, divide by the world size."""
        if self._divisor is None:
            return None
        opt = self.optimizer
        distributed = hasattr(opt, "reduce_gradients") and hasattr(opt, "world_size")
        ranks = int(opt.world_size) if distributed and opt.loss_reduction == "mean" else 1
        return _noise_std_before_scaling(opt) / (self._divisor * ranks)

    def _pre_step_hook(self, opt: Any, _args: Any, _kwargs: Any) -> None:
        tau = self.noise_std()
        self._divisor = None
        if tau is None:
            logger.debug("spectral denoiser: no noised step recorded before this update; skipped")
            return
        if bool(getattr(opt, "found_inf", None)):
            # a step refused on the device (non-finite values; opacus_rc.finite): the
            # fused update skips it, and an SVD of NaNs would raise
            logger.debug("spectral denoiser: step refused for a non-finite value; skipped")
            return
        start = time.perf_counter()
        seen, done = denoise_gradients_(self.params, tau, self.kappa, self.svd)
        elapsed = time.perf_counter() - start
        self.stats.seconds += elapsed
        self.stats.durations.append(elapsed)
        self.stats.steps += 1
        self.stats.matrices_seen += seen
        self.stats.matrices_denoised += done
        self.stats.last_noise_std = tau
        self.stats.history.append(done / seen if seen else 0.0)
        logger.debug("spectral denoiser: tau=%.3g, denoised %d of %d matrices", tau, done, seen)

    def remove(self) -> None:
        """Detach from the optimizer (restores ``scale_grad``, removes the hook)."""
        self._handle.remove()
        self.optimizer.scale_grad = self._orig_scale_grad
        if get_spectral_denoiser(self.optimizer) is self:
            delattr(self.optimizer, _DENOISER_ATTR)


def denoise_gradients_(
    params: Sequence[torch.Tensor], noise_std: float, kappa: float = DEFAULT_KAPPA, svd: str = "full"
) -> Tuple[int, int]:
    """Denoise ``p.grad`` in place for each 2-D ``p`` in ``params``, same shapes (and dtype/device)
    batched through one SVD. Reads nothing but ``p.grad`` and the constants. Returns
    (matrices seen, matrices denoised)."""
    groups: Dict[Tuple, List[torch.Tensor]] = defaultdict(list)
    for g in (p.grad for p in params):
        if g is not None and g.ndim == 2:
            groups[(tuple(g.shape), g.dtype, g.device)].append(g)
    seen = done = 0
    for grads in groups.values():
        out, mask = _denoise_stack(torch.stack(grads), noise_std, kappa, svd)
        for g, new, hit in zip(grads, out, mask.tolist()):
            if hit:
                g.copy_(new)
        seen += len(grads)
        done += int(mask.sum())
    return seen, done


def attach_spectral_denoiser(
    optimizer: Any,
    params: Sequence[torch.nn.Parameter],
    kappa: float = DEFAULT_KAPPA,
    svd: str = "full",
) -> SpectralDenoiser:
    """Install spectral denoising of ``params``' noised, averaged gradients on an Opacus optimizer.

    Works with ``DPOptimizer`` (flat clipping), ``DPOptimizerFastGradientClipping`` (ghost) and
    their Distributed variants; the per-entry noise std ``tau`` of each step: docs/denoising.md.

    Args:
        optimizer: the DP optimizer returned by ``PrivacyEngine.make_private``.
        params: 2-D weights (nn.Linear / HF Conv1D, LoRA A and B factors) trained by ``optimizer``.
        kappa: gate factor, finite and > 0 (default :data:`DEFAULT_KAPPA`).
        svd: "full" (default, exact), "lowrank" or "auto" (see :func:`spectral_denoise_batched`;
            lowrank's speed and accuracy: docs/denoising.md).

    Returns:
        The :class:`SpectralDenoiser` (its ``stats`` count denoised matrices and time spent;
        ``remove()`` detaches it). Attaching twice to one optimizer is a ValueError.
    """
    if get_spectral_denoiser(optimizer) is not None:
        raise ValueError("optimizer already has a spectral denoiser attached; call .remove() first")
    denoiser = SpectralDenoiser(optimizer, params, kappa, svd)
    setattr(optimizer, _DENOISER_ATTR, denoiser)
    return denoiser


def get_spectral_denoiser(optimizer: Any) -> Optional[SpectralDenoiser]:
    """The denoiser attached to ``optimizer`` by :func:`attach_spectral_denoiser`, if any."""
    return getattr(optimizer, _DENOISER_ATTR, None)


__all__ = [
    "DEFAULT_KAPPA",
    "SVD_METHODS",
    "DenoiseStats",
    "SpectralDenoiser",
    "attach_spectral_denoiser",
    "denoise_gradients_",
    "get_spectral_denoiser",
    "noise_edge",
    "optimal_shrinker",
    "spectral_denoise",
    "spectral_denoise_batched",
]
