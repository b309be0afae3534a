"""opacus_rc.hf: the private Hugging Face Trainer and TRL SFTTrainer (tiny Llama from a
config, random weights, generated data; nothing downloaded)."""

import copy
import json
import os

import pytest
import torch
import torch.utils.checkpoint
import transformers
from opacus import PrivacyEngine
from transformers import TrainingArguments

import opacus_rc  # noqa: F401
from opacus_rc.hf import (
    DP_STATE_NAME,
    DPTrainer,
    PrivacyArguments,
    is_empty_batch,
    per_example_token_loss,
    private_trainer,
)
from tests.models import RowDataset, tiny_llama

VOCAB, T, N = 64, 16, 24  # tiny_llama's vocabulary, RowDataset's row length and count
PER_DEVICE, ACCUM = 4, 2
B = PER_DEVICE * ACCUM  # expected logical batch
Q = 1.0 / (N // B)  # the default public rate: 1 / ceil(N / B)


def training_args(tmp_path, **kw) -> TrainingArguments:
    options = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=ACCUM, max_steps=3, logging_steps=3, report_to=[],
        save_strategy="no", learning_rate=0.5, lr_scheduler_type="constant", use_cpu=True,
        disable_tqdm=True, seed=0,
    )
    options.update(kw)
    return TrainingArguments(**options)


def recording(trainer_class):
    """The trainer class recording every physical batch it trains on (in order)."""

    class Recording(trainer_class):
        def training_step(self, model, inputs, num_items_in_batch=None):
            self.recorded = getattr(self, "recorded", [])
            self.recorded.append(None if is_empty_batch(inputs) else {k: v.clone() for k, v in inputs.items()})
            return super().training_step(model, inputs, num_items_in_batch)

    return Recording


def same_draw(opt):
    """BatchMemoryManager's skipped step: the next physical batch is the same Poisson draw."""
    try:
        opt.signal_skip_step(do_skip=True, same_draw=True)
    except TypeError:  # optimizers that count every skipped step as one draw
        opt.signal_skip_step(do_skip=True)


def plain_loop(model, recorded, *, lr, max_grad_norm, sample_rate, autocast=None, noise=0.0):
    """The reference: make_private (book-keeping, wrap_model=False) and a BatchMemoryManager-
    like split: every physical batch but the last of a logical step is a skipped step. Under
    autocast a plain loss must be summed (a mean is refused in half precision: docs/guide.md), so
    the reference sums and divides the learning rate by B: the same update."""
    engine = PrivacyEngine(accountant="rc_prv")
    params = [p for p in model.parameters() if p.requires_grad]
    loader = torch.utils.data.DataLoader(RowDataset(), batch_size=B)
    reduction = "sum" if autocast else "mean"
    hooks, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(params, lr=lr / B if autocast else lr), data_loader=loader,
        noise_multiplier=noise, max_grad_norm=max_grad_norm, clipping="randomized",
        grad_sample_mode="hooks", wrap_model=False, poisson_sampling=False, loss_reduction=reduction,
        expected_batch_size=B, sample_rate=sample_rate, sketch_size=32,
    )
    model.train()
    for start in range(0, len(recorded), ACCUM):
        step = [b for b in recorded[start:start + ACCUM] if b is not None]
        assert step, "an empty logical step (probability < 1e-4)"
        for i, batch in enumerate(step):
            ids = batch["input_ids"]
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            inputs["position_ids"] = torch.arange(ids.shape[1]).expand_as(ids)
            ctx = torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False)
            with ctx:
                logits = model(**inputs, use_cache=False).logits
            losses = per_example_token_loss(logits, batch["labels"], shift=True)
            (losses.sum() if autocast else losses.mean()).backward()
            if i < len(step) - 1:
                same_draw(opt)
            opt.step()
            opt.zero_grad()
    return engine


def assert_same_parameters(a, b, atol=1e-6):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=atol, rtol=1e-5), name


