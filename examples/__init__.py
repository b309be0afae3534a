"""Examples and the helpers they stand on, outside the runtime package ``opacus_rc``.

Scripts run as ``python examples/NAME.py``; the helpers are imported from the repository root
as ``examples.models`` (small decoders, the pretrained MiniLM encoder), ``examples.text_data``
(offline text data packages) and ``examples.profiling`` (operator-level allocation counters),
also by ``benchmarks/``, ``tests/`` and ``notebooks/``.
"""

import os


def one_thread_unless_set() -> int:
    """One intra-op torch thread unless ``OMP_NUM_THREADS`` is set, as the test script does:
    on a loaded 2-core machine a second thread mostly waits for the first at every parallel
    region (examples/demo.py at load 7.5 to 10: 99 s with one thread, 258 s with two; issue
    48). The examples call it first in ``main``; the thread count is returned."""
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    return torch.get_num_threads()
