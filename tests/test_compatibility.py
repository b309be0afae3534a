"""Which feature runs where: the compatibility matrix (docs/compatibility.md is written from here).

A cell is (entry, engine, form, privacy unit, noise); each either **equals brute force**, naming
the test that shows it at sigma 0 against per-example (per-user) clipping computed with plain
autograd, or is **refused**, with the reason the code gives. The document and the code cannot
drift apart:

* :func:`test_the_document_is_the_matrix` renders the tables below and compares them with
  docs/compatibility.md (``OPACUS_RC_WRITE_COMPATIBILITY=1`` rewrites it);
* :func:`test_every_named_test_exists` imports every test a cell names, and
  :func:`test_the_trainer_cells_are_those_tested` checks that the cells naming
  tests/hf/test_trainer_cells.py's tests are the cases they run;
* :func:`test_one_process_cell_equals_brute_force` is the evidence of every one-process cell of
  the plain loop and of BatchMemoryManager (each form, unit and noise), two releases at sigma 0
  against :mod:`tests.oracles`, and :func:`test_ddp_cell_equals_brute_force_gloo` of every DDP
  cell of the plain loop (2 gloo ranks, the union of their draws); the other cells name the tests
  of their own modules (FSDP2, the Trainer, TRL), which run in the suites.
"""

from __future__ import annotations

import copy
import importlib
import itertools
import os
import pathlib
from typing import Dict, List, Optional, Tuple

import pytest
import torch
from opacus import PrivacyEngine
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn

import opacus_rc  # noqa: F401

from tests.models import CheckpointedSequenceClassifier, SequenceClassifier
from tests.oracles import per_example_clipped_mean, per_user_clipped_mean

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCUMENT = ROOT / "docs" / "compatibility.md"

PLAIN, BMM, TRAINER, TRL = "plain loop", "BatchMemoryManager", "DPTrainer", "TRL SFTTrainer"
PACKED = "TRL SFTTrainer, padding_free=True"
ONE, DDP, FSDP2 = "one process", "DDP (2 gloo ranks)", "FSDP2 (2 gloo ranks)"
#: the forms a make_private loop can get (docs/forms.md) and the options that choose each
FORMS = {
    "two_pass": dict(grad_sample_mode="ghost"),
    "bookkeeping": dict(grad_sample_mode="bookkeeping"),
    "bookkeeping_with_criterion": dict(grad_sample_mode="ghost", bookkeeping=True),
    "output_passes": dict(grad_sample_mode="hooks", bookkeeping=False),
    "per_example": dict(per_example_backward=True),
}
#: the forms the private Trainer chooses (book-keeping; output passes on a checkpointed model;
#: the per-example form at one row a physical batch)
TRAINER_FORMS = ("bookkeeping", "output_passes", "per_example")
UNITS, NOISES = ("example", "user"), ("independent", "banded")

Cell = Tuple[str, str, str, str, str]  # (entry, engine, form, unit, noise)

_MATRIX = "tests/test_compatibility.py::test_one_process_cell_equals_brute_force"
_TRAINER_CELLS = "tests/hf/test_trainer_cells.py::test_trainer_cell_equals_brute_force"
_TRAINER_CELLS_DDP = "tests/hf/test_trainer_cells.py::test_two_gloo_ranks_cells_equal_brute_force_on_the_union"
_DDP_BANDED = "tests/hf/test_trainer_banded.py::test_two_gloo_ranks_banded_release_is_the_union_of_the_ranks_draws_and_resumes"


def _one_process(entry: str) -> Dict[Cell, str]:
    """The plain loop and BatchMemoryManager in one process: this module's own evidence."""
    return {(entry, ONE, form, unit, noise): _MATRIX
            for form, unit, noise in itertools.product(FORMS, UNITS, NOISES)}


