"""The per-example form (one example per backward pass, exact flat clipping).

At sigma = 0 its update equals brute-force per-example clipping (:func:`tests.oracles.
per_example_clipped_mean`: autograd on each example alone, no hook) in every set-up it
claims: plain and hooks modules, a Poisson draw of any size, activation checkpointing in
both forms, tied weights, layers no grad sampler knows, a frozen body with a trainable
adapter, the chunked LM head as a plain loss, bf16 autocast, BatchMemoryManager on top,
accumulation and nonfinite="skip". Tolerances: float32 summation order only (1e-6
absolute on updates of order 1e-2), bf16 autocast 2e-2 relative (bf16's 8-bit mantissa
in both the oracle and the form, rounded in different orders).
"""

from __future__ import annotations

import math

import pytest
import torch
from opacus import PrivacyEngine
from opacus.accountants import PRVAccountant
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn

import opacus_rc  # noqa: F401
from opacus_rc.forms import PER_EXAMPLE
from opacus_rc.forms.per_example import PerExampleHooks, PerExampleModule, PerExampleOptimizer
from opacus_rc.lm_head import ChunkedLMHeadLoss

from tests.models import CheckpointedSequenceClassifier, HeadModel, SequenceClassifier, token_task
from tests.oracles import per_example_clipped_mean

#: every test also with the batches copied as on a device (tests/conftest.py, issue 52)
pytestmark = pytest.mark.usefixtures("batches_as_on_a_device")

C, B, N = 0.05, 8, 48


def _ce(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def private(model, data, *, noise=0.0, batch_size=B, **options):
    engine = PrivacyEngine(accountant="rc_prv")
    out = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=torch.utils.data.DataLoader(data, batch_size=batch_size), noise_multiplier=noise,
        max_grad_norm=C, clipping="randomized", seed=5, **options,
    )
    return engine, out