def test_sigma0_equals_plain_loop_and_epsilon_matches(tmp_path):
    model = tiny_llama()
    reference = copy.deepcopy(model)
    trainer = recording(DPTrainer)(
        model=model, args=training_args(tmp_path), train_dataset=RowDataset(),
        optimizers=(torch.optim.SGD(model.parameters(), lr=0.5), None),
        privacy=PrivacyArguments(noise_multiplier=0.0, delta=1e-5, max_grad_norm=0.05, sketch_size=32),
    )
    trainer.train()
    assert len(trainer.recorded) == 3 * ACCUM
    engine = plain_loop(reference, trainer.recorded, lr=0.5, max_grad_norm=0.05, sample_rate=Q)
    assert_same_parameters(model, reference)
    assert trainer.accountant.history == engine.accountant.history  # one charge per logical step
    assert trainer.accountant.history[0][1] == pytest.approx(Q)
    assert trainer.get_epsilon() == engine.get_epsilon(delta=1e-5)


def test_log_history_has_epsilon_and_no_unnoised_statistic(tmp_path):
    model = tiny_llama()
    reference = copy.deepcopy(model)
    trainer = recording(DPTrainer)(
        model=model, args=training_args(tmp_path, max_steps=2, logging_steps=1), train_dataset=RowDataset(),
        privacy=PrivacyArguments(noise_multiplier=1.0, delta=1e-5),
    )
    out = trainer.train()
    # the same schedule in the plain loop (sigma = 1): the same history, the same epsilon
    engine = plain_loop(reference, trainer.recorded, lr=0.5, max_grad_norm=1.0, sample_rate=Q, noise=1.0)
    assert trainer.accountant.history == engine.accountant.history
    assert trainer.get_epsilon() == engine.get_epsilon(delta=1e-5)
    logs = trainer.state.log_history
    step_logs = [entry for entry in logs if "learning_rate" in entry]
    assert len(step_logs) == 2 and all("epsilon" in entry for entry in step_logs)
    assert step_logs[0]["epsilon"] < step_logs[1]["epsilon"]
    for entry in logs:
        for key in ("grad_norm", "loss", "train_loss", "total_flos", "num_input_tokens_seen"):
            assert key not in entry
    assert out.training_loss == 0.0
    assert "epsilon" in out.metrics
    assert trainer.args.max_grad_norm == 0.0  # the Trainer's own clipping is off


def test_logged_training_loss_is_the_mean_per_example_loss_of_the_step(tmp_path):
    """log_train_loss=True: each step's logged loss is the sum of its rows' per-example losses
    over the public batch size, whatever the accumulation (it was ACCUM times that when found:
    the Trainer sums what each accumulation step returns)."""
    model = tiny_llama()
    reference = copy.deepcopy(model)
    trainer = recording(DPTrainer)(
        model=model, args=training_args(tmp_path, max_steps=2, logging_steps=1), train_dataset=RowDataset(),
        optimizers=(torch.optim.SGD(model.parameters(), lr=0.0), None),
        privacy=PrivacyArguments(noise_multiplier=1.0, delta=1e-5, log_train_loss=True),
    )
    trainer.train()
    logged = [entry["loss"] for entry in trainer.state.log_history if "learning_rate" in entry]
    expected = []
    with torch.no_grad():
        for start in range(0, len(trainer.recorded), ACCUM):
            total = 0.0
            for batch in (b for b in trainer.recorded[start:start + ACCUM] if b is not None):
                ids = batch["input_ids"]
                logits = reference(input_ids=ids, position_ids=torch.arange(ids.shape[1]).expand_as(ids)).logits
                total += float(per_example_token_loss(logits, batch["labels"], shift=True).sum())
            expected.append(total / B)
    assert logged == pytest.approx(expected, rel=1e-4)


def test_short_run_lowers_the_loss(tmp_path):
    model = tiny_llama()
    ds = RowDataset()

    def loss() -> float:
        with torch.no_grad():
            logits = model(input_ids=ds.ids).logits
            return per_example_token_loss(logits, ds.labels, shift=True).mean().item()

    before = loss()
    trainer = DPTrainer(
        model=model, args=training_args(tmp_path, max_steps=6, learning_rate=3e-2, lr_scheduler_type="linear"),
        train_dataset=ds, privacy=PrivacyArguments(noise_multiplier=0.3, delta=1e-5, max_grad_norm=1.0),
    )
    trainer.train()
    assert loss() < before - 0.3


