"""The privacy options of the private Trainer (:class:`PrivacyArguments`); everything else
stays in ``TrainingArguments``."""

from __future__ import annotations

import functools
from dataclasses import field, fields, make_dataclass
from typing import Any, Dict, Optional, Tuple, Union

from ..accounting.records import StepRecord
from ..config import SketchConfig
from ..forms import per_example_chosen
from ..noises import NoiseSpec, noise_keywords
from ..options import (
    DEFAULTS, OPTIONS, check_sample_rate, finite_real, noise_of, parse_denoise, refuse_unknown, sketch_of, step_record,
)
from ..units import DEFAULT_MAX_EXAMPLES_PER_USER, check_max_examples_per_user, check_privacy_unit
from ..values import (
    DENOISERS as ENGINE_DENOISERS, EXAMPLE_UNIT, FLAT, INDEPENDENT_NOISE, RANDOMIZED, USER_UNIT, check_choice,
)

CLIPPINGS = (RANDOMIZED, FLAT)
DENOISERS = (None, *ENGINE_DENOISERS)


#: keys of the Trainer's (and TRL's) training logs that are statistics of the private
#: batches before noise (removed); "loss"/"train_loss" stay with log_train_loss=True
PRIVATE_LOG_KEYS = (
    "grad_norm", "num_input_tokens_seen", "train_tokens_per_second", "entropy",
    "mean_token_accuracy", "num_tokens", "aux_loss", "total_flos",
)
LOSS_LOG_KEYS = ("loss", "train_loss")

#: The fields of :class:`PrivacyArguments`, in order: the Trainer's own as
#: ``(name, annotation, default)``, and by name the options of ``make_private`` it passes
#: on (their annotation, default and checks: :data:`opacus_rc.options.OPTIONS`).
_FIELDS: Tuple[Union[str, Tuple[str, str, Any]], ...] = (
    ("target_epsilon", "Optional[float]", None),
    ("noise_multiplier", "Optional[float]", None),
    ("delta", "Optional[float]", None),
    ("max_grad_norm", "float", 1.0),
    ("clipping", "str", RANDOMIZED),
    "estimator", "sketch_size", "sketching", "per_example_backward",
    ("lm_head_block_size", "Optional[int]", None),
    "denoise",
    "noise", *(k[0] for k in noise_keywords()),
    ("secure_mode", "bool", False),
    "sample_rate",
    "privacy_unit",
    ("user_column", "Optional[str]", None),
    "max_examples_per_user",
    ("stop_at_epsilon", "Optional[float]", None),
    ("log_train_loss", "bool", False),
)
#: the options of ``make_private`` that are fields of :class:`PrivacyArguments`
PLUGIN_FIELDS = tuple(f for f in _FIELDS if isinstance(f, str))
_OPTION = {o.name: o for o in OPTIONS}


def _field(spec: Union[str, Tuple[str, str, Any]]) -> Tuple[str, str, Any]:
    """One field for :func:`dataclasses.make_dataclass` (an option's from :data:`OPTIONS`)."""
    name, annotation, default = spec if isinstance(spec, tuple) else (spec, _OPTION[spec].annotation, DEFAULTS[spec])
    return name, annotation, field(default=default)


