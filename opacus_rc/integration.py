"""The one place that extends Opacus's :class:`~opacus.PrivacyEngine`.

Opacus has no plugin registry for clipping modes, so :func:`install` wraps
``PrivacyEngine`` entry points (idempotently, keeping the originals for every other
mode):

* ``make_private(..., clipping="randomized", estimator=..., sketch_size=...,
  sketching=..., sketch_seed=..., seed=...)`` validates the options and the accountant, then
  runs Opacus's own ``make_private`` with the randomized grad-sample module and optimizer;
* ``_prepare_model`` builds :class:`~opacus_rc.grad_sample.GradSampleModuleRandomizedClipping`
  (or its hooks form for ``wrap_model=False``) while such a call is in progress, and
  ``_prepare_criterion`` the accumulating :class:`~opacus_rc.loss.DPLossRandomizedClipping`
  linked to the optimizer;
* ``make_private_with_epsilon(..., clipping="randomized")`` calibrates sigma with the
  ``rc_prv`` accountant for the requested sketch;
* ``_prepare_optimizer`` / ``_prepare_data_loader`` use the public normaliser and sample
  rate of :func:`public_sampling` (``expected_batch_size=``, ``sample_rate=`` keywords, else
  the loader's ``batch_size`` and ``1 / len(loader)``) instead of Opacus's
  ``int(len(dataset) / len(loader))``, which depends on the private dataset's size; with
  ``poisson_sampling=False`` the charged rate is the loader's own (:func:`loader_rate`).

Randomness (:mod:`opacus_rc.sketch`'s :class:`~opacus_rc.sketch.DeviceStreams`): the noise
and the Poisson masks of a randomized run never come from torch's global generator (a
script that calls ``torch.manual_seed`` and resumes would replay them). The optimizer owns
its noise stream and the Poisson loader gets its own generator, both seeded from
``os.urandom`` unless the run is made reproducible: ``seed=`` (one integer; noise, Poisson
and sketch streams derived with distinct domain tags), or Opacus's ``noise_generator=`` and
the DataLoader's ``generator=``. A reproducible run replays its randomness on resume.

``save_checkpoint`` / ``load_checkpoint`` keep generator states out of checkpoints unless
``include_rng_state=True`` (:mod:`opacus_rc.checkpoint`).

``make_private(..., denoise="spectral", denoise_kappa=..., denoise_svd=...)`` (any clipping
mode) attaches :func:`opacus_rc.denoise.attach_spectral_denoiser` to the optimizer for the
model's linear weights.

Every other clipping mode (flat, per_layer, adaptive) and grad-sample mode goes to
Opacus unchanged.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np
import opacus.privacy_engine as _pe
import torch
from opacus import PrivacyEngine
from opacus.accountants import register_accountant
from opacus.data_loader import DPDataLoader
from opacus.grad_sample import AbstractGradSampleModule
from torch import nn
from torch.utils.data import IterableDataset
from torch.utils.data.distributed import DistributedSampler

from . import checkpoint
from .csprng import loader_settings
from .accounting.accountant import RCPRVAccountant, get_noise_multiplier_rc
from .config import SketchConfig
from .sketch import POISSON_STREAM, DeviceStreams, check_seed
from .loss import DPLossRandomizedClipping
from .grad_sample import (
    GradSampleHooksBookkeeping,
    GradSampleHooksRandomizedClipping,
    GradSampleModuleBookkeeping,
    GradSampleModuleRandomizedClipping,
)
from .fsdp import (
    FSDP_MODE,
    FSDPRandomizedClippingOptimizer,
    GradSampleHooksRandomizedClippingFSDP,
    GradSampleModuleRandomizedClippingFSDP,
    check_fsdp_mode,
)
from .one_pass import BOOKKEEPING_WITH_CRITERION, OUTPUT_PASSES, pop_bookkeeping, with_criterion
from .output_passes import attach_output_passes
from .optimizer import (
    DistributedRandomizedClippingBookkeepingOptimizer,
    DistributedRandomizedClippingOptimizer,
    RandomizedClippingBookkeepingOptimizer,
    RandomizedClippingOptimizer,
)

logger = logging.getLogger(__name__)

RANDOMIZED = "randomized"
RC_ACCOUNTANTS = ("rc_prv",)
RC_GRAD_SAMPLE_MODES = ("ghost", "hooks", FSDP_MODE)
NONFINITE_MODES = ("raise", "skip")
SKETCH_OPTIONS = ("estimator", "sketch_size", "sketching", "exact_when_cheaper")
DENOISERS = ("spectral",)
#: make_private keywords fixing the public normaliser and sample rate (randomized only)
SAMPLING_OPTIONS = ("expected_batch_size", "sample_rate")


@dataclass(frozen=True)
class PublicSampling:
    """What the randomized path treats as public, fixed at make_private time.

    ``batch_size``: the averaging normaliser for ``loss_reduction="mean"`` (the expected
    logical batch size, summed over ranks in DDP; each rank divides by
    ``batch_size / world_size``, Opacus's convention); ``sample_rate``: the Poisson rate
    the loader samples at and the accountant charges. Neither depends on the private
    dataset's size (Opacus's ``int(len(dataset) / len(loader))`` does: issues #571, #819).
    """

    batch_size: int
    sample_rate: float
    explicit_sample_rate: bool = False


@dataclass(frozen=True)
class _RandomizedRequest:
    config: SketchConfig
    sketch_seed: Optional[int]
    sampling: Optional[PublicSampling] = None
    seed: Optional[int] = None  # make_private(seed=): noise and Poisson streams' root


_active_request: contextvars.ContextVar[Optional[_RandomizedRequest]] = contextvars.ContextVar(
    "opacus_rc_randomized_request", default=None
)


def sketch_config_from_kwargs(kwargs: Dict[str, Any]) -> SketchConfig:
    """Build (and validate) a :class:`SketchConfig` from make_private keyword arguments."""
    return SketchConfig(**{k: kwargs[k] for k in SKETCH_OPTIONS if k in kwargs})


def pop_nonfinite(kwargs: Dict[str, Any]) -> str:
    """Validate and remove ``nonfinite=`` ("raise", the default, or "skip"). "skip" needs
    book-keeping (``grad_sample_mode="hooks"`` after ``bookkeeping=`` was resolved): only
    there is each example's contribution assembled on its own, so a non-finite one can be
    dropped before the sum; the two-pass backward sums them inside autograd."""
    mode = kwargs.pop("nonfinite", "raise")
    if mode not in NONFINITE_MODES:
        raise ValueError(
            f"nonfinite={mode!r} is not supported; accepted values: "
            f"{', '.join(repr(m) for m in NONFINITE_MODES)}"
        )
    if mode == "skip" and kwargs.get("grad_sample_mode", "hooks") != "hooks":
        raise ValueError(
            "nonfinite='skip' needs book-keeping: use grad_sample_mode='hooks' (or "
            "bookkeeping=True with 'ghost'); the two-pass backward cannot drop one example's "
            f"non-finite gradient from its sum (got grad_sample_mode={kwargs.get('grad_sample_mode')!r})"
        )
    return mode


def _check_no_sketch_options(clipping: str, kwargs: Dict[str, Any]) -> None:
    given = [
        k for k in (*SKETCH_OPTIONS, "sketch_seed", "seed", "nonfinite", *SAMPLING_OPTIONS)
        if k in kwargs
    ]
    if given:
        raise ValueError(
            f"{', '.join(given)} only apply with clipping='randomized'; got clipping={clipping!r}"
        )


def check_randomized_setup(engine: PrivacyEngine, grad_sample_mode: str) -> None:
    """Refuse combinations that cannot be accounted or are not implemented."""
    mechanism = engine.accountant.mechanism()
    if mechanism not in RC_ACCOUNTANTS:
        raise ValueError(
            f"clipping='randomized' needs an accountant that accounts for the random "
            f"sensitivity of estimated norms: use PrivacyEngine(accountant='rc_prv') "
            f"(got accountant={mechanism!r}, which would report a too small epsilon)"
        )
    if grad_sample_mode not in RC_GRAD_SAMPLE_MODES:
        raise ValueError(
            f"clipping='randomized' does not support grad_sample_mode={grad_sample_mode!r}; "
            f"accepted values: {', '.join(repr(m) for m in RC_GRAD_SAMPLE_MODES)}"
        )


def loader_batch_size(data_loader) -> Optional[int]:
    """The batch size the user gave ``data_loader`` (its ``batch_size``, else its batch
    sampler's), times the replicas of a ``DistributedSampler`` (then it is per rank);
    ``None`` when it has none (e.g. an Opacus ``DPDataLoader``: its size is random)."""
    size = getattr(data_loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(data_loader, "batch_sampler", None), "batch_size", None)
    if size is None:
        return None
    sampler = getattr(data_loader, "sampler", None)
    if isinstance(sampler, DistributedSampler):
        size *= sampler.num_replicas
    return int(size)


def loader_rate(data_loader) -> float:
    """The rate a fixed-size loader used as given is charged:
    ``q = max(B / n, 1 / len(loader))`` (``B``: :func:`loader_batch_size`, ``n``: the
    dataset's size), capped at 1; ``1 / len(loader)`` when ``B`` or ``n`` is unknown.

    Both terms describe the loader (a batch of ``B`` out of ``n``; ``len(loader)``
    batches per epoch); their maximum is the larger, so the charge never falls below
    either (``1 / ceil(n / B) < B / n`` when ``B`` does not divide ``n``).
    """
    rate = 1.0 / len(data_loader)
    size = loader_batch_size(data_loader)
    try:
        n = len(data_loader.dataset)
    except TypeError:  # a dataset without __len__
        n = 0
    return min(1.0, max(rate, size / n)) if size and n else rate


def _matching_loader_rate(data_loader, sample_rate: float) -> float:
    """``sample_rate`` when it is the loader's own rate (relative tolerance 1e-9), else a
    ValueError: without Poisson sampling the loader is used as given, and charging
    another rate would misstate how it samples (e.g. 0.01 for batches of 25 out of 500)."""
    rate = loader_rate(data_loader)
    if not math.isclose(sample_rate, rate, rel_tol=1e-9, abs_tol=0.0):
        raise ValueError(
            f"sample_rate={sample_rate!r} does not match how this data_loader samples: with "
            f"poisson_sampling=False the loader is used as given (fixed-size batches) and "
            f"is charged its own rate max(batch_size / len(dataset), 1 / len(loader)) = "
            f"{rate!r}; accepted values: sample_rate=None or {rate!r} with "
            f"poisson_sampling=False, or poisson_sampling=True to sample at sample_rate"
        )
    return rate


def public_sampling(
    data_loader,
    expected_batch_size: Any = None,
    sample_rate: Any = None,
    poisson_sampling: bool = True,
) -> PublicSampling:
    """The public normaliser and sample rate of a randomized-clipping run.

    Normaliser: ``expected_batch_size`` when given, else the batch size of the loader as
    the user built it (:func:`loader_batch_size`): a hyper-parameter, never a function
    of the dataset's size. Sample rate with Poisson sampling: ``sample_rate`` when
    given, else ``1 / len(data_loader)`` (Opacus's choice; it assumes the number of
    batches per epoch is public, see docs/accounting.md, "What the guarantee assumes").
    With ``poisson_sampling=False``: the loader's own rate (:func:`loader_rate`); a
    ``sample_rate`` other than it is refused.

    Raises:
        ValueError: naming the parameter and its accepted values.
    """
    if expected_batch_size is not None:
        if (
            isinstance(expected_batch_size, bool)
            or not isinstance(expected_batch_size, numbers.Integral)
            or expected_batch_size < 1
        ):
            raise ValueError(
                f"expected_batch_size={expected_batch_size!r} is invalid; accepted values: "
                f"a positive int (the expected logical batch size, summed over ranks in DDP) "
                f"or None (the data loader's batch_size)"
            )
        batch_size = int(expected_batch_size)
    else:
        batch_size = loader_batch_size(data_loader)
        if batch_size is None:
            raise ValueError(
                "expected_batch_size=None is invalid for this data_loader: it has no "
                "batch_size (nor a batch sampler with one; an Opacus DPDataLoader has a "
                "random size) to use as the public normaliser; accepted values: a positive "
                "int, the expected logical batch size"
            )
    if sample_rate is not None:
        if (
            isinstance(sample_rate, bool)
            or not isinstance(sample_rate, numbers.Real)
            or not math.isfinite(sample_rate)
            or not 0.0 < sample_rate <= 1.0
        ):
            raise ValueError(
                f"sample_rate={sample_rate!r} is invalid; accepted values: a float in "
                f"(0, 1] or None (1 / len(data_loader))"
            )
        if not poisson_sampling:
            sample_rate = _matching_loader_rate(data_loader, float(sample_rate))
        return PublicSampling(batch_size, float(sample_rate), explicit_sample_rate=True)
    if not poisson_sampling:
        return PublicSampling(batch_size, loader_rate(data_loader))
    return PublicSampling(batch_size, 1.0 / len(data_loader))


def pop_seed(engine: PrivacyEngine, kwargs: Dict[str, Any]) -> Optional[int]:
    """Validate and remove ``seed=`` (None, the default, or a non-negative int): one root
    for a reproducible run's noise, Poisson and sketch streams (distinct domain tags, see
    :mod:`opacus_rc.sketch`); it replays them on resume. Refused next to another seed of
    the same stream and in secure mode (nothing there is seeded)."""
    seed = check_seed("seed", kwargs.pop("seed", None))
    if seed is None:
        return None
    if engine.secure_mode:
        raise ValueError(
            "seed= is invalid with secure_mode=True: secure noise, sketches and Poisson "
            "masks come from os.urandom; accepted values: seed=None"
        )
    loader = kwargs.get("data_loader")
    others = {
        "noise_generator": kwargs.get("noise_generator") is not None,
        "sketch_seed": kwargs.get("sketch_seed") is not None,
        "data_loader's generator": kwargs.get("poisson_sampling", True)
        and getattr(loader, "generator", None) is not None,
    }
    given = [name for name, present in others.items() if present]
    if given:
        raise ValueError(
            f"seed={seed!r} and {', '.join(given)} both seed the same stream; accepted "
            f"values: seed= alone (noise, Poisson masks and sketches from one integer), or "
            f"Opacus's noise_generator= / the DataLoader's generator= and sketch_seed= "
            f"without seed="
        )
    return seed


def poisson_generator(data_loader, seed: Optional[int], distributed: bool) -> torch.Generator:
    """The generator of the Poisson masks; never torch's global generator.

    The loader's own ``generator`` (reproducible; Opacus's way) as it is in one process;
    under DDP a child of it per rank (root its ``initial_seed()``), so that ranks seeded
    alike still draw independent masks. Else the :data:`~opacus_rc.sketch.POISSON_STREAM`
    of ``seed`` (``None``: 128 bits from ``os.urandom``), rank folded in.
    """
    user = getattr(data_loader, "generator", None)
    if user is not None and not distributed:
        return user
    root = np.random.SeedSequence(user.initial_seed() if user is not None else seed)
    return DeviceStreams(root, POISSON_STREAM, per_rank=True).generator("cpu")


def denoised_weights(module: nn.Module) -> List[nn.Parameter]:
    """The 2-D weights spectral denoising acts on: trainable ``nn.Linear`` weights
    (LoRA A/B factors included) and Hugging Face ``Conv1D`` weights."""
    return [
        m.weight
        for m in module.modules()
        if (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")
        and m.weight.requires_grad
        and m.weight.dim() == 2
    ]


def _pop_denoise_options(kwargs: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    denoise = kwargs.pop("denoise", None)
    options = {k: kwargs.pop(f"denoise_{k}") for k in ("kappa", "svd") if f"denoise_{k}" in kwargs}
    if denoise is None:
        if options:
            raise ValueError(
                f"{', '.join('denoise_' + k for k in options)} need denoise='spectral'"
            )
        return None
    if denoise not in DENOISERS:
        raise ValueError(
            f"denoise={denoise!r} is not supported; accepted values: None, "
            f"{', '.join(repr(d) for d in DENOISERS)}"
        )
    return options


def _with_denoising(entry_point):
    """Handle ``denoise=`` options around a make_private entry point (any clipping)."""

    @functools.wraps(entry_point)
    def run(original, self: PrivacyEngine, **kwargs):
        denoise_options = _pop_denoise_options(kwargs)
        out = entry_point(original, self, **kwargs)
        if denoise_options is not None:
            from .denoise import attach_spectral_denoiser

            weights = denoised_weights(kwargs["module"])
            attach_spectral_denoiser(out[1], weights, **denoise_options)
        return out

    return run


@_with_denoising
def _make_private(original, self: PrivacyEngine, *, clipping: str = "flat", **kwargs):
    runs = pop_bookkeeping(clipping, kwargs)  # book-keeping or two passes (one_pass.py)
    if clipping != RANDOMIZED:
        _check_no_sketch_options(clipping, kwargs)
        _require_torchcsprng(self, clipping)
        return original(self, clipping=clipping, **kwargs)
    check_randomized_setup(self, kwargs.get("grad_sample_mode", "hooks"))
    config = sketch_config_from_kwargs(kwargs)
    for key in SKETCH_OPTIONS:
        kwargs.pop(key, None)
    nonfinite = pop_nonfinite(kwargs)
    seed = pop_seed(self, kwargs)
    # From the loader as the user built it: Opacus's DPDataLoader has no batch_size.
    sampling = public_sampling(
        kwargs.get("data_loader"), kwargs.pop("expected_batch_size", None),
        kwargs.pop("sample_rate", None), kwargs.get("poisson_sampling", True),
    )
    sketch_seed = kwargs.pop("sketch_seed", None)
    request = _RandomizedRequest(
        config=config, sketch_seed=seed if sketch_seed is None else sketch_seed,
        sampling=sampling, seed=seed,
    )
    token = _active_request.set(request)
    try:
        out = original(self, clipping=RANDOMIZED, sketch_config=config, **kwargs)
    finally:
        _active_request.reset(token)
    out[1].nonfinite = nonfinite
    # Opacus charged 1 / len(its DPDataLoader); charge the public rate instead.
    out[1].attach_step_hook(self.accountant.get_optimizer_hook_fn(sample_rate=sampling.sample_rate))
    logger.info(
        "randomized clipping: public normaliser %d, sample rate %.6g", sampling.batch_size,
        sampling.sample_rate,
    )
    if runs == OUTPUT_PASSES:  # a plain-loss script on a checkpointed model
        module, optimizer, _, data_loader = out
        attach_output_passes(module, optimizer, kwargs.get("loss_reduction", "mean"))
        return module, optimizer, data_loader
    return with_criterion(out, kwargs) if runs == BOOKKEEPING_WITH_CRITERION else out


def _prepare_optimizer(original, self: PrivacyEngine, **kwargs):
    request = _active_request.get()
    if request is not None and request.sampling is not None:
        # Opacus passes int(len(dataset) / len(loader)) (/ world size): dataset-dependent.
        size = request.sampling.batch_size
        if kwargs.get("distributed", False):
            import torch.distributed as dist

            size = size / dist.get_world_size()  # per rank, as Opacus
        kwargs["expected_batch_size"] = size
    if request is not None:
        kwargs["noise_seed"] = request.seed  # the optimizer's own noise stream's root
    return original(self, **kwargs)


def _prepare_data_loader(original, self: PrivacyEngine, data_loader, **kwargs):
    """Randomized path: the Poisson loader at the public rate with its own generator
    (:func:`poisson_generator`); secure mode's CSPRNG loader; with
    ``poisson_sampling=False`` the loader as given (Opacus)."""
    request = _active_request.get()
    if request is None:
        return original(self, data_loader, **kwargs)
    if self.secure_mode:  # CSPRNG Poisson sampler, no torchcsprng
        return _secure_data_loader(original, self, data_loader, request, **kwargs)
    if not kwargs.get("poisson_sampling", True):
        return original(self, data_loader, **kwargs)
    if isinstance(data_loader.dataset, IterableDataset):
        raise ValueError("Uniform sampling is not supported for IterableDataset")
    original(self, data_loader, **{**kwargs, "poisson_sampling": False})  # dataset check
    distributed = kwargs.get("distributed", False)
    rate = request.sampling.sample_rate if request.sampling is not None else 1 / len(data_loader)
    generator = poisson_generator(data_loader, request.seed, distributed)
    setattr(self, checkpoint.POISSON_GENERATOR_ATTR, generator)  # include_rng_state
    # Opacus's DPDataLoader.from_data_loader, at the public rate and with our generator
    return DPDataLoader(
        dataset=data_loader.dataset,
        sample_rate=rate,
        **loader_settings(data_loader),
        generator=generator,
        distributed=distributed,
        batch_first=kwargs.get("batch_first", True),
        rand_on_empty=kwargs.get("rand_on_empty", False),
    )


# --- secure mode without torchcsprng (clipping="randomized" only) ---------------------


def _torchcsprng_available() -> bool:
    try:
        import torchcsprng  # noqa: F401
    except ImportError:
        return False
    return True


def _init(original, self: PrivacyEngine, *args, **kwargs):
    """``PrivacyEngine(secure_mode=True, accountant="rc_prv")`` without torchcsprng: the
    engine is built without Opacus's torchcsprng generator (``secure_rng = None``); the
    randomized path draws its Poisson masks, sketches and noise from
    :mod:`opacus_rc.csprng`. Other clipping modes then raise Opacus's ImportError at
    ``make_private``; every other configuration goes to Opacus unchanged."""
    if (
        args
        or not kwargs.get("secure_mode", False)
        or kwargs.get("accountant", "prv") not in RC_ACCOUNTANTS
        or _torchcsprng_available()
    ):
        return original(self, *args, **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        original(self, **{**kwargs, "secure_mode": False})
    self.secure_mode = True
    self.secure_rng = None
    self._opacus_rc_csprng_only = True
    logger.info("secure_mode without torchcsprng: clipping='randomized' uses opacus_rc.csprng")


def _require_torchcsprng(self: PrivacyEngine, clipping: str) -> None:
    """Opacus's secure-mode ImportError, deferred to a non-randomized make_private."""
    if getattr(self, "_opacus_rc_csprng_only", False):
        raise ImportError(
            "To use secure RNG, you must install the torchcsprng package! Check out the "
            "instructions here: https://github.com/pytorch/csprng#installation "
            f"(clipping={clipping!r} uses Opacus's torchcsprng generator; without it, "
            "secure_mode serves clipping='randomized' only, from opacus_rc.csprng)"
        )


def _secure_data_loader(original, self: PrivacyEngine, data_loader, request, **kwargs):
    """The randomized path's loader in secure mode: Poisson sampling with a
    :class:`~opacus_rc.csprng.SecurePoissonSampler` (masks from the CSPRNG) at the run's
    public sample rate."""
    from .csprng import SecureDPDataLoader

    if not kwargs.get("poisson_sampling", True):
        if self.secure_rng is None:
            raise ValueError(
                "poisson_sampling=False is invalid with secure_mode=True without "
                "torchcsprng: there is no secure generator to shuffle with; accepted "
                "values: poisson_sampling=True (the sampling rc_prv accounts for)"
            )
        return original(self, data_loader, **kwargs)
    if self.dataset is None:  # Opacus's one-dataset-per-engine check
        self.dataset = data_loader.dataset
    elif self.dataset != data_loader.dataset:
        warnings.warn(
            f"PrivacyEngine detected new dataset object. Was: {self.dataset}, got: "
            f"{data_loader.dataset}. Privacy accounting works per dataset, please "
            f"initialize new PrivacyEngine if you're using different dataset."
        )
    rate = request.sampling.sample_rate if request.sampling is not None else None
    return SecureDPDataLoader.from_data_loader(
        data_loader,
        sample_rate=rate,
        distributed=kwargs.get("distributed", False),
        batch_first=kwargs.get("batch_first", True),
        rand_on_empty=kwargs.get("rand_on_empty", False),
    )


def _prepare_model(original, self: PrivacyEngine, module, **kwargs):
    request = _active_request.get()
    if request is None:
        return original(self, module, **kwargs)
    self.validate(module=module, optimizer=None, data_loader=None)
    wrap_model = kwargs.get("wrap_model", True)
    if isinstance(module, AbstractGradSampleModule):
        raise ValueError(
            "clipping='randomized' needs a plain nn.Module; got an already wrapped "
            f"{type(module).__name__}"
        )
    common = dict(
        batch_first=kwargs.get("batch_first", True),
        loss_reduction=kwargs.get("loss_reduction", "mean"),
        sketch_config=request.config,
        sketch_seed=request.sketch_seed,
        secure_mode=self.secure_mode,
    )
    check_fsdp_mode(module, kwargs.get("grad_sample_mode", "hooks"))  # FSDP2: ghost_fsdp only
    if kwargs.get("grad_sample_mode") == FSDP_MODE:
        cls = GradSampleModuleRandomizedClippingFSDP if wrap_model else GradSampleHooksRandomizedClippingFSDP
        return cls(module, max_grad_norm=kwargs.get("max_grad_norm", 1.0), **common)
    if kwargs.get("grad_sample_mode") == "hooks":  # book-keeping: one backward pass
        cls = GradSampleModuleBookkeeping if wrap_model else GradSampleHooksBookkeeping
        return cls(module, **common)
    cls = GradSampleModuleRandomizedClipping if wrap_model else GradSampleHooksRandomizedClipping
    return cls(module, max_grad_norm=kwargs.get("max_grad_norm", 1.0), **common)


def _prepare_criterion(original, self: PrivacyEngine, *, module, optimizer, criterion, loss_reduction="mean", **kwargs):
    if _active_request.get() is None:
        return original(
            self, module=module, optimizer=optimizer, criterion=criterion,
            loss_reduction=loss_reduction, **kwargs,
        )
    return DPLossRandomizedClipping(module, optimizer, criterion, loss_reduction)


def _get_optimizer_class(original, clipping: str, distributed: bool, grad_sample_mode=None):
    if clipping == RANDOMIZED and grad_sample_mode == FSDP_MODE:
        return FSDPRandomizedClippingOptimizer
    if clipping == RANDOMIZED and grad_sample_mode == "hooks":
        if distributed:
            return DistributedRandomizedClippingBookkeepingOptimizer
        return RandomizedClippingBookkeepingOptimizer
    if clipping == RANDOMIZED:
        return DistributedRandomizedClippingOptimizer if distributed else RandomizedClippingOptimizer
    return original(clipping=clipping, distributed=distributed, grad_sample_mode=grad_sample_mode)


@_with_denoising
def _make_private_with_epsilon(
    original,
    self: PrivacyEngine,
    *,
    target_epsilon: float,
    target_delta: float,
    epochs: int,
    data_loader,
    clipping: str = "flat",
    **kwargs,
):
    if clipping != RANDOMIZED:
        _check_no_sketch_options(clipping, kwargs)
        return original(
            self,
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            epochs=epochs,
            data_loader=data_loader,
            clipping=clipping,
            **kwargs,
        )
    check_randomized_setup(self, kwargs.get("grad_sample_mode", "hooks"))
    config = sketch_config_from_kwargs(kwargs)
    sampling = public_sampling(
        data_loader, kwargs.get("expected_batch_size"), kwargs.get("sample_rate"),
        kwargs.get("poisson_sampling", True),
    )
    if len(self.accountant) > 0:
        warnings.warn(
            "You're calling make_private_with_epsilon with non-zero privacy budget "
            "already spent. Returned noise_multiplier assumes zero starting point, "
            "so your overall privacy budget will be higher."
        )
    noise_multiplier = get_noise_multiplier_rc(
        target_epsilon=target_epsilon,
        target_delta=target_delta,
        sample_rate=sampling.sample_rate,
        epochs=epochs,
        sketch_config=config,
    )
    logger.info("rc_prv calibrated noise_multiplier=%.4f for %s", noise_multiplier, config)
    return self.make_private(
        data_loader=data_loader,
        noise_multiplier=noise_multiplier,
        clipping=RANDOMIZED,
        **kwargs,
    )


def _wrap(owner: Any, name: str, replacement) -> None:
    """Replace ``owner.name`` by ``replacement(original, *args, **kwargs)`` once."""
    original = getattr(owner, name)
    if hasattr(original, "_opacus_rc_original"):
        return  # already installed

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        return replacement(original, *args, **kwargs)

    wrapped._opacus_rc_original = original
    setattr(owner, name, wrapped)


def _register_accountant() -> None:
    register_accountant("rc_prv", RCPRVAccountant, force=True)


_PATCHES = (
    (PrivacyEngine, "__init__", _init),
    (PrivacyEngine, "make_private", _make_private),
    (PrivacyEngine, "make_private_with_epsilon", _make_private_with_epsilon),
    (PrivacyEngine, "_prepare_model", _prepare_model),
    (PrivacyEngine, "_prepare_criterion", _prepare_criterion),
    (PrivacyEngine, "_prepare_optimizer", _prepare_optimizer),
    (PrivacyEngine, "_prepare_data_loader", _prepare_data_loader),
    (_pe, "get_optimizer_class", _get_optimizer_class),
    (PrivacyEngine, "save_checkpoint", checkpoint.save_checkpoint),
    (PrivacyEngine, "load_checkpoint", checkpoint.load_checkpoint),
)


def install() -> None:
    """Register randomized clipping and the ``rc_prv`` accountant with Opacus (idempotent)."""
    for owner, name, replacement in _PATCHES:
        _wrap(owner, name, replacement)
    _register_accountant()


def uninstall() -> None:
    """Restore Opacus's original entry points (the accountant stays registered)."""
    for owner, name, _ in _PATCHES:
        original = getattr(getattr(owner, name), "_opacus_rc_original", None)
        if original is not None:
            setattr(owner, name, original)
