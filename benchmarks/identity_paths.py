"""Issue 52's paths, measured on whatever ``opacus_rc`` is importable (run it once per checkout:
``PYTHONPATH=<checkout> python -m benchmarks.identity_paths --json out.json``), so that the
figures before and after a change come from one script. Public API only (``make_private``, the
returned loader and optimizer), so an older checkout runs it too.

Paths (sigma 0, brute force by hand unless said):

* ``added_user``: user level, banded noise (b = 2, rate 1 inside a part): the largest move of a
  release, in units of C, at a step that does not draw the user added in front (0 when no other
  user moves; it was about ``n C / b`` with parts by position).
* ``added_row``: example level, the first release of 400 runs of a dataset and of its neighbour
  with a row added in front (sigma 2.5, b = 2): the fitted Gaussian mu between the two release
  distributions and the Kolmogorov-Smirnov p-value.
* ``sorting_collate``: user level, a collate that sorts its rows: the largest distance of a
  release from brute-force per-user clipping, in units of C.
* ``checkpoint_secrets``: banded noise, the number of kept noise vectors found in a default
  ``save_checkpoint`` file.
* ``device_copy``, ``batch_encoding``, ``transform``: a loop that copies every field (an all-ones
  mask), a ``BatchEncoding`` collate with ``model(**batch)``, a normalisation in the loop: "trained"
  or the refusal's first words.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import math
from typing import Any, Callable, Dict, List

import torch
from opacus import PrivacyEngine
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn

import opacus_rc  # noqa: F401  (registers the plugin)

C = 0.05


class _Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.fc = nn.Embedding(32, 8), nn.Linear(8, 2)

    def forward(self, x, mask=None, **_: Any):
        return self.fc(self.emb(x if mask is None else x * mask)).mean(dim=1)


def _rows(n: int = 24, owners_of: Callable[[int], int] = lambda r: r % 6) -> Dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {"x": torch.randint(0, 32, (n, 6), generator=gen), "y": torch.randint(0, 2, (n,), generator=gen),
            "owners": [owners_of(r) for r in range(n)]}


class _Dicts(torch.utils.data.Dataset):
    def __init__(self, rows: Dict[str, Any]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows["y"])

    def __getitem__(self, r: int) -> Dict[str, torch.Tensor]:
        return {"x": self.rows["x"][r], "mask": torch.ones(6, dtype=torch.long), "y": self.rows["y"][r],
                "index": torch.tensor(r)}


def _private(rows, *, unit: str, collate=None, batch_size: int = 3, **options):
    model = _Classifier()
    reference = copy.deepcopy(model)
    users = dict(privacy_unit="user", user_ids=rows["owners"], max_examples_per_user=4) if unit == "user" else {}
    engine = PrivacyEngine(accountant="rc_prv")
    module, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        criterion=nn.CrossEntropyLoss(reduction="sum"), loss_reduction="sum",
        data_loader=torch.utils.data.DataLoader(_Dicts(rows), batch_size=batch_size, collate_fn=collate),
        noise_multiplier=0.0, max_grad_norm=C, clipping="randomized", grad_sample_mode="ghost", seed=5,
        **users, **options,
    )
    released: List[torch.Tensor] = []
    optimizer.original_optimizer.register_step_pre_hook(
        lambda *_: released.append(torch.cat([p.grad.double().reshape(-1) for p in model.parameters()]))
    )
    return engine, module, optimizer, criterion, loader, released, reference


def _train(module, optimizer, criterion, loader, steps: int, transform=lambda b: b) -> List[List[int]]:
    rows, out = [], []
    while len(out) < steps:
        for batch in loader:
            batch = transform(batch)
            rows += batch["index"].tolist()
            out_ = module(**{k: v for k, v in batch.items() if k in ("x", "mask")})
            criterion(out_, batch["y"]).backward()
            optimizer.step()
            optimizer.zero_grad()
            if not optimizer._is_last_step_skipped:
                out.append(rows)
                rows = []
                if len(out) == steps:
                    break
    return out


def _user_clipped_sum(reference: nn.Module, rows: Dict[str, Any], used: List[int]) -> torch.Tensor:
    """Brute force: per user, the mean of its rows' gradients clipped to C, summed."""
    params = list(reference.parameters())
    total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    for user in dict.fromkeys(rows["owners"][r] for r in used):
        mine = [r for r in used if rows["owners"][r] == user]
        mean = torch.zeros_like(total)
        for r in mine:
            loss = nn.functional.cross_entropy(reference(rows["x"][r][None]), rows["y"][r][None], reduction="sum")
            mean += torch.cat([g.double().reshape(-1) for g in torch.autograd.grad(loss, params)]) / len(mine)
        total += mean * min(1.0, C / (float(mean.norm()) + 1e-6))
    return total


