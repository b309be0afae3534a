"""The plugin's ``make_private`` options, parsed once into one frozen :class:`Options`.

:meth:`opacus_rc.PrivacyEngine.make_private` (and ``make_private_with_epsilon``) take the
plugin's keywords next to Opacus's; :meth:`Options.parse` validates all of them in one
place, with error messages that name the parameter and its accepted values, and resolves
what the call runs (book-keeping or two passes, :mod:`opacus_rc.forms.bookkeeping`), its public
normaliser and sample rate (:func:`public_sampling`) and its seeds. The engine then reads
nothing else: every ``_prepare_*`` step of Opacus's ``make_private`` reads the one object.
"""

from __future__ import annotations

import inspect
import math
import numbers
import textwrap
import warnings
import dataclasses
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, Callable, Collection, Dict, FrozenSet, Iterable, Mapping, Optional, Tuple

import torch
from opacus.accountants.utils import get_noise_multiplier
from opacus.optimizers import AdaClipDPOptimizer, DPOptimizer
from torch.utils.data.distributed import DistributedSampler

from .accounting.accountant import StepRecord, get_noise_multiplier_rc
from .config import SketchConfig
from .denoise import DEFAULT_KAPPA
from .forms import FORMS, resolve_form
from .forms import BOOKKEEPING, BOOKKEEPING_WITH_CRITERION, OUTPUT_PASSES, TWO_PASS
from .noises import INDEPENDENT, NoiseSpec, noise_keywords, parse_noise
from .sketch import check_seed
from .units import (
    DEFAULT_MAX_EXAMPLES_PER_USER, UserIndex, check_max_examples_per_user, check_privacy_unit, user_epoch_draws,
)
from .values import (
    ADAPTIVE, BOOKKEEPING_MODE, DENOISERS, EXAMPLE_UNIT, FLAT, FSDP_MODE, GHOST, HOOKS, NONFINITE_MODES, PER_LAYER,
    INDEPENDENT_NOISE, RAISE, RANDOMIZED, RC_PRV, SKIP, SVD_FULL, USER_UNIT, check_choice,
    did_you_mean, positive_int,
)

#: every clipping mode make_private accepts: Opacus's three and the plugin's
CLIPPING_MODES = (FLAT, PER_LAYER, ADAPTIVE, RANDOMIZED)
RC_ACCOUNTANTS = (RC_PRV,)
RC_GRAD_SAMPLE_MODES = (BOOKKEEPING_MODE, GHOST, HOOKS, FSDP_MODE)


@dataclass(frozen=True)
class Option:
    """One keyword of the plugin's ``make_private``: its name, default, annotation (as
    shown by ``inspect.signature``) and the text of its ``Args`` entry."""

    name: str
    default: Any
    annotation: str
    doc: str

    def parameter(self) -> inspect.Parameter:
        """The keyword-only parameter of the public signatures."""
        return inspect.Parameter(
            self.name, inspect.Parameter.KEYWORD_ONLY, default=self.default, annotation=self.annotation
        )


_SKETCH = SketchConfig()  # the sketch defaults: SketchConfig's fields, the one place they are