class _PrivacyArgumentsMethods:
    """The privacy options of :class:`DPTrainer` (everything else stays in ``TrainingArguments``;
    each field: docs/hf_trainer.md).

    Args:
        target_epsilon, noise_multiplier: exactly one: the epsilon at ``delta`` that sigma is
            calibrated for with ``rc_prv`` over the planned run, or sigma itself.
        delta: the delta of every reported epsilon (required).
        max_grad_norm: the per-example clipping bound C (replaces the Trainer's own).
        clipping: ``"randomized"`` (default) or ``"flat"`` (Opacus's exact per-sample gradients).
        estimator, sketch_size, sketching: the randomized-clipping sketch (see ``make_private``).
        per_example_backward: one row per backward pass with exact clipping (``None``: when
            ``per_device_train_batch_size`` is 1; randomized only).
        lm_head_block_size: positions per block of the chunked LM head
            (:class:`~opacus_rc.lm_head.ChunkedLMHeadLoss`; ``None``: the model's own logits).
        denoise: ``None`` or ``"spectral"`` (post-processing of the noisy gradient).
        noise, bands: the noise mechanism (:mod:`opacus_rc.noises`) and its keywords:
            ``"independent"`` (DP-SGD, default) or ``"banded"`` with ``bands=b`` (banded matrix
            factorisation: the Trainer's sampler draws cyclic Poisson draws, draw t from part
            t mod b of the units at rate b q; :mod:`opacus_rc.noises.banded`).
        secure_mode: noise, sketches and Poisson masks from :mod:`opacus_rc.csprng`.
        sample_rate: the public Poisson rate; ``None``: ``1 / ceil(len(train_dataset) / B)``
            (at ``privacy_unit="user"``: ``B / number of users``, B counting users: at most
            their number).
        privacy_unit: ``"example"`` (a dataset row, default) or ``"user"`` (a person with all
            their rows: Poisson over users, one clip of the mean of a user's rows; epsilon
            per user; :mod:`opacus_rc.units`).
        user_column: with ``privacy_unit="user"``, the ``train_dataset`` column (a
            ``datasets.Dataset`` column) naming each row's user; dropped before collation.
        max_examples_per_user: with ``privacy_unit="user"``, the rows k a sampled user
            contributes to a step (``min(k, n_u)``, drawn uniformly each step).
        stop_at_epsilon: stop training before a step would make epsilon exceed this value.
        log_train_loss: also log the training loss (an un-noised statistic outside epsilon).

    The options of ``make_private`` among them (:data:`PLUGIN_FIELDS`) have its defaults
    and are checked by its functions (:mod:`opacus_rc.options`).
    """

    def __post_init__(self) -> None:
        if (self.target_epsilon is None) == (self.noise_multiplier is None):
            raise ValueError(
                f"target_epsilon={self.target_epsilon!r}, noise_multiplier={self.noise_multiplier!r}: "
                "give exactly one; accepted values: target_epsilon a float > 0 (sigma is "
                "calibrated with rc_prv) or noise_multiplier a float >= 0"
            )
        self._refuse_invalid(
            ("target_epsilon", self.target_epsilon is None or _positive(self.target_epsilon), "a float > 0"),
            ("noise_multiplier",
             self.noise_multiplier is None or (finite_real(self.noise_multiplier) and self.noise_multiplier >= 0),
             "a float >= 0"),
            ("delta", finite_real(self.delta) and 0.0 < self.delta < 1.0,
             "a float in (0, 1), e.g. 1e-5 (below 1 / number of training rows); it is required"),
            ("max_grad_norm", _positive(self.max_grad_norm), "a float > 0"),
        )
        check_choice("clipping", self.clipping, CLIPPINGS)
        options = self.options()
        if self.clipping == RANDOMIZED:
            sketch_of(options)  # validates
        parse_denoise(options)
        self._check_noise()
        check_sample_rate(self.sample_rate, when_none="1 / ceil(len(train_dataset) / B)")
        self._check_unit()
        self._refuse_invalid(
            ("stop_at_epsilon", self.stop_at_epsilon is None or _positive(self.stop_at_epsilon), "a float > 0 or None"),
            ("secure_mode", isinstance(self.secure_mode, bool), "True, False"),
            ("log_train_loss", isinstance(self.log_train_loss, bool), "True, False"),
            ("per_example_backward",
             self.per_example_backward is None or isinstance(self.per_example_backward, bool)
             and (self.clipping == RANDOMIZED or not self.per_example_backward),
             "None, True, False (True with clipping='randomized' only)"),
            ("lm_head_block_size",
             self.lm_head_block_size is None or isinstance(self.lm_head_block_size, int)
             and not isinstance(self.lm_head_block_size, bool) and self.lm_head_block_size > 0
             and self.clipping == RANDOMIZED,
             "None or a positive int (with clipping='randomized' only)"),
        )

    def _check_unit(self) -> None:
        """``privacy_unit``, ``user_column`` and ``max_examples_per_user`` (what the Trainer
        cannot run at user level is refused by name)."""
        check_privacy_unit(self.privacy_unit)
        check_max_examples_per_user(self.max_examples_per_user)
        if self.privacy_unit == EXAMPLE_UNIT:
            given = [n for n, unset in (("user_column", self.user_column is None),
                                        ("max_examples_per_user",
                                         self.max_examples_per_user == DEFAULT_MAX_EXAMPLES_PER_USER)) if not unset]
            if given:
                raise ValueError(f"{', '.join(given)} only apply with privacy_unit='user'; got privacy_unit='example'")
            return
        if not isinstance(self.user_column, str) or not self.user_column:
            raise ValueError(
                f"user_column={self.user_column!r} is invalid; privacy_unit='user' needs the name of the "
                "train_dataset column holding each row's user (e.g. user_column='author')"
            )
        if self.clipping != RANDOMIZED:
            raise ValueError(f"privacy_unit='user' is not supported with clipping={self.clipping!r}; accepted: "
                             "clipping='randomized'")

    def _check_noise(self) -> None:
        """``noise`` and its keywords (what depends on the sample rate, e.g. ``bands * q <= 1``,
        is checked at construction of the Trainer); a noise other than the default needs the
        plugin's optimizer (``clipping="randomized"``)."""
        self.noise_spec()
        if self.noise != INDEPENDENT_NOISE and self.clipping != RANDOMIZED:
            raise ValueError(
                f"noise={self.noise!r} is not supported with clipping={self.clipping!r}; accepted: clipping='randomized'"
            )

    def noise_spec(self) -> NoiseSpec:
        """The noise mechanism's spec (``noise`` and its keywords, parsed:
        :func:`~opacus_rc.options.noise_of`)."""
        return noise_of(self.options(), "the logical steps of an epoch (int(1 / sample_rate))")

    def noise_options(self) -> Dict[str, Any]:
        """``noise`` and every mechanism's keywords, as ``make_private`` takes them."""
        return {name: getattr(self, name) for name in ("noise", *(k[0] for k in noise_keywords()))}

    def charged_rate(self, sample_rate: float) -> float:
        """The rate the accountant charges a logical step sampled at ``sample_rate``: inside a
        part of a cyclic sampler (:meth:`~opacus_rc.noises.NoiseSpec.charged_rate`; as
        ``Options.charged_rate``)."""
        return self.noise_spec().charged_rate(sample_rate)

    def step_record(self, physical_batch_size: int) -> StepRecord:
        """The accountant's record of one logical step (:meth:`sketch_config`; the noise
        mechanism's record, e.g. banded noise's ``bands`` and column norm), as the optimizer's
        hook records it."""
        return step_record(self.sketch_config(physical_batch_size), self.noise_spec())

    @property
    def user_level(self) -> bool:
        """Whether the unit of privacy is a user (``privacy_unit="user"``)."""
        return self.privacy_unit == USER_UNIT

    def _refuse_invalid(self, *checks: Tuple[str, bool, str]) -> None:
        for name, ok, accepted in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid; accepted values: {accepted}")

    def options(self) -> Dict[str, Any]:
        """Every option of ``make_private`` (:data:`~opacus_rc.options.DEFAULTS`), with this
        one's :data:`PLUGIN_FIELDS`."""
        return {**DEFAULTS, **{name: getattr(self, name) for name in PLUGIN_FIELDS}}

    def per_example(self, physical_batch_size: int) -> bool:
        """Whether training runs the per-example form (:func:`opacus_rc.forms.per_example_chosen`)."""
        return self.clipping == RANDOMIZED and per_example_chosen(self.per_example_backward, physical_batch_size)

    def sketch_config(self, physical_batch_size: int) -> Optional[SketchConfig]:
        """The sketch the accountant charges (None: exact clipping, flat or per-example)."""
        if self.clipping != RANDOMIZED or self.per_example(physical_batch_size):
            return None
        return sketch_of(self.options())


PrivacyArguments = make_dataclass(
    "PrivacyArguments", [_field(spec) for spec in _FIELDS], bases=(_PrivacyArgumentsMethods,),
    namespace={"__doc__": _PrivacyArgumentsMethods.__doc__, "__module__": __name__},
)

_dataclass_init = PrivacyArguments.__init__


@functools.wraps(_dataclass_init)
def _init_known_fields_only(self: PrivacyArguments, *args: Any, **kwargs: Any) -> None:
    """The dataclass's ``__init__``, after refusing a keyword that is not a field with a
    ValueError naming it and the nearest field (a misspelt option must not silently run at
    its default)."""
    refuse_unknown(kwargs, [f.name for f in fields(PrivacyArguments)], "PrivacyArguments")
    _dataclass_init(self, *args, **kwargs)


PrivacyArguments.__init__ = _init_known_fields_only


def _positive(x: Any) -> bool:
    return finite_real(x) and x > 0


__all__ = ["PrivacyArguments", "CLIPPINGS", "DENOISERS", "PLUGIN_FIELDS", "PRIVATE_LOG_KEYS", "LOSS_LOG_KEYS"]
