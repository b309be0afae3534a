"""opacus_rc.hf measured as an attacker would: at noise 0 with exact norms (every row no longer
than the sketch size), one example's effect on the released update is bounded by C whatever
else is in its batch (padding side, model family); a refused step ends the run; the batches
trained on come from the plugin's Poisson loader whatever the class hierarchy."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    OPTConfig,
    OPTForCausalLM,
    Trainer,
    TrainingArguments,
)

from opacus_rc.hf import DPTrainer, PrivacyArguments, private_trainer
from opacus_rc.hf.checks import check_records
from tests.models import tiny_llama

VOCAB, PAD = 64, 0
C = 1e-4  # far below every per-example gradient norm: each example contributes exactly C
K = 32  # sketch size >= every row length: exact norms


def tiny(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(
            vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2, pad_token_id=PAD,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False,
        ))
    if family == "llama":
        return tiny_llama(seed, vocab=VOCAB, pad_token_id=PAD, tie_word_embeddings=False)
    model = OPTForCausalLM(OPTConfig(
        vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=PAD, dropout=0.0,
        attention_dropout=0.0, layerdrop=0.0, tie_word_embeddings=False,
    ))
    return model


def args(tmp_path, **kw) -> TrainingArguments:
    options = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=1,
        max_steps=2, logging_steps=1, report_to=[], save_strategy="no", learning_rate=1.0,
        lr_scheduler_type="constant", use_cpu=True, disable_tqdm=True, seed=0,
    )
    options.update(kw)
    return TrainingArguments(**options)


def privacy(**kw) -> PrivacyArguments:
    return PrivacyArguments(**{"noise_multiplier": 0.0, "delta": 1e-5, "max_grad_norm": C, "sketch_size": K, **kw})


def padded(rows, side: str):
    """A physical batch of token rows padded to the longest (labels -100 on the padding)."""
    t = max(len(r) for r in rows)
    ids = torch.full((len(rows), t), PAD)
    mask = torch.zeros((len(rows), t), dtype=torch.long)
    for i, r in enumerate(rows):
        where = slice(t - len(r), t) if side == "left" else slice(0, len(r))
        ids[i, where], mask[i, where] = torch.tensor(r), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def released_sum(trainer, rows, side: str) -> torch.Tensor:
    """The clipped sum the DP optimizer releases for one logical batch (noise 0: the gradient
    it hands to SGD times the public B); the parameters are put back afterwards."""
    model, opt = trainer.model, trainer._dp_optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    model.train()
    batch = padded(rows, side)
    losses = trainer.per_example_loss(model, batch)
    losses.mean().backward()
    check_records(opt, len(rows), trainer._dp_names)
    opt.step()
    out = torch.cat([p.grad.reshape(-1) for p in params]).double() * trainer.expected_batch_size
    with torch.no_grad():
        for b, p in zip(before, params):
            p.copy_(b)
    opt.zero_grad(set_to_none=True)
    return out


def example_effects(tmp_path, family: str, side: str):
    """||S(D) - S(D without x)|| / C for every row x of D: three short rows and a long one."""
    model = tiny(family)
    trainer = DPTrainer(model=model, args=args(tmp_path, optim="sgd"), train_dataset=list(range(8)), privacy=privacy())
    trainer.create_optimizer()
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (4, 6, 5, 12)]
    full = released_sum(trainer, rows, side)
    return [float((full - released_sum(trainer, rows[:i] + rows[i + 1:], side)).norm()) / C for i in range(len(rows))]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_one_example_moves_the_released_sum_by_exactly_C_whatever_the_padding(tmp_path, family, side):
    """Every example's gradient norm is far above C, so adding or removing it changes the clipped
    sum by exactly C if the other rows' gradients do not depend on it. Left padding used to give
    every row arange(T) positions, T the longest row of the batch: adding a long row moved the
    others' positions (3.07 C on GPT-2). Float32 sums of a few C-sized terms: 1e-4 relative."""
    effects = example_effects(tmp_path, family, side)
    assert effects == pytest.approx([1.0] * len(effects), abs=1e-4), effects


