"""The one place that extends Opacus: :class:`PrivacyEngine`, a subclass of Opacus's.

``make_private`` parses the plugin's options (:data:`opacus_rc.options.OPTIONS`) once into
a frozen :class:`~opacus_rc.options.Options` and runs Opacus's own ``make_private`` on a
:class:`~opacus_rc.prepare.MakePrivateCall`, whose ``_prepare_*`` steps build the
randomized module, optimizer, criterion and Poisson loader; every other clipping mode runs
Opacus unchanged. A randomized run's noise and Poisson masks never come from torch's
global generator (docs/development.md). ``import opacus_rc`` makes ``from opacus import
PrivacyEngine`` give this class (:mod:`opacus_rc.registration`).
"""

from __future__ import annotations

import inspect
import logging
import math
import warnings
from typing import Any, Callable, Dict, List, Optional

from opacus.accountants import registry as accountant_registry
from torch import nn

from . import checkpoint
from .accounting.accountant import RCPRVAccountant, get_noise_multiplier_rc
from .accounting.group import check_group_size, group_epsilon
from .draws import DrawLoader
from .forms import FORMS
from .options import (  # noqa: F401  (loader_batch_size, loader_rate, public_sampling: public here too)
    RC_ACCOUNTANTS, RC_CALIBRATION_KEYWORDS, Options, PublicSampling, check_keywords, keywords, loader_batch_size,
    loader_rate, public_sampling, split_options, with_options,
)
from .forms.fsdp import is_fsdp_module
from .prepare import MakePrivateCall, OpacusPrivacyEngine
from .ranks import agreed, world_size
from .units import check_same_on_ranks
from .values import EXAMPLE_UNIT, RANDOMIZED, check_choice, did_you_mean

logger = logging.getLogger(__name__)