#: The plugin's keywords of make_private and make_private_with_epsilon: the only place
#: they, their defaults and their documentation are spelled (both signatures and both
#: docstrings are built from it, see :func:`with_options`). A keyword at its
#: default is the same as not giving it.
OPTIONS: Tuple[Option, ...] = (
    Option("estimator", _SKETCH.estimator, "str", (
        "*randomized*. ``\"hutchinson\"`` or ``\"hutchpp\"`` (Hutch++ spends\n"
        "``sketch_size`` more vectors on an exact head, about 3x the products)."
    )),
    Option("sketch_size", _SKETCH.sketch_size, "int", (
        "*randomized*. k, the number of Gaussian N(0, 1/k) sketch vectors\n"
        "(for Hutch++: of the residual; the accountant uses this count)."
    )),
    Option("sketching", _SKETCH.sketching, "str", (
        "*randomized*. ``\"per_example\"`` (an independent sketch per example;\n"
        "hidden-Z accounting) or ``\"shared\"`` (one sketch per layer and step)."
    )),
    Option("exact_when_cheaper", _SKETCH.exact_when_cheaper, "bool", (
        "*randomized*. Compute a linear layer exactly when its sequence length T <= k."
    )),
    Option("sketch_seed", None, "Optional[int]", (
        "*randomized*. Seed of the sketch generator; None: ``os.urandom``\n"
        "(or ``seed=``'s sketch stream)."
    )),
    Option("seed", None, "Optional[int]", (
        "*randomized*. One non-negative int seeding the noise, the Poisson masks\n"
        "and the sketches (independent streams): a reproducible run; None: all from\n"
        "``os.urandom``. Privacy hazards: whoever knows the seed can regenerate the\n"
        "noise and subtract it (keep it as secret as the data, or leave it None), and\n"
        "a seeded run resumed with the same seed draws its earlier steps' noise again,\n"
        "releasing noise-free differences: refused unless ``accept_replayed_noise=True``\n"
        "(or the checkpoint holds the generators' states, ``include_rng_state=True``)."
    )),
    Option("accept_replayed_noise", False, "bool", (
        "*randomized*, with ``seed=``. Loading the optimizer state (or ``load_checkpoint``)\n"
        "of a run that used ``seed=`` into a run with ``seed=`` is refused: it would replay\n"
        "the noise (see ``seed``). True accepts that hazard."
    )),
    Option("bookkeeping", None, "Optional[bool]", (
        "*randomized*. None, True or False: with ``\"ghost\"``, True runs the\n"
        "ghost script by book-keeping (one backward pass); with ``\"hooks\"``,\n"
        "book-keeping unless the model has activation checkpointing on (then two\n"
        "passes from the model's output); False forces those two passes. With\n"
        "``\"bookkeeping\"``: None or True."
    )),
    Option("per_example_backward", None, "Optional[bool]", (
        "*randomized*. None, True or False: True runs one example per backward\n"
        "pass with exact flat clipping of its whole gradient (no sketch; charged as\n"
        "Opacus's ``prv``; the returned loader yields one example per physical\n"
        "batch). None (default) does so when the data loader's ``batch_size`` is 1;\n"
        "False never (:mod:`opacus_rc.forms`)."
    )),
    Option("nonfinite", RAISE, "str", (
        "*randomized*. ``\"raise\"`` (a non-finite norm or gradient refuses the\n"
        "step) or ``\"skip\"`` (book-keeping and the per-example form only: drop that\n"
        "example's contribution, counted in ``optimizer.skipped_examples``, a non-private count)."
    )),
    Option("sample_rate", None, "Optional[float]", (
        "*randomized*. The public Poisson rate the loader samples at and\n"
        "the accountant charges, in (0, 1]; None: ``1 / len(data_loader)``. With\n"
        "``poisson_sampling=False`` only the loader's own rate is accepted."
    )),
    Option("expected_batch_size", None, "Optional[int]", (
        "*randomized*. The public normaliser of the averaged update (a positive int,\n"
        "summed over ranks); None: the loader's batch_size."
    )),
    Option("privacy_unit", EXAMPLE_UNIT, "str", (
        "*randomized*. What one clip bounds and epsilon protects: ``\"example\"``\n"
        "(a dataset row) or ``\"user\"`` (a person with all their rows: Poisson sampling\n"
        "over users at ``sample_rate``, else the loader's ``batch_size`` / number of users,\n"
        "and one clip of the mean of a sampled user's rows; :mod:`opacus_rc.units`)."
    )),
    Option("user_ids", None, "Optional[Sequence]", (
        "*randomized*, with ``privacy_unit=\"user\"``. One hashable id per dataset\n"
        "row: the person who owns it."
    )),
    Option("max_examples_per_user", DEFAULT_MAX_EXAMPLES_PER_USER, "int", (
        "*randomized*, with ``privacy_unit=\"user\"``. The contribution bound k: a\n"
        "sampled user contributes min(k, n_u) of their rows, drawn uniformly at each step.\n"
        "It bounds compute, not privacy (a user's clipped mean has norm <= C for any k)."
    )),
    Option("noise", INDEPENDENT_NOISE, "str", (
        "*randomized*. The noise mechanism, a row of :data:`opacus_rc.noises.NOISES`:\n"
        "``\"independent\"`` (DP-SGD: fresh noise at every step) or ``\"banded\"`` (banded\n"
        "matrix factorisation: noise correlated over ``bands`` steps, much of it\n"
        "cancelling in the model; cyclic Poisson sampling over ``bands`` parts of the\n"
        "units; :mod:`opacus_rc.noises.banded`)."
    )),
    *(Option(*keyword) for keyword in noise_keywords()),  # each mechanism's own keywords
    Option("denoise", None, "Optional[str]", (
        "None or ``\"spectral\"`` (any clipping mode): SVD shrinkage of the\n"
        "noisy gradient of the linear weights (:mod:`opacus_rc.denoise`)."
    )),
    Option("denoise_kappa", DEFAULT_KAPPA, "float", "the denoiser's gate factor (finite, > 0; needs ``denoise``)."),
    Option("denoise_svd", SVD_FULL, "str", "``\"full\"``, ``\"lowrank\"`` or ``\"auto\"`` (needs ``denoise``)."),
)
#: name -> default of :data:`OPTIONS`
DEFAULTS: Mapping[str, Any] = MappingProxyType({o.name: o.default for o in OPTIONS})


