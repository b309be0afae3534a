"""The privacy guarantee on every path a user can take: sketch freshness whatever way the
objects were built, independent seed streams, and what the accountant records per mode
(sample rate, noise multiplier, micro-batch multiplicity, sketch size, sketching)."""

from __future__ import annotations

import pytest
import torch
from opacus import PrivacyEngine
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn

from opacus_rc import (
    GradSampleModuleRandomizedClipping,
    RandomizedClippingBookkeepingOptimizer,
    RandomizedClippingOptimizer,
    SketchConfig,
)
from opacus_rc.forms.bookkeeping import GradSampleModuleBookkeeping
from opacus_rc.forms.two_pass import DPLossRandomizedClipping
from opacus_rc.sketch import Sketcher

from .conftest import distinct
from .models import SequenceClassifier, token_task

T, K = 24, 4  # T > k: every linear layer is sketched
CONFIG = SketchConfig(sketch_size=K)


def build(route: str, secure: bool, sketching: str = "shared"):
    """(module, optimizer, loss_fn) built by make_private or by hand, two-pass or
    book-keeping, secure mode on or off."""
    torch.manual_seed(0)
    model = SequenceClassifier()
    config = SketchConfig(sketch_size=K, sketching=sketching)
    seed = {} if secure else {"sketch_seed": 5}
    if route.startswith("make_private"):
        mode = "ghost" if route.endswith("ghost") else "hooks"
        engine = PrivacyEngine(accountant="rc_prv", secure_mode=secure)
        out = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=torch.utils.data.DataLoader(token_task(n=32, t=T), batch_size=8),
            criterion=nn.CrossEntropyLoss(), noise_multiplier=0.5, max_grad_norm=1.0,
            grad_sample_mode=mode, clipping="randomized", sketch_size=K, sketching=sketching, **seed,
        )
        module, opt = out[0], out[1]
        crit = out[2] if mode == "ghost" else nn.CrossEntropyLoss()
        return module, opt, lambda x, y: crit(module(x), y).backward()
    common = dict(noise_multiplier=0.5, max_grad_norm=1.0, expected_batch_size=8, secure_mode=secure)
    if route == "hand_ghost":
        module = GradSampleModuleRandomizedClipping(
            model, max_grad_norm=1.0, sketch_config=config, secure_mode=secure, **seed
        )
        opt = RandomizedClippingOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), sketch_config=config, **common
        )
        module.follow_steps(opt)
        crit = DPLossRandomizedClipping(module, opt, nn.CrossEntropyLoss(), "mean")
        return module, opt, lambda x, y: crit(module(x), y).backward()
    module = GradSampleModuleBookkeeping(model, sketch_config=config, secure_mode=secure, **seed)
    opt = RandomizedClippingBookkeepingOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), sketch_config=config, **common
    )
    module.follow_steps(opt)
    return module, opt, lambda x, y: nn.functional.cross_entropy(module(x), y).backward()


def record_sketches(module, steps: int = 2, micro: int = 2):
    """Runs ``steps`` steps of ``micro`` micro-batches and returns, per (step, micro-batch),
    the sketch drawn or reused for each key."""
    module_, opt, backward = module
    sketcher = module_.sketcher
    seen, phase = {}, [None]
    draw = sketcher.gaussian

    def logged(batch, rows, cols, device, key=None):
        out = draw(batch, rows, cols, device, key=key)
        seen.setdefault(phase[0], {})[key] = out.clone()
        return out

    sketcher.gaussian = logged
    x, y = token_task(n=8 * micro * steps, t=T).tensors
    for s in range(steps):
        for m in range(micro):
            phase[0] = (s, m)
            i = (s * micro + m) * 8
            backward(x[i : i + 8], y[i : i + 8])
        opt.step()
        opt.zero_grad()
    return seen


ROUTES = ["make_private_ghost", "make_private_hooks", "hand_ghost", "hand_hooks"]


