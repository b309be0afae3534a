"""opacus_rc.integration, the one way into Opacus: ``opacus_rc.PrivacyEngine``, its signatures and help, the names
of Opacus that ``import opacus_rc`` replaces, and the options object parsed once."""

import inspect
import json
import os
import pydoc
import subprocess
import sys
from pathlib import Path

import opacus
import pytest
import torch
from torch import nn

import opacus_rc
from opacus_rc import integration, registration
from opacus_rc.options import DEFAULTS, Options

from .models import token_task

OPTIONS = (
    "estimator", "sketch_size", "sketching", "exact_when_cheaper", "sketch_seed", "seed", "accept_replayed_noise",
    "bookkeeping", "per_example_backward", "denoise", "denoise_kappa", "denoise_svd", "nonfinite", "sample_rate",
    "expected_batch_size", "privacy_unit", "user_ids", "max_examples_per_user", "noise", "bands",
)
ENTRY_POINTS = ("make_private", "make_private_with_epsilon")


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_signature_shows_every_option_with_its_default(name):
    parameters = inspect.signature(getattr(opacus.PrivacyEngine, name)).parameters
    assert parameters["clipping"].default == "flat"
    for option in OPTIONS:
        assert parameters[option].kind is inspect.Parameter.KEYWORD_ONLY, option
        assert parameters[option].default == DEFAULTS[option], option


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_help_documents_every_option(name):
    engine = opacus.PrivacyEngine(accountant="rc_prv")
    text = pydoc.render_doc(getattr(engine, name), renderer=pydoc.plaintext)
    for option in ("clipping", *OPTIONS):
        assert f"{option}:" in text or f"{option}," in text, option
    assert "make_private" in pydoc.render_doc(opacus.PrivacyEngine, renderer=pydoc.plaintext)


def test_opacus_privacy_engine_is_the_plugins():
    assert opacus_rc.PrivacyEngine is opacus.PrivacyEngine
    assert opacus.privacy_engine.PrivacyEngine is opacus_rc.PrivacyEngine
    assert issubclass(opacus_rc.PrivacyEngine, integration.OpacusPrivacyEngine)
    # a name bound before `import opacus_rc` builds the plugin's engine too
    assert type(integration.OpacusPrivacyEngine(accountant="rc_prv")) is opacus_rc.PrivacyEngine


@pytest.mark.parametrize("name, hint", [("rcprv", " (did you mean 'rc_prv'?)"), ("RDP", ""), (None, "")])
def test_an_unknown_accountant_is_refused_by_name_with_the_accepted_values(name, hint):
    """Issue 48: PrivacyEngine(accountant="rcprv") raised Opacus's "Unexpected accounting
    mechanism: rcprv", with neither the accepted values nor the nearest one."""
    accepted = "accepted values: 'gdp', 'prv', 'rc_prv', 'rdp'"
    for engine in (opacus.PrivacyEngine, integration.OpacusPrivacyEngine):
        with pytest.raises(ValueError) as error:
            engine(accountant=name)
        assert str(error.value) == f"accountant={name!r} is not supported{hint}; {accepted}"


