"""Running a test worker on every rank of a CPU (gloo) process group."""

import os
import tempfile
import time

import torch
import torch.multiprocessing as mp

#: seconds a multi-process test may run before its ranks are killed and the test fails (a
#: rank left waiting in a collective would otherwise hang the whole suite)
DEADLINE = float(os.environ.get("OPACUS_RC_SPAWN_DEADLINE", 300))


def spawn(fn, world: int, *args, deadline: float = DEADLINE):
    """Run ``fn(rank, init_file, *args, out_dir)`` on ``world`` processes; returns the
    files ``rank{r}.pt`` each rank saved into ``out_dir``. Raises ``TimeoutError`` (after
    killing the ranks) when they have not all ended within ``deadline`` seconds (default
    :data:`DEADLINE`)."""
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.spawn(fn, args=(os.path.join(tmp, "init"), *args, tmp), nprocs=world, join=False)
        ends = time.monotonic() + deadline
        while not context.join(timeout=max(0.0, min(5.0, ends - time.monotonic()))):
            if time.monotonic() >= ends:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise TimeoutError(f"{fn.__name__}: the ranks did not all end within {deadline:.0f} s")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