class NoPositions(torch.nn.Module):
    """A token model whose forward takes no position_ids (it cannot be given per-row positions)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids, attention_mask=None):
        return {"logits": self.head(self.embed(input_ids))}


def test_left_padding_without_position_ids_is_refused(tmp_path):
    """A model that takes no position_ids cannot be given per-row positions: left padding is
    refused by name, right padding runs."""
    trainer = DPTrainer(model=NoPositions(), args=args(tmp_path), train_dataset=list(range(8)), privacy=privacy())
    rows = [[1, 2, 3], [4, 5, 6, 7, 8]]
    assert trainer.per_example_loss(trainer.model, padded(rows, "right")).shape == (2,)
    with pytest.raises(ValueError, match=r"left padding with NoPositions.*no position_ids.*padding_side='right'"):
        trainer.per_example_loss(trainer.model, padded(rows, "left"))


@pytest.mark.parametrize("frozen_positions", [False, True])
def test_opt_is_refused_by_name(tmp_path, frozen_positions):
    """OPT's decoder layers flatten batch and sequence before fc1/fc2 (the hooks would see
    one example per token) and its learned positional embedding takes the attention mask as
    its input: refused at construction by its model_type (frozen positions or not), before
    Opacus's hook fails on it ('int' object has no attribute 'detach') or book-keeping on the
    flattened layers."""
    model = tiny("opt")
    model.model.decoder.embed_positions.requires_grad_(not frozen_positions)
    with pytest.raises(ValueError, match=r"model_type='opt' is not supported.*GPT-2, Llama.*flatten"):
        DPTrainer(model=model, args=args(tmp_path), train_dataset=list(range(8)), privacy=privacy())


# --- item: a step refused on the device by a fused optimizer ends the run ---------------------


class Rows(torch.utils.data.Dataset):
    """16 token rows of length 8 (no padding)."""

    def __init__(self, n: int = 16) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(1, VOCAB, (n, 8), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def nan_at_step(step: int):
    class NaNAt(DPTrainer):
        """Every per-example loss is NaN at logical step ``step`` (0-based)."""

        def per_example_loss(self, model, inputs):
            losses = super().per_example_loss(model, inputs)
            return losses * float("nan") if self.state.global_step == step else losses

    return NaNAt


@pytest.mark.parametrize("last", [True, False])
def test_a_refused_step_with_a_fused_optimizer_raises_from_train(tmp_path, last):
    """adamw_torch_fused skips a non-finite step on the device (found_inf): the refusal used
    to be raised at the next step() only, so a refused LAST step let train() return normally,
    the step charged and the model unchanged. It is raised right after the step, before the
    step is logged or saved; the parameters are those before it."""
    model = tiny("llama")
    steps = 2
    refused = steps - 1 if last else 0
    trainer = nan_at_step(refused)(
        model=model, args=args(tmp_path, optim="adamw_torch_fused", max_steps=steps, learning_rate=1e-2,
                               save_strategy="steps", save_steps=1),
        train_dataset=Rows(), privacy=privacy(sample_rate=0.5),
    )
    with pytest.raises(FloatingPointError, match="non-finite"):
        trainer.train()
    assert trainer.state.global_step == refused  # neither counted nor followed by another step
    assert not (tmp_path / "out" / f"checkpoint-{refused + 1}").exists()  # the unchanged model is not saved


def test_two_gloo_ranks_a_refused_last_step_raises_on_every_rank(tmp_path):
    """The fused-optimizer refusal of the last step under torchrun --nproc_per_node 2: every
    rank's train() raises, neither counts the refused step."""
    from .test_trainer import run_two_ranks

    ranks = run_two_ranks(tmp_path, 0.0, clipping="refused_last_step")
    for r in ranks:
        assert "non-finite" in r["raised"], r
        assert r["global_step"] == 1


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "sgd"])
def test_a_non_finite_step_with_flat_clipping_is_refused(tmp_path, optim):
    """Opacus's flat optimizer has no non-finite check: a NaN loss made the parameters NaN,
    the step charged, and train() returned normally. Refused before the step: parameters
    finite and as after the previous step, the refused step not charged."""
    trainer = nan_at_step(1)(
        model=tiny("llama"), args=args(tmp_path, optim=optim, max_steps=2, learning_rate=1e-2),
        train_dataset=Rows(), privacy=privacy(clipping="flat", sample_rate=0.5),
    )
    with pytest.raises(FloatingPointError, match="non-finite per-sample gradient.*clipping='flat'"):
        trainer.train()
    assert all(bool(p.isfinite().all()) for p in trainer.model.parameters())
    assert trainer.state.global_step == 1 and trainer.privacy_steps() == 1


