"""The declared interface of a clipping form (issue 39 item 1): the row of
:data:`opacus_rc.forms.FORMS`, :func:`~opacus_rc.forms.form_of` to tell the plugin's
objects from Opacus's, and the traits declared on the optimizer base; no code outside
forms/ sniffs a form's traits by name."""

import ast
import copy
import pathlib

import pytest
import torch
from opacus import PrivacyEngine
from opacus.grad_sample import GradSampleModule
from opacus.optimizers import DPOptimizer
from torch import nn

import opacus_rc.options as options_module
from opacus_rc.clip_guard import BuiltSumsGuard
from opacus_rc.config import SketchConfig
from opacus_rc.draws import BatchReader
from opacus_rc.forms import FORMS, PER_EXAMPLE, TWO_PASS, Form, form_of
from opacus_rc.forms.per_example import PerExampleOptimizer
from opacus_rc.grad_sample import GradSampleHooksRandomizedClipping, GradSampleModuleRandomizedClipping
from opacus_rc.optimizer import (
    DistributedRandomizedClippingOptimizer,
    RandomizedClippingMixin,
    RandomizedClippingOptimizer,
    SketchedClippingMixin,
)

ROOT = pathlib.Path(__file__).resolve().parents[2] / "opacus_rc"

#: traits of a form: declared on the row or the plugin's base classes, never sniffed
TRAITS = {
    "one_example_per_backward", "note_finite", "check_refused_steps", "complete_batch", "sharded",
    "output_passes", "refusals_across_ranks", "_refusals_across_ranks", "_notes_in_module_grads",
    "check_cleared", "_check_cleared", "count_backward_pass", "backward_passes",
}


def _opt(cls, **kwargs):
    p = nn.Parameter(torch.zeros(2))
    return cls(torch.optim.SGD([p], lr=0.1), noise_multiplier=0.0, max_grad_norm=1.0,
               expected_batch_size=1, **kwargs)


def test_form_of_names_each_forms_objects_and_nothing_else():
    for form in FORMS.values():
        for cls in form.modules + form.optimizers:
            found = form_of(object.__new__(cls))
            assert found is not None and cls in found.modules + found.optimizers, (form.name, cls)
    assert form_of(_opt(PerExampleOptimizer)) is FORMS[PER_EXAMPLE]
    assert FORMS[PER_EXAMPLE].one_example_per_backward and not FORMS[PER_EXAMPLE].per_layer
    assert all(not f.one_example_per_backward and f.per_layer for n, f in FORMS.items() if n != PER_EXAMPLE)
    for other in (None, _opt(DPOptimizer), GradSampleModule(nn.Linear(2, 2)), nn.Linear(2, 2)):
        assert form_of(other) is None


def test_the_exact_form_optimizer_has_no_sketch():
    """Steps-and-noise base without the sketch: the per-example optimizer's sketch_config is
    None (what the accountant's step hook reads) and it has no estimator / sketch_size
    (they raised AttributeError from a property before); the sketched ones have them."""
    exact = _opt(PerExampleOptimizer, sketch_config=SketchConfig())
    assert exact.sketch_config is None and not isinstance(exact, SketchedClippingMixin)
    for name in ("estimator", "sketch_size", "sketching"):
        assert not hasattr(type(exact), name), name
    sketched = _opt(RandomizedClippingOptimizer, sketch_config=SketchConfig(sketch_size=4))
    assert (sketched.estimator, sketched.sketch_size) == ("hutchinson", 4)


def test_count_backward_pass_is_the_optimizers_own_counter():
    opt = _opt(RandomizedClippingOptimizer)
    opt.count_backward_pass()
    opt.count_backward_pass(2)
    assert opt.accumulated_iterations == 3


