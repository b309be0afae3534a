"""opacus_rc.checkpoint: checkpoints hold no generator state or seed by default, and with
``include_rng_state=True`` the generators round-trip (a resumed step equals the
uninterrupted one bit for bit)."""

import copy
import io

import pytest
import torch
from opacus import PrivacyEngine
from torch import nn

from .models import SequenceClassifier, token_task
from .test_robustness import private, step
from .test_rng_streams import _build, _steps


def build_run(seed=0):
    torch.manual_seed(seed)
    model = SequenceClassifier()
    return model, *private(model, noise=0.8, seed=seed)


SECRET_SEED = 987_654_321  # sketch and noise seed: must not appear in a default checkpoint


def _train_save_and_resume(**save_kwargs):
    """2 steps, checkpoint, step 3; a fresh run (same seeds) loads the checkpoint and
    takes its step 3. Returns both step-3 states, the engines and the checkpoint bytes."""
    x, y = token_task(n=16, t=40).tensors
    model, engine, module, opt, crit, _ = build_run(SECRET_SEED)
    for _ in range(2):
        step(module, opt, crit, x, y)
    buf = io.BytesIO()
    engine.save_checkpoint(path=buf, module=module, optimizer=opt, **save_kwargs)
    eps_saved = engine.get_epsilon(1e-5)
    step(module, opt, crit, x, y)
    uninterrupted = copy.deepcopy(model.state_dict())
    model2, engine2, module2, opt2, crit2, _ = build_run(SECRET_SEED)
    buf.seek(0)
    engine2.load_checkpoint(path=buf, module=module2, optimizer=opt2)
    eps_resumed = engine2.get_epsilon(1e-5)
    step(module2, opt2, crit2, x, y)
    assert eps_resumed == eps_saved  # the accountant's history round-trips
    return uninterrupted, model2.state_dict(), engine, engine2, eps_resumed, buf.getvalue(), module


def _holds(obj, predicate) -> bool:
    if predicate(obj):
        return True
    if isinstance(obj, dict):
        return any(_holds(k, predicate) or _holds(v, predicate) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return any(_holds(v, predicate) for v in obj)
    return False


def test_checkpoint_holds_no_generator_state_or_seed_by_default():
    """Default: neither the sketch seed nor any generator state is in the checkpoint (nor
    in optimizer.state_dict()); the resumed run reports the same epsilon and draws fresh
    randomness (its step 3 differs from the uninterrupted one)."""
    first, resumed, engine, engine2, eps_resumed, raw, module = _train_save_and_resume()
    assert engine2.get_epsilon(1e-5) == engine.get_epsilon(1e-5)
    checkpoint = torch.load(io.BytesIO(raw), weights_only=False)
    generator_states = (torch.Generator().get_state().shape, )
    assert not _holds(checkpoint, lambda o: isinstance(o, torch.Tensor) and o.dtype == torch.uint8
                      and o.shape in generator_states)
    assert module.sketcher.seed == SECRET_SEED
    assert not _holds(checkpoint, lambda o: isinstance(o, int) and not isinstance(o, bool) and o == SECRET_SEED)
    assert not _holds(checkpoint, lambda o: isinstance(o, str) and ("generator" in o or "seed" in o))
    (sigma, rate, steps, sketch), = engine2.accountant.history
    assert sketch.randomized and steps == 3
    assert any(not torch.equal(resumed[k], first[k]) for k in first)


def test_checkpoint_with_rng_state_resumes_bit_exactly():
    """include_rng_state=True (documented as secret as the data): the sketch and noise
    generators round-trip, and step 3 equals the uninterrupted one bit for bit."""
    first, resumed, engine, engine2, eps_resumed, raw, _ = _train_save_and_resume(include_rng_state=True)
    assert engine2.get_epsilon(1e-5) == engine.get_epsilon(1e-5)
    for k, v in resumed.items():
        torch.testing.assert_close(v, first[k], rtol=0, atol=0)
    with pytest.raises(ValueError, match="include_rng_state"):
        engine.save_checkpoint(path=io.BytesIO(), module=nn.Linear(2, 2), include_rng_state="yes")


def test_checkpoint_with_rng_state_restores_plugin_noise_and_poisson_streams():
    """include_rng_state=True (as secret as the data): the plugin's own noise and Poisson
    streams round-trip, so resumed steps 3, 4 equal the uninterrupted ones bit for bit."""
    run = _build("ghost")
    _steps(run)
    buf = io.BytesIO()
    run[0].save_checkpoint(path=buf, module=run[2], optimizer=run[3], include_rng_state=True)
    uninterrupted = _steps(run)
    resumed = _build("ghost")
    buf.seek(0)
    resumed[0].load_checkpoint(path=buf, module=resumed[2], optimizer=resumed[3])
    again = _steps(resumed)
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted[0], again[0]))
    assert uninterrupted[1] == again[1]