def one_logical_step(module, optimizer, loader, loss_of):
    """Iterate the loader until a step is taken; returns the examples it used."""
    xs, ys = [], []
    for x, y in loader:
        assert len(x) <= 1, "the per-example form's loader yields one example per batch"
        xs += list(x)
        ys += list(y)
        loss_of(module, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if not optimizer._is_last_step_skipped:
            return xs, ys
    raise AssertionError("no step was taken")


def check_update(make_model, data, loss_of=_ce, tol=dict(rtol=1e-5, atol=1e-6), make_reference=None, **options):
    model, reference = make_model(), (make_reference or make_model)()
    reference.load_state_dict(model.state_dict())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, out = private(model, data, **options)
    module = out[0] if isinstance(out[0], nn.Module) else model  # wrap_model=False: the model itself
    optimizer, loader = out[1], out[-1]
    assert isinstance(optimizer, PerExampleOptimizer)
    xs, ys = one_logical_step(module, optimizer, loader, loss_of)
    assert xs, "the draw was empty: pick another seed"
    want = per_example_clipped_mean(reference, loss_of, xs, ys, C, B)
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(before[name] - p.detach(), want[name], **tol, msg=name)
    return engine, out


def seeded(cls, **kwargs):
    def make():
        torch.manual_seed(0)
        return cls(**kwargs)

    return make


@pytest.mark.parametrize("wrap_model", [True, False])
def test_update_equals_brute_force_per_example_clipping(wrap_model):
    engine, out = check_update(seeded(SequenceClassifier), token_task(n=N), per_example_backward=True,
                               wrap_model=wrap_model)
    assert isinstance(out[0], PerExampleModule if wrap_model else PerExampleHooks)
    (sigma, q, steps, record), = engine.accountant.history
    assert (sigma, q, steps, record.micro_batches) == (0.0, B / N, 1, 1)  # one draw: one micro-batch
    assert record.estimator is None  # exact clipping


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_both_forms(use_reentrant):
    # the oracle's autograd.grad cannot run a reentrant checkpoint: it runs the same
    # parameters without checkpointing
    check_update(seeded(CheckpointedSequenceClassifier, use_reentrant=use_reentrant), token_task(n=N),
                 make_reference=seeded(SequenceClassifier), per_example_backward=True)


class TiedConvModel(nn.Module):
    """A tied embedding / output projection, a Conv1d and a custom layer with a raw
    parameter (no grad sampler knows it): nothing but autograd is needed."""

    def __init__(self, vocab=32, d=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.conv = nn.Conv1d(d, d, 3, padding=1)
        self.scale = nn.Parameter(torch.ones(d))
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x):
        h = self.conv(self.emb(x).transpose(1, 2)).transpose(1, 2)
        return self.out(torch.tanh(h) * self.scale).mean(dim=1)


def test_tied_weights_conv_and_unknown_layers():
    data = token_task(n=N)
    labels = torch.randint(0, 32, (N,), generator=torch.Generator().manual_seed(1))
    check_update(seeded(TiedConvModel), torch.utils.data.TensorDataset(data.tensors[0], labels),
                 per_example_backward=True)


def test_frozen_body_with_a_trainable_adapter():
    def make():
        torch.manual_seed(0)
        model = SequenceClassifier()
        for p in model.parameters():
            p.requires_grad_(False)
        model.fc2.weight.requires_grad_(True)  # the adapter (LoRA-like: only it trains)
        return model

    check_update(make, token_task(n=N), per_example_backward=True)


def test_chunked_head_as_a_plain_loss():
    torch.manual_seed(0)

    def loss_of(model, x, _y):
        inner = getattr(model, "_module", model)
        return ChunkedLMHeadLoss(inner.head, block_size=8)(model(x), x)

    check_update(seeded(HeadModel), token_task(n=N), loss_of, per_example_backward=True)


def test_bf16_autocast():
    def loss_of(model, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _ce(model, x, y).float()

    check_update(seeded(SequenceClassifier), token_task(n=N), loss_of, tol=dict(rtol=2e-2, atol=2e-4),
                 per_example_backward=True)


def test_automatic_with_a_physical_batch_of_one():
    import opacus_rc.forms as forms

    forms._logged_automatic = False
    model = seeded(SequenceClassifier)()
    with pytest.warns(UserWarning, match="per-example form"):
        _, out = private(model, token_task(n=N), batch_size=1)
    assert isinstance(out[1], PerExampleOptimizer)
    _, out = private(seeded(SequenceClassifier)(), token_task(n=N), batch_size=1, per_example_backward=False)
    assert not isinstance(out[1], PerExampleOptimizer)
    _, out = private(seeded(SequenceClassifier)(), token_task(n=N), batch_size=2)
    assert not isinstance(out[1], PerExampleOptimizer)


class _LM(nn.Module):
    """Token ids (B, T) -> logits (B, T, V): embedding, tanh, linear head."""

    def __init__(self, vocab: int = 12, d: int = 8):
        super().__init__()
        self.tok, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)

    def forward(self, x):
        return self.head(torch.tanh(self.tok(x)))


def _lm_task(n: int = 16, t: int = 6, vocab: int = 12):
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, vocab, (n, t), generator=gen), torch.randint(0, vocab, (n, t), generator=gen)
    y[::2, -2:] = -100  # padded tails on half the sequences
    return torch.utils.data.TensorDataset(x, y)


def _ghost_lm_loss(criterion, model, x, y):
    """A ghost LM script's loss, as Opacus's LM examples call the criterion."""
    logits = model(x)
    return criterion(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), shape=logits.shape[:2])


def _sequence_loss(model, x, y):
    """One sequence's loss: its mean over the positions not labelled -100 (Opacus's ghost
    criterion per sequence)."""
    return nn.functional.cross_entropy(model(x).reshape(-1, 12), y.reshape(-1), ignore_index=-100)