#: every cell and what shows it: a test ("equals brute force") or "refused: <reason>"
MATRIX: Dict[Cell, str] = {
    **_one_process(PLAIN),
    **_one_process(BMM),
    # DDP (Opacus's DPDDP): each rank clips its own rows, rank 0 adds the noise
    **{(PLAIN, DDP, form, unit, noise): "tests/test_compatibility.py::test_ddp_cell_equals_brute_force_gloo"
       for form, unit, noise in itertools.product(FORMS, UNITS, NOISES)},
    # FSDP2: Opacus's ghost_fsdp (two passes under fully_shard)
    (PLAIN, FSDP2, "ghost_fsdp", "example", "independent"): "tests/forms/test_fsdp.py::test_exact_norms_equal_opacus_ghost_fsdp",
    (PLAIN, FSDP2, "ghost_fsdp", "example", "banded"):
        "tests/forms/test_banded.py::test_fsdp_banded_noise_is_sharded_like_the_parameters_gloo",
    **{(PLAIN, FSDP2, "ghost_fsdp", "user", noise):
       "tests/forms/test_user_level_fsdp.py::test_fsdp_user_level_equals_brute_force_per_user_clipping_gloo"
       for noise in NOISES},
    # the private Trainer and TRL, one process
    (TRAINER, ONE, "bookkeeping", "example", "independent"): "tests/hf/test_trainer.py::test_sigma0_equals_plain_loop_and_epsilon_matches",
    (TRAINER, ONE, "output_passes", "example", "independent"): "tests/hf/test_trainer.py::test_gradient_checkpointing_equals_plain_loop",
    (TRAINER, ONE, "per_example", "example", "independent"):
        "tests/hf/test_trainer_per_example.py::test_equals_brute_force_per_example_clipping",
    (TRAINER, ONE, "bookkeeping", "user", "independent"): "tests/hf/test_trainer_users.py::test_update_equals_brute_force_per_user_clipping",
    (TRAINER, ONE, "per_example", "user", "independent"): "tests/hf/test_trainer_users.py::test_update_equals_brute_force_per_user_clipping",
    (TRAINER, ONE, "output_passes", "user", "independent"):
        "tests/hf/test_trainer_users.py::test_gradient_checkpointing_runs_the_output_passes_per_user",
    # the cells of tests/hf/test_trainer_cells.py (its CELLS and DDP_CELLS: test_the_trainer_cells_are_those_tested)
    **{(TRAINER, ONE, form, unit, "banded"): _TRAINER_CELLS for form, unit in itertools.product(TRAINER_FORMS, UNITS)},
    **{(TRL, ONE, "output_passes", unit, noise): _TRAINER_CELLS for unit, noise in itertools.product(UNITS, NOISES)},
    # the private Trainer, two gloo ranks
    (TRAINER, DDP, "bookkeeping", "example", "independent"): "tests/hf/test_trainer.py::test_two_gloo_ranks_equal_one_process_on_the_union",
    (TRAINER, DDP, "per_example", "example", "independent"):
        "tests/hf/test_trainer_per_example.py::test_two_gloo_ranks_per_example_equal_one_process_on_the_union",
    (TRAINER, DDP, "bookkeeping", "user", "independent"):
        "tests/hf/test_trainer_users.py::test_two_gloo_ranks_at_user_level_equal_brute_force_on_the_union",
    (TRAINER, DDP, "per_example", "user", "independent"):
        "tests/hf/test_trainer_users.py::test_two_gloo_ranks_at_user_level_equal_brute_force_on_the_union",
    # its kinds "trainer" and "sft" run book-keeping, "users" the per-example form (a physical batch of one)
    (TRAINER, DDP, "bookkeeping", "example", "banded"): _DDP_BANDED,
    (TRAINER, DDP, "per_example", "user", "banded"): _DDP_BANDED,
    (TRL, DDP, "bookkeeping", "example", "banded"): _DDP_BANDED,
    (TRAINER, DDP, "per_example", "example", "banded"): _TRAINER_CELLS_DDP,
    (TRAINER, DDP, "bookkeeping", "user", "banded"): _TRAINER_CELLS_DDP,
    (TRL, DDP, "bookkeeping", "example", "independent"): _TRAINER_CELLS_DDP,
    **{(TRL, DDP, "bookkeeping", "user", noise): _TRAINER_CELLS_DDP for noise in NOISES},
    # TRL's packed rows: each sequence its own example (or its user's)
    **{(PACKED, ONE, form, unit, "independent"):
       "tests/hf/test_trainer_padding_free.py::test_padding_free_equals_brute_force_over_the_unpacked_sequences"
       for form, unit in (("bookkeeping", "example"), ("output_passes", "example"), ("per_example", "example"),
                          ("bookkeeping", "user"), ("output_passes", "user"))},
    (PACKED, ONE, "per_example", "user", "independent"): _TRAINER_CELLS,
    **{(PACKED, ONE, form, unit, "banded"): _TRAINER_CELLS for form, unit in itertools.product(TRAINER_FORMS, UNITS)},
}


# --- the document ---------------------------------------------------------------------------------

def _cell_text(evidence: Optional[str]) -> str:
    if evidence is None:
        return "not tested"
    if evidence.startswith("refused"):
        return evidence
    return f"✓ `{evidence.split('::', 1)[1]}`"