@pytest.mark.parametrize("secure", [False, True])
@pytest.mark.parametrize("route", ROUTES)
def test_shared_sketches_fresh_per_step_and_shared_within_it(route, secure):
    seen = record_sketches(build(route, secure))
    keys = seen[(0, 0)].keys()
    assert len(keys) >= 2  # fc1 and fc2 are sketched
    for key in keys:
        torch.testing.assert_close(seen[(0, 1)][key], seen[(0, 0)][key], rtol=0, atol=0)
        torch.testing.assert_close(seen[(1, 1)][key], seen[(1, 0)][key], rtol=0, atol=0)
        assert distinct(seen[(1, 0)][key], seen[(0, 0)][key])


@pytest.mark.parametrize("route", ["hand_ghost", "hand_hooks"])
def test_step_clock_is_the_optimizers_post_step_hook(route):
    """``module.follow_steps(optimizer)`` is the clock: nothing is stashed on the
    parameters; an unlinked hand-built module draws new shared sketches every pass (never
    reuses one across steps); linking twice counts each step once; a skipped
    (BatchMemoryManager-style) step does not advance it."""
    module, opt, backward = build(route, False)
    assert not any(hasattr(p, "_rc_steps_taken") for p in module.parameters())
    module.follow_steps(opt)  # a second link replaces the first
    x, y = token_task(n=16, t=T).tensors
    backward(x[:8], y[:8])
    opt.signal_skip_step(do_skip=True, same_draw=True)
    opt.step()  # skipped: clips and accumulates only
    assert module._optimizer_steps() == 0
    backward(x[8:], y[8:])
    opt.step()
    assert module._optimizer_steps() == 1
    opt.zero_grad()

    module._step_hook.remove()
    module._step_hook, module._steps_taken = None, None  # as if never linked
    seen = record_sketches((module, opt, backward))
    for key in seen[(0, 0)]:
        assert distinct(seen[(0, 1)][key], seen[(0, 0)][key])
        assert distinct(seen[(1, 0)][key], seen[(0, 1)][key])


@pytest.mark.parametrize("route", ["make_private_hooks", "hand_ghost"])
def test_per_example_sketches_fresh_every_pass(route):
    """Per-example sketches belong to one pass: reused across passes they would tie the
    sketches of different examples (the hidden-Z analysis needs them independent)."""
    seen = record_sketches(build(route, False, sketching="per_example"))
    for key in seen[(0, 0)]:
        assert seen[(0, 0)][key].shape[0] == 8
        assert distinct(seen[(0, 1)][key], seen[(0, 0)][key])
        assert distinct(seen[(1, 0)][key], seen[(0, 0)][key])


def test_same_integer_for_sketch_and_noise_seed_gives_independent_streams():
    """A user passing 42 for both seeds: the sketch stream is derived through a
    SeedSequence with its own domain tag, so it is not the noise generator's stream."""
    sketcher = Sketcher(SketchConfig(sketch_size=64), seed=42)
    sketch = sketcher.gaussian(1, 1000, 64, torch.device("cpu")) * 64**0.5
    noise = torch.randn(sketch.shape, generator=torch.Generator().manual_seed(42))
    plain = torch.randn(sketch.shape, generator=torch.Generator().manual_seed(43))
    assert distinct(sketch, noise) and distinct(sketch, plain)
    # independent: the sample correlation of 64,000 pairs is ~N(0, 1/64000); 5 sd = 0.02
    assert abs(torch.corrcoef(torch.stack([sketch.flatten(), noise.flatten()]))[0, 1]) < 0.02


def test_rank_enters_per_example_streams_only(monkeypatch):
    import opacus_rc.sketch as sk

    draws = {}
    for rank in (0, 1):
        monkeypatch.setattr(sk, "_process_rank", lambda rank=rank: rank)
        for sketching in ("shared", "per_example"):
            s = Sketcher(SketchConfig(sketch_size=8, sketching=sketching), seed=3)
            draws[rank, sketching] = s.gaussian(2, 16, 8, torch.device("cpu"))
    torch.testing.assert_close(draws[0, "shared"], draws[1, "shared"], rtol=0, atol=0)
    assert distinct(draws[0, "per_example"], draws[1, "per_example"])


