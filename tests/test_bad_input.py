"""Bad input refused by the plugin itself, naming the parameter and its accepted values
(or, where the input is legal but degenerate, said once and clearly)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from opacus import PrivacyEngine
from torch import nn

from opacus_rc.accounting.accountant import RCPRVAccountant
from opacus_rc.lm_head import from_causal_lm


def make_private(**kwargs):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    engine = PrivacyEngine(accountant="rc_prv")
    return engine, engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(data, batch_size=4), max_grad_norm=1.0, **kwargs,
    )


def test_zero_noise_is_said_once_and_epsilon_is_infinite():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, (module, optimizer, loader) = make_private(clipping="randomized", noise_multiplier=0.0)
    said = [w for w in caught if "not private" in str(w.message)]
    assert len(said) == 1 and "noise_multiplier=0" in str(said[0].message)
    x, y = next(iter(loader))
    F.cross_entropy(module(x), y).backward()
    optimizer.step()
    assert engine.get_epsilon(delta=1e-5) == math.inf


@pytest.mark.parametrize("record", [None, {"sketch_size": 32}])
@pytest.mark.parametrize("q", [0.1, 1.0])
def test_noiseless_steps_have_infinite_epsilon_at_every_rate(q, record):
    """sigma = 0 releases the clipped sum itself: epsilon is infinite, also at q = 1
    (which used to fail with 'math domain error' inside the PRV's log-MGF)."""
    accountant = RCPRVAccountant()
    accountant.history = [(0.0, q, 3) if record is None else (0.0, q, 3, record)]
    assert accountant.get_epsilon(delta=1e-5) == math.inf


def test_chunked_head_reduction_none_returns_per_sequence_losses():
    torch.manual_seed(0)

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(8, 11, bias=False)

        def get_output_embeddings(self):
            return self.lm_head

    model = Tiny()
    hidden, ids = torch.randn(3, 5, 8), torch.randint(0, 11, (3, 5))
    per_sequence = from_causal_lm(model, block_size=2, reduction="none")(hidden, ids)
    logits = model.lm_head(hidden)[:, :-1]
    expected = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(dim=1)
    assert per_sequence.shape == (3,)
    torch.testing.assert_close(per_sequence, expected)
    with pytest.raises(ValueError, match="reduction='avg'.*'none'"):
        from_causal_lm(model, reduction="avg")


@pytest.mark.parametrize("sigma", [-1.0, math.nan])
def test_privacy_arguments_refuse_an_invalid_noise_multiplier(sigma):
    from opacus_rc.hf import PrivacyArguments

    with pytest.raises(ValueError, match="noise_multiplier=.*accepted values"):
        PrivacyArguments(noise_multiplier=sigma, delta=1e-5)


def test_dp_trainer_at_full_batch_without_noise_reports_infinite_epsilon(tmp_path):
    """sample_rate=1.0 with noise 0 used to crash at the end of train() ('math domain error'
    in the PRV's log-MGF): epsilon is infinite, logged as such."""
    from opacus_rc.hf import DPTrainer, PrivacyArguments

    from .hf.test_trainer import training_args
    from .models import RowDataset, tiny_llama

    trainer = DPTrainer(
        model=tiny_llama(), args=training_args(tmp_path, max_steps=1), train_dataset=RowDataset(8),
        privacy=PrivacyArguments(noise_multiplier=0.0, delta=1e-5, sample_rate=1.0, sketch_size=4),
    )
    trainer.train()
    assert trainer.get_epsilon() == math.inf


def test_privacy_arguments_refuse_an_unknown_field_by_name():
    from opacus_rc.hf import PrivacyArguments

    with pytest.raises(ValueError, match=r"PrivacyArguments got an unknown keyword 'sketchsize' \(did you mean 'sketch_size'"):
        PrivacyArguments(noise_multiplier=1.0, delta=1e-5, sketchsize=8)
    with pytest.raises(ValueError, match=r"unknown keyword 'privacy_units' \(did you mean 'privacy_unit'"):
        PrivacyArguments(noise_multiplier=1.0, delta=1e-5, privacy_units="user")
    assert PrivacyArguments(noise_multiplier=1.0, delta=1e-5, privacy_unit="user", user_column="author").privacy_unit == "user"
    assert PrivacyArguments(noise_multiplier=1.0, delta=1e-5, sketch_size=8).sketch_size == 8


def test_privacy_arguments_take_make_private_options_with_its_defaults():
    """PrivacyArguments' fields named like make_private's options have their annotation and
    default (one place: opacus_rc.options.OPTIONS); the others are the Trainer's own."""
    import dataclasses

    from opacus_rc.hf import PrivacyArguments
    from opacus_rc.hf.arguments import PLUGIN_FIELDS
    from opacus_rc.options import OPTIONS

    options = {o.name: o for o in OPTIONS}
    shared = [f for f in dataclasses.fields(PrivacyArguments) if f.name in options]
    assert [f.name for f in shared] == list(PLUGIN_FIELDS)
    assert {"estimator", "sketch_size", "sketching", "per_example_backward", "denoise", "sample_rate",
            "privacy_unit", "max_examples_per_user"} <= set(PLUGIN_FIELDS)
    for f in shared:
        assert (f.type, f.default) == (options[f.name].annotation, options[f.name].default), f.name


@pytest.mark.parametrize("bad", [dict(sketch_size=0), dict(estimator="hutch"), dict(sketching="none"), dict(denoise="svd")])
def test_privacy_arguments_refuse_an_option_as_make_private_does(bad):
    """The Trainer's options are checked by make_private's own checks: the same message."""
    from opacus_rc.hf import PrivacyArguments

    with pytest.raises(ValueError) as engine_error:
        make_private(noise_multiplier=1.0, clipping="randomized", **bad)
    with pytest.raises(ValueError) as trainer_error:
        PrivacyArguments(noise_multiplier=1.0, delta=1e-5, **bad)
    assert str(trainer_error.value) == str(engine_error.value)
    assert next(iter(bad)) in str(trainer_error.value)
