"""Running a test worker on every rank of a CPU (gloo) process group."""

import os
import tempfile

import torch
import torch.multiprocessing as mp


def spawn(fn, world: int, *args):
    """Run ``fn(rank, init_file, *args, out_dir)`` on ``world`` processes; returns the
    files ``rank{r}.pt`` each rank saved into ``out_dir``."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(fn, args=(os.path.join(tmp, "init"), *args, tmp), nprocs=world, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