_PROBE = r"""
import importlib, json, pkgutil, sys, warnings

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import opacus
    from opacus import PrivacyEngine as bound_before

    for info in pkgutil.walk_packages(opacus.__path__, "opacus."):
        if "tests" not in info.name.split("."):
            try:
                importlib.import_module(info.name)
            except Exception:
                pass
names = {}  # every module global of opacus and every attribute of its classes
for module_name, module in list(sys.modules.items()):
    if module is None or not (module_name == "opacus" or module_name.startswith("opacus.")):
        continue
    for attr, value in list(vars(module).items()):
        names[f"{module_name}.{attr}"] = (module, attr, value)
        if isinstance(value, type) and value.__module__ == module_name:
            for a, v in list(vars(value).items()):
                names[f"{module_name}.{attr}.{a}"] = (value, a, v)
classes = {id(o): (k.rsplit(".", 1)[0], o) for k, (o, _, _) in names.items() if isinstance(o, type)}

import opacus_rc  # outside catch_warnings: its filters stay

changed = [k for k, (owner, attr, value) in names.items() if vars(owner).get(attr) is not value]
changed += [f"{where}.{a}" for where, cls in classes.values() for a in vars(cls) if f"{where}.{a}" not in names]
with warnings.catch_warnings(record=True) as caught:  # the filters of `-W always` and opacus_rc
    for message, category in (
        ("Full backward hook is firing when gradients are computed with respect to module "
         "outputs since no inputs require gradients. See ...", UserWarning),
        ("Using a non-full backward hook when the forward contains multiple autograd Nodes "
         "is deprecated ...", FutureWarning),
        ("Using a non-full backward hook when outputs are nested in python data structure", FutureWarning),
        ("Full backward hook is firing", DeprecationWarning),
        ("an unrelated warning", UserWarning),
    ):
        warnings.warn(message, category)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    bound = type(bound_before(accountant="rc_prv")).__module__
print(json.dumps({"changed": sorted(set(changed)), "bound_before": bound, "shown": [str(w.message) for w in caught]}))
"""