def test_ghost_lm_script_at_batch_size_one_runs_with_the_ghost_criterion_signature():
    """A one-flag ghost LM script at batch_size=1 (the per-example form, chosen
    automatically): ``criterion(logits, targets, shape=(B, T))`` works, and the update at
    noise 0 is per-sequence clipping computed by hand."""
    torch.manual_seed(0)
    model, data = _LM(), _lm_task()
    reference = _LM()
    reference.load_state_dict(model.state_dict())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = PrivacyEngine(accountant="rc_prv")
    module, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=torch.utils.data.DataLoader(data, batch_size=1), noise_multiplier=0.0,
        max_grad_norm=C, clipping="randomized", seed=5, grad_sample_mode="ghost",
        criterion=nn.CrossEntropyLoss(),
    )
    assert isinstance(optimizer, PerExampleOptimizer)
    xs, ys = one_logical_step(module, optimizer, loader, lambda m, x, y: _ghost_lm_loss(criterion, m, x, y))
    assert xs, "the draw was empty: pick another seed"
    want = per_example_clipped_mean(reference, _sequence_loss, xs, ys, C, 1)
    for name, p in model.named_parameters():
        torch.testing.assert_close(before[name] - p.detach(), want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_every_form_gives_the_ghost_criterion_value(loss_reduction):
    """The criterion of every form a ghost script can get (two passes, book-keeping, per
    example) takes Opacus's ``shape=`` call and gives Opacus's own ghost criterion's value
    on one sequence: the mean (or sum) over its labelled positions."""
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    from opacus_rc.forms import BOOKKEEPING_WITH_CRITERION, TWO_PASS

    x, y = _lm_task().tensors
    x, y = x[:1], y[:1]  # a padded sequence: -100 at its last two positions
    values = {}
    for form, options in ((TWO_PASS, {}), (BOOKKEEPING_WITH_CRITERION, {"bookkeeping": True}),
                          (PER_EXAMPLE, {"per_example_backward": True})):
        torch.manual_seed(0)
        model = _LM()
        engine = PrivacyEngine(accountant="rc_prv")
        module, optimizer, criterion, _ = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=torch.utils.data.DataLoader(_lm_task(), batch_size=4), noise_multiplier=0.0,
            max_grad_norm=C, clipping="randomized", grad_sample_mode="ghost", loss_reduction=loss_reduction,
            criterion=nn.CrossEntropyLoss(reduction=loss_reduction), **options,
        )
        values[form] = float(_ghost_lm_loss(criterion, module, x, y).item())
        if form == TWO_PASS:  # Opacus's own ghost criterion on the same module
            backward, module.loss_reduction = module.loss_reduction, loss_reduction  # (the module sums: Form.sums_losses)
            ghost = DPLossFastGradientClipping(module, optimizer, nn.CrossEntropyLoss(reduction=loss_reduction),
                                               loss_reduction)
            module.loss_reduction = backward
            values["opacus"] = float(_ghost_lm_loss(ghost, module, x, y).item())
            token_loss = nn.functional.cross_entropy(module(x)[0, :-2], y[0, :-2], reduction=loss_reduction)
            values["by hand"] = token_loss.item()
    assert len({round(v, 5) for v in values.values()}) == 1, values


def test_batch_memory_manager_on_top_and_accumulation():
    """BatchMemoryManager over the per-example loader changes nothing (one draw, one
    micro-batch); two draws accumulated into one step by hand (objects whose loader was
    never iterated) are charged as two micro-batches."""
    model = seeded(SequenceClassifier)()
    engine, (module, optimizer, loader) = private(model, token_task(n=N), per_example_backward=True)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=optimizer) as managed:
        one_logical_step(module, optimizer, managed, _ce)
    assert engine.accountant.history[-1][3].micro_batches == 1
    engine, (module, optimizer, _) = private(seeded(SequenceClassifier)(), token_task(n=N), per_example_backward=True)
    x, y = token_task(n=2).tensors
    for i in range(2):  # two independent single-example draws, one step
        _ce(module, x[i:i + 1], y[i:i + 1]).backward()
    optimizer.step()
    assert engine.accountant.history[-1][3].micro_batches == 2


def test_epsilon_equals_opacus_prv_and_calibration_is_smaller():
    model = seeded(SequenceClassifier)()
    engine, (module, optimizer, loader) = private(model, token_task(n=N), noise=1.1, per_example_backward=True)
    for _ in range(3):
        one_logical_step(module, optimizer, loader, _ce)
    prv = PRVAccountant()
    prv.history = [(1.1, B / N, 3)]
    assert engine.get_epsilon(1e-5) == pytest.approx(prv.get_epsilon(1e-5), rel=2e-2)
    assert _calibrated(True) < _calibrated(False)  # exact clipping: no noise premium


def _calibrated(exact: bool) -> float:
    e = PrivacyEngine(accountant="rc_prv")
    m = seeded(SequenceClassifier)()
    out = e.make_private_with_epsilon(
        module=m, optimizer=torch.optim.SGD(m.parameters(), lr=1.0),
        data_loader=torch.utils.data.DataLoader(token_task(n=N), batch_size=B), target_epsilon=3.0,
        target_delta=1e-5, epochs=2, max_grad_norm=C, clipping="randomized", per_example_backward=exact,
    )
    return out[1].noise_multiplier


