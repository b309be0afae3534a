"""opacus_rc.optimizer: the randomized-clipping optimizer's own noise stream and its
refusal to load a seeded run's state into a seeded run."""

import io

import pytest
import torch
from torch import nn

from .test_rng_streams import _build, _steps


def test_loading_a_seeded_optimizer_state_into_a_seeded_run_is_refused():
    """``optimizer.load_state_dict`` of a seeded run's state: refused into a seeded run
    (unless accepted), fine into a run without seed= (fresh noise) and from an unseeded
    run; a checkpoint with the generators' states continues the streams (no replay)."""
    seeded = _build("hooks", seed=7)
    _steps(seeded)
    state = seeded[3].state_dict()
    with pytest.raises(ValueError, match="replays its noise"):
        _build("hooks", seed=7)[3].load_state_dict(state)
    _build("hooks")[3].load_state_dict(state)
    _build("hooks", seed=7, accept_replayed_noise=True)[3].load_state_dict(state)
    _build("hooks", seed=7)[3].load_state_dict(_build("hooks")[3].state_dict())
    buf = io.BytesIO()
    seeded[0].save_checkpoint(path=buf, module=seeded[2], optimizer=seeded[3], include_rng_state=True)
    uninterrupted = _steps(seeded)
    resumed = _build("hooks", seed=7)
    buf.seek(0)
    resumed[0].load_checkpoint(path=buf, module=resumed[2], optimizer=resumed[3])
    again = _steps(resumed)
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted[0], again[0]))  # continued, not replayed
    with pytest.raises(ValueError, match="accept_replayed_noise=True only applies with seed="):
        _build("hooks", accept_replayed_noise=True)


def test_hand_built_optimizer_owns_its_noise_stream():
    """Built by hand (no make_private): noise from the optimizer's own stream, fresh after
    the same torch.manual_seed(0); ``noise_seed=`` reproduces it; a user generator is used
    as given (Opacus)."""
    from opacus_rc.optimizer import RandomizedClippingOptimizer

    def noise(**options):
        torch.manual_seed(0)
        p = nn.Parameter(torch.zeros(64))
        opt = RandomizedClippingOptimizer(
            torch.optim.SGD([p], lr=1.0), noise_multiplier=1.0, max_grad_norm=1.0,
            expected_batch_size=1, **options,
        )
        p.grad = torch.zeros(64)
        opt.mark_clipped()  # as the plugin's clipped pass does (a hand-set gradient is refused)
        opt.step()
        return p.grad.clone()

    assert not torch.equal(noise(), noise())
    assert torch.equal(noise(noise_seed=4), noise(noise_seed=4))
    assert not torch.equal(noise(noise_seed=4), noise(noise_seed=5))
    mine = noise(generator=torch.Generator().manual_seed(4))
    assert torch.equal(mine, noise(generator=torch.Generator().manual_seed(4)))
    assert not torch.equal(mine, noise(noise_seed=4))  # the tagged stream is not seed 4's
    with pytest.raises(ValueError, match="noise_seed"):
        noise(noise_seed=4, secure_mode=True)
