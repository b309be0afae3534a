"""opacus_rc.options: the options parsed once (``Options.parse``), the keywords checked by
name (``with_options``, ``check_keywords``) and the values refused with the parameter's name
and its accepted values."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from opacus import PrivacyEngine
from torch import nn

from opacus_rc.options import DEFAULTS, Options

from .models import token_task
from .test_bad_input import make_private
from .test_integration import OPTIONS
from .test_randomized_clipping import loader
from .test_rng_streams import D, _build, _loader


def make_private_classifier(engine, model, n: int, **options):
    """``engine.make_private`` of ``model`` on ``n`` token examples in batches of 8
    (sigma 1, C 1, SGD at lr 0.1)."""
    return engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(),
        data_loader=loader(token_task(n=n), 8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        **options,
    )


def test_the_options_are_the_parsed_ones():
    assert set(OPTIONS) == set(DEFAULTS)


def test_options_are_frozen():
    options = Options()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.sketch_size = 8
    assert not options.randomized


def test_misspelled_clipping_names_the_parameter_and_the_near_value():
    with pytest.raises(ValueError, match=r"clipping='randomised'.*did you mean 'randomized'.*'flat'"):
        make_private(clipping="randomised", noise_multiplier=1.0)


@pytest.mark.parametrize("clipping", ["randomized", "flat"])
@pytest.mark.parametrize("sigma", [-1.0, math.nan, math.inf, "1.0"])
def test_invalid_noise_multiplier_refused_at_make_private(clipping, sigma):
    with pytest.raises(ValueError, match="noise_multiplier=.*finite real >= 0"):
        make_private(clipping=clipping, noise_multiplier=sigma)


def _epsilon_call(engine, **kwargs):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    return engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(data, batch_size=4), max_grad_norm=1.0,
        target_epsilon=50.0, target_delta=1e-3, epochs=1, **kwargs,
    )


UNKNOWN = [
    (dict(clipping="randomized", sketchsize=8), r"'sketchsize' \(did you mean 'sketch_size'\?\)"),
    (dict(clipping="randomized", totally_bogus=1), r"unknown keyword 'totally_bogus'"),
    (dict(clipping="randomized", privacy_units="user"), r"unknown keyword 'privacy_units' \(did you mean 'privacy_unit'\?\)"),
    (dict(clipping="flat", totally_bogus=1), r"unknown keyword 'totally_bogus'"),
    (dict(clipping="flat", noise_generater=None), r"'noise_generater' \(did you mean 'noise_generator'\?\)"),
    (dict(clipping="randomized", noise_seed=3), r"unknown keyword 'noise_seed'"),  # internal: seed= is the option
    (dict(clipping="randomized", secure_mode=True), r"unknown keyword 'secure_mode' \(it is PrivacyEngine's"),
    (dict(clipping="flat", target_unclipped_quantile=0.5), r"target_unclipped_quantile only applies with clipping='adaptive'"),
]


@pytest.mark.parametrize("kwargs, message", UNKNOWN)
def test_unknown_keyword_of_make_private_is_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_private(noise_multiplier=1.0, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message, accountant",
    [  # randomized clipping is accounted by rc_prv only
        (kwargs, message, accountant) for kwargs, message in UNKNOWN for accountant in ("rc_prv", "prv")
        if kwargs["clipping"] != "randomized" or accountant == "rc_prv"
    ],
)
def test_unknown_keyword_of_make_private_with_epsilon_is_refused_by_name(kwargs, message, accountant):
    with pytest.raises(ValueError, match=message):
        _epsilon_call(PrivacyEngine(accountant=accountant), **kwargs)
    with pytest.raises(ValueError, match=r"unknown keyword 'noise_multiplier'"):  # it calibrates sigma
        _epsilon_call(PrivacyEngine(accountant=accountant), noise_multiplier=1.0, clipping=kwargs["clipping"])


def test_opacus_documented_keywords_still_pass_through():
    """Opacus's own keywords run: make_private's named ones, the adaptive optimizer's,
    make_private_with_epsilon's calibration (Opacus's get_noise_multiplier and the
    accountant's get_epsilon; rc_prv's for randomized, which they reach)."""
    make_private(noise_multiplier=1.0, clipping="flat", rand_on_empty=True, batch_first=True,
                 noise_generator=torch.Generator().manual_seed(1), wrap_model=True)
    make_private(noise_multiplier=1.0, clipping="adaptive", target_unclipped_quantile=0.5,
                 clipbound_learning_rate=0.2, max_clipbound=10.0, min_clipbound=0.1, unclipped_num_std=1.0)
    _epsilon_call(PrivacyEngine(accountant="prv"), clipping="flat", epsilon_tolerance=0.5, eps_error=0.05,
                  rand_on_empty=True)
    _epsilon_call(PrivacyEngine(accountant="rdp"), clipping="flat", alphas=[1.1 + x / 10.0 for x in range(100)] + list(range(12, 64)))
    coarse = _epsilon_call(PrivacyEngine(accountant="rc_prv"), clipping="randomized", epsilon_tolerance=5.0)[1]
    fine = _epsilon_call(PrivacyEngine(accountant="rc_prv"), clipping="randomized", epsilon_tolerance=0.01)[1]
    assert coarse.noise_multiplier != fine.noise_multiplier  # the tolerance reached the calibration


@pytest.mark.parametrize(
    "kwargs, param, accepted",
    [
        ({"sketch_size": 0}, "sketch_size", "positive integer"),
        ({"sketch_size": -3}, "sketch_size", "positive integer"),
        ({"sketch_size": 2.5}, "sketch_size", "positive integer"),
        ({"sketch_size": "32"}, "sketch_size", "positive integer"),
        ({"sketch_size": True}, "sketch_size", "positive integer"),
        ({"estimator": "hutch+++"}, "estimator", "'hutchinson', 'hutchpp'"),
        ({"sketching": "per_batch"}, "sketching", "'shared', 'per_example'"),
        ({"grad_sample_mode": "ew"}, "grad_sample_mode", "'ghost', 'hooks'"),
        ({"grad_sample_mode": "functorch"}, "grad_sample_mode", "'ghost', 'hooks'"),
        ({"sketch_seed": "abc"}, "sketch_seed", "a non-negative int or None"),
        ({"sketch_seed": -1}, "sketch_seed", "a non-negative int or None"),
    ],
)
def test_bad_options_raise_clear_errors(model_factory, kwargs, param, accepted):
    engine = PrivacyEngine(accountant="rc_prv")
    model = model_factory()
    options = {"grad_sample_mode": "ghost", "clipping": "randomized", **kwargs}
    with pytest.raises(ValueError) as err:
        make_private_classifier(engine, model, n=16, **options)
    assert param in str(err.value) and accepted in str(err.value)


@pytest.mark.parametrize("accountant", ["prv", "rdp", "gdp"])
def test_randomized_clipping_refuses_accountants_that_cannot_account_for_it(
    model_factory, accountant
):
    engine = PrivacyEngine(accountant=accountant)
    model = model_factory()
    for call, extra in [
        (engine.make_private, {"noise_multiplier": 1.0}),
        (engine.make_private_with_epsilon, {"target_epsilon": 3.0, "target_delta": 1e-5, "epochs": 1}),
    ]:
        with pytest.raises(ValueError, match="accountant='rc_prv'"):
            call(
                module=model,
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                criterion=nn.CrossEntropyLoss(),
                data_loader=loader(token_task(n=16), 8),
                max_grad_norm=1.0,
                grad_sample_mode="ghost",
                clipping="randomized",
                **extra,
            )


def test_sketch_options_without_randomized_clipping_are_refused(model_factory):
    engine = PrivacyEngine()
    model = model_factory()
    with pytest.raises(ValueError, match="sketch_size only apply with clipping='randomized'"):
        engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader(token_task(n=16), 8),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            sketch_size=8,
        )


def test_seed_conflicts_and_secure_mode_are_refused():
    with pytest.raises(ValueError, match="seed=.*noise_generator"):
        _build("ghost", seed=1, noise_generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="seed=.*sketch_seed"):
        _build("ghost", seed=1, sketch_seed=2)
    with pytest.raises(ValueError, match="seed=.*generator"):
        _build("ghost", seed=1, loader_kwargs={"generator": torch.Generator().manual_seed(1)})
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="seed=.*accepted values"):
            _build("ghost", seed=bad)
    with pytest.raises(ValueError, match="seed only apply with clipping='randomized'"):
        model = nn.Linear(D, 2)
        PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=_loader(), noise_multiplier=1.0, max_grad_norm=1.0, seed=1,
        )
    model = nn.Linear(D, 2, bias=False)
    with pytest.raises(ValueError, match="seed"):
        PrivacyEngine(accountant="rc_prv", secure_mode=True).make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=_loader(), noise_multiplier=1.0, max_grad_norm=1.0,
            clipping="randomized", grad_sample_mode="ghost", seed=1,
        )