def render() -> str:
    """docs/compatibility.md from :data:`MATRIX`: one table per entry and engine, then each
    named test's file."""
    lines = [
        "# Compatibility: which feature runs where",
        "",
        "Written by `tests/test_compatibility.py`: `OPACUS_RC_WRITE_COMPATIBILITY=1 pytest "
        "tests/test_compatibility.py` rewrites it, and the test fails when this file and the code disagree.",
        "",
        "Each cell is a clipping form ([forms.md](forms.md)) at a privacy unit ([privacy_unit.md](privacy_unit.md)) "
        "with a noise ([correlated_noise.md](correlated_noise.md)), on an engine, from an entry point.",
        "",
        "* ✓ names the test that checks the releases at noise 0 against per-example (or per-user) clipping "
        "computed with plain autograd: it *equals brute force*.",
        "* *refused* gives the reason the code gives.",
        "* *not tested* is a combination that no test covers yet. It may run; it is not claimed.",
        "",
    ]
    groups: Dict[Tuple[str, str], List[Cell]] = {}
    for cell in MATRIX:
        groups.setdefault(cell[:2], []).append(cell)
    for (entry, engine), cells in groups.items():
        forms = sorted({c[2] for c in cells}, key=lambda f: list(FORMS).index(f) if f in FORMS else len(FORMS))
        lines += [f"## {entry}, {engine}", "", "| form | unit | independent noise | banded noise |", "|---|---|---|---|"]
        for form, unit in itertools.product(forms, UNITS):
            row = [_cell_text(MATRIX.get((entry, engine, form, unit, noise))) for noise in NOISES]
            lines.append(f"| {form} | {unit} | {row[0]} | {row[1]} |")
        lines.append("")
    tests = sorted({e for e in MATRIX.values() if not e.startswith("refused")}, key=lambda e: e.split("::")[::-1])
    lines += ["## The tests", ""] + [f"* `{e.split('::', 1)[1]}`: `{e.split('::', 1)[0]}`" for e in tests] + [""]
    return "\n".join(lines)


def test_the_document_is_the_matrix():
    text = render()
    if os.environ.get("OPACUS_RC_WRITE_COMPATIBILITY"):
        DOCUMENT.write_text(text)
    assert DOCUMENT.read_text() == text, (
        "docs/compatibility.md differs from tests/test_compatibility.py's MATRIX: "
        "OPACUS_RC_WRITE_COMPATIBILITY=1 pytest tests/test_compatibility.py rewrites it"
    )


def test_every_named_test_exists():
    for evidence in set(MATRIX.values()):
        if evidence.startswith("refused"):
            continue
        path, name = evidence.split("::", 1)
        module = importlib.import_module(path[:-3].replace("/", "."))
        assert callable(getattr(module, name.split("[", 1)[0], None)), evidence


def test_the_trainer_cells_are_those_tested():
    """The cells naming tests/hf/test_trainer_cells.py's tests are the cases those tests run."""
    from tests.hf import test_trainer_cells as cells

    entries = {"trainer": TRAINER, "sft": TRL, "packed": PACKED}
    for name, engine, tested in ((_TRAINER_CELLS, ONE, cells.CELLS), (_TRAINER_CELLS_DDP, DDP, cells.DDP_CELLS)):
        named = {cell for cell, evidence in MATRIX.items() if evidence == name}
        assert named == {(entries[entry], engine, *rest) for entry, *rest in tested}, name


# --- the one-process evidence -----------------------------------------------------------------------

C, BATCH_USERS, BATCH_ROWS, PER_USER = 0.05, 2, 4, 2


def _data():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 32, (24, 6), generator=gen), torch.randint(0, 2, (24,), generator=gen)
    return torch.utils.data.TensorDataset(x, y, torch.arange(24)), [r % 8 for r in range(24)]