def test_noise_std_is_sigma_c():
    """A parameter no example reaches gets noise only: its update is N(0, (sigma C / B)^2)
    per entry; with n = 65,536 entries the sample std is within 5 / sqrt(2n) = 1.4% of it."""

    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(4, 2)
            self.unused = nn.Parameter(torch.zeros(256, 256))

        def forward(self, x):
            return self.used(x)

    torch.manual_seed(0)
    model = Wide()
    data = torch.utils.data.TensorDataset(torch.randn(N, 4), torch.randint(0, 2, (N,)))
    _, (module, optimizer, loader) = private(model, data, noise=2.0, per_example_backward=True)
    one_logical_step(module, optimizer, loader, _ce)
    std = float(model.unused.detach().std())
    assert std == pytest.approx(2.0 * C / B, rel=5 / math.sqrt(2 * 65536))


def test_memory_of_a_step_is_independent_of_the_draw():
    """Gradient bytes held (``p.grad``, the running sum ``summed_grad``), counted after
    every backward pass and step of a draw: the peak is the same for a draw of 2 examples
    and one of 24, two float32 gradient-sized buffers (the example's gradient and the
    sum: one over non-private accumulation); a draw of 1 holds one."""
    model = seeded(SequenceClassifier)()
    _, (module, optimizer, loader) = private(model, token_task(n=N), per_example_backward=True)
    x, y = token_task(n=24).tensors
    params = sum(p.numel() for p in model.parameters())

    def held() -> int:  # bytes of distinct buffers (the noisy p.grad is the sum's buffer)
        buffers = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for p in model.parameters()
                   for t in (p.grad, getattr(p, "summed_grad", None)) if t is not None}
        return sum(buffers.values())

    def peak(size: int) -> int:
        most = 0
        for i in range(size):
            loss = _ce(module, x[i:i + 1], y[i:i + 1])
            loss.register_hook(lambda g: None)
            loss.backward()
            most = max(most, held())
            optimizer.signal_skip_step(do_skip=i < size - 1, same_draw=True)
            optimizer.step()
            most = max(most, held())
            optimizer.zero_grad()
        return most

    assert peak(1) == 4 * params
    assert peak(2) == peak(24) <= 2 * 4 * params


def test_nonfinite_skip_drops_the_example():
    model = seeded(SequenceClassifier)()
    reference = seeded(SequenceClassifier)()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _, (module, optimizer, _) = private(model, token_task(n=N), per_example_backward=True, nonfinite="skip")
    x, y = token_task(n=3).tensors
    for i in range(3):
        loss = _ce(module, x[i:i + 1], y[i:i + 1])
        (loss * float("inf") if i == 1 else loss).backward()
        optimizer.signal_skip_step(do_skip=i < 2, same_draw=True)
        optimizer.step()
        optimizer.zero_grad()
    assert optimizer.skipped_examples == 1
    want = per_example_clipped_mean(reference, _ce, [x[0], x[2]], [y[0], y[2]], C, B)
    for name, p in model.named_parameters():
        torch.testing.assert_close(before[name] - p.detach(), want[name], rtol=1e-5, atol=1e-6)


# --- refusals: a backward pass that is not one example's --------------------------------


def _made():
    model = seeded(SequenceClassifier)()
    _, (module, optimizer, _) = private(model, token_task(n=N), per_example_backward=True)
    x, y = token_task(n=4).tensors
    return model, module, optimizer, x, y


def test_a_batch_of_two_is_refused_at_the_forward():
    _, module, _, x, y = _made()
    with pytest.raises(ValueError, match="one example per backward pass.*a batch of 2"):
        module(x[:2])


def test_two_examples_in_one_backward_are_refused():
    model, module, optimizer, x, y = _made()
    before = [p.detach().clone() for p in model.parameters()]
    (_ce(module, x[:1], y[:1]) + _ce(module, x[1:2], y[1:2])).backward()
    with pytest.raises(ValueError, match="each backward pass must hold one example"):
        optimizer.step()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_an_earlier_graph_run_again_is_refused():
    _, module, optimizer, x, y = _made()
    first = _ce(module, x[:1], y[:1])
    first.backward(retain_graph=True)
    _ce(module, x[1:2], y[1:2])  # a new forward, then the old graph again
    first.backward()
    with pytest.raises(ValueError, match="one example"):
        optimizer.step()