def added_user() -> float:
    def releases(added: bool):
        rows = _rows(24, lambda r: 10 + r % 8)
        if added:
            extra = _rows(3)
            rows = {"x": torch.cat([extra["x"], rows["x"]]), "y": torch.cat([extra["y"], rows["y"]]),
                    "owners": [99, 99, 99] + rows["owners"]}
        _, module, optimizer, criterion, loader, released, _ = _private(
            rows, unit="user", batch_size=4, sample_rate=0.5, noise="banded", bands=2)  # rate 1 inside a part
        used = _train(module, optimizer, criterion, loader, 4)
        return released, [{rows["owners"][r] for r in u} for u in used]

    base, _ = releases(False)
    neighbour, users = releases(True)
    moves = [float((n - b).norm()) / C for n, b, u in zip(neighbour, base, users) if 99 not in u]
    return max(moves) if moves else float("nan")


def added_row(runs: int = 400) -> Dict[str, float]:
    from scipy import stats

    from opacus_rc.units import CyclicPoissonSampler

    values = torch.tensor([1.0 if r % 2 == 0 else -1.0 for r in range(48)], dtype=torch.float64)

    def first(v: torch.Tensor, seed: int) -> float:
        sampler = CyclicPoissonSampler(None, 0.5, 2, torch.Generator().manual_seed(seed), steps=1, num_units=len(v))
        (_, rows), = sampler.numbered_draws()
        z = torch.randn((), generator=torch.Generator().manual_seed(10**6 + seed), dtype=torch.float64)
        return float(v[rows].sum()) + 2.5 * float(z)

    base = torch.tensor([first(values, s) for s in range(runs)])
    added = torch.tensor([first(torch.cat([values[:1], values]), s) for s in range(runs, 2 * runs)])
    mu = float((added.mean() - base.mean()).abs() / math.sqrt((base.var() + added.var()).item() / 2))
    return {"mu": mu, "ks_pvalue": float(stats.ks_2samp(base.numpy(), added.numpy()).pvalue)}


def sorting_collate() -> float:
    rows = _rows()

    def longest_first(batch):
        batch = sorted(batch, key=lambda r: -int(r["x"].sum()))
        return {k: torch.stack([r[k] for r in batch]) for k in ("x", "mask", "y", "index")}

    _, module, optimizer, criterion, loader, released, reference = _private(rows, unit="user", collate=longest_first)
    used = _train(module, optimizer, criterion, loader, 3)
    return max(float((r - _user_clipped_sum(reference, rows, u)).norm()) / C for r, u in zip(released, used))


def checkpoint_secrets() -> int:
    rows = _rows()
    engine, module, optimizer, criterion, loader, _, _ = _private(rows, unit="example", batch_size=6,
                                                                  noise="banded", bands=3)
    _train(module, optimizer, criterion, loader, 3)
    buffer = io.BytesIO()
    engine.save_checkpoint(path=buffer, module=module, optimizer=optimizer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    banded = getattr(optimizer, "banded", None)
    kept = getattr(banded, "kept", None)
    state = kept.state_dict() if kept is not None else banded.state_dict()
    vectors = [v for past in state["past"].values() for v in past]
    leaves = torch.utils._pytree.tree_leaves(saved)
    return sum(any(isinstance(t, torch.Tensor) and t.shape == v.shape and torch.equal(t, v) for t in leaves)
               for v in vectors)


def _outcome(run: Callable[[], Any]) -> str:
    try:
        run()
        return "trained"
    except ValueError as error:
        return "refused: " + str(error)[:90]


def loops() -> Dict[str, str]:
    from transformers import BatchEncoding

    rows = _rows()

    def copied(batch):
        return {k: v.clone() for k, v in batch.items()}

    def encoding(batch):
        return BatchEncoding({k: torch.stack([r[k] for r in batch]) for k in batch[0]})

    def user_copies(**form):
        _, module, optimizer, criterion, loader, *_ = _private(rows, unit="user", **form)
        _train(module, optimizer, criterion, loader, 3, transform=copied)

    def bmm(collate=None, transform=copied):
        _, module, optimizer, criterion, loader, *_ = _private(rows, unit="example", batch_size=8, collate=collate)
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=optimizer) as split:
            _train(module, optimizer, criterion, split, 3, transform=transform)

    return {
        "device_copy_user_level": _outcome(user_copies),
        "device_copy_user_level_per_example": _outcome(lambda: user_copies(per_example_backward=True)),
        "device_copy_batch_memory_manager": _outcome(bmm),
        "batch_encoding_batch_memory_manager": _outcome(lambda: bmm(encoding, lambda b: BatchEncoding(copied(b)))),
        "transform_batch_memory_manager": _outcome(
            lambda: bmm(None, lambda b: {"x": (b["x"] * 7 + 3) % 32, "y": b["y"].clone(), "index": b["index"]})),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    figures = {
        "opacus_rc": opacus_rc.__file__,
        "added_user_max_move_in_C": added_user(),
        "added_row": added_row(),
        "sorting_collate_max_error_in_C": sorting_collate(),
        "kept_vectors_in_default_checkpoint": checkpoint_secrets(),
        **loops(),
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