def _trained(seed=None, steps=2, rows=32, **options):
    """A book-keeping run (SGD with momentum: the optimizer has state) after ``steps`` steps."""
    torch.manual_seed(0)
    model = SequenceClassifier()
    engine = PrivacyEngine(accountant="rc_prv")
    module, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        data_loader=torch.utils.data.DataLoader(token_task(n=rows, t=8), batch_size=8), noise_multiplier=0.5,
        max_grad_norm=1.0, clipping="randomized", grad_sample_mode="bookkeeping", seed=seed, **options,
    )
    done = 0
    while done < steps:
        for x, y in loader:
            nn.functional.cross_entropy(module(x), y).backward()
            opt.step()
            opt.zero_grad()
            done += 1
            if done == steps:
                break
    return engine, module, opt


def _other_rank(checkpoint):
    checkpoint["opacus_rc_rng_state"]["rank"] = 1


def _unexpected_key(checkpoint):
    checkpoint["module_state_dict"]["_module.extra"] = torch.zeros(1)


def _bad_history(checkpoint):
    checkpoint["privacy_accountant_state_dict"]["history"].append((1.0, 0.1))


#: case: (the saved run's options, its save options, an edit of the file, the loading run's options, the refusal)
REFUSED_LOADS = {
    "banded_into_independent": ({"noise": "banded", "bands": 2}, {}, None, {}, "noise=banded loaded into a run with noise=independent"),
    "independent_into_banded": ({}, {}, None, {"noise": "banded", "bands": 2}, "noise=independent loaded into a run with noise=banded"),
    "other_bands": ({"noise": "banded", "bands": 2}, {}, None, {"noise": "banded", "bands": 3}, "resume with the same bands="),
    "seeded_into_seeded": ({"seed": 5}, {}, None, {"seed": 6}, "replays its noise"),
    "other_rank": ({}, {"include_rng_state": True}, _other_rank, {}, "rank 1's generator states"),
    "banded_partition_of_other_rows": ({"noise": "banded", "bands": 2}, {"include_rng_state": True}, None,
                                       {"noise": "banded", "bands": 2, "rows": 24}, "partition of the units is of other rows"),
    "module_keys": ({}, {}, _unexpected_key, {}, "Unexpected key"),
    "accountant_history": ({}, {}, _bad_history, {}, "history entry"),
}


@pytest.mark.parametrize("case", sorted(REFUSED_LOADS))
def test_a_refused_load_leaves_the_module_optimizer_accountant_and_generators_untouched(case):
    """Every refusal of PrivacyEngine.load_checkpoint is decided before anything is loaded (issue
    53): the module's parameters, the optimizer's state (momentum buffers, banded noise's step),
    the accountant's history and the noise and Poisson generators are the loading run's own after
    the refusal. Before, Opacus's load had loaded the module and the accountant (and torch the
    optimizer's state, for other bands) when the optimizer's state or the generators' were refused."""
    saved_options, save_options, edit, options, refusal = REFUSED_LOADS[case]
    engine, module, opt = _trained(**saved_options)
    buf = io.BytesIO()
    engine.save_checkpoint(path=buf, module=module, optimizer=opt, **save_options)
    if edit is not None:
        checkpoint = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
        edit(checkpoint)
        buf = io.BytesIO()
        torch.save(checkpoint, buf)
    engine2, module2, opt2 = _trained(steps=3, **options)
    before = (copy.deepcopy(module2.state_dict()), copy.deepcopy(opt2.state_dict()),
              copy.deepcopy(engine2.accountant.history), opt2.noise_streams.state_dict(),
              getattr(engine2, "_opacus_rc_poisson_generator").get_state())
    assert any(not torch.equal(v, before[0][k]) for k, v in module.state_dict().items())  # a load would show
    buf.seek(0)
    with pytest.raises((ValueError, RuntimeError), match=refusal):
        engine2.load_checkpoint(path=buf, module=module2, optimizer=opt2)
    after = (module2.state_dict(), opt2.state_dict(), engine2.accountant.history, opt2.noise_streams.state_dict(),
             getattr(engine2, "_opacus_rc_poisson_generator").get_state())
    assert before[0].keys() == after[0].keys() and all(torch.equal(before[0][k], after[0][k]) for k in after[0])
    assert repr(before[1]) == repr(after[1])
    assert before[2] == after[2]
    assert repr(before[3]) == repr(after[3]) and torch.equal(before[4], after[4])