class KeepsPrevious(nn.Module):
    """Keeps its hidden state across forward passes without detaching it (``self.prev = h``):
    with ``retain_graph=True`` every later example's backward pass runs through example 0's
    graph again. No biases: an example of zeros has a zero gradient of its own."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(4, 8, bias=False), nn.Linear(8, 2, bias=False)
        self.prev = None

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        if self.prev is not None:
            h = h + self.prev
        self.prev = h
        return self.fc2(h)


def _update_of_one_draw(xs, c=0.1, draws=1, keeps=True):
    """The update (times the batch size) of one logical step over ``xs`` (``draws`` of them),
    one example per backward pass, each ``backward(retain_graph=True)``; ``keeps=False``: the
    model keeps no state."""
    model = KeepsPrevious()
    if not keeps:
        model.forward = lambda x: model.fc2(torch.tanh(model.fc1(x)))
    before = [p.detach().clone() for p in model.parameters()]
    data = torch.utils.data.TensorDataset(torch.zeros(4, 4), torch.zeros(4, dtype=torch.long))
    module, optimizer, _ = PrivacyEngine(accountant="rc_prv").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=torch.utils.data.DataLoader(data, batch_size=4), noise_multiplier=0.0, max_grad_norm=c,
        clipping="randomized", per_example_backward=True, poisson_sampling=False,
    )
    for _ in range(draws):
        for i, x in enumerate(xs):
            module(x[None]).sum().backward(retain_graph=True)
            optimizer.signal_skip_step(do_skip=i < len(xs) - 1, same_draw=True)
            optimizer.step()
            optimizer.zero_grad()
    return torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters())]) * len(data) / c


def test_state_kept_across_forwards_is_refused_by_name():
    """Issue 38, item 2: on main example 0 moved the update by 4 C (its gradient again in
    each later example's backward pass), with nothing refused."""
    xs = torch.zeros(4, 4)
    xs[0] = torch.randn(4, generator=torch.Generator().manual_seed(1))
    # refused at the step by the read first (tests/test_forward_changes.py), before the graph check
    carried = "attribute 'prev' of the model \\(KeepsPrevious\\) was read by a later training forward pass"
    with pytest.raises(ValueError, match=carried + ".*a value written by one forward pass was read by a later one"):
        _update_of_one_draw(xs)
    # one example: its forward pass read no earlier one's value, its step releases it alone (as
    # without the state); the next draw's forward pass reads it
    assert torch.equal(_update_of_one_draw(xs[:1]), _update_of_one_draw(xs[:1], keeps=False))
    with pytest.raises(ValueError, match=carried):
        _update_of_one_draw(xs[:1], draws=2)


def test_state_kept_in_a_closure_is_refused():
    model, module, optimizer, x, y = _made()
    kept = []
    model.fc1.register_forward_hook(lambda _m, _i, out: out + kept[0] if kept else kept.append(out))
    _ce(module, x[:1], y[:1]).backward(retain_graph=True)
    _ce(module, x[1:2], y[1:2]).backward()  # through example 0's fc1 output again
    with pytest.raises(ValueError, match="a tensor kept by the model \\(in a closure or a global\\)"):
        optimizer.step()


def test_detached_state_and_frozen_transforms_still_train():
    """State detached between forwards (kept outside the model: a module attribute is refused
    by value, tests/test_forward_changes.py), and a tensor computed from a weight before training:
    the update equals brute-force per-example clipping."""
    kept = {}

    class Detached(SequenceClassifier):
        def forward(self, x):
            out = super().forward(x)
            kept["last"] = out.detach()
            return out

    check_update(seeded(Detached), token_task(n=N), per_example_backward=True)


def test_a_gradient_set_by_hand_is_refused():
    model, module, optimizer, x, y = _made()
    _ce(module, x[:1], y[:1]).backward()
    model.fc1.weight.grad = torch.ones_like(model.fc1.weight)
    with pytest.raises(ValueError, match="fc1.weight"):
        optimizer.step()


def test_torch_ddp_and_other_options_are_refused():
    model = seeded(SequenceClassifier)()
    with pytest.raises(ValueError, match="per_example_backward.*bookkeeping"):
        private(model, token_task(n=N), per_example_backward=True, bookkeeping=True)
    with pytest.raises(ValueError, match="per_example_backward=1 is invalid"):
        private(model, token_task(n=N), per_example_backward=1)
    engine = PrivacyEngine(accountant="prv")
    with pytest.raises(ValueError, match="only applies with clipping='randomized'"):
        engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=torch.utils.data.DataLoader(token_task(n=N), batch_size=B), noise_multiplier=1.0,
            max_grad_norm=C, per_example_backward=True,
        )