def test_target_epsilon_calibrates_for_the_planned_steps(tmp_path):
    model = tiny_llama()
    trainer = DPTrainer(
        model=model, args=training_args(tmp_path, max_steps=3), train_dataset=RowDataset(),
        privacy=PrivacyArguments(target_epsilon=8.0, delta=1e-5),
    )
    trainer.train()
    eps = trainer.get_epsilon()
    assert 7.8 <= eps <= 8.0
    assert trainer.state.log_history[-1]["epsilon"] == eps


def test_budget_stop_before_exceeding(tmp_path):
    model = tiny_llama()
    trainer = DPTrainer(
        model=model, args=training_args(tmp_path, max_steps=20, logging_steps=50), train_dataset=RowDataset(),
        privacy=PrivacyArguments(noise_multiplier=1.0, delta=1e-5, stop_at_epsilon=6.0),
    )
    trainer.train()
    steps = trainer.state.global_step
    assert 0 < steps < 20
    assert trainer.get_epsilon() <= 6.0
    probe = copy.deepcopy(trainer.accountant)
    s, q, n, sk = probe.history[-1]
    probe.history[-1] = (s, q, n + 1, sk)
    assert probe.get_epsilon(delta=1e-5) > 6.0


def test_evaluate_and_generate_leave_no_records_and_no_charge(tmp_path):
    model = tiny_llama()
    trainer = DPTrainer(
        model=model, args=training_args(tmp_path, max_steps=1), train_dataset=RowDataset(),
        eval_dataset=RowDataset(8), privacy=PrivacyArguments(noise_multiplier=1.0, delta=1e-5),
    )
    trainer.train()
    history = list(trainer.accountant.history)
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics and "epsilon" in metrics
    model.generate(input_ids=torch.zeros(1, 3, dtype=torch.long), max_new_tokens=2, do_sample=False)
    assert trainer.accountant.history == history
    for p in model.parameters():
        assert getattr(p, "grad_sample", None) is None
    assert not len(trainer._dp_hooks.records)  # book-keeping's records
    for m in model.modules():
        assert not getattr(m, "activations", [])


def test_resume_keeps_history_and_draws_fresh_noise(tmp_path):
    def run(resume=None, steps=2):
        model = tiny_llama()
        trainer = DPTrainer(
            model=model,
            args=training_args(tmp_path, max_steps=steps, save_strategy="steps", save_steps=2, logging_steps=1),
            train_dataset=RowDataset(), privacy=PrivacyArguments(noise_multiplier=1.0, delta=1e-5),
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer, model

    first, _ = run()
    ckpt = str(tmp_path / "out" / "checkpoint-2")
    state = json.load(open(os.path.join(ckpt, DP_STATE_NAME)))
    assert state["epsilon"] == pytest.approx(first.get_epsilon())
    text = json.dumps(state).lower()
    assert "seed" not in text and "generator" not in text
    rng = torch.load(os.path.join(ckpt, "rng_state.pth"), weights_only=False)
    assert set(rng) <= {"python", "numpy", "cpu", "cuda"}  # global generators only: none of DP's
    a, model_a = run(ckpt, steps=3)
    b, model_b = run(ckpt, steps=3)
    assert a.privacy_steps() == 3 and a.accountant.history == b.accountant.history
    fresh = DPTrainer(
        model=tiny_llama(), args=training_args(tmp_path), train_dataset=RowDataset(),
        privacy=PrivacyArguments(noise_multiplier=1.0, delta=1e-5),
    )
    fresh.create_optimizer()
    hist = fresh.accountant
    hist.history = [(1.0, Q, 3, a.accountant.history[0][3])]
    assert a.get_epsilon() == pytest.approx(hist.get_epsilon(delta=1e-5))
    assert a.state.log_history[-1]["epsilon"] == pytest.approx(a.get_epsilon())
    # the same checkpoint resumed twice: fresh noise and sampling each time
    assert not torch.allclose(model_a.lm_head.weight, model_b.lm_head.weight)


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(fp16=True), "fp16"),
        (dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False, "offload": True}),
         "offload"),
        (dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": "yes"}), "use_reentrant"),
        (dict(max_grad_norm=0.5), "max_grad_norm"),
        (dict(include_num_input_tokens_seen="all"), "include_num_input_tokens_seen"),
        (dict(auto_find_batch_size=True), "auto_find_batch_size"),
    ],
)
def test_refused_training_arguments(tmp_path, kw, name):
    with pytest.raises(ValueError, match=name):
        DPTrainer(
            model=tiny_llama(), args=training_args(tmp_path, **kw), train_dataset=RowDataset(),
            privacy=PrivacyArguments(noise_multiplier=1.0, delta=1e-5),
        )


