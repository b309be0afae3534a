"""Plain-loss scripts (``grad_sample_mode="hooks"``) on a checkpointed model run the two
passes from the model's output (:mod:`opacus_rc.forms.output_passes`): book-keeping would keep
every linear layer's input and output gradient, the memory checkpointing frees.

With exact norms (T <= k) and no noise the update equals brute-force per-example clipping
(tests/oracles.py) to float32 round-off (rtol 1e-4), step after step."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from opacus import PrivacyEngine
from torch import nn

from opacus_rc.forms.output_passes import OutputPasses
from opacus_rc.optimizer import RandomizedClippingOptimizer

from tests.oracles import per_example_clipped_mean

B, T, V, C = 4, 8, 32, 0.05


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
        attn_implementation="eager"))


def tokens(n=B, seed=0):
    x = torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(seed))
    return x, x.clone()


def sequence_loss(model, x, labels):
    """Mean over sequences of each sequence's mean next-token loss (a plain loss)."""
    positions = torch.arange(x.shape[1]).repeat(x.shape[0], 1)
    logits = model(input_ids=x, position_ids=positions).logits[:, :-1]
    per_token = nn.functional.cross_entropy(
        logits.reshape(-1, V), labels[:, 1:].reshape(-1), reduction="none").view(x.shape[0], -1)
    return per_token.mean(dim=1).mean()


def private(model, clipping="randomized", **options):
    engine = PrivacyEngine(accountant="rc_prv")
    x, labels = tokens()
    out = engine.make_private(
        module=model, optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0),
        data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, labels), batch_size=B),
        noise_multiplier=0.0, max_grad_norm=C, poisson_sampling=False, clipping=clipping,
        **({"sketch_size": 32, "seed": 0} if clipping == "randomized" else {}), **options,
    )
    return engine, out


def checkpointed(model, reentrant=True):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:
        model.enable_input_require_grads()
    model.train()
    return model


def assert_updates(model, want):
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("lora", [False, True])
def test_checkpointed_plain_loss_script_runs_two_passes_and_equals_per_example_clipping(lora, reentrant):
    model = llama()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    reference = copy.deepcopy(model)
    engine, out = private(checkpointed(model, reentrant))
    assert len(out) == 3  # the plain-loss script's 3-tuple, unchanged
    module, opt, _ = out
    assert isinstance(opt, RandomizedClippingOptimizer)
    assert isinstance(module.output_passes, OutputPasses)
    for step in range(3):  # catches state left behind between steps
        x, labels = tokens(seed=step)
        want = per_example_clipped_mean(reference, sequence_loss, x, labels, C, normaliser=B)
        sequence_loss(module, x, labels).backward()
        opt.step()
        assert_updates(model, want)
        opt.zero_grad()
    assert [e[2] for e in engine.accountant.history] == [3]
    assert engine.accountant.history[0][-1].micro_batches == 1


def test_bookkeeping_false_runs_two_passes_without_checkpointing_and_accumulates():
    model = llama()
    reference = copy.deepcopy(model)
    engine, (module, opt, _) = private(model, bookkeeping=False)
    (x1, l1), (x2, l2) = tokens(seed=1), tokens(seed=2)
    want = per_example_clipped_mean(
        reference, sequence_loss, torch.cat([x1, x2]), torch.cat([l1, l2]), C, normaliser=2 * B)
    sequence_loss(module, x1, l1).backward()
    sequence_loss(module, x2, l2).backward()
    opt.step()
    assert_updates(model, want)
    assert engine.accountant.history[0][-1].micro_batches == 2


def test_loss_computed_inside_the_model_from_labels_is_downstream_of_the_boundary():
    """``model(input_ids, labels=...)`` computes the loss inside the model from the LM
    head's output, where the boundary sits: still clipped per example."""
    model = llama()
    reference = copy.deepcopy(model)

    def hf_loss(m, x, labels):
        positions = torch.arange(x.shape[1]).repeat(x.shape[0], 1)
        return m(input_ids=x, position_ids=positions, labels=labels).loss

    _, (module, opt, _) = private(checkpointed(model))
    x, labels = tokens(n=1)  # HF's token mean over one sequence: a per-example loss
    want = per_example_clipped_mean(reference, hf_loss, x, labels, C, normaliser=B)
    hf_loss(module, x, labels).backward()
    opt.step()
    assert_updates(model, want)


