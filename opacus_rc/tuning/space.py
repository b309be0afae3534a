"""The search space: Hugging Face's ``hp_space`` convention (a function of an Optuna-style trial
returning a dict), or a dict of lists; sampled at random, each trial independently of the
others' results, and enumerated for the accounting.

``hp_space(trial)`` may call ``trial.suggest_float(name, low, high, *, step=None, log=False)``,
``trial.suggest_int(name, low, high, step=1, log=False)`` and
``trial.suggest_categorical(name, choices)``, and return any dict computed from the values.
It is called once with a recording trial (each suggestion returns its first value) to learn
the suggestions, which must not depend on earlier ones (no conditional spaces); each
trial then draws every suggestion independently, from the search's secret generator.
A dict space ``{"learning_rate": [0.01, 0.1], "epochs": 3}`` is the same as suggesting each list
with ``suggest_categorical`` and keeping each other value fixed.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

CATEGORICAL, FLOAT, INT = "categorical", "float", "int"
#: combinations of the finite suggestions enumerated for the accounting, at most
MAX_COMBINATIONS = 100_000
#: continuous suggestions whose every corner is enumerated, at most (beyond: both ends only)
MAX_CORNERS = 6

HpSpace = Union[Callable[[Any], Dict[str, Any]], Mapping[str, Any]]


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """One suggested value: ``kind`` ``"categorical"`` (``choices``), ``"int"`` or ``"float"``
    (``low``, ``high``, ``step``, ``log``)."""

    name: str
    kind: str
    choices: Tuple[Any, ...] = ()
    low: float = 0.0
    high: float = 0.0
    step: Optional[float] = None
    log: bool = False

    @property
    def values(self) -> Optional[Tuple[Any, ...]]:
        """Every value it can take, when finitely many (None: a continuous range)."""
        if self.kind == CATEGORICAL:
            return self.choices
        if self.kind == INT or self.step is not None:
            step = self.step if self.step is not None else 1
            n = int(math.floor((self.high - self.low) / step + 1e-9)) + 1
            cast = int if self.kind == INT else float
            return tuple(cast(self.low + i * step) for i in range(n))
        return None

    @property
    def ends(self) -> Tuple[Any, ...]:
        return (self.low, self.high)

    def draw(self, u: float) -> Any:
        """The value at uniform ``u`` in [0, 1): uniform over the choices or the grid, else
        uniform (log-uniform with ``log``) over ``[low, high]``."""
        values = self.values
        if values is not None and not (self.log and self.kind == INT):
            return values[min(int(u * len(values)), len(values) - 1)]
        if self.kind == INT:  # log-uniform over [low, high + 1), floored
            return min(int(math.floor(math.exp(math.log(self.low) + u * math.log((self.high + 1) / self.low)))), self.high)
        if self.log:
            return math.exp(math.log(self.low) + u * (math.log(self.high) - math.log(self.low)))
        return self.low + u * (self.high - self.low)


def _number(name: str, value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"hp_space: {what} of {name!r} is {value!r}; accepted values: a finite number")
    return value


class _Recorder:
    """The trial ``hp_space`` is first called with: records each suggestion, returns its first value."""

    def __init__(self) -> None:
        self.suggestions: Dict[str, Suggestion] = {}
        self.number = 0
        self.params: Dict[str, Any] = {}

    def _add(self, s: Suggestion) -> Any:
        known = self.suggestions.get(s.name)
        if known is not None and known != s:
            raise ValueError(f"hp_space: {s.name!r} is suggested twice with different ranges ({known} and {s})")
        self.suggestions[s.name] = s
        value = s.choices[0] if s.kind == CATEGORICAL else s.low
        self.params[s.name] = value
        return value

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        choices = tuple(choices)
        if not choices:
            raise ValueError(f"hp_space: suggest_categorical({name!r}, choices=()): accepted values: at least one choice")
        return self._add(Suggestion(name, CATEGORICAL, choices=choices))

    def suggest_float(self, name: str, low: float, high: float, *, step: Optional[float] = None, log: bool = False) -> Any:
        low, high = _number(name, low, "low"), _number(name, high, "high")
        if not low <= high or (log and low <= 0) or (step is not None and (log or not _number(name, step, "step") > 0)):
            raise ValueError(f"hp_space: suggest_float({name!r}, {low!r}, {high!r}, step={step!r}, log={log!r}); "
                             "accepted values: low <= high, low > 0 with log=True, step > 0 without log")
        return self._add(Suggestion(name, FLOAT, low=float(low), high=float(high), step=step, log=bool(log)))

    def suggest_int(self, name: str, low: int, high: int, step: int = 1, log: bool = False) -> Any:
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high, step))
        if not ints or not low <= high or step < 1 or (log and (low < 1 or step != 1)):
            raise ValueError(f"hp_space: suggest_int({name!r}, {low!r}, {high!r}, step={step!r}, log={log!r}); "
                             "accepted values: integers low <= high, step >= 1, low >= 1 and step 1 with log=True")
        return self._add(Suggestion(name, INT, low=low, high=high, step=step, log=bool(log)))


class SampledTrial:
    """The trial ``hp_space`` is called with for each trial: every suggestion returns the value
    drawn for it (``params``); a suggestion the recording call did not make is refused."""

    def __init__(self, params: Dict[str, Any], suggestions: Mapping[str, Suggestion]) -> None:
        self.params = dict(params)
        self._suggestions = suggestions
        self.number = 0  # no trial numbers: the number of trials is secret

    def _value(self, name: str, kind: str) -> Any:
        s = self._suggestions.get(name)
        if s is None or s.kind != kind:
            raise ValueError(
                f"hp_space suggested {name!r} ({kind}) only for some values of the others: conditional search "
                "spaces are not supported (suggest every parameter on every call)"
            )
        return self.params[name]

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        return self._value(name, CATEGORICAL)

    def suggest_float(self, name: str, low: float, high: float, *, step: Optional[float] = None, log: bool = False) -> Any:
        return self._value(name, FLOAT)

    def suggest_int(self, name: str, low: int, high: int, step: int = 1, log: bool = False) -> Any:
        return self._value(name, INT)


class Space:
    """A search space (module docstring): :meth:`draw` a trial's ``(params, config)``,
    :meth:`enumerate` configs covering every privacy-relevant value."""

    def __init__(self, hp_space: HpSpace) -> None:
        if isinstance(hp_space, Mapping):
            self._fixed = {k: v for k, v in hp_space.items() if not isinstance(v, (list, tuple))}
            recorder = _Recorder()
            for name, value in hp_space.items():
                if isinstance(value, (list, tuple)):
                    recorder.suggest_categorical(name, value)
            self._function: Optional[Callable[[Any], Dict[str, Any]]] = None
        elif callable(hp_space):
            recorder = _Recorder()
            first = hp_space(recorder)
            if not isinstance(first, Mapping):
                raise ValueError(f"hp_space returned {type(first).__name__}; accepted values: a dict of hyperparameters")
            self._fixed, self._function = {}, hp_space
        else:
            raise ValueError(f"hp_space={hp_space!r}; accepted values: a function of a trial returning a dict "
                             "(Hugging Face's convention), or a dict of lists")
        self.suggestions: Dict[str, Suggestion] = recorder.suggestions

    def config(self, params: Mapping[str, Any]) -> Dict[str, Any]:
        """The hyperparameters of a trial whose suggestions took ``params``."""
        if self._function is None:
            return {**self._fixed, **params}
        config = self._function(SampledTrial(dict(params), self.suggestions))
        if not isinstance(config, Mapping):
            raise ValueError(f"hp_space returned {type(config).__name__}; accepted values: a dict of hyperparameters")
        return dict(config)

    def draw(self, uniform: Callable[[], float]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """``(params, config)`` of one trial, each suggestion drawn with one ``uniform()``."""
        params = {name: s.draw(uniform()) for name, s in self.suggestions.items()}
        return params, self.config(params)

    def enumerate(self) -> Iterator[Tuple[Tuple[Any, ...], List[Dict[str, Any]]]]:
        """For each combination of the finite suggestions' values: the configs at the corners of
        the continuous ones (each at ``low`` and ``high``; with more than :data:`MAX_CORNERS`
        of them, all low and all high). Refuses more than :data:`MAX_COMBINATIONS` combinations."""
        finite = [(n, s.values) for n, s in self.suggestions.items() if s.values is not None]
        ranges = [(n, s.ends) for n, s in self.suggestions.items() if s.values is None]
        total = math.prod(len(v) for _, v in finite)
        if total > MAX_COMBINATIONS:
            raise ValueError(
                f"hp_space has {total} combinations of its finite suggestions; accepted values: at most "
                f"{MAX_COMBINATIONS} (the accounting checks every one): draw fewer values"
            )
        if len(ranges) <= MAX_CORNERS:
            corners = list(itertools.product(*[ends for _, ends in ranges]))
        else:
            corners = [tuple(e[0] for _, e in ranges), tuple(e[1] for _, e in ranges)]
        for combo in itertools.product(*[v for _, v in finite]):
            base = dict(zip([n for n, _ in finite], combo))
            yield combo, [self.config({**base, **dict(zip([n for n, _ in ranges], c))}) for c in corners]

    def continuous(self) -> Tuple[str, ...]:
        """The names of the continuous suggestions."""
        return tuple(n for n, s in self.suggestions.items() if s.values is None)


__all__ = ["MAX_COMBINATIONS", "SampledTrial", "Space", "Suggestion"]
