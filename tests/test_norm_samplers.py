"""opacus_rc.norm_samplers: per-layer sketched norms (float32 accumulation, a sketch per
layer and step, memory linear in the sequence length)."""

import pytest
import torch
from opacus.grad_sample.linear import compute_linear_norm_sample
from torch import nn

from opacus_rc.config import SketchConfig
from opacus_rc.norm_samplers import linear_norm_sample
from opacus_rc.sketch import Sketcher


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_model_accumulates_sketch_in_float32(dtype):
    """Norm estimates of a half-precision layer match the float64 computation on the same
    (rounded) inputs and sketch to float32 accuracy, not half precision."""
    layer = nn.Linear(64, 96).to(dtype)
    a = torch.randn(3, 80, 64).to(dtype)
    g = torch.randn(3, 80, 96).to(dtype)
    low = linear_norm_sample(layer, [a], g, Sketcher(SketchConfig(sketch_size=8), seed=1))
    ref = linear_norm_sample(
        layer.double(), [a.double()], g.double(), Sketcher(SketchConfig(sketch_size=8), seed=1)
    )
    for p_low, p_ref in zip(low.values(), ref.values()):
        assert p_low.dtype == torch.float32
        torch.testing.assert_close(p_low.double(), p_ref, rtol=1e-5, atol=0)


def test_each_layer_and_step_gets_its_own_sketch():
    """Two layers fed identical inputs get different sketches in one step; within a step
    a layer keeps its sketch (micro-batches share it); a new step draws a new one."""
    sketcher = Sketcher(SketchConfig(sketch_size=4), seed=0)
    clock = [0]
    sketcher.bind_step_clock(lambda: clock[0])
    layer, twin = nn.Linear(8, 8), nn.Linear(8, 8)
    a, g = torch.randn(2, 40, 8), torch.randn(2, 40, 8)
    first = linear_norm_sample(layer, [a], g, sketcher)[layer.weight]
    other_layer = linear_norm_sample(twin, [a], g, sketcher)[twin.weight]
    same_step = linear_norm_sample(layer, [a], g, sketcher)[layer.weight]
    clock[0] += 1  # the optimizer took a step
    next_step = linear_norm_sample(layer, [a], g, sketcher)[layer.weight]
    assert not torch.allclose(first, other_layer)
    torch.testing.assert_close(first, same_step)
    assert not torch.allclose(first, next_step)


def peak_bytes(fn) -> int:
    """The most bytes held at once by the storages that the operators run by ``fn()``
    allocate (its result included): a storage is counted from the operator that creates it
    until it is freed; an output sharing an input's storage (a view, an in-place result) is
    not new. Operator by operator (a TorchDispatchMode), so on any device and whatever the
    allocator caches."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    held, totals = {}, {"now": 0, "peak": 0}  # held: storage address -> bytes

    def freed(address):
        totals["now"] -= held.pop(address, 0)

    class Meter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            inputs = {x.untyped_storage().data_ptr() for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)}
            result = func(*args, **(kwargs or {}))
            for out in (x for x in tree_leaves(result) if isinstance(x, torch.Tensor)):
                storage = out.untyped_storage()
                address = storage.data_ptr()
                if storage.nbytes() and address not in inputs and address not in held:
                    held[address] = storage.nbytes()
                    totals["now"] += held[address]
                    totals["peak"] = max(totals["peak"], totals["now"])
                    weakref.finalize(storage, freed, address)
            return result

    with Meter():
        fn()
    return totals["peak"]


def test_norm_sampler_memory_linear_in_t_while_ghost_is_quadratic():
    """Peak bytes allocated by the nn.Linear norm computation, T = 512 ... 8192.

    Counted operator by operator (a TorchDispatchMode byte counter), not wall time.
    Ours holds G P (B T k) and a d x k product; Opacus ghost holds T x T matrices.
    A log-log slope fit over T must be ~1 (ours) and ~2 (ghost).
    """
    layer = nn.Linear(64, 64)
    sketcher = Sketcher(SketchConfig(sketch_size=32), seed=0)
    ts = [512, 1024, 2048, 4096, 8192]
    ours, ghost = [], []
    for t in ts:
        a, g = torch.randn(1, t, 64), torch.randn(1, t, 64)
        ours.append(peak_bytes(lambda: linear_norm_sample(layer, [a], g, sketcher)))
        ghost.append(peak_bytes(lambda: compute_linear_norm_sample(layer, [a], g)))

    def slope(ys):
        lx = torch.tensor(ts, dtype=torch.float64).log()
        ly = torch.tensor(ys, dtype=torch.float64).log()
        return (((lx - lx.mean()) * (ly - ly.mean())).sum() / ((lx - lx.mean()) ** 2).sum()).item()

    assert 0.9 <= slope(ours) <= 1.1
    assert 1.9 <= slope(ghost) <= 2.1
    assert ours[-1] < ghost[-1] / 100
