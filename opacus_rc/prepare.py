"""Opacus's ``make_private`` steps for one call: :class:`MakePrivateCall`. For a randomized
call they build the form's module and optimizer (:data:`opacus_rc.forms.FORMS`), the Poisson
loader at the public rate with its own generator (never torch's global one) and the
two-pass criterion; Opacus's ``_prepare_*`` steps have no registry of clipping modes.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterator, Optional

import numpy as np
import opacus.privacy_engine
import torch
from opacus.data_loader import DPDataLoader
from opacus.grad_sample import AbstractGradSampleModule
from opacus.optimizers import DPOptimizer
from opacus.utils.uniform_sampler import DistributedUniformWithReplacementSampler
from torch import nn
from torch.utils.data import IterableDataset

from . import checkpoint
from .csprng import SecureDPDataLoader, default_generator, init_poisson_loader, loader_settings
from .forms import FORMS
from .forms.fsdp import check_fsdp_mode
from .forms.two_pass import DPLossRandomizedClipping
from .forward_changes import check_no_max_norm
from .options import Options, per_rank_normaliser
from .sketch import POISSON_STREAM, DeviceStreams
from .draws import CyclicPoissonLoader, UserDataLoader

#: Opacus's engine, as ``opacus.privacy_engine`` defines it
OpacusPrivacyEngine = opacus.privacy_engine.PrivacyEngine


def poisson_generator(data_loader, seed: Optional[int], distributed: bool) -> torch.Generator:
    """The generator of the Poisson masks; never torch's global generator.

    The loader's own ``generator`` (reproducible; Opacus's way) as it is in one process;
    under DDP a child of it per rank (root its ``initial_seed()``), so that ranks seeded
    alike still draw independent masks. Else the :data:`~opacus_rc.sketch.POISSON_STREAM`
    of ``seed`` (``None``: 128 bits from ``os.urandom``), rank folded in. The loader's
    generator and its child are :func:`~opacus_rc.checkpoint.reproducible`: a resume without
    their state is refused (it would replay the draws).
    """
    user = getattr(data_loader, "generator", None)
    if user is not None and not distributed:
        return checkpoint.reproducible(user)
    root = np.random.SeedSequence(user.initial_seed() if user is not None else seed)
    generator = DeviceStreams(root, POISSON_STREAM, per_rank=True).generator("cpu")
    return generator if user is None else checkpoint.reproducible(generator)


class EveryDrawDistributedSampler(DistributedUniformWithReplacementSampler):
    """Opacus's distributed Poisson sampler (this rank's share of a shuffled dataset) that
    yields every draw, an empty one too, as its one-process sampler does: Opacus's skips a
    draw empty on this rank, which unpairs the ranks' steps (docs/development.md)."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        if self.shuffle:
            order = torch.Generator().manual_seed(self.shuffle_seed + self.epoch)
            indices = torch.randperm(self.total_size, generator=order)
        else:
            indices = torch.arange(self.total_size)
        indices = indices[self.rank:self.total_size:self.num_replicas]
        for _ in range(self.num_batches):
            mask = torch.rand(self.num_samples, generator=self.generator) < self.sample_rate
            yield indices[mask.nonzero(as_tuple=False).reshape(-1)]


class DistributedDPDataLoader(DPDataLoader):
    """Opacus's ``DPDataLoader(distributed=True)`` over :class:`EveryDrawDistributedSampler`:
    every rank yields every draw of the epoch (an empty one as an empty batch), so the
    ranks' steps stay paired."""

    def __init__(self, dataset: Any, *, sample_rate: float, generator: Optional[torch.Generator] = None,
                 **kwargs: Any) -> None:
        self.sample_rate = sample_rate
        self.distributed = True
        sampler = EveryDrawDistributedSampler(total_size=len(dataset), sample_rate=sample_rate, generator=generator)
        init_poisson_loader(self, dataset, sampler, **kwargs)


def _prepare_step(name: str) -> Callable:
    """:class:`MakePrivateCall`'s ``_prepare_<name>``: its ``_randomized_<name>`` for a
    randomized call, else the engine's ``_prepare_<name>`` (Opacus's)."""

    def prepare(self, *args: Any, **kwargs: Any) -> Any:
        if self.options.randomized:
            return getattr(self, f"_randomized_{name}")(*args, **kwargs)
        return getattr(self.engine, f"_prepare_{name}")(*args, **kwargs)

    return prepare


