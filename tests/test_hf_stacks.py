"""Randomized clipping on real LLM stacks: Hugging Face models (built from small configs,
random weights, nothing downloaded), PEFT LoRA, tied weights, gradient accumulation."""

import copy
import math

import peft
import pytest
import torch
from opacus import PrivacyEngine
from torch import nn

from tests.models import hf_model, lm_batch

VOCAB, T, BATCH = 64, 48, 8  # hf_model's vocabulary, lm_batch's sequence length


def causal_lm_loss(model, criterion, x, labels):
    positions = torch.arange(x.shape[1]).repeat(x.shape[0], 1)  # per-sample position ids
    logits = model(input_ids=x, position_ids=positions).logits[:, :-1]
    return criterion(
        logits.reshape(-1, VOCAB), labels[:, 1:].reshape(-1), shape=logits.shape[:2]
    )


def make_private(model, *, n=2 * BATCH, batch_size=BATCH, noise=0.5, opt_cls=None, **options):
    engine = PrivacyEngine(accountant="rc_prv")
    x, labels = lm_batch(n)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, labels), batch_size=batch_size
    )
    params = [p for p in model.parameters() if p.requires_grad]
    out = engine.make_private(
        module=model,
        optimizer=(opt_cls or (lambda ps: torch.optim.Adam(ps, lr=1e-2)))(params),
        criterion=nn.CrossEntropyLoss(ignore_index=-100),
        data_loader=loader,
        noise_multiplier=noise,
        max_grad_norm=1.0,
        poisson_sampling=False,
        grad_sample_mode="ghost",
        clipping="randomized",
        **{"sketch_size": 16, "sketch_seed": 0, "sketching": "shared", **options},
    )
    return engine, out


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2"])
@pytest.mark.parametrize("wrap_model", [True, False])
def test_hf_causal_lms_train(name, wrap_model):
    """A few noisy steps: finite losses, parameters move, the loss falls, epsilon is
    reported. T = 48 > k = 16 so the linear layers are really sketched; RMSNorm (Llama,
    Qwen2) goes through Opacus's exact per-sample gradients."""
    model = hf_model(name)
    model.train()
    before = copy.deepcopy(model.state_dict())
    engine, (module, opt, crit, loader) = make_private(model, wrap_model=wrap_model)
    forward = module if wrap_model else model
    losses = []
    for _ in range(4):
        for x, labels in loader:
            loss = causal_lm_loss(forward, crit, x, labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.3
    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert moved
    assert 0 < engine.get_epsilon(1e-5) < float("inf")


def test_ignore_index_padding_matches_opacus_ghost():
    """With exact linear norms (T <= k) the update equals Opacus ghost clipping's on the
    same padded batch: the per-sequence privacy unit and the -100 handling agree."""
    model = hf_model("llama")
    model.train()
    results = []
    for clipping in ["flat", "randomized"]:
        m = copy.deepcopy(model)
        engine = PrivacyEngine(accountant="prv" if clipping == "flat" else "rc_prv")
        x, labels = lm_batch(BATCH)
        extra = {"sketch_size": 64} if clipping == "randomized" else {}
        module, opt, crit, _ = engine.make_private(
            module=m,
            optimizer=torch.optim.SGD(m.parameters(), lr=1.0),
            criterion=nn.CrossEntropyLoss(ignore_index=-100),
            data_loader=torch.utils.data.DataLoader(
                torch.utils.data.TensorDataset(x, labels), batch_size=BATCH
            ),
            noise_multiplier=0.0,
            max_grad_norm=0.1,
            poisson_sampling=False,
            grad_sample_mode="ghost",
            clipping=clipping,
            **extra,
        )
        causal_lm_loss(module, crit, x, labels).backward()
        opt.step()
        results.append({k: v.clone() for k, v in m.state_dict().items()})
    for k in results[0]:
        torch.testing.assert_close(results[1][k], results[0][k], rtol=1e-4, atol=1e-6)


def test_peft_lora_randomized_clipping_and_denoising():
    """Only LoRA A/B are trainable: they train with randomized clipping and spectral
    denoising, and the frozen base never gets gradients or per-sample state."""
    model = hf_model("llama")
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    lora.train()
    frozen = [p for p in lora.parameters() if not p.requires_grad]
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    engine, (module, opt, crit, loader) = make_private(
        lora, wrap_model=False, denoise="spectral"
    )
    for x, labels in loader:
        causal_lm_loss(lora, crit, x, labels).backward()
        opt.step()
        opt.zero_grad()
    from opacus_rc.denoise import get_spectral_denoiser

    denoiser = get_spectral_denoiser(opt)
    assert denoiser is not None and len(denoiser.params) == 4  # A and B of q and v
    for p in frozen:
        assert p.grad is None
        assert getattr(p, "grad_sample", None) is None
        assert getattr(p, "_norm_sample", None) is None
    assert 0 < engine.get_epsilon(1e-5) < float("inf")


def per_sample_sq_norms(model, x, labels):
    """Exact per-sample squared gradient norms (all parameters) by per-example autograd,
    with the tied parameter's gradient summed over its uses by autograd itself."""
    crit = nn.CrossEntropyLoss(ignore_index=-100)
    out = []
    for i in range(x.shape[0]):
        model.zero_grad()
        positions = torch.arange(x.shape[1])[None]
        logits = model(input_ids=x[i : i + 1], position_ids=positions).logits[:, :-1]
        crit(logits.reshape(-1, VOCAB), labels[i : i + 1, 1:].reshape(-1)).backward()
        out.append(sum(p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None))
    model.zero_grad()
    return torch.stack(out)


@pytest.mark.parametrize("name", ["gpt2", "llama_tied"])
def test_tied_embedding_estimate_is_unbiased(name):
    """Tied input embedding / LM head (Opacus ghost clipping raises NotImplementedError).

    One example replicated R = 1500 times with per-example sketches gives R independent
    estimates of its squared norm in one pass (every linear layer sketched, the tied
    weight through the sum of its uses' sketches); their mean must be within 4 standard
    errors of the exact squared norm from per-example autograd.
    """
    model = hf_model(name)
    model.train()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    x, labels = lm_batch(1, seed=3)
    exact = per_sample_sq_norms(copy.deepcopy(model), x, labels)[0]
    replicas = 1500
    engine, (module, opt, crit, _) = make_private(
        model, sketch_size=4, sketching="per_example", exact_when_cheaper=False, noise=0.0
    )
    xr, lr = x.repeat(replicas, 1), labels.repeat(replicas, 1)
    causal_lm_loss(module, crit, xr, lr).backward()
    est = module.per_sample_gradient_norms.pow(2).double()
    se = est.std() / math.sqrt(replicas)
    assert abs(est.mean() - exact) <= 4 * se
    assert se < 0.1 * exact  # the test has power: a 40% bias would be caught


def test_tied_weights_do_not_change_accounting():
    """The accountant sees the same mechanism for tied and untied models."""
    eps = []
    for name in ["llama_tied", "llama"]:
        model = hf_model(name)
        model.train()
        engine, (module, opt, crit, loader) = make_private(model)
        for x, labels in loader:
            causal_lm_loss(module, crit, x, labels).backward()
            opt.step()
            opt.zero_grad()
        eps.append((engine.accountant.history, engine.get_epsilon(1e-5)))
    assert eps[0] == eps[1]


def test_gradient_accumulation_equals_one_large_batch():
    """Two micro-batches of 8 then one step == one batch of 16 (noise 0, the same shared
    sketches: a step's sketches are shared by its micro-batches). Every example is
    clipped once; the accountant is charged once, with sample rate 2 x 8/16."""
    model = hf_model("llama")
    model.train()
    x, labels = lm_batch(2 * BATCH)
    updates, engines = [], []
    for micro in [False, True]:
        m = copy.deepcopy(model)
        engine, (module, opt, crit, loader) = make_private(
            m, n=2 * BATCH, batch_size=BATCH if micro else 2 * BATCH, noise=0.0,
            opt_cls=lambda ps: torch.optim.SGD(ps, lr=1.0),
        )
        chunks = [(x[:BATCH], labels[:BATCH]), (x[BATCH:], labels[BATCH:])] if micro else [(x, labels)]
        for xb, lb in chunks:
            causal_lm_loss(module, crit, xb, lb).backward()
        opt.step()
        opt.zero_grad()
        updates.append({k: v.clone() for k, v in m.state_dict().items()})
        engines.append(engine)
    for k in updates[0]:
        torch.testing.assert_close(updates[1][k], updates[0][k], rtol=1e-4, atol=1e-7)
    # same update; the accountant records the two independently sampled micro-batches
    # as a multiplicity at the loader's rate, never as one draw at 2q
    (_, q_one, _, one), (_, q_two, _, two) = engines[0].accountant.history[0], engines[1].accountant.history[0]
    assert (q_one, one.micro_batches) == (1.0, 1)
    assert (q_two, two.micro_batches) == (0.5, 2)