@pytest.mark.parametrize("options", [dict(secure_mode=True), dict(clipping="flat"), dict(denoise="spectral")])
def test_secure_mode_flat_clipping_and_denoising_train(tmp_path, options):
    model = tiny_llama()
    before = copy.deepcopy(model.lm_head.weight)
    trainer = DPTrainer(
        model=model, args=training_args(tmp_path, max_steps=1, learning_rate=1e-2), train_dataset=RowDataset(),
        privacy=PrivacyArguments(noise_multiplier=1.0, delta=1e-5, **options),
    )
    trainer.train()
    assert not torch.equal(model.lm_head.weight, before)
    assert trainer.privacy_steps() == 1 and trainer.accountant.history[0][1] == pytest.approx(Q)
    if options.get("clipping") == "flat":
        assert not trainer.accountant.history[0][3].randomized  # deterministic clipping charged
        assert trainer._dp_optimizer.expected_batch_size == B


@pytest.mark.parametrize("checkpointing", [False, True])
def test_empty_physical_batches_and_empty_logical_steps(tmp_path, checkpointing):
    """At q = 0.02 most physical batches (and many logical steps) are empty: they are
    skipped without a forward pass, the step still adds noise and is charged."""
    model = tiny_llama()
    before = copy.deepcopy(model.lm_head.weight)
    trainer = recording(DPTrainer)(
        model=model, args=training_args(tmp_path, max_steps=4, learning_rate=1e-2, gradient_checkpointing=checkpointing),
        train_dataset=RowDataset(),
        privacy=PrivacyArguments(noise_multiplier=1.0, delta=1e-5, sample_rate=0.02),
    )
    trainer.train()
    assert len(trainer.recorded) == 4 * ACCUM
    assert any(b is None for b in trainer.recorded)
    assert trainer.accountant.history[0][1:3] == (0.02, 4)
    assert not torch.equal(model.lm_head.weight, before)  # noise even on an empty step


@pytest.mark.parametrize(
    "where, kwargs, reentrant",
    [
        ("args", None, False),  # Hugging Face's default: non-reentrant
        ("args", {"use_reentrant": True}, True),
        ("args", {"use_reentrant": False}, False),
        ("model", None, False),  # gradient_checkpointing_enable() called before, its default
    ],
    ids=["args-default", "args-reentrant", "args-non_reentrant", "model-default"],
)
def test_gradient_checkpointing_equals_plain_loop(tmp_path, where, kwargs, reentrant):
    """Gradient checkpointing in the form the user set (TrainingArguments, or on the model
    before): two passes from the model's output; sigma = 0 equals the plain loop without
    checkpointing for the same batches, charged the same."""
    model = tiny_llama()
    reference = copy.deepcopy(model)
    if where == "model":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        options = {}
    else:
        options = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs=kwargs)
    trainer = recording(DPTrainer)(
        model=model, args=training_args(tmp_path, **options), train_dataset=RowDataset(),
        optimizers=(torch.optim.SGD(model.parameters(), lr=0.5), None),
        privacy=PrivacyArguments(noise_multiplier=0.0, delta=1e-5, max_grad_norm=0.05, sketch_size=32),
    )
    trainer.train()
    forms = {m._gradient_checkpointing_func.keywords["use_reentrant"]
             for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True}
    assert forms == {reentrant}  # the user's form, not replaced
    assert getattr(trainer._dp_hooks, "output_passes", None) is not None  # not book-keeping
    engine = plain_loop(reference, trainer.recorded, lr=0.5, max_grad_norm=0.05, sample_rate=Q)
    assert_same_parameters(model, reference)
    assert trainer.accountant.history == engine.accountant.history


