"""A row's identity (its unit, its draw) is carried with it, never re-found by value (docs/forms.md,
"Which batch a forward takes"): loops as they run on a GPU train and equal brute force.

* every batch copied the way ``.to(device)`` copies it (``.clone()`` of every field here), with a
  field equal across batches (an all-ones attention mask), at user level, with banded noise,
  under BatchMemoryManager and in the per-example form (before: "tensors of several batches");
* a collate returning transformers' ``BatchEncoding`` and ``model(**batch)`` (before: "not
  delivered");
* whatever the loop computes from the batch before the forward (normalise, augment, shift,
  permute) keeps the batch's identity (before: "not delivered" under BatchMemoryManager);
* a collate that sorts its rows (longest first) at user level: each row stays in its user's
  unit (before: a user's rows were clipped in other users' units, 2.0 C off);
* a collate that drops or duplicates rows, or whose rows cannot be followed, is refused by name.

Brute force: :mod:`tests.oracles` (autograd on each row alone). Tolerance: 1e-6 absolute on
updates of order 1e-2 (float32 summation order).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List

import pytest
import torch
from opacus import PrivacyEngine
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.utils._pytree import tree_map
from transformers import BatchEncoding

import opacus_rc  # noqa: F401

from tests.models import SequenceClassifier
from tests.oracles import per_example_clipped_mean, per_user_clipped_mean

C, K, T = 0.05, 3, 6
FORMS = {
    "two_pass": dict(grad_sample_mode="ghost", sketch_size=64),
    "bookkeeping": dict(grad_sample_mode="bookkeeping", sketch_size=64),
    "per_example": dict(per_example_backward=True),
}


class Rows(torch.utils.data.Dataset):
    """24 rows as dicts: ``x`` (T token ids), ``mask`` (all ones: equal in every batch), ``y``,
    ``index``; user ``r % 6`` owns row ``r``."""

    def __init__(self, n: int = 24):
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 32, (n, T), generator=gen)
        self.y = torch.randint(0, 2, (n,), generator=gen)
        self.owners = [r % 6 for r in range(n)]

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, r: int) -> Dict[str, torch.Tensor]:
        return {"x": self.x[r], "mask": torch.ones(T, dtype=torch.long), "y": self.y[r], "index": torch.tensor(r)}


class ByName(nn.Module):
    """A classifier called as ``model(**batch)``: ``x`` and an attention mask (all ones)."""

    def __init__(self):
        super().__init__()
        self.net = SequenceClassifier()

    def forward(self, x, mask=None, **_ignored):
        return self.net(x * mask)


def _ce(model, x, y):
    return nn.functional.cross_entropy(model(x, torch.ones_like(x)), y)


def device_copy(batch: Any) -> Any:
    """What ``batch.to("cuda")`` does to a batch: every tensor a new copy (its container kept)."""
    if isinstance(batch, BatchEncoding):
        return BatchEncoding({k: device_copy(v) for k, v in batch.items()})
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, batch)


def to_batch_encoding(rows: List[Dict[str, torch.Tensor]]) -> BatchEncoding:
    """A collate returning transformers' BatchEncoding (as DataCollatorWithPadding does)."""
    return BatchEncoding({k: torch.stack([r[k] for r in rows]) for k in rows[0]})


def private(form: str, unit: str, *, collate: Callable = None, banded: bool = False, batch_size: int = None):
    """``batch_size``: expected rows (example level, default 8) or users (default 3) per draw."""
    batch_size = batch_size or (3 if unit == "user" else 8)
    torch.manual_seed(0)
    model = ByName()
    reference = copy.deepcopy(model)
    data = Rows()
    units = dict(privacy_unit="user", user_ids=data.owners, max_examples_per_user=K) if unit == "user" else {}
    noise = dict(noise="banded", bands=2) if banded else {}
    engine = PrivacyEngine(accountant="rc_prv")
    out = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), criterion=nn.CrossEntropyLoss(),
        data_loader=torch.utils.data.DataLoader(data, batch_size=batch_size, collate_fn=collate),
        noise_multiplier=0.0, max_grad_norm=C, clipping="randomized", seed=3, **units, **noise, **FORMS[form],
    )
    module, optimizer, *criterion, loader = out
    released = []
    optimizer.original_optimizer.register_step_pre_hook(
        lambda *_: released.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    )
    return dict(module=module, optimizer=optimizer, criterion=criterion[0] if criterion else None, loader=loader,
                reference=reference, data=data, released=released, unit=unit)


