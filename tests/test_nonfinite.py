"""Non-finite examples: refusals name no example and no value; ``nonfinite="skip"``
drops a non-finite example's whole contribution before the sum (book-keeping only)."""

from __future__ import annotations

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
    with pytest.raises(ValueError, match="grad_sample_mode='hooks'"):
        make(mlp(), mode="ghost", nonfinite="skip")
    with pytest.raises(ValueError, match="nonfinite='ignore'.*accepted values: 'raise', 'skip'"):
        make(mlp(), nonfinite="ignore")
