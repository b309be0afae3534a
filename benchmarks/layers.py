"""Per-layer cost of the per-sample norm computation of one ``nn.Linear`` layer.

For a batch of ``B`` sequences of length ``T`` through a (d -> p) linear layer, four ways
to get the per-sample weight-gradient norms ``||A_i^T G_i||_F``:

* ``ghost``: Opacus ghost clipping (``compute_linear_norm_sample``): ``A A^T`` and
  ``G G^T`` (T x T), FLOPs ``2 B T^2 (d + p)``, memory ``O(B T^2)``;
* ``fgc``: fast gradient clipping, per-sample gradients (``compute_linear_grad_sample``)
  then their norms: FLOPs ``2 B T d p``, memory ``O(B d p)``;
* ``hutchinson``: ``||A_i^T (G_i P)||_F^2``, P (p x k): FLOPs ``2 B T k (d + p)``,
  memory ``O(B k (T + min(d, p)) + k max(d, p))``;
* ``hutchpp``: Hutch++ with k head and k tail vectors (about 3x Hutchinson's products).

FLOPs come from :class:`torch.utils.flop_counter.FlopCounterMode` (matrix products only:
elementwise work is not counted) and peak extra memory from
:class:`examples.profiling.PeakAllocationCounter` (live bytes allocated by the
computation, inputs excluded). Both run on the meta device by default, so shapes that
would not fit in RAM (d = 2048, p = 8192, T = 16384) cost nothing to measure.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from opacus.grad_sample.linear import compute_linear_grad_sample, compute_linear_norm_sample
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from examples.profiling import PeakAllocationCounter
from opacus_rc.config import SketchConfig
from opacus_rc.norm_samplers import linear_norm_sample
from opacus_rc.sketch import Sketcher

METHODS = ("ghost", "fgc", "hutchinson", "hutchpp")
NormFn = Callable[[], Dict[nn.Parameter, torch.Tensor]]


@dataclass(frozen=True)
class LayerCase:
    """One (method, layer shape, sequence length, batch) measurement."""

    method: str
    d: int
    p: int
    seq_len: int
    batch: int = 1
    sketch_size: int = 32


@dataclass
class LayerResult:
    """FLOPs and peak extra bytes of one :class:`LayerCase` (``time_s`` only for real
    tensors: the median wall time of the norm computation)."""

    method: str
    d: int
    p: int
    seq_len: int
    batch: int
    sketch_size: int
    flops: int
    peak_bytes: int
    device: str
    time_s: Optional[float] = None

    def as_dict(self) -> dict:
        return asdict(self)


def _fgc_norms(layer: nn.Linear, a: torch.Tensor, g: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
    """FGC: per-sample gradients ``G_i^T A_i`` (B x p x d), then their Frobenius norms."""
    grads = compute_linear_grad_sample(layer, [a], g)
    return {k: v.reshape(v.shape[0], -1).norm(2, dim=1) for k, v in grads.items()}


def norm_function(case: LayerCase, device: str = "meta", seed: int = 0) -> NormFn:
    """A closure computing the per-sample norms of ``case`` on fresh inputs.

    Inputs (activations B x T x d, backprops B x T x p) are allocated here, outside the
    closure, so the measured peak counts only the norm computation's own memory.
    """
    if case.method not in METHODS:
        raise ValueError(f"method={case.method!r} is not supported; accepted values: {METHODS}")
    gen = None if device == "meta" else torch.Generator(device=device).manual_seed(seed)
    layer = nn.Linear(case.d, case.p, bias=False, device=device)

    def tensor(*shape: int) -> torch.Tensor:
        if device == "meta":
            return torch.empty(shape, device=device)
        return torch.randn(shape, device=device, generator=gen)

    a = tensor(case.batch, case.seq_len, case.d)
    g = tensor(case.batch, case.seq_len, case.p)
    if case.method == "ghost":
        return lambda: compute_linear_norm_sample(layer, [a], g)
    if case.method == "fgc":
        return lambda: _fgc_norms(layer, a, g)
    config = SketchConfig(
        estimator=case.method, sketch_size=case.sketch_size, exact_when_cheaper=False
    )
    sketcher = Sketcher(config, seed=seed)
    return lambda: linear_norm_sample(layer, [a], g, sketcher)


def count_flops(fn: NormFn) -> int:
    """Matrix-product FLOPs of ``fn()`` (FlopCounterMode)."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def peak_bytes(fn: NormFn) -> int:
    """Peak live bytes allocated by ``fn()`` (its result included)."""
    with PeakAllocationCounter() as counter:
        out = fn()
    del out
    return counter.peak