def loss_of(run, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    out = run["module"](**{k: v for k, v in batch.items() if k != "y"})
    return run["criterion"](out, batch["y"]) if run["criterion"] is not None else nn.functional.cross_entropy(out, batch["y"])


def train(run, loader, steps: int, transform: Callable = device_copy) -> List[List[int]]:
    """Train on ``loader`` until ``steps`` releases, each batch through ``transform`` first;
    returns each release's rows (in the order the batches held them)."""
    rows, out, optimizer = [], [], run["optimizer"]
    while len(out) < steps:
        for batch in loader:
            batch = transform(batch)
            rows += batch["index"].tolist()
            loss_of(run, batch).backward()
            optimizer.step()
            optimizer.zero_grad()
            if not optimizer._is_last_step_skipped:
                out.append(rows)
                rows = []
                if len(out) == steps:
                    break
    return out


def check(run, releases: List[List[int]], normaliser: float, x_of: Callable = None) -> None:
    """Each release equals brute-force clipping of its rows (per user at user level)."""
    data = run["data"]
    assert any(len(r) > 1 for r in releases), "every release had at most one row: pick another seed"
    for rows, released in zip(releases, run["released"]):
        index = torch.tensor(rows, dtype=torch.long)
        x = data.x[index] if x_of is None else x_of(data.x[index])
        y = data.y[index]
        if run["unit"] == "user":
            want = per_user_clipped_mean(run["reference"], _ce, x, y, [data.owners[r] for r in rows], C, normaliser)
        else:
            want = per_example_clipped_mean(run["reference"], _ce, x, y, C, normaliser)
        for name, value in released.items():
            torch.testing.assert_close(value, want[name], atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")


def _normaliser(run) -> float:
    return run["optimizer"].expected_batch_size


# --- device copies and BatchEncoding ---------------------------------------------------------


@pytest.mark.parametrize("container", ["dict", "batch_encoding"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_user_level_device_copies_train_and_equal_brute_force(form, container):
    """privacy_unit="user": every field of every batch copied (an all-ones mask equal in every
    batch), dict or BatchEncoding batches, ``model(**batch)``."""
    run = private(form, "user", collate=to_batch_encoding if container == "batch_encoding" else None)
    releases = train(run, run["loader"], 3)
    check(run, releases, _normaliser(run))


@pytest.mark.parametrize("unit", ["example", "user"])
def test_banded_device_copies_train_and_equal_brute_force(unit):
    run = private("bookkeeping", unit, banded=True)
    releases = train(run, run["loader"], 3)
    check(run, releases, _normaliser(run))


@pytest.mark.parametrize("container", ["dict", "batch_encoding"])
@pytest.mark.parametrize("form", ["bookkeeping", "two_pass"])
def test_batch_memory_manager_device_copies_train_and_equal_brute_force(form, container):
    """Example level, BatchMemoryManager over the returned loader (physical batches of 2 rows):
    an Opacus script with a BatchEncoding collate and device copies (trained on 0b1aff9, refused
    at the first batch on e8eb7d9)."""
    run = private(form, "example", collate=to_batch_encoding if container == "batch_encoding" else None)
    with BatchMemoryManager(data_loader=run["loader"], max_physical_batch_size=2, optimizer=run["optimizer"]) as split:
        releases = train(run, split, 3)
    check(run, releases, _normaliser(run))


# --- what the loop computes from the batch --------------------------------------------------

TRANSFORMS = {
    # token ids: a remapping the brute force applies too (a "normalisation" of the ids)
    "normalise": (lambda b: {**device_copy(b), "x": (b["x"] * 7 + 3) % 32}, lambda x: (x * 7 + 3) % 32),
    "flip": (lambda b: {**device_copy(b), "x": b["x"].flip(1)}, lambda x: x.flip(1)),  # an augmentation
    "roll": (lambda b: {**device_copy(b), "x": torch.roll(b["x"], 1, dims=1)}, lambda x: torch.roll(x, 1, dims=1)),
    "cast": (lambda b: {k: v.to(torch.int32) if k == "x" else v.clone() for k, v in b.items()}, None),
}


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("unit", ["example", "user"])
def test_what_the_loop_computes_from_the_batch_keeps_its_identity(transform, unit):
    """The per-example form (example level: its loader splits each draw into one-row batches;
    user level: a user's rows over several backward passes) with a row-wise transform in the
    loop: trains and equals brute force on the transformed rows."""
    run = private("per_example", unit)
    step, x_of = TRANSFORMS[transform]
    releases = train(run, run["loader"], 2, transform=step)
    check(run, releases, _normaliser(run), x_of=x_of)


# --- a collate that sorts (user level) ------------------------------------------------------


def longest_first(rows: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """A collate that sorts its rows (by their token sum, descending: as ``pack_padded_sequence``
    sorts by length) and stacks them."""
    rows = sorted(rows, key=lambda r: -int(r["x"].sum()))
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def longest_first_tuples(rows):
    """The same for tuple rows, stacking with ``pad_sequence`` (no padding at equal lengths)."""
    rows = sorted(rows, key=lambda r: -int(r["x"].sum()))
    return {"x": nn.utils.rnn.pad_sequence([r["x"] for r in rows], batch_first=True),
            "mask": torch.stack([r["mask"] for r in rows]), "y": torch.stack([r["y"] for r in rows]),
            "index": torch.stack([r["index"] for r in rows])}


def dropping_the_key(rows):
    """A collate that sorts, drops unknown keys and rebuilds its tensors from Python lists (no
    position carried): the rows are matched by their values."""
    rows = sorted(rows, key=lambda r: -int(r["x"].sum()))
    return {k: torch.tensor([r[k].tolist() for r in rows]) for k in ("x", "mask", "y", "index")}


@pytest.mark.parametrize("collate", [longest_first, longest_first_tuples, dropping_the_key],
                         ids=["stack", "pad_sequence", "by_values"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_sorting_collate_keeps_each_row_in_its_users_unit(form, collate):
    run = private(form, "user", collate=collate)
    releases = train(run, run["loader"], 3)
    sorted_somewhere = any(r != sorted(r, key=lambda i: -int(run["data"].x[i].sum())) or len(r) > 1 for r in releases)
    assert sorted_somewhere
    check(run, releases, _normaliser(run))


def test_collates_that_drop_duplicate_or_lose_rows_are_refused_by_name():
    """User level: a collate that drops a row, one that duplicates a row, and one whose rows
    cannot be followed (tuple rows rebuilt from numpy, no mapping key) are refused by name."""
    def drop(rows):
        return longest_first(rows[1:])

    def duplicate(rows):
        return longest_first(rows + rows[:1])

    for collate, match in ((drop, "each row it is given once"), (duplicate, "each row it is given once")):
        run = private("bookkeeping", "user", collate=collate)
        with pytest.raises(ValueError, match=f"privacy_unit='user'.*{match}"):
            train(run, run["loader"], 1)

    def numpy_tuples(rows):
        rows = sorted(rows, key=lambda r: -int(r["x"].sum()))
        return [torch.from_numpy(torch.stack([r[k] for r in rows]).numpy().copy()) for k in ("x", "mask", "y", "index")]

    run = private("bookkeeping", "user", collate=numpy_tuples)
    with pytest.raises(ValueError, match="privacy_unit='user'.*cannot be followed"):
        next(iter(run["loader"]))


# --- which batch a forward takes ------------------------------------------------------------


def test_a_validation_forward_in_train_mode_is_refused_with_its_cause():
    """After the loader's batches are all taken, a forward in train mode with gradients on (a
    validation forward without model.eval()/no_grad) is refused naming that cause; under
    torch.no_grad() it runs."""
    run = private("bookkeeping", "user")
    batches = list(run["loader"])
    for batch in batches:
        loss_of(run, batch).backward()
        run["optimizer"].step()
        run["optimizer"].zero_grad()
    with torch.no_grad():
        run["module"](**{k: v for k, v in batches[0].items() if k != "y"})
    with pytest.raises(ValueError, match="no batch of the loader make_private returned was pending.*validation"):
        run["module"](**{k: v for k, v in batches[0].items() if k != "y"})


def test_a_skipped_batch_is_never_released_and_the_next_one_is_taken():
    """On the very tensors the loader delivered (no copy), a loop that skips a batch trains the
    next one with the next one's units (a user's rows stay theirs)."""
    run = private("two_pass", "user")
    releases, skipped = [], 0
    for batch in run["loader"]:
        if len(batch["index"]) and not skipped:
            skipped = 1
            continue
        loss_of(run, batch).backward()
        run["optimizer"].step()
        run["optimizer"].zero_grad()
        releases.append(batch["index"].tolist())
        if len(releases) == 3:
            break
    check(run, releases, _normaliser(run))


def test_two_batches_before_one_step_are_refused_also_when_listed_first():
    """``list(loader)`` then two forwards before one step: the second forward's tensors are the
    second batch's, so the step is refused as two batches (not released as the first's)."""
    run = private("two_pass", "user", batch_size=2)
    batches = [b for b in list(run["loader"]) if len(b["index"])][:2]  # one iteration: both delivered, in order
    assert len(batches) == 2, "fewer than two non-empty draws: pick another seed"
    loss_of(run, batches[0]).backward()
    with pytest.raises(ValueError, match="followed 2 physical batches|exactly one optimizer.step"):
        loss_of(run, batches[1]).backward()
        run["optimizer"].step()


def test_a_sorting_collate_in_worker_processes_with_pinned_memory():
    """The collate runs in 2 worker processes (prefetching ahead) with pin_memory: the positions
    are read and stripped in the workers, the script gets plain tensors, and each release equals
    brute force per user."""
    torch.manual_seed(0)
    model = ByName()
    reference = copy.deepcopy(model)
    data = Rows()
    engine = PrivacyEngine(accountant="rc_prv")
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=torch.utils.data.DataLoader(data, batch_size=3, collate_fn=longest_first, num_workers=2,
                                                pin_memory=torch.cuda.is_available()),
        noise_multiplier=0.0, max_grad_norm=C, clipping="randomized", seed=3, privacy_unit="user",
        user_ids=data.owners, max_examples_per_user=K, **FORMS["bookkeeping"],
    )
    released = []
    optimizer.original_optimizer.register_step_pre_hook(
        lambda *_: released.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    )
    run = dict(module=module, optimizer=optimizer, criterion=None, reference=reference, data=data,
               released=released, unit="user")
    seen = []
    releases = train(run, loader, 3, transform=lambda b: seen.append(type(b["x"])) or b)
    assert set(seen) == {torch.Tensor}
    check(run, releases, optimizer.expected_batch_size)
