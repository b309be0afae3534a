"""Small models built from configs (random init) for demos, benchmarks and tests, and the
pretrained MiniLM encoder helpers (:mod:`examples.models.minilm`, loaded lazily: importing
this package never imports transformers)."""

import importlib
from typing import Any

from .decoder import TinyDecoder, markov_text

__all__ = ["TinyDecoder", "markov_text", "minilm"]


def __getattr__(name: str) -> Any:
    if name == "minilm":
        return importlib.import_module(".minilm", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