def test_unrecognised_or_flat_gradient_checkpointing_is_refused(tmp_path):
    def own_checkpoint(function, *args, **kwargs):  # not torch's checkpoint
        return function(*args, **kwargs)

    model = tiny_llama()
    model.gradient_checkpointing_enable()
    for m in model.modules():
        if hasattr(m, "_gradient_checkpointing_func"):
            m._gradient_checkpointing_func = own_checkpoint
    with pytest.raises(ValueError, match="gradient checkpointing function .* not recognised.*use_reentrant"):
        DPTrainer(
            model=model, args=training_args(tmp_path), train_dataset=RowDataset(),
            privacy=PrivacyArguments(noise_multiplier=1.0, delta=1e-5),
        )
    model = tiny_llama()  # selective checkpointing (a context_fn): not verified
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
        "use_reentrant": False, "context_fn": torch.utils.checkpoint.noop_context_fn})
    with pytest.raises(ValueError, match="not recognised"):
        DPTrainer(
            model=model, args=training_args(tmp_path), train_dataset=RowDataset(),
            privacy=PrivacyArguments(noise_multiplier=1.0, delta=1e-5),
        )
    with pytest.raises(ValueError, match="gradient_checkpointing"):
        DPTrainer(
            model=tiny_llama(), args=training_args(tmp_path, gradient_checkpointing=True), train_dataset=RowDataset(),
            privacy=PrivacyArguments(noise_multiplier=1.0, delta=1e-5, clipping="flat"),
        )


def test_refused_privacy_arguments():
    with pytest.raises(ValueError, match="target_epsilon"):
        PrivacyArguments(delta=1e-5)
    with pytest.raises(ValueError, match="delta"):
        PrivacyArguments(noise_multiplier=1.0)
    with pytest.raises(ValueError, match="clipping"):
        PrivacyArguments(noise_multiplier=1.0, delta=1e-5, clipping="ghost")
    with pytest.raises(ValueError, match="sketch_size"):
        PrivacyArguments(noise_multiplier=1.0, delta=1e-5, sketch_size=0)


def test_a_weight_used_outside_its_module_is_refused(tmp_path):
    class FusedHead(DPTrainer):
        def per_example_loss(self, model, inputs):
            hidden = model.model(input_ids=inputs["input_ids"]).last_hidden_state
            logits = torch.nn.functional.linear(hidden, model.lm_head.weight)  # no hook sees it
            return per_example_token_loss(logits, inputs["labels"], shift=True)

    trainer = FusedHead(
        model=tiny_llama(), args=training_args(tmp_path, max_steps=1), train_dataset=RowDataset(),
        privacy=PrivacyArguments(noise_multiplier=1.0, delta=1e-5),
    )
    with pytest.raises(ValueError, match="lm_head.weight"):
        trainer.train()


def test_custom_compute_loss_is_refused(tmp_path):
    class Custom(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    with pytest.raises(ValueError, match="per_example_loss"):
        private_trainer(Custom)(
            model=tiny_llama(), args=training_args(tmp_path), train_dataset=RowDataset(),
            privacy=PrivacyArguments(noise_multiplier=1.0, delta=1e-5),
        )


def test_lora_trains_only_the_adapters(tmp_path):
    import peft
    model = peft.get_peft_model(
        tiny_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer = DPTrainer(
        model=model, args=training_args(tmp_path, max_steps=2, learning_rate=1e-2), train_dataset=RowDataset(),
        privacy=PrivacyArguments(noise_multiplier=1.0, delta=1e-5),
    )
    trainer.train()
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], v) for n, v in frozen.items())
    assert any(not torch.equal(params[n], v) for n, v in lora.items())


# ------------------------------------------------------------------------- TRL


def char_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    chars = [chr(c) for c in range(ord("a"), ord("a") + VOCAB - 4)]
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