def measure_layer(case: LayerCase, device: str = "meta") -> LayerResult:
    """FLOPs and peak extra memory of one case (on ``device``; meta by default)."""
    fn = norm_function(case, device)
    return LayerResult(
        **asdict(case), flops=count_flops(fn), peak_bytes=peak_bytes(fn), device=device
    )


def time_layers(
    cases: Sequence[LayerCase],
    reps: int,
    device: str = "cpu",
    tick: Callable[[], None] = lambda: None,
) -> List[float]:
    """Median wall time (s) of each case's norm computation on real tensors.

    Repetitions are interleaved (case 1, case 2, ..., case 1, case 2, ...) so that load
    changes on a shared machine hit every case alike; one untimed warm-up run each.
    ``tick()`` is called after every timed run (progress bars).
    """
    fns = [norm_function(case, device) for case in cases]
    for fn in fns:
        fn()
    times: List[List[float]] = [[] for _ in cases]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - start)
            tick()
    return [median(ts) for ts in times]


def median(xs: Sequence[float]) -> float:
    """The median (mean of the two middle values for an even count)."""
    s = sorted(xs)
    n = len(s)
    if n == 0:
        raise ValueError("median of an empty sequence")
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def layer_cases(
    shapes: Iterable[Tuple[int, int]],
    seq_lens: Iterable[int],
    *,
    batch: int = 1,
    sketch_size: int = 32,
    methods: Sequence[str] = METHODS,
) -> List[LayerCase]:
    """Every (shape, T, method) combination."""
    return [
        LayerCase(method, d, p, t, batch, sketch_size)
        for d, p in shapes
        for t in seq_lens
        for method in methods
    ]


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``log y`` against ``log x`` (the exponent of y ~ x^s)."""
    lx = [math.log(x) for x in xs]
    ly = [math.log(max(y, 1)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    sxx = sum((x - mx) ** 2 for x in lx)
    if sxx == 0:
        raise ValueError("loglog_slope needs at least two distinct x values")
    return sum((x - mx) * (y - my) for x, y in zip(lx, ly)) / sxx


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> Tuple[float, float, float]:
    """Least-squares ``y = a + b x``; returns (a, b, largest |residual| / y)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("linear_fit needs at least two distinct x values")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    worst = max(abs(a + b * x - y) / y for x, y in zip(xs, ys) if y > 0)
    return a, b, worst


def memory_fits(results: Sequence[LayerResult]) -> List[dict]:
    """Per (method, shape): log-log slope of peak memory in T (all points and the upper
    half of the T range) and a linear fit ``peak = a + b T``."""
    groups: Dict[Tuple[str, int, int, int], List[LayerResult]] = {}
    for r in results:
        groups.setdefault((r.method, r.d, r.p, r.batch), []).append(r)
    fits = []
    for (method, d, p, batch), rows in groups.items():
        rows = sorted(rows, key=lambda r: r.seq_len)
        if len({r.seq_len for r in rows}) < 2:
            continue
        ts = [r.seq_len for r in rows]
        mem = [r.peak_bytes for r in rows]
        upper = rows[len(rows) // 2 :] if len(rows) >= 4 else rows[-2:]
        a, b, worst = linear_fit(ts, mem)
        fits.append(
            {
                "method": method, "d": d, "p": p, "batch": batch,
                "slope_loglog": loglog_slope(ts, mem),
                "slope_loglog_upper": loglog_slope(
                    [r.seq_len for r in upper], [r.peak_bytes for r in upper]
                ),
                "linear_intercept_bytes": a,
                "linear_bytes_per_token": b,
                "linear_max_rel_residual": worst,
            }
        )
    return fits
