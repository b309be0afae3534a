"""One rank of the two-process DPTrainer test (tests/hf/test_trainer.py), launched with
``python -m torch.distributed.run --nproc_per_node 2 tests/hf/trainer_ddp_worker.py OUT SIGMA CLIPPING``
(CLIPPING: "randomized", "flat", "per_example" (randomized, one row per backward pass), "users"
(privacy_unit="user", tests/hf/test_trainer_users.py), "banded_trainer" or "banded_sft" (noise="banded",
tests/hf/test_trainer_banded.py), "cells" (the compatibility matrix's cells of two ranks,
tests/hf/test_trainer_cells.py), or a refusal scenario)
(gloo on CPU). Each rank saves what it trained on and where it ended."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import tests.hf.test_trainer as t  # noqa: E402  (the repository root on the path: tests.models too)


def refused_last_step(out: str) -> None:
    """Both ranks: adamw_torch_fused, every per-example loss NaN at the last of 2 steps
    (tests/hf/test_trainer_privacy_paths.py's one-process test, under DDP): train() must raise."""
    import pathlib

    import tests.hf.test_trainer_privacy_paths as h

    trainer = h.nan_at_step(1)(
        model=h.tiny("llama"), args=h.args(pathlib.Path(out), optim="adamw_torch_fused", max_steps=2,
                                           learning_rate=1e-2, per_device_train_batch_size=2),
        train_dataset=h.Rows(), privacy=h.privacy(sample_rate=0.5),
    )
    try:
        trainer.train()
        raised = ""
    except FloatingPointError as error:
        raised = str(error)
    torch.save({"raised": raised, "global_step": trainer.state.global_step},
               os.path.join(out, f"rank{os.environ['RANK']}.pt"))
    torch.distributed.destroy_process_group()


def shuffled_loader(out: str) -> None:
    """Both ranks: a DPTrainer subclass whose get_train_dataloader returns fixed shuffled
    batches (tests/hf/test_trainer_privacy_paths.py's one-process test, under DDP): refused."""
    import pathlib

    import tests.hf.test_trainer_privacy_paths as h

    trainer = h.loader_trainer(h.ShuffledLoader, pathlib.Path(out))
    try:
        trainer.train()
        raised = ""
    except ValueError as error:
        raised = str(error)
    torch.save({"raised": raised, "steps": trainer.privacy_steps()}, os.path.join(out, f"rank{os.environ['RANK']}.pt"))
    torch.distributed.destroy_process_group()


def users(out: str) -> None:
    """Both ranks, privacy_unit="user" (tests/hf/test_trainer_users.py's ``train``): each
    run of ``USER_RUNS`` saved with what each rank trained on and where it ended."""
    import pathlib

    import tests.hf.test_trainer_users as u

    results = {}
    for name, (per_device, accumulation, privacy) in u.USER_RUNS.items():
        model, _, trainer = u.train(pathlib.Path(out) / name, per_device, accumulation, privacy, max_steps=3,
                                    logging_steps=3)
        results[name] = {
            "recorded": trainer.recorded,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "history": trainer.accountant.history,
            "epsilon": trainer.get_epsilon(),
            "optimizer": type(trainer._dp_optimizer).__name__,
            "expected_batch_size": trainer.expected_batch_size,
            "sample_rate": trainer.sample_rate,
        }
    torch.save(results, os.path.join(out, f"rank{os.environ['RANK']}.pt"))
    torch.distributed.destroy_process_group()


def users_sharded(out: str) -> None:
    """Rank r given its own shard of the rows (r, r + 2, ...) and their authors, privacy_unit="user":
    refused at construction on both ranks (a user in both shards would be clipped on both)."""
    import pathlib

    import tests.hf.test_trainer_users as u

    rank = int(os.environ["RANK"])
    data = u.user_dataset()
    try:
        u.DPTrainer(model=u.tiny_llama(), args=t.training_args(pathlib.Path(out), per_device_train_batch_size=1),
                    train_dataset=data.select(range(rank, len(data), 2)),
                    privacy=u.arguments(privacy_unit="user", user_column="author"))
        raised = ""
    except ValueError as error:
        raised = str(error)
    torch.save({"raised": raised}, os.path.join(out, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def banded(out: str, kind: str) -> None:
    """Both ranks, noise="banded" (tests/hf/test_trainer_banded.py): 2 steps with a checkpoint,
    then every rank resumes from it to 4 steps; each rank saves what each run recorded."""
    import pathlib

    import tests.hf.test_trainer_banded as b

    first = b.ddp_banded_run(pathlib.Path(out), kind, max_steps=2)
    torch.distributed.barrier()  # rank 0 has written the checkpoint
    resumed = b.ddp_banded_run(pathlib.Path(out), kind, max_steps=4, resume=os.path.join(out, "out", "checkpoint-2"))
    torch.save({"first": first, "resumed": resumed}, os.path.join(out, f"rank{os.environ['RANK']}.pt"))
    torch.distributed.destroy_process_group()


def cells(out: str) -> None:
    """Both ranks, every cell of tests/hf/test_trainer_cells.py's ``DDP_CELLS`` (sigma 0), each
    rank's model seeded with its rank (rank 0's is broadcast): what each run recorded."""
    import pathlib

    import tests.hf.test_trainer_cells as c

    rank = int(os.environ["RANK"])
    results = {cell: c.cell_run(pathlib.Path(out) / "-".join(cell), *cell, seed=rank) for cell in c.DDP_CELLS}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def main(out: str, sigma: float, clipping: str) -> None:
    import pathlib

    torch.set_num_threads(1)
    if clipping == "refused_last_step":
        return refused_last_step(out)
    if clipping == "shuffled_loader":
        return shuffled_loader(out)
    if clipping == "users":
        return users(out)
    if clipping == "users_sharded":
        return users_sharded(out)
    if clipping == "cells":
        return cells(out)
    if clipping == "banded_shifted":
        import pathlib

        import tests.hf.test_trainer_banded as b

        torch.save(b.ddp_shifted_draws(pathlib.Path(out)), os.path.join(out, f"rank{os.environ['RANK']}.pt"))
        return torch.distributed.destroy_process_group()
    if clipping.startswith("banded_"):
        return banded(out, clipping[len("banded_"):])
    model = t.tiny_llama(seed=int(os.environ["RANK"]))  # different on purpose: rank 0's is broadcast
    trainer = t.recording(t.DPTrainer)(
        model=model,
        args=t.training_args(pathlib.Path(out), per_device_train_batch_size=t.PER_DEVICE // 2, logging_steps=1),
        train_dataset=t.RowDataset(),
        optimizers=(torch.optim.SGD(model.parameters(), lr=0.5), None),
        privacy=t.PrivacyArguments(
            noise_multiplier=sigma, delta=1e-5, max_grad_norm=0.05, log_train_loss=clipping == "flat",
            **({"clipping": "randomized", "per_example_backward": True} if clipping == "per_example"
               else {"clipping": clipping, **({"sketch_size": 32} if clipping == "randomized" else {})})),
    )
    trainer.train()
    torch.save(
        {
            "recorded": trainer.recorded,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "history": trainer.accountant.history,
            "epsilon": [e.get("epsilon") for e in trainer.state.log_history],
            "loss": [e.get("loss") for e in trainer.state.log_history if "learning_rate" in e],
            "world_size": trainer.args.world_size,
            "expected_batch_size": trainer.expected_batch_size,
        },
        os.path.join(out, f"rank{os.environ['RANK']}.pt"),
    )
    # gloo's threads outlive an exit without this, and a rank could abort at teardown
    # ("terminate called without an active exception") after its results were saved
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3])
