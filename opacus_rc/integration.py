"""The one place that extends Opacus: :class:`PrivacyEngine`, a subclass of Opacus's.

``make_private(..., clipping="randomized", estimator=..., sketch_size=...)`` parses the
plugin's options once into a frozen :class:`~opacus_rc.options.Options` and runs Opacus's
own ``make_private`` on a :class:`MakePrivateCall` of the engine and those options, whose
``_prepare_model`` / ``_prepare_optimizer`` / ``_prepare_data_loader`` /
``_prepare_criterion`` steps hand them to the engine's randomized steps (the
randomized grad-sample module, optimizer and criterion; a Poisson loader at the public
rate with its own generator; the public normaliser). Every other clipping mode goes to
Opacus unchanged. The options, their defaults and their documentation are spelled once,
in :data:`opacus_rc.options.OPTIONS`; both signatures are built from it. ``make_private_with_epsilon`` calibrates sigma with the ``rc_prv``
accountant for the requested sketch; ``save_checkpoint`` / ``load_checkpoint`` keep
generator states out of checkpoints unless ``include_rng_state=True``;
``PrivacyEngine(secure_mode=True, accountant="rc_prv")`` works without torchcsprng
(:mod:`opacus_rc.csprng`); ``denoise="spectral"`` (any clipping mode) attaches
:func:`opacus_rc.denoise.attach_spectral_denoiser`.

Randomness (:mod:`opacus_rc.sketch`'s :class:`~opacus_rc.sketch.DeviceStreams`): the noise
and the Poisson masks of a randomized run never come from torch's global generator (a
script that calls ``torch.manual_seed`` and resumes would replay them). The optimizer owns
its noise stream and the Poisson loader gets its own generator, both seeded from
``os.urandom`` unless the run is made reproducible: ``seed=`` (one integer; noise, Poisson
and sketch streams derived with distinct domain tags), or Opacus's ``noise_generator=`` and
the DataLoader's ``generator=``. A reproducible run replays its randomness on resume.

:func:`install` (run by ``import opacus_rc``) makes ``from opacus import PrivacyEngine``
give this class and BatchMemoryManager's sampler declare its physical batches one Poisson
draw. Opacus has no registry of engines or clipping modes, nor a same-draw signal, so it
replaces four names (:data:`PATCHES`; the ``rc_prv`` accountant goes through Opacus's
registry); :func:`uninstall` restores every one of them (:data:`ORIGINALS`).
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import warnings
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import opacus
import opacus.privacy_engine
import torch
from opacus.accountants import register_accountant
from opacus.data_loader import DPDataLoader
from opacus.grad_sample import AbstractGradSampleModule
from opacus.optimizers import DPOptimizer
from opacus.utils.batch_memory_manager import BatchSplittingSampler
from torch import nn
from torch.utils.data import IterableDataset

from . import checkpoint
from .accounting.accountant import RCPRVAccountant, get_noise_multiplier_rc
from .csprng import SecureDPDataLoader, loader_settings
from .forms import FORMS
from .forms.fsdp import check_fsdp_mode
from .forms.two_pass import DPLossRandomizedClipping
from .optimizer import RandomizedClippingMixin
from .options import (  # noqa: F401  (loader_batch_size, loader_rate, public_sampling: public here too)
    RANDOMIZED,
    RC_ACCOUNTANTS,
    Options,
    PublicSampling,
    loader_batch_size,
    loader_rate,
    public_sampling,
    split_options,
    with_options,
)
from .sketch import POISSON_STREAM, DeviceStreams

logger = logging.getLogger(__name__)

#: Opacus's engine, as ``opacus.privacy_engine`` defines it
OpacusPrivacyEngine = opacus.privacy_engine.PrivacyEngine


def _with_opacus_defaults(method: Callable, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """``kwargs`` completed with the defaults of Opacus's ``method``, read from its
    signature: what Opacus will use, without copying its defaults."""
    defaults = {
        name: p.default for name, p in inspect.signature(method).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    return {**defaults, **kwargs}


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


def per_rank_normaliser(batch_size: int, distributed: bool) -> float:
    """The public normaliser (the expected logical batch size, summed over ranks) as one
    rank's DP optimizer takes it: Opacus's DDP optimizers average the ranks' sums, so each
    rank divides by its share ``batch_size / world_size``."""
    return batch_size / torch.distributed.get_world_size() if distributed else batch_size


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


class PrivacyEngine(OpacusPrivacyEngine):
    """Opacus's :class:`~opacus.privacy_engine.PrivacyEngine` with randomized clipping
    (``make_private(..., clipping="randomized")``), the ``rc_prv`` accountant, spectral
    denoising (``denoise="spectral"``) and checkpoints without secrets.

    ``import opacus_rc`` makes ``opacus.PrivacyEngine`` this class. Every clipping mode
    other than ``"randomized"`` runs Opacus's code unchanged.

    Args:
        accountant: as in Opacus, plus ``"rc_prv"`` (required by
            ``clipping="randomized"``: it accounts for the random sensitivity of
            estimated norms).
        secure_mode: as in Opacus. With ``accountant="rc_prv"`` and without torchcsprng
            installed, the engine serves ``clipping="randomized"`` from
            :mod:`opacus_rc.csprng` (Poisson masks, sketches and noise); other clipping
            modes then raise Opacus's ImportError at ``make_private``.
    """

    def __init__(self, *, accountant: str = "prv", secure_mode: bool = False) -> None:
        self._torchcsprng_error: Optional[ImportError] = None
        try:
            super().__init__(accountant=accountant, secure_mode=secure_mode)
        except ImportError as error:  # Opacus's secure mode needs torchcsprng
            if not (secure_mode and accountant in RC_ACCOUNTANTS):
                raise
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Secure RNG turned off")
                super().__init__(accountant=accountant, secure_mode=False)
            self.secure_mode, self.secure_rng = True, None
            self._torchcsprng_error = error  # raised by any other clipping mode
            logger.info("secure_mode without torchcsprng: clipping='randomized' uses opacus_rc.csprng")

    # --- the public entry points --------------------------------------------------------

    @with_options
    def make_private(self, *, clipping: str = "flat", **kwargs: Any):
        """Opacus's ``make_private`` (module, optimizer, data_loader, noise_multiplier,
        max_grad_norm, criterion, grad_sample_mode, poisson_sampling, ... as there), plus
        ``clipping="randomized"`` and the plugin's options.

        A plugin option at its default is the same as not giving it; the options marked
        *randomized* are refused (ValueError) with any other clipping mode.

        Args:
            clipping: Opacus's modes, or ``"randomized"``: per-sample norms of linear layers
                estimated with sketches (needs ``PrivacyEngine(accountant="rc_prv")``;
                ``grad_sample_mode`` ``"bookkeeping"`` (one backward pass, a plain loss;
                Opacus's default ``"hooks"`` is its alias, see ``bookkeeping``), ``"ghost"``
                (two passes) or ``"ghost_fsdp"``).
            {options}
            **kwargs: Opacus's ``make_private`` arguments.

        Returns:
            As Opacus: ``(module, optimizer, data_loader)``, with the criterion before the
            loader for ``grad_sample_mode="ghost"``.

        Raises:
            ValueError: an invalid option, named with its accepted values.
        """
        plugin, kwargs = split_options(kwargs)
        arguments = _with_opacus_defaults(OpacusPrivacyEngine.make_private, kwargs)
        options = Options.parse(self, clipping, plugin, arguments)
        return self._make_private(options, arguments, kwargs)

    @with_options
    def make_private_with_epsilon(
        self, *, target_epsilon: float, target_delta: float, epochs: int, clipping: str = "flat", **kwargs: Any
    ):
        """Opacus's ``make_private_with_epsilon``, with the options of :meth:`make_private`.

        With ``clipping="randomized"`` the noise multiplier is calibrated with the
        ``rc_prv`` accountant for the requested sketch and the public sample rate
        (``sample_rate=``, else ``1 / len(data_loader)``).

        Args:
            target_epsilon, target_delta, epochs: as in Opacus.
            clipping, {option_names}: as in :meth:`make_private`.
            **kwargs: Opacus's ``make_private_with_epsilon`` arguments.
        """
        plugin, kwargs = split_options(kwargs)
        call = {**kwargs, "target_epsilon": target_epsilon, "target_delta": target_delta, "epochs": epochs}
        arguments = _with_opacus_defaults(OpacusPrivacyEngine.make_private_with_epsilon, call)
        options = Options.parse(self, clipping, plugin, arguments)
        if not options.randomized:
            call["clipping"] = clipping
            return self._run_opacus(OpacusPrivacyEngine.make_private_with_epsilon, options, arguments, call)
        # Copied from Opacus's make_private_with_epsilon, which calibrates for its own
        # accountants at 1 / len(loader): rc_prv needs the sketch and the public rate.
        if len(self.accountant) > 0:
            warnings.warn(
                "You're calling make_private_with_epsilon with non-zero privacy budget "
                "already spent. Returned noise_multiplier assumes zero starting point, "
                "so your overall privacy budget will be higher."
            )
        noise_multiplier = get_noise_multiplier_rc(
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            sample_rate=options.sampling.sample_rate,
            epochs=epochs,
            sketch_config=options.sketch,
        )
        logger.info("rc_prv calibrated noise_multiplier=%.4f for %s", noise_multiplier, options.sketch)
        kwargs = {**kwargs, "noise_multiplier": noise_multiplier}
        return self._make_private(options, {**arguments, **kwargs}, kwargs)

    def save_checkpoint(self, *, include_rng_state: bool = False, **kwargs: Any) -> None:
        """Opacus's ``save_checkpoint``; no generator state is stored unless
        ``include_rng_state=True`` (then the sketch, noise and Poisson generators' states:
        such a file is as secret as the training data; :mod:`opacus_rc.checkpoint`)."""
        return super().save_checkpoint(**checkpoint.with_rng_state(self, include_rng_state, kwargs))

    def load_checkpoint(self, **kwargs: Any) -> Dict[str, Any]:
        """Opacus's ``load_checkpoint``; restores the generators' states if the file has
        them (saved with ``include_rng_state=True``)."""
        return checkpoint.restore_rng_state(self, super().load_checkpoint(**kwargs), kwargs)

    # --- one make_private call ----------------------------------------------------------

    def _make_private(self, options: Options, arguments: Dict[str, Any], kwargs: Dict[str, Any]):
        """Opacus's make_private(**kwargs) with ``options``; ``arguments``: ``kwargs`` with
        Opacus's defaults."""
        call = {**kwargs, "clipping": options.clipping}
        if options.randomized:
            call["grad_sample_mode"] = options.grad_sample_mode
            call.update(options.optimizer_kwargs())  # Opacus passes them to the optimizer
        return self._run_opacus(OpacusPrivacyEngine.make_private, options, arguments, call)

    def _run_opacus(self, method: Callable, options: Options, arguments: Dict[str, Any], call: Dict[str, Any]):
        """Opacus's ``method(**call)`` (its ``make_private`` or ``make_private_with_epsilon``)
        run as :class:`MakePrivateCall` of this engine and ``options``; its outputs completed
        for the randomized path and the denoiser."""
        if not options.randomized:
            self._require_torchcsprng(options.clipping)
        out = method(MakePrivateCall(self, options), **call)
        if options.randomized:
            out = self._randomized_outputs(out, options, arguments)
        return self._denoised(out, options, arguments["module"])

    def _randomized_outputs(self, out, options: Options, arguments: Dict[str, Any]):
        """Opacus's outputs of a randomized call, charged at the public rate and in the
        form the script expects (the form's ``outputs``, :mod:`opacus_rc.forms`)."""
        sampling: PublicSampling = options.sampling
        out[0].follow_steps(out[1])  # fresh sketches after every step the optimizer takes
        # Opacus charged 1 / len(its DPDataLoader); charge the public rate instead.
        out[1].attach_step_hook(self.accountant.get_optimizer_hook_fn(sample_rate=sampling.sample_rate))
        logger.info(
            "randomized clipping: public normaliser %d, sample rate %.6g", sampling.batch_size,
            sampling.sample_rate,
        )
        return FORMS[options.runs].outputs(out, arguments)

    @staticmethod
    def _denoised(out, options: Options, module: nn.Module):
        """``out`` with the spectral denoiser attached to its optimizer (``denoise=``)."""
        if options.denoise is not None:
            from .denoise import attach_spectral_denoiser

            attach_spectral_denoiser(out[1], denoised_weights(module), **options.denoise_kwargs)
        return out

    def _require_torchcsprng(self, clipping: str) -> None:
        """Opacus's secure-mode ImportError (kept from ``__init__``), for any clipping mode
        but ``"randomized"`` when torchcsprng is missing."""
        if self._torchcsprng_error is not None:
            raise ImportError(
                f"{self._torchcsprng_error} (clipping={clipping!r} uses Opacus's torchcsprng "
                "generator; without it, secure_mode serves clipping='randomized' only, from "
                "opacus_rc.csprng)"
            ) from self._torchcsprng_error

    # --- Opacus's make_private steps, randomized path (called by MakePrivateCall) -------

    def _randomized_model(self, options: Options, module: nn.Module, **kwargs: Any):
        """The form's grad-sample module (:data:`opacus_rc.forms.FORMS`; its hooks form for
        ``wrap_model=False``). Opacus builds its own through ``get_gsm_class``, which has
        no registry."""
        self.validate(module=module, optimizer=None, data_loader=None)
        if isinstance(module, AbstractGradSampleModule):
            raise ValueError(
                "clipping='randomized' needs a plain nn.Module; got an already wrapped "
                f"{type(module).__name__}"
            )
        check_fsdp_mode(module, kwargs["grad_sample_mode"])  # FSDP2: ghost_fsdp only
        return FORMS[options.runs].build_module(
            module,
            kwargs["wrap_model"],
            kwargs["max_grad_norm"],
            batch_first=kwargs["batch_first"],
            loss_reduction=kwargs["loss_reduction"],
            sketch_config=options.sketch,
            sketch_seed=options.sketch_seed,
            secure_mode=self.secure_mode,
        )

    def _randomized_optimizer(self, options: Options, *, optimizer, noise_generator=None, **kwargs: Any) -> DPOptimizer:
        """The randomized optimizer, averaging by the public normaliser."""
        distributed = kwargs.pop("distributed", False)
        # Opacus passes int(len(dataset) / len(loader)), dataset-dependent, divided per
        # rank; the public normaliser is divided as Opacus divides its own.
        kwargs["expected_batch_size"] = per_rank_normaliser(options.sampling.batch_size, distributed)
        kwargs.pop("grad_sample_mode")
        cls = FORMS[options.runs].optimizer_class(distributed)
        kwargs.pop("clipping")
        # Copied from Opacus's _prepare_optimizer, whose get_optimizer_class has no registry.
        if isinstance(optimizer, DPOptimizer):
            optimizer = optimizer.original_optimizer
        generator = self.secure_rng if self.secure_mode else noise_generator
        return cls(optimizer=optimizer, generator=generator, secure_mode=self.secure_mode, **kwargs)

    def _randomized_data_loader(
        self, options: Options, data_loader, *, poisson_sampling: bool, distributed: bool, **kwargs: Any
    ):
        """The Poisson loader at the public rate with its own generator
        (:func:`poisson_generator`), or in secure mode with the CSPRNG's masks; with
        ``poisson_sampling=False`` the loader as given (Opacus)."""
        if not poisson_sampling and self.secure_rng is None and self.secure_mode:
            raise ValueError(
                "poisson_sampling=False is invalid with secure_mode=True without "
                "torchcsprng: there is no secure generator to shuffle with; accepted "
                "values: poisson_sampling=True (the sampling rc_prv accounts for)"
            )
        if not poisson_sampling:
            return self._prepare_data_loader(
                data_loader, poisson_sampling=poisson_sampling, distributed=distributed, **kwargs
            )
        if isinstance(data_loader.dataset, IterableDataset):
            raise ValueError("Uniform sampling is not supported for IterableDataset")
        self._check_dataset(data_loader)
        settings = dict(
            sample_rate=options.sampling.sample_rate,
            distributed=distributed,
            batch_first=kwargs.get("batch_first", True),
            rand_on_empty=kwargs.get("rand_on_empty", False),
        )
        if self.secure_mode:  # CSPRNG Poisson sampler, no torchcsprng
            return SecureDPDataLoader.from_data_loader(data_loader, **settings)
        generator = poisson_generator(data_loader, options.seed, distributed)
        setattr(self, checkpoint.POISSON_GENERATOR_ATTR, generator)  # include_rng_state
        # Opacus's DPDataLoader.from_data_loader, at the public rate and with our generator
        return DPDataLoader(
            dataset=data_loader.dataset, **loader_settings(data_loader), generator=generator, **settings
        )

    def _check_dataset(self, data_loader) -> None:
        """Opacus's one-dataset-per-engine check. Copied: Opacus runs it only inside its
        ``_prepare_data_loader``, which builds the loader at its own rate and generator."""
        if self.dataset is None:
            self.dataset = data_loader.dataset
        elif self.dataset != data_loader.dataset:
            warnings.warn(
                f"PrivacyEngine detected new dataset object. Was: {self.dataset}, got: "
                f"{data_loader.dataset}. Privacy accounting works per dataset, please "
                f"initialize new PrivacyEngine if you're using different dataset."
            )

    def _randomized_criterion(self, options: Options, *, module, optimizer, criterion, **kwargs: Any):
        """The randomized two-pass criterion, linked to the optimizer."""
        return DPLossRandomizedClipping(module, optimizer, criterion, kwargs.get("loss_reduction", "mean"))


class MakePrivateCall:
    """One call of Opacus's ``make_private`` (or ``make_private_with_epsilon``) on an
    engine with the call's parsed :class:`~opacus_rc.options.Options`: how the options
    reach Opacus's ``_prepare_*`` steps.

    Opacus's ``make_private`` calls ``self._prepare_model(...)``,
    ``self._prepare_data_loader(...)``, ``self._prepare_optimizer(...)`` and
    ``self._prepare_criterion(...)`` with fixed arguments and no room for the plugin's
    (``make_private_with_epsilon`` calls ``self.make_private(...)``). So
    :meth:`PrivacyEngine._run_opacus` runs Opacus's method with this short-lived object
    as ``self``, built for the one call and dropped after it: its ``_prepare_*`` steps
    hand ``options`` explicitly to the engine's randomized steps (``_randomized_model``,
    ...) when the call is randomized, and to Opacus's own otherwise; its
    ``make_private`` (Opacus's ``make_private_with_epsilon`` calling back) is Opacus's
    own, on this object, so the call's keywords are parsed once; every other attribute
    read or written is the engine's (``accountant``, ``secure_mode``, ``dataset``, ...).
    The engine stores no options, so there is no state to reset and no re-entry to
    guard: a nested or concurrent call has its own object.
    """

    __slots__ = ("engine", "options")

    def __init__(self, engine: PrivacyEngine, options: Options) -> None:
        object.__setattr__(self, "engine", engine)
        object.__setattr__(self, "options", options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.engine, name, value)

    def make_private(self, **kwargs: Any):
        return OpacusPrivacyEngine.make_private(self, **kwargs)

    def _prepare_model(self, module: nn.Module, **kwargs: Any):
        if self.options.randomized:
            return self.engine._randomized_model(self.options, module, **kwargs)
        return self.engine._prepare_model(module, **kwargs)

    def _prepare_data_loader(self, data_loader, **kwargs: Any):
        if self.options.randomized:
            return self.engine._randomized_data_loader(self.options, data_loader, **kwargs)
        return self.engine._prepare_data_loader(data_loader, **kwargs)

    def _prepare_optimizer(self, **kwargs: Any) -> DPOptimizer:
        if self.options.randomized:
            return self.engine._randomized_optimizer(self.options, **kwargs)
        return self.engine._prepare_optimizer(**kwargs)

    def _prepare_criterion(self, **kwargs: Any):
        if self.options.randomized:
            return self.engine._randomized_criterion(self.options, **kwargs)
        return self.engine._prepare_criterion(**kwargs)


# --- install: the patches of Opacus ----------------------------------------------------


#: Opacus's own ``__init__`` of its engine and ``__iter__`` of BatchMemoryManager's sampler
_OPACUS_INIT = OpacusPrivacyEngine.__init__
_OPACUS_SPLITTING_ITER = BatchSplittingSampler.__iter__


@functools.wraps(_OPACUS_INIT)
def _init_plugin_engine(self, *args: Any, **kwargs: Any) -> None:
    """``__init__`` of Opacus's engine: ``opacus.privacy_engine.PrivacyEngine(...)`` builds
    this module's :class:`PrivacyEngine` (the new object becomes one before it is
    initialised); subclasses of Opacus's, and the plugin's own ``super().__init__()``,
    run Opacus's ``__init__``. (Not ``__new__``: CPython cannot give a class its
    original ``__new__`` back once it was replaced, so :func:`uninstall` could not undo it.)"""
    if type(self) is OpacusPrivacyEngine:
        self.__class__ = PrivacyEngine
        PrivacyEngine.__init__(self, *args, **kwargs)
    else:
        _OPACUS_INIT(self, *args, **kwargs)


class _SameDrawSignals:
    """The optimizer as a :class:`BatchSplittingSampler` signals it: every skipped step it
    signals cuts one Poisson draw into physical batches (``same_draw=True``)."""

    def __init__(self, optimizer: RandomizedClippingMixin) -> None:
        self.optimizer = optimizer

    def signal_skip_step(self, do_skip: bool = True) -> None:
        self.optimizer.signal_skip_step(do_skip=do_skip, same_draw=do_skip)


def _splitting_iter(self: BatchSplittingSampler):
    """``BatchSplittingSampler.__iter__`` (BatchMemoryManager's physical batches): Opacus's
    own, on a copy of the sampler whose optimizer, a plugin one, hears its skipped steps
    as continuations of the same Poisson draw (charged as one micro-batch, see
    :meth:`~opacus_rc.optimizer.RandomizedClippingMixin.signal_skip_step`). Over a loader
    that is split already (the per-example form's), its own batches and signals, unsplit
    again: two splitters would each signal the end of a draw. Opacus's optimizers hear
    what they always did."""
    if not isinstance(self.optimizer, RandomizedClippingMixin):
        return _OPACUS_SPLITTING_ITER(self)
    if isinstance(self.sampler, BatchSplittingSampler):  # over a loader that splits already
        if self.sampler.max_batch_size > self.max_batch_size:
            raise ValueError(
                f"BatchMemoryManager(max_physical_batch_size={self.max_batch_size}) over a loader "
                f"already split into physical batches of up to {self.sampler.max_batch_size}: "
                "give the unsplit Poisson loader, or a max_physical_batch_size of at least "
                f"{self.sampler.max_batch_size}"
            )
        return iter(self.sampler)  # its batches fit; it signals the draws itself
    splitter = copy.copy(self)
    splitter.optimizer = _SameDrawSignals(self.optimizer)
    return _OPACUS_SPLITTING_ITER(splitter)


#: ``(owner, name, value)``: every name of Opacus that :func:`install` replaces, and why
#: Opacus offers no extension point for it.
PATCHES = (
    # Opacus has no engine registry: the name is how scripts reach the engine.
    (opacus, "PrivacyEngine", PrivacyEngine),
    # The same name, imported from its defining module.
    (opacus.privacy_engine, "PrivacyEngine", PrivacyEngine),
    # A name bound before `import opacus_rc` (isort's order: `from opacus import
    # PrivacyEngine` above it) still builds the plugin's engine.
    (OpacusPrivacyEngine, "__init__", _init_plugin_engine),
    # BatchMemoryManager's sampler signals its optimizer signal_skip_step(do_skip=True),
    # with no way to say that its physical batches are one Poisson draw: it says so to the
    # plugin's optimizers (same_draw=True), which charge them as one micro-batch.
    (BatchSplittingSampler, "__iter__", _splitting_iter),
)

#: what each of :data:`PATCHES` replaced, as Opacus defines it (read before install)
ORIGINALS = tuple(vars(owner)[name] for owner, name, _ in PATCHES)


def install() -> None:
    """Make ``opacus.PrivacyEngine`` the plugin's engine and register the ``rc_prv``
    accountant with Opacus (idempotent)."""
    for owner, name, value in PATCHES:
        setattr(owner, name, value)
    register_accountant("rc_prv", RCPRVAccountant, force=True)


def uninstall() -> None:
    """Undo :func:`install`: every name of :data:`PATCHES` is Opacus's again
    (:data:`ORIGINALS`; the accountant stays registered; :class:`PrivacyEngine` itself
    keeps working). :func:`install` makes them the plugin's again."""
    for (owner, name, _), original in zip(PATCHES, ORIGINALS):
        setattr(owner, name, original)