def sft_dataset(n: int = N):
    import datasets
    g = torch.Generator().manual_seed(3)
    texts = []
    for i in range(n):
        start = int(torch.randint(0, 20, (1,), generator=g))
        length = int(torch.randint(6, T - 2, (1,), generator=g))
        texts.append("".join(chr(ord("a") + (start + j) % 20) for j in range(length)))
    return datasets.Dataset.from_dict({"text": texts})


def test_private_sft_trainer_sigma0_equals_plain_loop(tmp_path):
    import trl
    model = tiny_llama()
    reference, initial = copy.deepcopy(model), copy.deepcopy(model)
    # SFTConfig's defaults: bf16 autocast, gradient checkpointing (Hugging Face's default
    # non-reentrant form, run as two passes from the output), its logging; the optimizer and
    # schedule are the test's
    config = trl.SFTConfig(
        output_dir=str(tmp_path / "sft"), per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=ACCUM, max_steps=3, report_to=[], save_strategy="no",
        use_cpu=True, disable_tqdm=True, lr_scheduler_type="constant",
    )
    assert config.bf16 and config.gradient_checkpointing
    DPSFT = private_trainer(trl.SFTTrainer)
    assert private_trainer(trl.SFTTrainer) is DPSFT
    trainer = recording(DPSFT)(
        model=model, args=config, train_dataset=sft_dataset(), processing_class=char_tokenizer(),
        optimizers=(torch.optim.SGD(model.parameters(), lr=0.5), None),
        privacy=PrivacyArguments(noise_multiplier=0.0, delta=1e-5, max_grad_norm=0.05, sketch_size=32),
    )
    trainer.train()
    assert len(trainer.recorded) == 3 * ACCUM
    assert {m._gradient_checkpointing_func.keywords["use_reentrant"]
            for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True} == {False}
    plain_loop(reference, trainer.recorded, lr=0.5, max_grad_norm=0.05, sample_rate=Q, autocast=torch.bfloat16)
    # bf16: the two passes (checkpointing) apply the clip factors in bf16 arithmetic, the
    # plain loop's book-keeping in float32: equal up to bf16 rounding of the update
    for (name, p), q, p0 in zip(model.named_parameters(), reference.parameters(), initial.parameters()):
        assert (p - q).norm() <= 0.02 * (q - p0).norm() + 1e-7, name
    for entry in trainer.state.log_history:
        assert not {"entropy", "mean_token_accuracy", "num_tokens", "loss", "grad_norm"} & set(entry)
    assert "epsilon" in trainer.state.log_history[-1]




# ------------------------------------------------------------------- distributed


def run_two_ranks(tmp_path, sigma: float, clipping: str = "randomized"):
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:  # a free port (torchrun's --master_port 0 waits forever)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / f"ddp{sigma}{clipping}"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           os.path.join(os.path.dirname(__file__), "trainer_ddp_worker.py"), str(out), str(sigma), clipping]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_two_gloo_ranks_equal_one_process_on_the_union(tmp_path):
    """torchrun --nproc_per_node 2: sigma = 0 equals the plain one-process loop on the union of
    the ranks' batches (logical batch PER_DEVICE/2 x ACCUM x 2 = B); sigma > 0: the noise is
    added once (every rank ends with the same parameters) and every rank reports the same
    epsilon, the one-process epsilon of the schedule."""
    ranks = run_two_ranks(tmp_path, 0.0)
    engine, _ = assert_equals_one_process_on_the_union(ranks)
    assert ranks[0]["history"] == ranks[1]["history"] == engine.accountant.history

    noisy = run_two_ranks(tmp_path, 1.0)
    for name, p in noisy[0]["params"].items():
        assert torch.equal(p, noisy[1]["params"][name]), name
    assert noisy[0]["epsilon"] == noisy[1]["epsilon"]
    one = PrivacyEngine(accountant="rc_prv").accountant
    one.history = [(1.0, Q, 3, noisy[0]["history"][0][3])]
    assert noisy[0]["epsilon"][-1] == pytest.approx(one.get_epsilon(delta=1e-5))