def _sniffed(path: pathlib.Path):
    """(trait, line) of every getattr/hasattr/setattr call on a trait name in ``path``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in TRAITS):
            yield node.args[1].value, node.lineno


@pytest.mark.parametrize("path", sorted(p for p in ROOT.rglob("*.py") if "forms" not in p.parts), ids=str)
def test_no_code_outside_forms_sniffs_a_form_trait(path):
    rel = str(path.relative_to(ROOT))
    found = list(_sniffed(path))
    assert not found, f"{rel} reads form traits by name: {found}"


def _two_steps(model, x, y):
    """Two seeded steps at noise 1 of ``make_private(grad_sample_mode="ghost")``: the
    parameters, make_private's outputs and the epsilon charged."""
    engine = PrivacyEngine(accountant="rc_prv")
    module, optimizer, criterion, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        criterion=nn.CrossEntropyLoss(),
        data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=0.5,
        grad_sample_mode="ghost",
        clipping="randomized",
        sketch_size=4,
        seed=7,
    )
    for _ in range(2):
        xb, yb = x[:8], y[:8]  # the same rows in both runs (the loader's draws are seeded too)
        criterion(module(xb), yb).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()], (module, optimizer), engine.get_epsilon(1e-5)


def test_a_new_form_is_its_classes_one_row_and_its_branch_of_the_rule(monkeypatch):
    """What adding a form takes (docs/forms.md, "Adding a form"): its classes, one row of
    ``FORMS`` and its branch of :func:`~opacus_rc.forms.resolve_form`. The engine builds the
    new form's module and optimizer from the row, ``form_of`` names its objects, and the
    accountant charges its sketch: a toy form (the two-pass classes under new names) gives
    the two-pass run bit for bit (same seed: same noise, sketches and parameters) and the
    same epsilon."""
    class ToyModule(GradSampleModuleRandomizedClipping):
        pass

    class ToyHooks(GradSampleHooksRandomizedClipping):
        pass

    class ToyOptimizer(RandomizedClippingOptimizer):
        pass

    class ToyDistributedOptimizer(DistributedRandomizedClippingOptimizer):
        pass

    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    torch.manual_seed(0)
    init = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    two_pass, (module, optimizer), eps = _two_steps(copy.deepcopy(init), x, y)
    assert form_of(optimizer) is FORMS[TWO_PASS]

    toy = Form("toy", modules=(ToyModule, ToyHooks), optimizers=(ToyOptimizer, ToyDistributedOptimizer))
    monkeypatch.setitem(FORMS, "toy", toy)
    rule = options_module.resolve_form  # the decision rule, as the options read it

    def with_toy_branch(*args, **kwargs):
        runs, mode = rule(*args, **kwargs)
        return ("toy" if runs == TWO_PASS else runs), mode

    monkeypatch.setattr(options_module, "resolve_form", with_toy_branch)
    params, (module, optimizer), toy_eps = _two_steps(copy.deepcopy(init), x, y)
    assert type(module) is ToyModule and type(optimizer) is ToyOptimizer
    assert form_of(module) is toy and form_of(optimizer) is toy
    assert 0 < toy_eps == eps < float("inf")
    for a, b in zip(params, two_pass):
        assert torch.equal(a, b)
    assert not torch.equal(params[0], init[0].weight)  # it trained


def test_a_form_that_does_not_declare_honours_users_is_refused_at_user_level(monkeypatch):
    """``honours_users`` defaults to False: a new form clips per row until it declares that it
    clips per user, and ``privacy_unit="user"`` on it is refused by name, listing the forms that
    do (every form of the table, FSDP2's included, since issue 53)."""
    toy = Form("toy", modules=(GradSampleModuleRandomizedClipping, GradSampleHooksRandomizedClipping),
               optimizers=(RandomizedClippingOptimizer, DistributedRandomizedClippingOptimizer))
    assert not toy.honours_users and all(form.honours_users for form in FORMS.values())
    monkeypatch.setitem(FORMS, "toy", toy)
    rule = options_module.resolve_form
    monkeypatch.setattr(options_module, "resolve_form", lambda *a, **k: ("toy", rule(*a, **k)[1]))
    model = nn.Linear(6, 3)
    data = torch.utils.data.TensorDataset(torch.randn(8, 6), torch.randint(0, 3, (8,)))
    with pytest.raises(ValueError, match=r"privacy_unit='user' is not supported by the 'toy' form .*'ghost_fsdp'"):
        PrivacyEngine(accountant="rc_prv").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
            data_loader=torch.utils.data.DataLoader(data, batch_size=2), max_grad_norm=0.1, clipping="randomized",
            grad_sample_mode="ghost", privacy_unit="user", user_ids=[0, 1] * 4,
        )