@pytest.fixture(scope="module")
def probe():
    """What a fresh interpreter sees around ``import opacus_rc`` (run once)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-W", "always", "-c", _PROBE], capture_output=True, text=True, env=env,
        timeout=300, cwd=root,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_replaces_at_most_five_names_of_opacus(probe):
    assert len(probe["changed"]) <= 5, probe["changed"]
    assert probe["changed"] == sorted(
        f"{owner.__module__}.{owner.__qualname__}.{name}" if isinstance(owner, type) else f"{owner.__name__}.{name}"
        for owner, name, _ in registration.PATCHES
    )


def test_a_name_bound_before_the_import_builds_the_plugins_engine(probe):
    # `from opacus import PrivacyEngine` above `import opacus_rc` (isort's order)
    assert probe["bound_before"] == "opacus_rc.integration"


def test_import_sets_no_warning_filter(probe):
    # torch's notes about Opacus's hooks are silenced only inside the plugin's own passes
    assert probe["shown"] == [
        "Full backward hook is firing when gradients are computed with respect to module "
        "outputs since no inputs require gradients. See ...",
        "Using a non-full backward hook when the forward contains multiple autograd Nodes "
        "is deprecated ...",
        "Using a non-full backward hook when outputs are nested in python data structure",
        "Full backward hook is firing",
        "an unrelated warning",
    ]


def test_cleanup_removes_the_step_hook():
    engine = opacus.PrivacyEngine(accountant="rc_prv")
    module, optimizer, _ = engine.make_private(
        **_setup(), noise_multiplier=1.0, max_grad_norm=1.0, clipping="randomized", sketch_size=4,
    )
    hooks = optimizer.original_optimizer._optimizer_step_post_hooks
    assert module._step_hook is not None and module._step_hook.id in hooks
    module.cleanup()
    assert module._step_hook is None and not hooks


def test_wrapping_leaves_the_norm_sampler_registries_unchanged():
    import transformers
    from opacus_rc import norm_samplers

    before = dict(norm_samplers.RANDOMIZED_NORM_SAMPLERS), dict(norm_samplers.TIED_PROJECTIONS)
    conv1d = transformers.pytorch_utils.Conv1D
    model = nn.Sequential(nn.Embedding(32, 8), conv1d(8, 8), nn.Linear(8, 2))
    engine = opacus.PrivacyEngine(accountant="rc_prv")
    data = token_task(n=32, t=12)
    module, _, _, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(data, batch_size=8), noise_multiplier=1.0,
        max_grad_norm=1.0, clipping="randomized", grad_sample_mode="ghost", sketch_size=4,
    )
    assert conv1d in module.NORM_SAMPLERS and conv1d in module._third_party_projections
    assert (dict(norm_samplers.RANDOMIZED_NORM_SAMPLERS), dict(norm_samplers.TIED_PROJECTIONS)) == before


# --- the options object -------------------------------------------------------------------


def _setup(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 2))
    data = token_task(n=32, t=12)
    return dict(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(data, batch_size=8),
    )


def _count_parses(monkeypatch):
    calls = []
    parse = Options.parse.__func__

    def counting(cls, *args, **kwargs):
        calls.append(parse(cls, *args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(Options, "parse", classmethod(counting))
    return calls


@pytest.mark.parametrize("clipping", ["randomized", "flat"])
def test_make_private_parses_once(monkeypatch, clipping):
    calls = _count_parses(monkeypatch)
    engine = opacus.PrivacyEngine(accountant="rc_prv" if clipping == "randomized" else "prv")
    extra = dict(sketch_size=4, nonfinite="skip", seed=3) if clipping == "randomized" else {}
    out = engine.make_private(
        **_setup(), noise_multiplier=1.0, max_grad_norm=1.0, clipping=clipping, **extra
    )
    assert len(calls) == 1 and not hasattr(engine, "_options")
    options = calls[0]
    if clipping == "randomized":
        assert options.sketch.sketch_size == 4 and options.seed == options.sketch_seed == 3
        assert out[1].nonfinite == "skip" and out[1].sketch_config is options.sketch
        assert out[1].expected_batch_size == options.sampling.batch_size == 8


@pytest.mark.parametrize("clipping", ["randomized", "flat"])
def test_make_private_with_epsilon_parses_once(monkeypatch, clipping):
    calls = _count_parses(monkeypatch)
    monkeypatch.setattr(integration, "get_noise_multiplier_rc", lambda **kw: 1.0)
    engine = opacus.PrivacyEngine(accountant="rc_prv" if clipping == "randomized" else "prv")
    engine.make_private_with_epsilon(
        **_setup(), target_epsilon=8.0, target_delta=1e-5, epochs=1, max_grad_norm=1.0,
        clipping=clipping,
    )
    assert len(calls) == 1 and not hasattr(engine, "_options")


def test_uninstall_undoes_every_patch_and_install_redoes_them():
    from opacus.utils.batch_memory_manager import BatchSplittingSampler

    stock = integration.OpacusPrivacyEngine
    assert "__new__" not in vars(stock)  # never replaced: CPython could not restore it
    try:
        registration.uninstall()
        assert opacus.PrivacyEngine is opacus.privacy_engine.PrivacyEngine is stock
        for (owner, name, _), original in zip(registration.PATCHES, registration.ORIGINALS):
            assert vars(owner)[name] is original, name
        assert stock.__new__ is object.__new__ and "__new__" not in vars(stock)
        assert type(stock(accountant="prv")) is stock  # stock Opacus
        assert type(opacus.PrivacyEngine(accountant="prv")) is stock
        assert BatchSplittingSampler.__iter__ is registration.ORIGINALS[3]
        assert type(opacus_rc.PrivacyEngine(accountant="rc_prv")) is opacus_rc.PrivacyEngine
    finally:
        registration.install()
    assert opacus.PrivacyEngine is opacus_rc.PrivacyEngine
    assert type(stock(accountant="rc_prv")) is opacus_rc.PrivacyEngine
    assert stock.__new__ is object.__new__


def test_the_hand_built_objects_the_docs_name_are_exported():
    """Every plugin class docs/ names for a step built by hand (grad-sample module, optimizer,
    the two-pass criterion) is importable from ``opacus_rc`` and listed in its ``__all__``."""
    import re

    from opacus_rc.forms.two_pass import DPLossRandomizedClipping

    docs = Path(__file__).resolve().parents[1] / "docs"
    pattern = r"\b(DPLossRandomizedClipping|GradSample\w*RandomizedClipping|\w*RandomizedClipping\w*Optimizer)\b"
    names = {m for path in docs.glob("*.md") for m in re.findall(pattern, path.read_text())}
    assert "DPLossRandomizedClipping" in names
    assert sorted(n for n in names if n not in opacus_rc.__all__ or not hasattr(opacus_rc, n)) == []
    assert opacus_rc.DPLossRandomizedClipping is DPLossRandomizedClipping