def test_two_gloo_ranks_with_flat_clipping_equal_one_process_on_the_union(tmp_path):
    """Flat clipping under DPDDP divides by the per-rank share of the public batch size (Opacus
    averages the ranks' sums): sigma = 0 equals the one-process loop (T = 16 <= k = 32, so the
    randomized reference clips exactly too). The update was half of it (divided by B, then by
    the world size) when this was found. The run also logs its training loss."""
    ranks = run_two_ranks(tmp_path, 0.0, clipping="flat")
    _, step_losses = assert_equals_one_process_on_the_union(ranks)
    assert ranks[0]["history"] == ranks[1]["history"] and not ranks[0]["history"][0][3].randomized
    # log_train_loss (on in the flat run): the logged loss is the union's, not one rank's share
    assert ranks[0]["loss"] == ranks[1]["loss"] == pytest.approx(step_losses, rel=1e-4)


def assert_equals_one_process_on_the_union(ranks):
    """Both ranks end with the parameters of the plain one-process loop (exact clipping,
    sigma = 0) over the union of their batches; returns that loop's engine."""
    assert all(r["world_size"] == 2 and r["expected_batch_size"] == B for r in ranks)
    for name, p in ranks[0]["params"].items():
        assert torch.equal(p, ranks[1]["params"][name]), name
    union = []
    for start in range(0, len(ranks[0]["recorded"]), ACCUM):  # a logical step: both ranks' physical batches
        for r in ranks:
            union.extend(r["recorded"][start:start + ACCUM])
    reference = tiny_llama(seed=0)  # rank 0's initial weights
    steps = []
    for start in range(0, len(union), 2 * ACCUM):
        steps.append([b for b in union[start:start + 2 * ACCUM] if b is not None])
    engine = PrivacyEngine(accountant="rc_prv")
    hooks, opt, _ = engine.make_private(
        module=reference, optimizer=torch.optim.SGD(reference.parameters(), lr=0.5),
        data_loader=torch.utils.data.DataLoader(RowDataset(), batch_size=B), noise_multiplier=0.0,
        max_grad_norm=0.05, clipping="randomized", grad_sample_mode="hooks", wrap_model=False,
        poisson_sampling=False, expected_batch_size=B, sample_rate=Q, sketch_size=32,
    )
    reference.train()
    step_losses = []  # each logical step's summed per-example loss over B
    for step in steps:
        step_losses.append(0.0)
        for i, batch in enumerate(step):
            ids = batch["input_ids"]
            logits = reference(input_ids=ids, position_ids=torch.arange(ids.shape[1]).expand_as(ids), use_cache=False).logits
            losses = per_example_token_loss(logits, batch["labels"], shift=True)
            step_losses[-1] += float(losses.detach().sum()) / B
            losses.mean().backward()
            if i < len(step) - 1:
                same_draw(opt)
            opt.step()
            opt.zero_grad()
    for name, p in reference.named_parameters():
        assert torch.allclose(ranks[0]["params"][name], p, atol=1e-6, rtol=1e-5), name
    return engine, step_losses


def test_private_sft_trainer_with_peft_config_trains_the_adapters(tmp_path):
    import trl
    import peft
    config = trl.SFTConfig(
        output_dir=str(tmp_path / "sft"), per_device_train_batch_size=PER_DEVICE, gradient_accumulation_steps=ACCUM,
        max_steps=2, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
        learning_rate=1e-2,  # SFTConfig's gradient checkpointing on, with LoRA
    )
    trainer = private_trainer(trl.SFTTrainer)(
        model=tiny_llama(), args=config, train_dataset=sft_dataset(), processing_class=char_tokenizer(),
        peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
        privacy=PrivacyArguments(noise_multiplier=1.0, delta=1e-5),
    )
    model = trainer.model
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)
    trainer.train()
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], v) for n, v in frozen.items())
    assert all(not torch.equal(params[n], v) for n, v in lora.items())
    assert trainer.privacy_steps() == 2


@pytest.mark.slow
def test_importing_opacus_rc_hf_does_not_import_transformers():
    """Issue 48: ``import opacus_rc.hf`` imported transformers and TRL (seconds); the Trainer
    classes are imported at first use (every other test uses them)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = "import sys; from opacus_rc.hf import PrivacyArguments; assert not {'transformers', 'trl'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": root})
