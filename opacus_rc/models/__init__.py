"""Small models built from configs (random init) for demos, benchmarks and tests."""

from .decoder import TinyDecoder, markov_text

__all__ = ["TinyDecoder", "markov_text"]