class _MaterialisedModule(BatchReader, GradSampleModule):
    """A form of its own (no base of the plugin's forms): Opacus's per-sample gradients,
    materialised, reading each forward's batch through the modules' one base."""

    def __init__(self, m, *, batch_first=True, loss_reduction="mean", **_sketch):
        GradSampleModule.__init__(self, m, batch_first=batch_first, loss_reduction=loss_reduction)
        self.autograd_grad_sample_hooks.extend(self.watch_batches(self._module))

    def follow_steps(self, optimizer):
        optimizer.bind_module(self)

    def forget_per_example_values(self):
        pass


class _MaterialisedOptimizer(RandomizedClippingMixin, DPOptimizer):
    """Opacus's flat clipping of the materialised per-sample gradients, by the plugin's step."""

    clip_guard_class = BuiltSumsGuard

    def __init__(self, optimizer, **kwargs):
        kwargs.pop("sketch_config", None)
        super().__init__(optimizer, **kwargs)


def test_a_form_of_its_own_is_its_module_one_row_and_its_branch(monkeypatch):
    """A form whose module and optimizer subclass none of the plugin's forms (the modules' one
    base, :class:`~opacus_rc.draws.BatchReader`, and the optimizers', ``RandomizedClippingMixin``):
    one row of ``FORMS`` and its branch of the rule make ``make_private`` build it; at noise 0 its
    release equals brute-force per-example clipping, and under BatchMemoryManager a loop stopped
    inside a draw drops that draw (the draw is the plugin's, not the form's), charged as exact steps."""
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    from tests.oracles import per_example_clipped_mean

    toy = Form("materialised", modules=(_MaterialisedModule, _MaterialisedModule),
               optimizers=(_MaterialisedOptimizer, _MaterialisedOptimizer), takes_bound=False, exact=True)
    monkeypatch.setitem(FORMS, "materialised", toy)
    rule = options_module.resolve_form
    monkeypatch.setattr(options_module, "resolve_form",
                        lambda *a, **k: ("materialised", rule(*a, **k)[1]))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    engine = PrivacyEngine(accountant="rc_prv")
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
        data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8),
        max_grad_norm=0.1, clipping="randomized", grad_sample_mode="hooks", seed=1,
    )
    assert type(module) is _MaterialisedModule and type(optimizer) is _MaterialisedOptimizer
    assert form_of(optimizer) is toy and not isinstance(module, (GradSampleModuleRandomizedClipping, PerExampleOptimizer))
    loss_of = lambda m, a, b: nn.functional.cross_entropy(m(a), b)  # noqa: E731
    managed = BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=optimizer).__enter__()
    for xb, yb in managed:  # stopped inside the first draw
        loss_of(module, xb, yb).backward()
        optimizer.step()
        optimizer.zero_grad()
        break
    assert optimizer.draw_pending, "pick another seed: the first draw fits one physical batch"
    reference, xs, ys = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)), [], []
    reference.load_state_dict(model.state_dict())  # (no hooks)
    with pytest.warns(RuntimeWarning, match="left after 1 of its"):
        for xb, yb in managed:
            xs, ys = xs + list(xb), ys + list(yb)
            loss_of(module, xb, yb).backward()
            optimizer.step()
            optimizer.zero_grad()
            if not optimizer._is_last_step_skipped:
                break
    want = per_example_clipped_mean(reference, loss_of, xs, ys, 0.1, 8)
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(r.detach() - p.detach(), want[name], rtol=1e-5, atol=1e-6)
    (sigma, q, steps, record), = engine.accountant.history
    assert steps == 1 and record.estimator is None and record.micro_batches == 1