class MakePrivateCall:
    """One call of Opacus's ``make_private`` (or ``make_private_with_epsilon``) on an
    engine with the call's parsed :class:`~opacus_rc.options.Options`, passed to Opacus's
    method as ``self`` (docs/development.md): its ``_prepare_*`` steps run the randomized
    steps below when the call is randomized, else the engine's (Opacus's); its
    ``make_private`` is Opacus's, on this object (the keywords are parsed once); every
    other attribute read or written is the engine's. The engine stores no options: a
    nested or concurrent call has its own object.
    """

    __slots__ = ("engine", "options")

    def __init__(self, engine: Any, options: Options) -> None:
        object.__setattr__(self, "engine", engine)
        object.__setattr__(self, "options", options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.engine, name, value)

    def make_private(self, **kwargs: Any):
        return OpacusPrivacyEngine.make_private(self, **kwargs)

    _prepare_model = _prepare_step("model")
    _prepare_data_loader = _prepare_step("data_loader")
    _prepare_optimizer = _prepare_step("optimizer")
    _prepare_criterion = _prepare_step("criterion")

    # --- the randomized steps ---------------------------------------------------------

    def _randomized_model(self, module: nn.Module, **kwargs: Any):
        """The form's grad-sample module (:data:`opacus_rc.forms.FORMS`; its hooks form for
        ``wrap_model=False``). Opacus builds its own through ``get_gsm_class``, which has
        no registry."""
        self.validate(module=module, optimizer=None, data_loader=None)
        check_no_max_norm(module)  # its forward changes the embedding from the data
        if isinstance(module, AbstractGradSampleModule):
            raise ValueError(
                f"clipping='randomized' needs a plain nn.Module; got an already wrapped {type(module).__name__}"
            )
        check_fsdp_mode(module, kwargs["grad_sample_mode"])  # FSDP2: ghost_fsdp only
        return FORMS[self.options.runs].build_module(
            module,
            kwargs["wrap_model"],
            kwargs["max_grad_norm"],
            batch_first=kwargs["batch_first"],
            loss_reduction=kwargs["loss_reduction"],
            sketch_config=self.options.sketch,
            sketch_seed=self.options.sketch_seed,
            secure_mode=self.secure_mode,
        )

    def _randomized_optimizer(self, *, optimizer, noise_generator=None, **kwargs: Any) -> DPOptimizer:
        """The randomized optimizer, averaging by the public normaliser."""
        distributed = kwargs.pop("distributed", False)
        # Opacus passes int(len(dataset) / len(loader)), dataset-dependent, divided per
        # rank; the public normaliser is divided as Opacus divides its own.
        kwargs["expected_batch_size"] = per_rank_normaliser(self.options.sampling.batch_size, distributed)
        kwargs.pop("grad_sample_mode")
        cls = FORMS[self.options.runs].optimizer_class(distributed)
        kwargs.pop("clipping")
        # Copied from Opacus's _prepare_optimizer, whose get_optimizer_class has no registry.
        if isinstance(optimizer, DPOptimizer):
            optimizer = optimizer.original_optimizer
        generator = self.secure_rng if self.secure_mode else noise_generator
        return cls(optimizer=optimizer, generator=generator, secure_mode=self.secure_mode, **kwargs)

    def _randomized_data_loader(self, data_loader, *, poisson_sampling: bool, distributed: bool, **kwargs: Any):
        """The Poisson loader at the public rate with its own generator
        (:func:`poisson_generator`), or in secure mode with the CSPRNG's masks; with
        ``poisson_sampling=False`` the loader as given (Opacus)."""
        if not poisson_sampling:
            if self.secure_rng is None and self.secure_mode:
                raise ValueError(
                    "poisson_sampling=False is invalid with secure_mode=True without "
                    "torchcsprng: there is no secure generator to shuffle with; accepted "
                    "values: poisson_sampling=True (the sampling rc_prv accounts for)"
                )
            return self.engine._prepare_data_loader(
                data_loader, poisson_sampling=poisson_sampling, distributed=distributed, **kwargs
            )
        if isinstance(data_loader.dataset, IterableDataset):
            raise ValueError("Uniform sampling is not supported for IterableDataset")
        self._check_dataset(data_loader)
        settings = dict(
            sample_rate=self.options.sampling.sample_rate, distributed=distributed,
            batch_first=kwargs.get("batch_first", True), rand_on_empty=kwargs.get("rand_on_empty", False),
        )
        parts = self.options.noise.parts  # the noise mechanism's sampler: cyclic Poisson over this many parts
        if self.secure_mode and self.options.users is None and parts is None:
            # CSPRNG Poisson sampler, no torchcsprng
            return SecureDPDataLoader.from_data_loader(data_loader, **settings)
        if self.secure_mode:  # the user-level or cyclic loader's masks from the CSPRNG
            generator = default_generator()
        else:
            generator = poisson_generator(data_loader, self.options.seed, distributed)
            setattr(self, checkpoint.POISSON_GENERATOR_ATTR, generator)  # include_rng_state
        # (distributed: the ranks' user indexes were checked alike when the call was parsed,
        # opacus_rc.integration.agreed_call)
        if parts is not None:  # cyclic Poisson over parts of the units (e.g. noise="banded")
            loader = CyclicPoissonLoader(
                data_loader.dataset, index=self.options.users, bands=parts,
                sample_rate=self.options.charged_rate, generator=generator, distributed=distributed,
                steps=self.options.epoch_draws(data_loader, True), batch_first=settings["batch_first"],
                rand_on_empty=settings["rand_on_empty"], **loader_settings(data_loader),
            )
            setattr(self, checkpoint.CYCLIC_SAMPLER_ATTR, loader.batch_sampler.poisson)  # include_rng_state
            return loader
        if self.options.users is not None:  # privacy_unit="user": Poisson over (this rank's share of) users
            return UserDataLoader(
                data_loader.dataset, index=self.options.users, generator=generator, **settings,
                **loader_settings(data_loader),
            )
        # Opacus's DPDataLoader.from_data_loader, at the public rate and with our generator;
        # distributed: every draw, an empty one too (EveryDrawDistributedSampler)
        loader = DistributedDPDataLoader if settings.pop("distributed") else DPDataLoader
        return loader(dataset=data_loader.dataset, **loader_settings(data_loader), generator=generator, **settings)

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

    def _randomized_criterion(self, *, module, optimizer, criterion, **kwargs: Any):
        """The randomized two-pass criterion, linked to the optimizer."""
        return DPLossRandomizedClipping(module, optimizer, criterion, kwargs.get("loss_reduction", "mean"))


__all__ = [
    "DistributedDPDataLoader", "EveryDrawDistributedSampler", "MakePrivateCall", "OpacusPrivacyEngine",
    "poisson_generator",
]