def split_options(kwargs: Mapping[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """A call's keywords ``kwargs`` split into the plugin's (every one of :data:`OPTIONS`,
    at its default when not given) and the rest (Opacus's)."""
    plugin = {o.name: kwargs.get(o.name, o.default) for o in OPTIONS}
    return plugin, {k: v for k, v in kwargs.items() if k not in DEFAULTS}


def keywords(function: Callable) -> FrozenSet[str]:
    """The named parameters of ``function`` (not ``self``, ``*args`` or ``**kwargs``)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(
        name for name, p in inspect.signature(function).parameters.items() if p.kind in kinds and name != "self"
    )


#: Opacus's optimizer keywords that only its adaptive clipping optimizer takes (Opacus
#: passes make_private's ``**kwargs`` to the optimizer, whose base class drops unknown ones)
ADAPTIVE_KEYWORDS = keywords(AdaClipDPOptimizer.__init__) - keywords(DPOptimizer.__init__)
#: keywords of Opacus's get_noise_multiplier that its make_private_with_epsilon sets itself
#: (``steps``: it calibrates for ``epochs``)
_CALIBRATION_SET = frozenset(("target_epsilon", "target_delta", "sample_rate", "epochs", "steps", "accountant"))
#: keywords of the rc_prv calibration a randomized make_private_with_epsilon passes on
RC_CALIBRATION_KEYWORDS = keywords(get_noise_multiplier_rc) - _CALIBRATION_SET - {
    "sketch_config", "sigma_lower", "bands", "column_norm",
}


#: keywords of ``PrivacyEngine(...)`` itself (a user may pass them to make_private by mistake)
_ENGINE_KEYWORDS = frozenset(("accountant", "secure_mode"))


def refuse_unknown(given: Iterable[str], accepted: Collection[str], where: str) -> None:
    """A ValueError naming the first keyword of ``given`` that is not in ``accepted``, with
    the nearest accepted one (:func:`difflib.get_close_matches`) and all of them: a
    misspelt option (``sketchsize=8``) must not silently run at its default."""
    for name in given:
        if name in accepted:
            continue
        hint = did_you_mean(name, accepted)
        if name in _ENGINE_KEYWORDS:  # e.g. secure_mode: the engine's, not the call's
            hint = f" (it is PrivacyEngine's: PrivacyEngine({name}=...))"
        raise ValueError(
            f"{where} got an unknown keyword {name!r}{hint}; accepted keywords: {', '.join(sorted(accepted))}"
        )


def check_keywords(
    where: str, given: Iterable[str], clipping: Any, opacus_keywords: Collection[str], accountant: Any = None
) -> None:
    """Refuse (:func:`refuse_unknown`, a ValueError) a keyword of the plugin's ``make_private``
    or ``make_private_with_epsilon`` (``where``) that neither it nor Opacus's method
    (``opacus_keywords``) knows; :data:`ADAPTIVE_KEYWORDS` need ``clipping="adaptive"``. With
    ``accountant`` (``make_private_with_epsilon``) the calibration's keywords are accepted too."""
    given = list(given)
    for name in given:
        if name in ADAPTIVE_KEYWORDS and clipping != ADAPTIVE:
            raise ValueError(f"{name} only applies with clipping='adaptive'; got clipping={clipping!r}")
    accepted = set(opacus_keywords) | {"clipping"} | set(DEFAULTS) | ADAPTIVE_KEYWORDS
    if accountant is not None:
        if clipping == RANDOMIZED:
            accepted |= RC_CALIBRATION_KEYWORDS
        else:
            accepted |= keywords(get_noise_multiplier) - _CALIBRATION_SET
            accepted |= keywords(type(accountant).get_epsilon) - {"delta"}
    refuse_unknown(given, accepted, where)


def with_options(method: Callable) -> Callable:
    """``method`` (keyword-only parameters, then ``**kwargs``, which carries the plugin's
    keywords) shown with the plugin's options, from :data:`OPTIONS`: its
    ``__signature__`` gets them as keyword-only parameters before ``**kwargs``; in its
    docstring a line ``{options}`` becomes their ``Args`` entries and ``{option_names}``
    their names (wrapped at the line's indentation)."""
    signature = inspect.signature(method)
    parameters = list(signature.parameters.values())
    parameters[-1:-1] = [o.parameter() for o in OPTIONS]
    method.__signature__ = signature.replace(parameters=parameters)
    lines = []
    for line in method.__doc__.splitlines():
        indent = line[: len(line) - len(line.lstrip())]
        if line.strip() == "{options}":
            for o in OPTIONS:
                first, *rest = o.doc.splitlines()
                lines.append(f"{indent}{o.name}: {first}")
                lines.extend(f"{indent}    {text}" for text in rest)
        elif "{option_names}" in line:
            head, tail = line.split("{option_names}")
            names = textwrap.wrap(
                ", ".join(o.name for o in OPTIONS) + tail, width=88 - len(indent) - 4,
                initial_indent=head.lstrip(), subsequent_indent="    ",
            )
            lines.extend(indent + text for text in names)
        else:
            lines.append(line)
    method.__doc__ = "\n".join(lines)
    return method


#: the keywords that make the SketchConfig (its fields, in order)
SKETCH_OPTIONS = tuple(f.name for f in fields(SketchConfig))
#: keywords that only apply with clipping="randomized" (bookkeeping has its own message)
RANDOMIZED_ONLY = (
    *SKETCH_OPTIONS, "sketch_seed", "seed", "accept_replayed_noise", "nonfinite", "expected_batch_size", "sample_rate",
    "privacy_unit", "user_ids", "max_examples_per_user", "noise", *(k[0] for k in noise_keywords()),
)
#: keywords that only apply with privacy_unit="user"
USER_ONLY = ("user_ids", "max_examples_per_user")


def finite_real(x: Any) -> bool:
    """``x`` is a finite real number (not a bool)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _given(options: Mapping[str, Any], name: str) -> bool:
    """True when the keyword ``name`` is not at its default (same type, same value)."""
    value, default = options[name], DEFAULTS[name]
    return value is not default and (type(value) is not type(default) or value != default)


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


def per_rank_normaliser(batch_size: int, distributed: bool) -> float:
    """The public normaliser (the expected logical batch size, summed over ranks) as one
    rank's DP optimizer takes it: Opacus's DDP optimizers average the ranks' sums, so each
    rank divides by its share ``batch_size / world_size``."""
    return batch_size / torch.distributed.get_world_size() if distributed else batch_size


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
    dataset's size), capped at 1; ``1 / len(loader)`` when ``B`` or ``n`` is unknown. The
    maximum never falls below either term (``1 / ceil(n / B) < B / n`` when ``B`` does not
    divide ``n``; docs/accounting.md)."""
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
    """The public normaliser and sample rate of a randomized-clipping run (ValueError naming
    an invalid parameter and its accepted values).

    Normaliser: ``expected_batch_size`` when given, else the batch size of the loader as
    the user built it (:func:`loader_batch_size`): a hyper-parameter, never a function
    of the dataset's size. Sample rate with Poisson sampling: ``sample_rate`` when
    given, else ``1 / len(data_loader)`` (Opacus's choice; it assumes the number of
    batches per epoch is public, see docs/accounting.md, "What the guarantee assumes").
    With ``poisson_sampling=False``: the loader's own rate (:func:`loader_rate`); a
    ``sample_rate`` other than it is refused.
    """
    if expected_batch_size is not None:
        if not positive_int(expected_batch_size):
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
        check_sample_rate(sample_rate)
        if not poisson_sampling:
            sample_rate = _matching_loader_rate(data_loader, float(sample_rate))
        return PublicSampling(batch_size, float(sample_rate), explicit_sample_rate=True)
    if not poisson_sampling:
        return PublicSampling(batch_size, loader_rate(data_loader))
    return PublicSampling(batch_size, 1.0 / len(data_loader))


def check_sample_rate(sample_rate: Any, when_none: str = "1 / len(data_loader)") -> None:
    """``sample_rate=``: None or a float in (0, 1], else a ValueError naming it, its accepted
    values and ``when_none``, the rate None stands for."""
    if sample_rate is not None and not (finite_real(sample_rate) and 0.0 < sample_rate <= 1.0):
        raise ValueError(
            f"sample_rate={sample_rate!r} is invalid; accepted values: a float in "
            f"(0, 1] or None ({when_none})"
        )


def sketch_of(options: Mapping[str, Any]) -> SketchConfig:
    """The :class:`~opacus_rc.config.SketchConfig` of ``options`` (its keywords,
    :data:`SKETCH_OPTIONS`; it validates them)."""
    return SketchConfig(**{k: options[k] for k in SKETCH_OPTIONS})


def parse_denoise(options: Mapping[str, Any]) -> Optional[Tuple[Tuple[str, Any], ...]]:
    """``denoise=`` and its ``denoise_kappa`` / ``denoise_svd``: None (no denoising) or
    the keyword arguments of :func:`~opacus_rc.denoise.attach_spectral_denoiser`."""
    given = {k: options[f"denoise_{k}"] for k in ("kappa", "svd") if _given(options, f"denoise_{k}")}
    denoise = options["denoise"]
    if denoise is None:
        if given:
            raise ValueError(f"{', '.join('denoise_' + k for k in given)} need denoise='spectral'")
        return None
    check_choice("denoise", denoise, (None, *DENOISERS))
    return tuple(given.items())


def _noise_multiplier(opacus: Mapping[str, Any]) -> None:
    """``noise_multiplier=`` (when the call gives it): a finite real >= 0. Zero adds no
    noise, so epsilon is infinite: allowed (a debugging run), with one warning."""
    if "noise_multiplier" not in opacus:
        return  # make_private_with_epsilon calibrates it
    sigma = opacus["noise_multiplier"]
    if not finite_real(sigma) or sigma < 0:
        raise ValueError(
            f"noise_multiplier={sigma!r} is invalid; accepted values: a finite real >= 0 "
            f"(the noise std in units of max_grad_norm)"
        )
    if sigma == 0:
        warnings.warn(
            "noise_multiplier=0: no noise is added, the run is not private (epsilon = inf)",
            UserWarning, stacklevel=4,
        )


def _nonfinite(mode: Any, grad_sample_mode: str, runs: str) -> str:
    """``nonfinite=`` ("raise", the default, or "skip"). "skip" needs a form that assembles
    each example's contribution on its own (:attr:`~opacus_rc.forms.Form.drops_examples`:
    book-keeping, the per-example form), so a non-finite one can be dropped before the sum."""
    check_choice("nonfinite", mode, NONFINITE_MODES)
    if mode == SKIP and not FORMS[runs].drops_examples:
        raise ValueError(
            "nonfinite='skip' needs book-keeping: use grad_sample_mode='bookkeeping' (or its "
            "aliases 'hooks', 'ghost' with bookkeeping=True); the two-pass backward cannot drop one example's "
            f"non-finite gradient from its sum (got grad_sample_mode={grad_sample_mode!r})"
        )
    return mode


def _seed(seed: Any, options: Mapping[str, Any], opacus: Mapping[str, Any], secure_mode: bool) -> Optional[int]:
    """``seed=`` (None, the default, or a non-negative int): one root for a reproducible
    run's noise, Poisson and sketch streams (distinct domain tags, see
    :mod:`opacus_rc.sketch`); it replays them on resume. Refused next to another seed of
    the same stream and in secure mode (nothing there is seeded)."""
    seed = check_seed("seed", seed)
    if seed is None:
        return None
    if secure_mode:
        raise ValueError(
            "seed= is invalid with secure_mode=True: secure noise, sketches and Poisson "
            "masks come from os.urandom; accepted values: seed=None"
        )
    others = {
        "noise_generator": opacus["noise_generator"] is not None,
        "sketch_seed": options["sketch_seed"] is not None,
        "data_loader's generator": opacus["poisson_sampling"]
        and getattr(opacus.get("data_loader"), "generator", None) is not None,
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


def _accept_replayed_noise(accept: Any, seed: Optional[int]) -> bool:
    """``accept_replayed_noise=`` (False, the default, or True, with ``seed=`` only)."""
    if not isinstance(accept, bool):
        raise ValueError(f"accept_replayed_noise={accept!r} is invalid; accepted values: True, False")
    if accept and seed is None:
        raise ValueError(
            "accept_replayed_noise=True only applies with seed=: a run without seed= draws fresh "
            "randomness on resume and replays nothing"
        )
    return accept


def _user_index(options: Mapping[str, Any], opacus: Mapping[str, Any], runs: str) -> Optional[UserIndex]:
    """``privacy_unit=`` with ``user_ids=`` and ``max_examples_per_user=``: the
    :class:`~opacus_rc.units.UserIndex` of a user-level call (None: example level). A
    ValueError where the plugin cannot clip per user exactly (a form without
    :attr:`~opacus_rc.forms.Form.honours_users`, ``poisson_sampling=False``)."""
    unit = check_privacy_unit(options["privacy_unit"])
    check_max_examples_per_user(options["max_examples_per_user"])
    if unit == EXAMPLE_UNIT:
        given = [k for k in USER_ONLY if _given(options, k)]
        if given:
            raise ValueError(f"{', '.join(given)} only apply with privacy_unit='user'; got privacy_unit='example'")
        return None
    if not FORMS[runs].honours_users:
        honouring = ", ".join(repr(name) for name, form in FORMS.items() if form.honours_users)
        raise ValueError(
            f"privacy_unit='user' is not supported by the {runs!r} form (it does not clip per user); accepted "
            f"with it: the forms {honouring} (docs/forms.md)"
        )
    if not opacus["poisson_sampling"]:
        raise ValueError(
            "privacy_unit='user' needs poisson_sampling=True: the guarantee is for Poisson sampling over users"
        )
    dataset = getattr(opacus.get("data_loader"), "dataset", None)
    try:
        size = len(dataset)
    except TypeError:
        raise ValueError("privacy_unit='user' needs a data_loader over a dataset with a length") from None
    return UserIndex(options["user_ids"], size, options["max_examples_per_user"])


def user_sampling(sampling: PublicSampling, users: UserIndex) -> PublicSampling:
    """The public sampling of a user-level run: the rate ``q_u`` is ``sample_rate=`` when
    given, else the normaliser (expected users per step: ``expected_batch_size``, else the
    loader's ``batch_size``) over the number of users: ``q_u = B / N``.

    Raises:
        ValueError: naming ``batch_size`` and ``sample_rate``, when ``B > N`` without
            ``sample_rate=`` (q_u would be capped at 1 while the update is divided by B).
    """
    if sampling.explicit_sample_rate:
        return sampling
    if sampling.batch_size > users.num_users:
        raise ValueError(
            f"batch_size={sampling.batch_size} (expected users per step: expected_batch_size=, else the data "
            "loader's batch_size; the Trainer's per-device batch x accumulation x world size) is above the "
            f"{users.num_users} users of user_ids, with sample_rate=None; accepted values: a batch_size of at most "
            f"{users.num_users}, or sample_rate= in (0, 1]"
        )
    return PublicSampling(sampling.batch_size, sampling.batch_size / users.num_users)


def noise_of(options: Mapping[str, Any], most: str) -> NoiseSpec:
    """``noise=`` and its mechanism's keywords in ``options`` (every row's, by name), with
    ``denoise=``: the run's :class:`~opacus_rc.noises.NoiseSpec` (``most``: the largest number of
    the sampler's parts, in words); a ValueError names an invalid parameter (:func:`~opacus_rc.noises.parse_noise`)."""
    given = {name: options[name] for name, *_ in noise_keywords()}
    return parse_noise(options["noise"], given, options["denoise"], most)


def step_record(sketch: Optional[SketchConfig], noise: NoiseSpec = INDEPENDENT) -> StepRecord:
    """The accountant's record of one step: its sketch and its noise mechanism's record
    (:meth:`~opacus_rc.noises.NoiseSpec.record_fields`)."""
    return StepRecord.from_config(sketch, 1, **noise.record_fields())


@dataclass(frozen=True)
class Options:
    """The plugin's options of one ``make_private`` call, parsed once (:meth:`parse`).

    Attributes:
        clipping: the clipping mode (``"randomized"`` or one of Opacus's).
        grad_sample_mode: the grad-sample mode the call builds (``bookkeeping=`` may
            switch the requested one, see :func:`opacus_rc.forms.resolve_form`).
        runs: the form the randomized call runs, a key of :data:`opacus_rc.forms.FORMS`.
        denoise: keyword arguments of the spectral denoiser, or None (no denoising).
        sketch: the :class:`~opacus_rc.config.SketchConfig` (a sketched randomized form only,
            else None: exact clipping).
        sketch_seed: the sketches' seed (``sketch_seed=``, else ``seed=``).
        seed: ``seed=``, root of the noise and Poisson streams (None: ``os.urandom``).
        nonfinite: ``"raise"`` or ``"skip"``.
        accept_replayed_noise: a resumed seeded run may replay its noise (see :data:`OPTIONS`).
        sampling: the public normaliser and sample rate (randomized only, else None);
            at user level, of users.
        users: the :class:`~opacus_rc.units.UserIndex` of a ``privacy_unit="user"`` call
            (None: example level).
        noise: the noise mechanism's spec (``noise=`` and its keywords; :mod:`opacus_rc.noises`).
    """

    clipping: str = FLAT
    grad_sample_mode: str = HOOKS
    runs: str = TWO_PASS
    denoise: Optional[Tuple[Tuple[str, Any], ...]] = None
    sketch: Optional[SketchConfig] = None
    sketch_seed: Optional[int] = None
    seed: Optional[int] = None
    nonfinite: str = RAISE
    accept_replayed_noise: bool = False
    sampling: Optional[PublicSampling] = None
    users: Optional[UserIndex] = None
    noise: NoiseSpec = INDEPENDENT

    @property
    def randomized(self) -> bool:
        return self.clipping == RANDOMIZED

    @property
    def charged_rate(self) -> float:
        """The rate the accountant charges: the sample rate, inside a part of a cyclic sampler
        (:meth:`~opacus_rc.noises.NoiseSpec.charged_rate`)."""
        return self.noise.charged_rate(self.sampling.sample_rate)

    def step_record(self) -> StepRecord:
        """The accountant's record of one step of this call (its sketch, its noise mechanism)."""
        return step_record(self.sketch, self.noise)

    @property
    def privacy_unit(self) -> str:
        return EXAMPLE_UNIT if self.users is None else USER_UNIT

    @property
    def denoise_kwargs(self) -> Optional[Dict[str, Any]]:
        return None if self.denoise is None else dict(self.denoise)

    def epoch_draws(self, data_loader: Any, poisson_sampling: bool) -> int:
        """Logical steps in one epoch of the loader ``make_private`` returns (what calibration
        counts): the given loader's ``len`` without Poisson sampling, else
        :func:`~opacus_rc.units.user_epoch_draws` over users, Opacus's ``int(1 / q)`` over rows."""
        q = self.sampling.sample_rate
        if not poisson_sampling:
            return len(data_loader)
        return user_epoch_draws(q) if self.users is not None else int(1 / q)

    def optimizer_kwargs(self) -> Dict[str, Any]:
        """What the randomized optimizer takes through Opacus's ``**kwargs``."""
        return {
            "sketch_config": self.sketch, "nonfinite": self.nonfinite, "noise_seed": self.seed,
            "accept_replayed_noise": self.accept_replayed_noise, "user_index": self.users,
            "noise_mechanism": self.noise,
        }

    @classmethod
    def parse(
        cls, engine: Any, clipping: str, options: Mapping[str, Any], opacus: Mapping[str, Any]
    ) -> "Options":
        """Validate the plugin's keywords ``options`` (all of :data:`DEFAULTS`) of a call with
        clipping mode ``clipping`` and Opacus's arguments ``opacus`` (``module``, ``data_loader``,
        ``grad_sample_mode``, ``poisson_sampling``, ``noise_generator``: read, never changed) on
        ``engine``; a ValueError names an invalid parameter and its accepted values."""
        clipping = check_choice("clipping", clipping, CLIPPING_MODES, did_you_mean(str(clipping), CLIPPING_MODES))
        _noise_multiplier(opacus)
        denoise = parse_denoise(options)
        runs, mode = resolve_form(
            clipping, options["bookkeeping"], options["per_example_backward"], opacus["grad_sample_mode"],
            opacus.get("module"), opacus.get("data_loader"), options["sample_rate"],
        )
        if clipping != RANDOMIZED:
            given = [k for k in RANDOMIZED_ONLY if _given(options, k)]
            if given:
                raise ValueError(
                    f"{', '.join(given)} only apply with clipping='randomized'; got clipping={clipping!r}"
                )
            return cls(clipping=clipping, grad_sample_mode=mode, denoise=denoise)
        check_randomized_setup(engine, mode)
        sketch = None if FORMS[runs].exact else sketch_of(options)
        nonfinite = _nonfinite(options["nonfinite"], mode, runs)
        seed = _seed(options["seed"], options, opacus, engine.secure_mode)
        accept_replayed_noise = _accept_replayed_noise(options["accept_replayed_noise"], seed)
        # From the loader as the user built it: Opacus's DPDataLoader has no batch_size.
        sampling = public_sampling(
            opacus.get("data_loader"), options["expected_batch_size"], options["sample_rate"],
            opacus["poisson_sampling"],
        )
        users = _user_index(options, opacus, runs)
        if users is not None:
            sampling = user_sampling(sampling, users)
        sketch_seed = options["sketch_seed"]
        parsed = cls(
            clipping=clipping, grad_sample_mode=mode, runs=runs, denoise=denoise, sketch=sketch,
            sketch_seed=seed if sketch_seed is None else sketch_seed, seed=seed,
            nonfinite=nonfinite, accept_replayed_noise=accept_replayed_noise, sampling=sampling, users=users,
        )
        draws = parsed.epoch_draws(opacus.get("data_loader"), opacus["poisson_sampling"])
        noise = noise_of(options, f"the draws of an epoch ({draws})")
        noise.check_sampling(poisson_sampling=opacus["poisson_sampling"], draws=draws,
                             sample_rate=sampling.sample_rate, draws_are="draws")
        return dataclasses.replace(parsed, noise=noise)


def check_randomized_setup(engine: Any, grad_sample_mode: str) -> None:
    """Refuse combinations that cannot be accounted or are not implemented."""
    mechanism = engine.accountant.mechanism()
    if mechanism not in RC_ACCOUNTANTS:
        raise ValueError(
            f"clipping='randomized' needs an accountant that accounts for the random "
            f"sensitivity of estimated norms: use PrivacyEngine(accountant='rc_prv') "
            f"(got accountant={mechanism!r}, which would report a too small epsilon)"
        )
    check_choice("grad_sample_mode", grad_sample_mode, RC_GRAD_SAMPLE_MODES, " with clipping='randomized'")


__all__ = [
    "Options", "PublicSampling", "public_sampling", "per_rank_normaliser", "loader_rate", "loader_batch_size",
    "check_randomized_setup", "DEFAULTS", "OPTIONS", "Option", "split_options", "with_options", "RANDOMIZED", "BOOKKEEPING", "BOOKKEEPING_WITH_CRITERION",
    "OUTPUT_PASSES", "TWO_PASS",
]
