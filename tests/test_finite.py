"""opacus_rc.finite, non-finite examples: refusals name no example and no value; ``nonfinite="skip"``
drops a non-finite example's whole contribution before the sum (book-keeping only)."""

from __future__ import annotations

import copy
import io
import re

import pytest
import torch
from opacus import PrivacyEngine
from torch import nn



def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 2))


def make(model, *, mode="hooks", nonfinite="raise", noise=0.0, batch_size=8):
    engine = PrivacyEngine(accountant="rc_prv")
    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randint(0, 2, (32,)))
    out = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=torch.utils.data.DataLoader(data, batch_size=batch_size),
        criterion=nn.CrossEntropyLoss(), noise_multiplier=noise, max_grad_norm=0.5,
        grad_sample_mode=mode, clipping="randomized", nonfinite=nonfinite, sketch_seed=3,
    )
    return engine, out


def one_step(model, x, y, **kwargs):
    engine, (module, opt, *rest) = make(model, **kwargs)
    loss = nn.functional.cross_entropy(module(x), y)
    loss.backward()
    opt.step()
    return engine, opt


def poisoned_batch():
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=gen), torch.randint(0, 2, (8,), generator=gen)
    x[3, 0] = float("inf")  # example 3: non-finite activations, loss and gradient
    return x, y


def test_refusal_names_no_example_and_no_value():
    x, y = poisoned_batch()
    for mode in ("hooks", "ghost"):
        model = mlp()
        engine, (module, opt, *rest) = make(model, mode=mode)
        with pytest.raises(FloatingPointError) as err:
            if mode == "ghost":
                rest[0](module(x), y).backward()
            else:
                nn.functional.cross_entropy(module(x), y).backward()
            opt.step()
        assert not re.search(r"\d", str(err.value)), str(err.value)
        assert len(engine.accountant.history) == 0


def test_skip_drops_the_whole_contribution_of_a_non_finite_example():
    """noise 0: the update with example 3 poisoned and skipped equals the update of the
    batch without it (same public normaliser 8); the step is charged as usual and the
    count stays in a local attribute that no state_dict or checkpoint holds."""
    x, y = poisoned_batch()
    skipped_model, clean_model = mlp(), mlp()
    engine, opt = one_step(skipped_model, x, y, nonfinite="skip")
    keep = torch.arange(8) != 3
    one_step(clean_model, x[keep], y[keep])
    for (name, a), b in zip(skipped_model.named_parameters(), clean_model.parameters()):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert opt.skipped_examples == 1
    assert len(engine.accountant.history) == 1 and engine.accountant.history[0][2] == 1
    buf = io.BytesIO()
    engine.save_checkpoint(path=buf, module=skipped_model, optimizer=opt)
    assert b"skipped_examples" not in buf.getvalue()
    assert "skipped_examples" not in str(opt.state_dict())


