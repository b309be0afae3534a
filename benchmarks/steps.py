"""Per-step cost of DP training of a small causal decoder, side by side in one process.

Six configurations train copies of the same model (a :class:`~examples.models.TinyDecoder`
or a Llama-style :class:`~examples.models.llama.LlamaLM`) on the same batch (SGD,
next-token loss):

* ``nonprivate``: plain training, mean cross-entropy, one backward pass;
* ``hooks``: Opacus ``grad_sample_mode="hooks"`` (per-sample gradients, flat clipping);
* ``ghost``: Opacus ghost clipping (``grad_sample_mode="ghost"``, two backward passes,
  per-sequence loss through Opacus's ``DPLossFastGradientClipping``);
* ``randomized``: the same with ``clipping="randomized"`` (Hutchinson, k = 32);
* ``randomized_bk``: randomized clipping by book-keeping (``grad_sample_mode="hooks"``,
  one backward pass, plain loss; Hutchinson, k = 32);
* ``randomized_bk_ghost``: a ghost script switched to book-keeping with
  ``bookkeeping=True`` (``grad_sample_mode="ghost"``, the returned per-sequence criterion,
  one backward pass).

Step time is the median over interleaved repetitions (config order rotated every
repetition, so load changes on a shared machine hit every configuration alike); the
phases of each step (forward, first backward, norm computation, clipping coefficients,
second backward, optimizer) are timed within the same steps. Peak memory is the peak of
live bytes allocated during one whole step (forward, backward(s), optimizer step; counted
operator by operator with :class:`~examples.profiling.PeakAllocationCounter`, which does
not depend on the allocator), and optionally peak-RSS growth measured in a fresh
subprocess per configuration (:mod:`benchmarks.rss`).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from examples.models import TinyDecoder, markov_text
from examples.profiling import PeakAllocationCounter
from .layers import median

logger = logging.getLogger(__name__)

CONFIGS = ("nonprivate", "hooks", "ghost", "randomized", "randomized_bk", "randomized_bk_ghost")
#: Also accepted by ``--configs``: the randomized ones with one sketch shared by the batch
#: (``sketching="shared"``; the others use the default, per-example sketches).
SHARED_CONFIGS = ("randomized_shared", "randomized_bk_shared")
ACCEPTED_CONFIGS = CONFIGS + SHARED_CONFIGS
BASELINE = "nonprivate"


ARCHS = ("decoder", "llama")


@dataclass(frozen=True)
class StepShape:
    """A model and batch shape: sequence length T, width d, batch size; ``arch`` is
    ``"decoder"`` (:class:`~examples.models.TinyDecoder`: LayerNorm, GELU MLP, biases) or
    ``"llama"`` (:class:`~examples.models.llama.LlamaLM`: RMSNorm, rotary, SwiGLU)."""

    seq_len: int
    d_model: int
    batch: int
    n_layers: int = 2
    vocab: int = 512
    arch: str = "decoder"

    @property
    def label(self) -> str:
        prefix = "" if self.arch == "decoder" else f"{self.arch} "
        return f"{prefix}T={self.seq_len},d={self.d_model},b={self.batch}"

    @property
    def spec(self) -> str:
        """The ``[arch:]T:d:b`` text :meth:`parse` reads back."""
        prefix = "" if self.arch == "decoder" else f"{self.arch}:"
        return f"{prefix}{self.seq_len}:{self.d_model}:{self.batch}"

    @property
    def n_heads(self) -> int:
        """Heads of width 64 (at least one head, dividing d)."""
        heads = max(1, self.d_model // 64)
        while self.d_model % heads:
            heads -= 1
        return heads

    @classmethod
    def parse(cls, text: str, **kwargs: int) -> "StepShape":
        """``"[arch:]T:d:b"`` (e.g. ``"2048:512:1"``, ``"llama:2048:512:1"``) -> StepShape."""
        fields = text.strip().split(":")
        arch = fields.pop(0) if len(fields) == 4 else "decoder"
        accepted = f"accepted format: [{'|'.join(ARCHS)}:]T:d:batch, e.g. 2048:512:1 or llama:2048:512:1"
        if arch not in ARCHS:
            raise ValueError(f"step shape {text!r} has an unknown model {arch!r}; {accepted}")
        try:
            t, d, b = (int(x) for x in fields)
        except ValueError:
            raise ValueError(f"step shape {text!r} is invalid; {accepted}") from None
        if min(t, d, b) <= 0:
            raise ValueError(f"step shape {text!r} is invalid: T, d and batch must be positive")
        return cls(t, d, b, arch=arch, **kwargs)


def build_model(shape: StepShape, seed: int = 0) -> nn.Module:
    """The model for ``shape`` (a decoder or a Llama-style LM) with seeded random weights."""
    torch.manual_seed(seed)
    size = dict(vocab=shape.vocab, d_model=shape.d_model, n_layers=shape.n_layers,
                n_heads=shape.n_heads, max_len=shape.seq_len)
    if shape.arch == "llama":
        from examples.models.llama import LlamaLM

        return LlamaLM(**size)
    return TinyDecoder(**size)


def make_tokens(shape: StepShape, seed: int = 0) -> torch.Tensor:
    """A (batch, T + 1) batch of Markov-chain token ids."""
    return markov_text(shape.batch, shape.seq_len, shape.vocab, seed=seed)


@dataclass
class PhaseClock:
    """Wall-clock phases of one step (seconds), filled by :class:`Trainer`."""

    times: Dict[str, float] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.times[name] = self.times.get(name, 0.0) + seconds


def _timed(fn: Callable, clock: PhaseClock, name: str) -> Callable:
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock.add(name, time.perf_counter() - start)

    return run


@contextlib.contextmanager
def _instance_override(obj: Any, name: str, value: Any) -> Iterator[None]:
    """Set ``obj.name = value`` for the duration (restoring a class-level lookup)."""
    had = name in vars(obj)
    saved = vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, saved)
        else:
            delattr(obj, name)


class Trainer:
    """One configuration: a module, its optimizer and its loss on a token batch.

    ``step(tokens)`` runs forward, backward(s) and the optimizer step and returns the
    phase times: ``forward``, ``backward`` (both passes), ``optimizer``; for the two-pass
    modes also ``backward1`` (up to the clipping coefficients), ``clip`` and
    ``backward2``; ``norms`` (norm samplers: linear layers, embeddings) and
    ``grad_samples`` (per-sample gradients of the other layers) are parts of the
    backward pass(es).
    """

    def __init__(self, name: str, module: nn.Module, optimizer: Any, loss_fn: Callable) -> None:
        self.name = name
        self.module = module
        self.optimizer = optimizer
        self.loss_fn = loss_fn

    @contextlib.contextmanager
    def _instrumented(self, clock: PhaseClock) -> Iterator[None]:
        module = self.module
        with contextlib.ExitStack() as stack:
            for table, phase in (("NORM_SAMPLERS", "norms"), ("GRAD_SAMPLERS", "grad_samples")):
                samplers = getattr(module, table, None)
                if samplers:
                    timed = {k: _timed(f, clock, phase) for k, f in samplers.items()}
                    stack.enter_context(_instance_override(module, table, timed))
            if hasattr(module, "get_clipping_coef"):
                original = module.get_clipping_coef

                def coef():
                    clock.times["_coef_start"] = time.perf_counter()
                    out = original()
                    clock.times["_coef_end"] = time.perf_counter()
                    return out

                stack.enter_context(_instance_override(module, "get_clipping_coef", coef))
            yield

    def step(self, tokens: torch.Tensor) -> Dict[str, float]:
        clock = PhaseClock()
        with self._instrumented(clock):
            t0 = time.perf_counter()
            loss = self.loss_fn(tokens)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
        phases = dict(clock.times)
        phases.update(forward=t1 - t0, backward=t2 - t1, optimizer=t3 - t2, total=t3 - t0)
        if "_coef_start" in phases:
            start, end = phases.pop("_coef_start"), phases.pop("_coef_end")
            phases.update(backward1=start - t1, clip=end - start, backward2=t2 - end)
        return phases


def _lm_targets(tokens: torch.Tensor):
    # contiguous: Opacus's ghost embedding norm sampler views the token ids.
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _plain_loss(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss(tokens: torch.Tensor) -> torch.Tensor:
        inputs, targets = _lm_targets(tokens)
        logits = module(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return loss


def _per_sequence_loss(module: nn.Module, criterion: Any) -> Callable[[torch.Tensor], Any]:
    """The ghost/randomized loss: Opacus reduces token losses per sequence (privacy unit)."""

    def loss(tokens: torch.Tensor):
        inputs, targets = _lm_targets(tokens)
        logits = module(inputs)
        return criterion(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), shape=logits.shape[:2]
        )

    return loss


def make_trainer(
    config: str,
    model: nn.Module,
    tokens: torch.Tensor,
    *,
    lr: float = 1e-3,
    noise_multiplier: float = 1.0,
    sketch_size: int = 32,
    estimator: str = "hutchinson",
) -> Trainer:
    """A :class:`Trainer` for ``config`` (one of :data:`CONFIGS`) owning ``model``."""
    if config not in ACCEPTED_CONFIGS:
        raise ValueError(f"config={config!r} is not supported; accepted values: {ACCEPTED_CONFIGS}")
    sketching = "shared" if config in SHARED_CONFIGS else "per_example"
    base = config.removesuffix("_shared")
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    if base == "nonprivate":
        return Trainer(config, model, optimizer, _plain_loss(model))
    from opacus import PrivacyEngine

    import opacus_rc  # noqa: F401  registers clipping="randomized" and accountant="rc_prv"

    randomized = base.startswith("randomized")
    one_pass = base in ("hooks", "randomized_bk")
    engine = PrivacyEngine(accountant="rc_prv" if randomized else "prv")
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(tokens), batch_size=tokens.shape[0]
    )
    extra: Dict[str, Any] = (
        {"clipping": "randomized", "sketch_size": sketch_size, "estimator": estimator, "sketch_seed": 0,
         "sketching": sketching, "per_example_backward": False}  # batch 1 would choose the per-example form
        if randomized
        else {}
    )
    if base == "randomized_bk_ghost":  # a ghost script (4-tuple, criterion) in one pass
        extra["bookkeeping"] = True
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        out = engine.make_private(
            module=model,
            optimizer=optimizer,
            criterion=nn.CrossEntropyLoss(),
            data_loader=loader,
            noise_multiplier=noise_multiplier,
            max_grad_norm=1.0,
            # randomized_bk: book-keeping by its public name, also on a checkpointed model
            # (where "hooks" runs two passes from the output)
            grad_sample_mode=("bookkeeping" if base == "randomized_bk" else "hooks") if one_pass else "ghost",
            **extra,
        )
    if one_pass:
        module, dp_optimizer, _ = out
        return Trainer(config, module, dp_optimizer, _plain_loss(module))
    module, dp_optimizer, criterion, _ = out
    return Trainer(config, module, dp_optimizer, _per_sequence_loss(module, criterion))


def step_peak_bytes(trainer: Trainer, tokens: torch.Tensor) -> int:
    """Peak live bytes allocated during one whole training step of ``trainer``."""
    with PeakAllocationCounter() as counter:
        trainer.step(tokens)
    return counter.peak


@dataclass
class StepResult:
    """Medians over repetitions for one (shape, config)."""

    shape: StepShape
    config: str
    time_s: float
    times_s: List[float]
    phases_s: Dict[str, float]
    peak_bytes: int
    rss_growth_bytes: Optional[int] = None

    def as_dict(self) -> dict:
        return {
            "shape": self.shape.label,
            "seq_len": self.shape.seq_len,
            "d_model": self.shape.d_model,
            "batch": self.shape.batch,
            "n_layers": self.shape.n_layers,
            "vocab": self.shape.vocab,
            "config": self.config,
            "time_s": self.time_s,
            "time_min_s": min(self.times_s),
            "times_s": self.times_s,
            "phases_s": self.phases_s,
            "peak_bytes": self.peak_bytes,
            "rss_growth_bytes": self.rss_growth_bytes,
        }


def measure_steps(
    shape: StepShape,
    *,
    reps: int,
    configs: Sequence[str] = CONFIGS,
    tick: Callable[[], None] = lambda: None,
    **trainer_kwargs: Any,
) -> List[StepResult]:
    """Step time (median of ``reps`` interleaved steps), phase medians and peak bytes
    of every configuration on ``shape``; one warm-up step each first."""
    tokens = make_tokens(shape)
    base = build_model(shape)
    trainers = [make_trainer(c, copy.deepcopy(base), tokens, **trainer_kwargs) for c in configs]
    del base
    peaks = []
    for trainer in trainers:
        trainer.step(tokens)  # warm-up (lazy initialisation, first-call overheads)
        peaks.append(step_peak_bytes(trainer, tokens))
        tick()
    runs: List[List[Dict[str, float]]] = [[] for _ in trainers]
    for rep in range(reps):
        for j in range(len(trainers)):
            i = (rep + j) % len(trainers)  # rotate the order every repetition
            gc.collect()
            runs[i].append(trainers[i].step(tokens))
            tick()
    results = []
    for trainer, peak, steps in zip(trainers, peaks, runs):
        keys = sorted({k for s in steps for k in s})
        phases = {k: median([s.get(k, 0.0) for s in steps]) for k in keys}
        totals = [s["total"] for s in steps]
        results.append(
            StepResult(shape, trainer.name, median(totals), totals, phases, peak)
        )
    del trainers
    gc.collect()
    return results


def ratios(results: Sequence[StepResult], baseline: str = BASELINE) -> List[dict]:
    """Per (shape, config): time, peak bytes and RSS growth as multiples of ``baseline``
    (non-private training) on the same shape."""
    base = {r.shape: r for r in results if r.config == baseline}
    rows = []
    for r in results:
        b = base.get(r.shape)
        if b is None:
            continue
        rss = None
        if r.rss_growth_bytes is not None and b.rss_growth_bytes:
            rss = r.rss_growth_bytes / b.rss_growth_bytes
        rows.append(
            {
                "shape": r.shape.label,
                "config": r.config,
                "time_ratio": r.time_s / b.time_s,
                "time_ratio_min": min(r.times_s) / min(b.times_s),
                "peak_ratio": r.peak_bytes / b.peak_bytes if b.peak_bytes else None,
                "rss_growth_ratio": rss,
            }
        )
    return rows