# --- item: the batches come from the plugin's Poisson loader ---------------------------------


class ShuffledLoader(DPTrainer):
    """The ordinary Hugging Face customisation: a loader of fixed shuffled batches."""

    def get_train_dataloader(self):
        return torch.utils.data.DataLoader(self.train_dataset, batch_size=4, shuffle=True,
                                           collate_fn=self.data_collator)


class WrappedLoader(DPTrainer):
    """An override that calls super() but hands the loop another loader."""

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        return torch.utils.data.DataLoader(loader.dataset, batch_size=4, collate_fn=loader.collate_fn)


class SameLoader(DPTrainer):
    """An override that returns the plugin's loader (allowed)."""

    def get_train_dataloader(self):
        self.built = getattr(self, "built", 0) + 1
        return super().get_train_dataloader()


class BaseLoader(Trainer):
    def get_train_dataloader(self):
        return torch.utils.data.DataLoader(self.train_dataset, batch_size=4, shuffle=True)


class BaseSampler(Trainer):
    def _get_train_sampler(self, train_dataset=None):
        return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)


class SubclassSampler(DPTrainer):
    def _get_train_sampler(self, train_dataset=None):
        return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)


def loader_trainer(cls, tmp_path):
    return cls(model=tiny("llama"), args=args(tmp_path, optim="sgd", learning_rate=1e-2),
               train_dataset=Rows(), privacy=privacy(sample_rate=0.25))


@pytest.mark.parametrize("cls", [ShuffledLoader, WrappedLoader], ids=["shuffled", "wrapped"])
def test_an_override_of_get_train_dataloader_that_bypasses_the_poisson_loader_is_refused(tmp_path, cls):
    """Fixed shuffled batches of 4 would be reported with the Poisson epsilon: refused at the
    first batch, before any update or charge, saying how to customise loading."""
    trainer = loader_trainer(cls, tmp_path)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(ValueError, match=r"not the private Trainer's Poisson loader.*data_collator=.*super\(\)\.get_train_dataloader\(\)"):
        trainer.train()
    assert trainer.privacy_steps() == 0
    assert all(torch.equal(b, p) for b, p in zip(before, trainer.model.parameters()))


def test_two_gloo_ranks_an_override_bypassing_the_poisson_loader_is_refused(tmp_path):
    """The same refusal under torchrun --nproc_per_node 2: every rank refuses at its first
    batch, no step charged."""
    from .test_trainer import run_two_ranks

    for r in run_two_ranks(tmp_path, 0.0, clipping="shuffled_loader"):
        assert "not the private Trainer's Poisson loader" in r["raised"], r
        assert r["steps"] == 0


def test_an_override_returning_the_poisson_loader_trains(tmp_path):
    trainer = loader_trainer(SameLoader, tmp_path)
    trainer.train()
    assert trainer.built == 1 and trainer.privacy_steps() == 2


@pytest.mark.parametrize("where", ["base_loader", "base_sampler", "subclass_sampler"])
def test_an_override_the_private_trainer_would_ignore_is_refused(tmp_path, where):
    """get_train_dataloader on the class given to private_trainer, or _get_train_sampler
    anywhere, used to be ignored without a word: refused at construction."""
    cls = {"base_loader": lambda: private_trainer(BaseLoader), "base_sampler": lambda: private_trainer(BaseSampler),
           "subclass_sampler": lambda: SubclassSampler}[where]()
    name = "_get_train_sampler" if "sampler" in where else "get_train_dataloader"
    with pytest.raises(ValueError, match=rf"{name} would be ignored.*data_collator="):
        loader_trainer(cls, tmp_path)