def test_skip_with_noise_keeps_parameters_finite_and_learning_goes_on():
    x, y = poisoned_batch()
    model = mlp()
    engine, (module, opt, *_) = make(model, nonfinite="skip", noise=1.0)
    for _ in range(3):
        nn.functional.cross_entropy(module(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert opt.skipped_examples == 3 and sum(h[2] for h in engine.accountant.history) == 3


def test_skip_is_refused_where_the_sum_cannot_drop_one_example():
    with pytest.raises(ValueError, match="grad_sample_mode='bookkeeping'"):
        make(mlp(), mode="ghost", nonfinite="skip")
    with pytest.raises(ValueError, match="nonfinite='ignore'.*accepted values: 'raise', 'skip'"):
        make(mlp(), nonfinite="ignore")


# --- Where and when a refusal is decided (opacus_rc.finite) ---------------------------
#
# Every check folds into a device-side flag decided once per step, before noise: with an
# optimizer that can skip on the device (fused SGD/Adam/AdamW read ``found_inf``) a step
# has no host synchronisation of ours at all; otherwise exactly one.


def token_model(seed: int = 0) -> nn.Module:
    from .models import SequenceClassifier

    torch.manual_seed(seed)
    return SequenceClassifier()  # embedding + linear layers (T = 40 > k = 8: sketched)


def make_with(model, optimizer, *, mode, noise=0.0, accumulate=False):
    from .models import token_task

    engine = PrivacyEngine(accountant="rc_prv")
    out = engine.make_private(
        module=model, optimizer=optimizer,
        data_loader=torch.utils.data.DataLoader(token_task(n=32, t=40), batch_size=8),
        criterion=nn.CrossEntropyLoss(), noise_multiplier=noise, max_grad_norm=0.5,
        grad_sample_mode=mode, clipping="randomized", sketch_size=8, sketch_seed=3,
        poisson_sampling=False,
    )
    module, opt = out[0], out[1]
    crit = out[2] if mode == "ghost" else nn.CrossEntropyLoss()
    return engine, module, opt, crit


def token_batch(poison: bool = False):
    from .models import token_task

    x, y = token_task(n=8, t=40, seed=4).tensors
    return x, y, poison


class Poisonable(nn.Module):
    """Scales the output of the examples whose first token is 0 by inf (a data-dependent
    fault): their loss and gradients are non-finite."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        scale = torch.where(x[:, 0] == 0, float("inf"), 1.0)[:, None]
        return self.inner(x) * scale


def backward(module, crit, x, y):
    crit(module(x), y).backward()


@pytest.mark.parametrize("mode", ["ghost", "hooks"])
@pytest.mark.parametrize("fused", [False, True])
def test_host_synchronisations_per_step(mode, fused):
    """Counted with benchmarks.host_sync (Python reads of tensor values and
    data-dependent shapes, what blocks the host on CUDA), over forward, backward(s) and
    step: none with a fused optimizer, exactly the one refusal decision otherwise."""
    from benchmarks.host_sync import HostSyncCounter

    model = token_model()
    opt_in = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused)
    engine, module, opt, crit = make_with(model, opt_in, mode=mode, noise=1.0)
    x, y, _ = token_batch()
    for _ in range(2):  # the second step is measured (nothing lazy left)
        with HostSyncCounter() as syncs:
            backward(module, crit, x, y)
            opt.step()
        opt.zero_grad()
    sites = [w.rsplit(" ", 1)[-1] for w in syncs.where]
    assert sites == ([] if fused else ["_decide_finite"]), syncs.where
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("mode", ["ghost", "hooks"])
def test_fused_optimizer_refuses_on_the_device_and_reports_at_the_next_step(mode):
    """A poisoned batch with fused Adam: the step is skipped on the device (parameters
    and Adam's state untouched), counted by the accountant (conservative), and the
    refusal is raised at the next step() before that step's update."""
    model = Poisonable(token_model())
    adam = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    engine, module, opt, crit = make_with(model, adam, mode=mode, noise=1.0)
    x, y, _ = token_batch()
    before = copy.deepcopy(model.state_dict())
    bad = x.clone()
    bad[5, 0] = 0
    backward(module, crit, bad, y)
    opt.step()  # no raise: decided on the device
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k])
    state = adam.state[next(model.parameters())]
    assert float(state["step"]) == 0 and not state["exp_avg"].any()
    assert "found_inf" not in vars(adam)
    assert len(engine.accountant.history) == 1  # the refused step is charged
    opt.zero_grad()
    backward(module, crit, x, y)
    with pytest.raises(FloatingPointError, match="earlier step met a non-finite per-sample") as err:
        opt.step()
    assert not re.search(r"\d", str(err.value)), str(err.value)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k])


def test_a_refusal_on_the_last_step_is_reported_on_request():
    """After the last step, check_refused_steps() reports a device-side refusal (once);
    a clean run reports nothing."""
    for poison in (False, True):
        model = Poisonable(token_model())
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
        engine, module, opt, crit = make_with(model, sgd, mode="ghost")
        x, y, _ = token_batch()
        x = x.clone()
        if poison:
            x[5, 0] = 0
        backward(module, crit, x, y)
        opt.step()
        if poison:
            with pytest.raises(FloatingPointError, match="earlier step met a non-finite per-sample"):
                opt.check_refused_steps()
        opt.check_refused_steps()  # nothing (left) to report


@pytest.mark.parametrize("mode", ["ghost", "hooks"])
def test_fused_and_unfused_optimizers_take_the_same_clean_steps(mode):
    """The device-side decision (found_inf = 0) leaves clean updates as they are."""
    results = []
    for fused in (False, True):
        model = token_model()
        adam = torch.optim.Adam(model.parameters(), lr=0.05, fused=fused, foreach=False if not fused else None)
        engine, module, opt, crit = make_with(model, adam, mode=mode)
        x, y, _ = token_batch()
        for _ in range(3):
            backward(module, crit, x, y)
            opt.step()
            opt.zero_grad()
        results.append(model.state_dict())
    for k in results[0]:
        torch.testing.assert_close(results[1][k], results[0][k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["ghost", "hooks"])
def test_a_poisoned_micro_batch_refuses_the_whole_step(mode):
    """Two micro-batches, the second poisoned: nothing is raised in backward (no sync
    there); step() refuses the step, the accountant and parameters are unchanged."""
    model = Poisonable(token_model())
    engine, module, opt, crit = make_with(model, torch.optim.SGD(model.parameters(), lr=0.1), mode=mode)
    x, y, _ = token_batch()
    before = copy.deepcopy(model.state_dict())
    bad = x[4:].clone()
    bad[1, 0] = 0
    backward(module, crit, x[:4], y[:4])
    backward(module, crit, bad, y[4:])
    with pytest.raises(FloatingPointError, match="non-finite per-sample"):
        opt.step()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k])
    assert engine.accountant.history == []