def test_loss_that_bypasses_the_output_is_refused():
    """A loss read from the head's weight directly (as TRL's fused paths do) never passes
    the boundary: refused, never an unclipped update."""
    model = llama()
    _, (module, opt, _) = private(checkpointed(model))
    x, _ = tokens()
    hidden = module._module.model(input_ids=x, position_ids=torch.arange(T).repeat(B, 1)).last_hidden_state
    logits = hidden @ model.lm_head.weight.t()
    with pytest.raises(ValueError, match="without passing the output"):
        logits.logsumexp(-1).mean().backward()


def test_the_bounded_output_is_not_a_copy_and_cannot_be_edited_in_place():
    """The boundary returns a view of the logits (no second (B, T, V) tensor); an in-place
    edit of it, which would change the values the passes differentiate, is refused."""
    model = llama()
    _, (module, opt, _) = private(checkpointed(model))
    x, _ = tokens()
    logits = module(input_ids=x, position_ids=torch.arange(T).repeat(B, 1)).logits
    assert bounded(logits) and logits._base is not None
    with pytest.raises(RuntimeError, match="modified inplace"):
        logits.mul_(2.0)


def bounded(t: torch.Tensor, depth: int = 3) -> bool:
    """True if the boundary's node is within ``depth`` autograd nodes of ``t``."""
    frontier = [t.grad_fn]
    for _ in range(depth):
        if any(f is not None and "Boundary" in type(f).__name__ for f in frontier):
            return True
        frontier = [n for f in frontier if f is not None for n, _ in f.next_functions]
    return False


def test_evaluation_is_untouched():
    """No boundary in evaluation (eval mode or no_grad): outputs equal the model's own."""
    model = llama()
    reference = copy.deepcopy(model).eval()
    _, (module, opt, _) = private(checkpointed(model))
    x, _ = tokens()
    module.eval()
    with torch.no_grad():
        torch.testing.assert_close(module(input_ids=x).logits, reference(input_ids=x).logits)
    assert not bounded(module(input_ids=x).logits)
    module.train()
    assert bounded(module(input_ids=x).logits)


@pytest.mark.parametrize("spelling", [
    {"grad_sample_mode": "bookkeeping"},
    {"grad_sample_mode": "hooks", "bookkeeping": True},
], ids=["bookkeeping", "hooks_alias"])
def test_bookkeeping_mode_name_is_book_keeping_also_on_a_checkpointed_model(spelling):
    """``grad_sample_mode="bookkeeping"`` (the public name) and its alias ``"hooks"`` +
    ``bookkeeping=True`` run one backward pass (the book-keeping optimizer, a 3-tuple) on a
    checkpointed model, equal to brute-force per-example clipping; plain ``"hooks"`` there
    runs the output passes (the test above)."""
    from opacus_rc.forms.bookkeeping import RandomizedClippingBookkeepingOptimizer

    model = llama()
    reference = copy.deepcopy(model)
    engine, out = private(checkpointed(model), **spelling)
    module, opt, _ = out
    assert isinstance(opt, RandomizedClippingBookkeepingOptimizer)
    assert getattr(module, "output_passes", None) is None
    x, labels = tokens(seed=3)
    want = per_example_clipped_mean(reference, sequence_loss, x, labels, C, normaliser=B)
    sequence_loss(module, x, labels).backward()
    opt.step()
    assert_updates(model, want)


@pytest.mark.parametrize("options, match", [
    ({"grad_sample_mode": "bookkeeping", "bookkeeping": False}, "bookkeeping=False contradicts"),
    ({"grad_sample_mode": "bookkeeping", "clipping": "flat"}, "grad_sample_mode='bookkeeping' only applies"),
])
def test_bookkeeping_mode_name_refuses_contradictions(options, match):
    with pytest.raises(ValueError, match=match):
        private(llama(), **options)