def test_secure_mode():
    model = seeded(SequenceClassifier)()
    engine = PrivacyEngine(accountant="rc_prv", secure_mode=True)
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=torch.utils.data.DataLoader(token_task(n=N), batch_size=B), noise_multiplier=1.0,
        max_grad_norm=C, clipping="randomized", per_example_backward=True,
    )
    one_logical_step(module, optimizer, loader, _ce)
    assert len(engine.accountant.history) == 1


def test_form_is_in_the_table():
    from opacus_rc.forms import FORMS

    assert FORMS[PER_EXAMPLE].exact and not any(f.exact for n, f in FORMS.items() if n != PER_EXAMPLE)


def test_empty_batches_contribute_zero_with_or_without_backward():
    """An empty Poisson draw's batch: its forward (the mean loss is NaN) and backward leave
    no contribution; an empty forward without backward changes nothing either."""
    model, module, optimizer, x, y = _made()
    reference = seeded(SequenceClassifier)()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _ce(module, x[:0], y[:0]).backward()  # empty, backward
    optimizer.signal_skip_step(do_skip=True, same_draw=True)  # the same draw continues
    optimizer.step()
    module(x[:0])  # empty, no backward
    _ce(module, x[:1], y[:1]).backward()
    optimizer.step()
    want = per_example_clipped_mean(reference, _ce, [x[0]], [y[0]], C, B)
    for name, p in model.named_parameters():
        torch.testing.assert_close(before[name] - p.detach(), want[name], rtol=1e-5, atol=1e-6)


def test_a_second_example_in_any_batched_argument_is_refused():
    _, module, _, x, _ = _made()
    with pytest.raises(ValueError, match="a batch of 2"):
        module(x[:1], mask=torch.ones(2, x.shape[1]))  # the batch of a later 2-D argument


def test_a_forward_without_backward_then_another_example_is_refused():
    _, module, optimizer, x, y = _made()
    module(x[:1])  # its graph is dropped, but its example was counted
    _ce(module, x[1:2], y[1:2]).backward()
    with pytest.raises(ValueError, match="held 2 examples"):
        optimizer.step()


def test_nonfinite_raise_refuses_the_step():
    model, module, optimizer, x, y = _made()
    before = [p.detach().clone() for p in model.parameters()]
    (_ce(module, x[:1], y[:1]) * float("inf")).backward()
    with pytest.raises(FloatingPointError, match="non-finite"):
        optimizer.step()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_resume_continues_the_history_and_the_update(tmp_path):
    """save_checkpoint after a step, load into fresh objects: the accountant's history goes
    on, and the next step equals brute force from the restored parameters (noise 0)."""
    model = seeded(SequenceClassifier)()
    engine, (module, optimizer, loader) = private(model, token_task(n=N), per_example_backward=True)
    one_logical_step(module, optimizer, loader, _ce)
    path = tmp_path / "ckpt.pt"
    engine.save_checkpoint(path=path, module=module, optimizer=optimizer)
    restored = seeded(SequenceClassifier)()
    engine2, (module2, optimizer2, loader2) = private(restored, token_task(n=N), per_example_backward=True,
                                                 accept_replayed_noise=True)  # seed=5 again, noise 0
    engine2.load_checkpoint(path=path, module=module2, optimizer=optimizer2)
    assert [h[:3] for h in engine2.accountant.history] == [h[:3] for h in engine.accountant.history]
    for p, q in zip(model.parameters(), restored.parameters()):
        assert torch.equal(p, q)
    reference = seeded(SequenceClassifier)()
    reference.load_state_dict(restored.state_dict())
    before = {n: p.detach().clone() for n, p in restored.named_parameters()}
    xs, ys = one_logical_step(module2, optimizer2, loader2, _ce)
    want = per_example_clipped_mean(reference, _ce, xs, ys, C, B)
    for name, p in restored.named_parameters():
        torch.testing.assert_close(before[name] - p.detach(), want[name], rtol=1e-5, atol=1e-6)
    assert engine2.accountant.history[-1][2] == 2  # the resumed step adds to the history