def _with_opacus_defaults(method: Callable, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """``kwargs`` completed with the defaults of Opacus's ``method``, read from its
    signature: what Opacus will use, without copying its defaults."""
    defaults = {
        name: p.default for name, p in inspect.signature(method).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    return {**defaults, **kwargs}


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


def distributed_module(module: Any) -> bool:
    """Opacus's test of a distributed ``make_private`` call: a DPDDP, DDP or FSDP2 module."""
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
    from torch.nn.parallel import DistributedDataParallel as DDP

    return isinstance(module, (DPDDP, DDP)) or is_fsdp_module(module)


def agreed_call(clipping: Any, kwargs: Dict[str, Any], parsed: List[Options]) -> Any:
    """The block that parses a randomized ``make_private`` call on a distributed module, ended by
    its rank check (:func:`opacus_rc.ranks.agreed`): every rank reaches
    :func:`~opacus_rc.units.check_same_on_ranks` with the user index it parsed (``parsed[0]``),
    or with the failure flag when its options were refused, so the other ranks refuse too instead
    of waiting in the check (or in FSDP2's broadcast of the sketch seed after it)."""
    active = clipping == RANDOMIZED and distributed_module(kwargs.get("module")) and world_size() > 1
    return agreed(lambda failed: check_same_on_ranks(None if failed else parsed[0].users, failed), active)


class PrivacyEngine(OpacusPrivacyEngine):
    """Opacus's :class:`~opacus.privacy_engine.PrivacyEngine` with randomized clipping
    (``make_private(..., clipping="randomized")``), the ``rc_prv`` accountant, spectral
    denoising (``denoise="spectral"``) and checkpoints without secrets.

    ``import opacus_rc`` makes ``opacus.PrivacyEngine`` this class. Every clipping mode
    other than ``"randomized"`` runs Opacus's code unchanged.

    Args:
        accountant: as in Opacus, plus ``"rc_prv"`` (required by
            ``clipping="randomized"``: it accounts for the random sensitivity of
            estimated norms); another name is a ValueError naming ``accountant``, the
            nearest registered one and all of them.
        secure_mode: as in Opacus. With ``accountant="rc_prv"`` and without torchcsprng
            installed, the engine serves ``clipping="randomized"`` from
            :mod:`opacus_rc.csprng` (Poisson masks, sketches and noise); other clipping
            modes then raise Opacus's ImportError at ``make_private``.
    """

    def __init__(self, *, accountant: str = "prv", secure_mode: bool = False) -> None:
        self._torchcsprng_error: Optional[ImportError] = None
        #: what ``get_epsilon`` protects: ``"example"`` (a row), or ``"user"`` after a
        #: ``make_private(..., privacy_unit="user")`` call (:mod:`opacus_rc.units`)
        self.privacy_unit = EXAMPLE_UNIT
        self._unit_fixed = False  # a make_private call fixed privacy_unit (one engine, one unit)
        known = tuple(sorted(accountant_registry._ACCOUNTANTS))  # Opacus's registry, rc_prv included
        check_choice("accountant", accountant, known, did_you_mean(str(accountant), known))
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
            ValueError: an invalid option, named with its accepted values; a keyword that
                neither the plugin nor Opacus knows, named with the nearest accepted one.
        """
        parsed: List[Options] = []
        with agreed_call(clipping, kwargs, parsed):
            check_keywords("make_private", kwargs, clipping, keywords(OpacusPrivacyEngine.make_private))
            plugin, kwargs = split_options(kwargs)
            arguments = _with_opacus_defaults(OpacusPrivacyEngine.make_private, kwargs)
            parsed.append(Options.parse(self, clipping, plugin, arguments))
        return self._make_private(parsed[0], arguments, kwargs)

    @with_options
    def make_private_with_epsilon(
        self, *, target_epsilon: float, target_delta: float, epochs: int, clipping: str = "flat", **kwargs: Any
    ):
        """Opacus's ``make_private_with_epsilon``, with the options of :meth:`make_private`.

        With ``clipping="randomized"`` the noise multiplier is calibrated with the
        ``rc_prv`` accountant for the requested sketch and the public sample rate
        (``sample_rate=``, else ``1 / len(data_loader)``), for the steps the returned loader
        runs in ``epochs`` epochs: ``epochs x len(loader)`` (:meth:`Options.epoch_draws`).

        Args:
            target_epsilon, target_delta, epochs: as in Opacus.
            clipping, {option_names}: as in :meth:`make_private`.
            **kwargs: Opacus's ``make_private_with_epsilon`` arguments (those of its
                ``make_private`` and of its calibration included); with
                ``clipping="randomized"``, ``epsilon_tolerance`` and ``eps_error`` go to
                :func:`~opacus_rc.accounting.accountant.get_noise_multiplier_rc`.

        Raises:
            ValueError: as :meth:`make_private`.
        """
        opacus_keywords = keywords(OpacusPrivacyEngine.make_private_with_epsilon) | (
            keywords(OpacusPrivacyEngine.make_private) - {"noise_multiplier"}  # it calibrates sigma
        )
        parsed: List[Options] = []
        with agreed_call(clipping, kwargs, parsed):
            check_keywords("make_private_with_epsilon", kwargs, clipping, opacus_keywords, self.accountant)
            plugin, kwargs = split_options(kwargs)
            call = {**kwargs, "target_epsilon": target_epsilon, "target_delta": target_delta, "epochs": epochs}
            arguments = _with_opacus_defaults(OpacusPrivacyEngine.make_private_with_epsilon, call)
            parsed.append(Options.parse(self, clipping, plugin, arguments))
        options = parsed[0]
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
        calibration = {k: kwargs.pop(k) for k in RC_CALIBRATION_KEYWORDS if k in kwargs}
        # the steps the returned loader runs in `epochs` epochs (not epochs / q: int(1 / q) or
        # round(1 / q_u) draws per epoch, len(loader) without Poisson sampling)
        steps = math.ceil(epochs * options.epoch_draws(arguments["data_loader"], arguments["poisson_sampling"]))
        record = options.step_record()  # its sketch and noise mechanism's record
        noise_multiplier = get_noise_multiplier_rc(
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            sample_rate=options.charged_rate,
            steps=steps,
            sketch_config=options.sketch,
            bands=record.bands,
            column_norm=record.column_norm,
            **calibration,
        )
        logger.info("rc_prv calibrated noise_multiplier=%.4f for %d steps, %s", noise_multiplier, steps, record)
        kwargs = {**kwargs, "noise_multiplier": noise_multiplier}
        return self._make_private(options, {**arguments, **kwargs}, kwargs)

    def get_epsilon(self, delta: float) -> float:
        """Opacus's ``get_epsilon``: epsilon at ``delta`` for one unit of
        :attr:`privacy_unit` (a row; at ``privacy_unit="user"`` a user with all their rows),
        which the log line names."""
        epsilon = super().get_epsilon(delta)
        logger.info("epsilon %.4g at delta %g, per %s", epsilon, delta, self.privacy_unit)
        return epsilon

    def get_user_epsilon(self, delta: float, max_examples_per_user: int) -> float:
        """Epsilon at ``delta`` for a person who owns at most ``max_examples_per_user`` rows,
        after the steps of an example-level run (``get_epsilon`` protects one row).

        Each step is the mixture over how many of the person's rows the draw holds
        (``J ~ Bin(max_examples_per_user, q)``, shift ``J * C``), composed with the PRV
        accountant (:func:`~opacus_rc.accounting.group.group_epsilon`); ``k * epsilon`` is not
        a bound at the same delta. Works for any accountant with a history (Opacus's: exact clipping);
        with ``max_examples_per_user=1`` and ``rc_prv`` it is ``get_epsilon(delta)``.

        Raises:
            ValueError: ``max_examples_per_user`` not an integer >= 1; a user-level run
                (``privacy_unit="user"``: ``get_epsilon`` is already per user).
        """
        if self.privacy_unit != EXAMPLE_UNIT:
            raise ValueError(
                f"get_user_epsilon is for example-level runs; this engine's privacy_unit={self.privacy_unit!r}: "
                "its get_epsilon(delta) is already per user"
            )
        k = check_group_size(max_examples_per_user, "max_examples_per_user")
        bins = {"bin_ratio": self.accountant.bin_ratio} if isinstance(self.accountant, RCPRVAccountant) else {}
        return group_epsilon(self.accountant.history, delta, k, **bins)

    def save_checkpoint(self, *, include_rng_state: bool = False, **kwargs: Any) -> None:
        """Opacus's ``save_checkpoint``; no generator state is stored unless
        ``include_rng_state=True`` (then the sketch, noise and Poisson generators' states:
        such a file is as secret as the training data; :mod:`opacus_rc.checkpoint`)."""
        return super().save_checkpoint(**checkpoint.with_rng_state(self, include_rng_state, kwargs))

    def load_checkpoint(
        self,
        *,
        path: Any,
        module: nn.Module,
        optimizer: Optional[Any] = None,
        noise_scheduler: Optional[Any] = None,
        grad_clip_scheduler: Optional[Any] = None,
        module_load_dict_kwargs: Optional[Dict[str, Any]] = None,
        torch_load_kwargs: Optional[Dict[str, Any]] = None,
    ) -> Dict[str, Any]:
        """Opacus's ``load_checkpoint`` (same arguments); restores the generators' states if the
        file has them (saved with ``include_rng_state=True``). Every refusal is decided before
        anything is loaded: a refused load leaves the module, optimizer, accountant and generators
        as they were (:func:`opacus_rc.checkpoint.load_checked`). A checkpoint of a run that used
        ``seed=``, without the generators' states, loaded into a run with ``seed=`` is refused (it
        would replay the noise) unless ``make_private(..., accept_replayed_noise=True)``."""
        return checkpoint.load_checked(
            self, path=path, module=module, optimizer=optimizer, noise_scheduler=noise_scheduler,
            grad_clip_scheduler=grad_clip_scheduler, module_load_dict_kwargs=module_load_dict_kwargs,
            torch_load_kwargs=torch_load_kwargs,
        )

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
        for the randomized path and with the spectral denoiser (``denoise=``)."""
        if not options.randomized and self._torchcsprng_error is not None:
            # Opacus's secure-mode ImportError (kept from __init__) when torchcsprng is missing
            raise ImportError(
                f"{self._torchcsprng_error} (clipping={options.clipping!r} uses Opacus's torchcsprng "
                "generator; without it, secure_mode serves clipping='randomized' only, from "
                "opacus_rc.csprng)"
            ) from self._torchcsprng_error
        unit = options.privacy_unit
        if unit != self.privacy_unit and (self._unit_fixed or len(self.accountant) > 0):
            # one accountant, one unit (any clipping mode: their optimizers all charge this accountant)
            raise ValueError(
                f"privacy_unit={unit!r} on an engine whose earlier make_private call or steps are at "
                f"privacy_unit={self.privacy_unit!r}: epsilon of the two would mix units; use a new PrivacyEngine"
            )
        out = method(MakePrivateCall(self, options), **call)
        self.privacy_unit, self._unit_fixed = unit, True
        if options.randomized:
            out = self._randomized_outputs(out, options, arguments)
        if options.denoise is not None:
            from .denoise import attach_spectral_denoiser

            attach_spectral_denoiser(out[1], denoised_weights(arguments["module"]), **options.denoise_kwargs)
        return out

    def _randomized_outputs(self, out, options: Options, arguments: Dict[str, Any]):
        """Opacus's outputs of a randomized call, charged at the public rate and in the
        form the script expects (the form's ``outputs``, :mod:`opacus_rc.forms`)."""
        sampling: PublicSampling = options.sampling
        out[0].follow_steps(out[1])  # fresh sketches after every step the optimizer takes
        if isinstance(out[-1], DrawLoader):
            out[-1].follow(out[1])  # each batch, with its draw and units, delivered to the optimizer
        # Opacus charged 1 / len(its DPDataLoader); charge the public rate instead.
        out[1].attach_step_hook(self.accountant.get_optimizer_hook_fn(sample_rate=options.charged_rate))
        logger.info(
            "randomized clipping: public normaliser %d, sample rate %.6g", sampling.batch_size,
            sampling.sample_rate,
        )
        return FORMS[options.runs].outputs(out, arguments)