def _ce(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def _private(form: str, unit: str, noise: str, wrap=None):
    """make_private of ``form`` at ``unit`` with ``noise`` (sigma 0, lr 0, seeded; ``wrap``: DPDDP);
    returns the returned objects, the reference copy and the list the releases are appended to."""
    data, owners = _data()
    torch.manual_seed(0)
    model = CheckpointedSequenceClassifier() if form == "output_passes" else SequenceClassifier()
    reference = copy.deepcopy(model)
    wrapped = wrap(model) if wrap is not None else model
    users = dict(privacy_unit="user", user_ids=owners, max_examples_per_user=PER_USER) if unit == "user" else {}
    banded = dict(noise="banded", bands=2) if noise == "banded" else {}
    engine = PrivacyEngine(accountant="rc_prv")
    module, optimizer, *criterion, loader = engine.make_private(
        module=wrapped, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), criterion=nn.CrossEntropyLoss(),
        data_loader=torch.utils.data.DataLoader(data, batch_size=BATCH_USERS if unit == "user" else BATCH_ROWS),
        noise_multiplier=0.0, max_grad_norm=C, clipping="randomized", seed=3, sketch_size=64,
        **users, **banded, **FORMS[form],
    )
    released: List[Dict[str, torch.Tensor]] = []
    optimizer.original_optimizer.register_step_pre_hook(
        lambda *_: released.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    )
    return module, optimizer, criterion[0] if criterion else None, loader, reference, released


def _train(module, optimizer, criterion, batches, releases: int) -> List[List[int]]:
    """The rows of each of ``releases`` releases (one training loop over ``batches``)."""
    rows, draws = [], []
    while len(draws) < releases:
        for x, y, index in batches:
            rows += index.tolist()
            (criterion(module(x), y) if criterion is not None else _ce(module, x, y)).backward()
            optimizer.step()
            optimizer.zero_grad()
            if not optimizer._is_last_step_skipped:
                draws.append(rows)
                rows = []
                if len(draws) == releases:
                    break
    return draws


def _check(unit: str, reference, draws, released, normaliser: float) -> None:
    """Each release equals brute-force clipping of its rows (per user at user level) over the
    public normaliser (tolerance 1e-6 on updates of order 1e-2: float32 summation order)."""
    data, owners = _data()
    assert any(len(d) > 1 for d in draws), "no draw of several rows: pick another seed"
    for drawn, update in zip(draws, released):
        x, y, _ = data[torch.tensor(drawn, dtype=torch.long)]
        if unit == "user":
            want = per_user_clipped_mean(reference, _ce, x, y, [owners[r] for r in drawn], C, normaliser)
        else:
            want = per_example_clipped_mean(reference, _ce, x, y, C, normaliser)
        for name, value in update.items():
            torch.testing.assert_close(value, want[name], atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("noise", NOISES)
@pytest.mark.parametrize("unit", UNITS)
@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("entry", ["plain", "bmm"])
def test_one_process_cell_equals_brute_force(entry, form, unit, noise):
    """Two releases of ``form`` at ``unit`` with ``noise`` (sigma 0, lr 0), each equal to brute-force
    clipping of exactly the rows drawn (per user at user level) over the public normaliser; under
    BatchMemoryManager the draws are cut into physical batches of whole units."""
    module, optimizer, criterion, loader, reference, released = _private(form, unit, noise)
    if entry == "bmm":
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=PER_USER, optimizer=optimizer) as split:
            draws = _train(module, optimizer, criterion, split, 2)
    else:
        draws = _train(module, optimizer, criterion, loader, 2)
    _check(unit, reference, draws, released, optimizer.expected_batch_size)


WORLD = 2


def ddp_worker(rank, init_file, out_dir):
    """Every cell of the plain loop under Opacus's DPDDP on 2 gloo ranks: each rank's rows and
    releases (the release is the same on both ranks: the union's clipped sum over B)."""
    import warnings

    import torch.distributed as dist
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    out = {}
    for form, unit, noise in itertools.product(FORMS, UNITS, NOISES):
        module, optimizer, criterion, loader, _, released = _private(form, unit, noise, wrap=DPDDP)
        draws = _train(module, optimizer, criterion, loader, 2)
        out[form, unit, noise] = {"draws": draws, "released": released}
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_ddp_cell_equals_brute_force_gloo():
    """Every form, unit and noise of the plain loop under DDP (2 gloo ranks, one spawn): both
    ranks release the same update, brute-force clipping of the union of their draws over the
    public B (the one-process run's normaliser)."""
    from tests.spawn import spawn

    ranks = spawn(ddp_worker, WORLD)
    for form, unit, noise in itertools.product(FORMS, UNITS, NOISES):
        runs = [r[form, unit, noise] for r in ranks]
        union = [a + b for a, b in zip(runs[0]["draws"], runs[1]["draws"])]
        for release in range(2):
            for name in runs[0]["released"][release]:
                torch.testing.assert_close(runs[0]["released"][release][name], runs[1]["released"][release][name])
        _, optimizer, _, _, reference, _ = _private(form, unit, noise)
        _check(unit, reference, union, runs[0]["released"], optimizer.expected_batch_size)
