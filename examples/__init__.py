"""Examples and the helpers they stand on, outside the runtime package ``opacus_rc``.

Scripts run as ``python examples/NAME.py``; the helpers are imported from the repository root
as ``examples.models`` (small decoders, the pretrained MiniLM encoder), ``examples.text_data``
(offline text data packages) and ``examples.profiling`` (operator-level allocation counters),
also by ``benchmarks/``, ``tests/`` and ``notebooks/``.
"""