# --- what the accountant records, per mode ------------------------------------------


def engine_and_step(mode: str, **options):
    torch.manual_seed(0)
    model = SequenceClassifier()
    engine = PrivacyEngine(accountant="rc_prv")
    data = token_task(n=64, t=T)
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    common = dict(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        criterion=nn.CrossEntropyLoss(), max_grad_norm=1.0, clipping="randomized",
        sketch_size=options.get("sketch_size", K), sketching="per_example",
        grad_sample_mode="hooks" if mode in ("hooks", "wrap_model_false", "bmm_hooks") else "ghost",
    )
    if mode == "wrap_model_false":
        common["wrap_model"] = False
    if mode == "epsilon":
        out = engine.make_private_with_epsilon(target_epsilon=8.0, target_delta=1e-5, epochs=1, **common)
    else:
        out = engine.make_private(noise_multiplier=0.7, **common)
    module = model if mode == "wrap_model_false" else out[0]
    opt, loader = out[1], out[-1]
    crit = out[2] if common["grad_sample_mode"] == "ghost" else nn.CrossEntropyLoss()
    x, y = data.tensors
    micro = options.get("micro", 1)
    if mode.startswith("bmm"):
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=opt) as mem:
            physical = 0
            for xb, yb in mem:
                crit(module(xb), yb).backward()
                opt.step()
                opt.zero_grad()
                physical += 1
                if len(engine.accountant.history):
                    break
        return engine, opt
    for m in range(micro):
        crit(module(x[16 * m : 16 * m + 16]), y[16 * m : 16 * m + 16]).backward()
    opt.step()
    return engine, opt


@pytest.mark.parametrize(
    "mode, micro",
    [("ghost", 1), ("hooks", 1), ("wrap_model_false", 1), ("epsilon", 1), ("ghost", 3), ("hooks", 3),
     ("bmm_ghost", 1), ("bmm_hooks", 1)],
)
def test_accountant_record_after_one_step(mode, micro):
    """Sample rate of one micro-batch (1/len(loader) = 0.25), the noise multiplier,
    micro-batch multiplicity (backward passes per step; BatchMemoryManager's physical
    batches are one Poisson draw: 1), sketch size and sketching."""
    # calibration at k=4 is slow (heavy envelope tail: many Z bins); k=32 takes seconds
    k = 32 if mode == "epsilon" else K
    engine, opt = engine_and_step(mode, micro=micro, sketch_size=k)
    (sigma, q, steps, record), = engine.accountant.history
    assert (q, steps) == (0.25, 1)
    assert sigma == opt.noise_multiplier and (sigma == 0.7) == (mode != "epsilon")
    assert record.micro_batches == micro
    assert (record.sketch_size, record.sketching, record.estimator) == (k, "per_example", "hutchinson")


def test_bookkeeping_accumulation_of_linear_only_model_is_charged():
    """The issue's reproduction: every trainable layer nn.Linear/nn.Embedding (no
    LayerNorm to hide the count), 3 micro-batches of 16 from 64 examples."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 2))
    engine = PrivacyEngine(accountant="rc_prv")
    data = token_task(n=64, t=T)
    module, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(data, batch_size=16),
        noise_multiplier=1.0, max_grad_norm=1.0, clipping="randomized", sketch_size=K,
    )
    x, y = data.tensors
    for m in range(3):
        nn.functional.cross_entropy(module(x[16 * m : 16 * m + 16]).mean(dim=1), y[16 * m : 16 * m + 16]).backward()
    opt.step()
    (_, q, _, record), = engine.accountant.history
    assert (q, record.micro_batches) == (0.25, 3)
