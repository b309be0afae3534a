import json
import os
import pathlib
import time
import warnings
from typing import Dict, Optional

import pytest
import torch

import opacus_rc  # noqa: F401  (registers the plugin)
from tests.models import SequenceClassifier

warnings.filterwarnings("ignore", message="Secure RNG turned off")
warnings.filterwarnings("ignore", message=".*full_backward_hook.*")


#: The slow rest, run by ``bash scripts/test_slow.sh`` (``.ci/run`` runs both suites): test
#: files that start processes (gloo ranks, notebook kernels), build Hugging Face stacks or run
#: benchmarks and long sweeps. Every privacy-critical and brute-force-equivalence test of one
#: process stays in the fast suite (``bash scripts/test.sh``).
#: Paths relative to tests/ (tests/test_layout.py checks that each exists).
SLOW_FILES = (
    "test_ddp.py", "forms/test_fsdp.py", "test_lm_head_fsdp.py", "test_notebooks.py", "test_hf_stacks.py",
    "test_scaling.py", "test_bench.py", "test_checkpointing_bench.py", "test_gpu_bench.py",
    "test_utility_report.py",
)
#: single slow tests of otherwise fast files: multi-process runs (names with "gloo" or "ddp"),
#: long sweeps and end-to-end runs whose path a faster test of the fast suite also covers
SLOW_TESTS = (
    "gloo", "ddp",
    "test_randomized_accumulation_matches_independent_pld_on_the_same_bins",  # fast: ..._quadrature_...
    "test_large_epsilon_and_100k_steps",
    "test_unchanged_opacus_loop_learns_with_noise",  # fast: the README quickstart learns (test_readme.py)
    "test_make_private_with_epsilon_parses_once[flat]",
    # fast: test_empty_poisson_batch_is_a_noise_only_step (every form)
    "test_empty_poisson_batches_are_skipped_cleanly",
    # reproducibility, not privacy; fast: test_checkpoint_holds_no_generator_state_or_seed_by_default
    "test_checkpoint_with_rng_state_resumes_bit_exactly",
    # fast: test_single_accumulated_step_matches_quadrature_on_independent_bins
    "test_deterministic_mixture_matches_dp_accounting_and_exceeds_q_times_m",
    "test_short_run_lowers_the_loss",  # utility; fast: the README quickstart learns
    "test_norm_sampler_memory_linear_in_t_while_ghost_is_quadratic",  # a memory claim (docs/benchmarks.md)
    # the README's other blocks as pasted (docs); fast: the quickstart block runs and learns
    "test_every_other_block_runs_as_pasted_or_is_a_labelled_excerpt",
    "test_user_level_example_reports_epsilon_per_movie_and_both_accuracies",  # an example end to end
    # fast: test_calibration_hits_the_target_total[flat] and the per-example search epsilon
    "test_calibration_hits_the_target_total[per_example]",
    # fast: test_trainer_search_releases_the_best_trial_only (the Trainer's search); the plain
    # loop's test_release_trials_returns_every_trial_and_charges_their_composition
    "test_trainer_search_with_every_trial_released", "test_private_sft_trainer_search_with_a_model_init",
    "test_private_search_example_quick_writes_its_json",  # an example end to end
)
#: parametrised sweeps: the cases that stay in the fast suite (each form, path and option
#: value at least once); the other cases of the sweep run in the slow suite. A name here that
#: matches no collected case is an error (tests/conftest.py checks it at collection).
FAST_CASES = {
    # the compatibility matrix's one-process cells: each form, unit, noise and entry once (issue 53)
    "test_one_process_cell_equals_brute_force": (
        "plain-two_pass-user-banded", "plain-bookkeeping-example-independent", "plain-output_passes-user-independent",
        "plain-per_example-example-banded", "bmm-bookkeeping_with_criterion-user-banded", "bmm-per_example-user-independent",
        "bmm-two_pass-example-independent", "bmm-output_passes-example-banded",
    ),
    # the Trainer's and TRL's cells of the matrix: each entry, form, unit and noise once (issue 53)
    "test_trainer_cell_equals_brute_force": (
        "trainer-per_example-user-banded", "sft-output_passes-user-independent", "packed-bookkeeping-example-banded",
        "packed-per_example-user-independent",
    ),
    # 1,029 aligned rows twice per case: the 4.4 C case before the fix stays fast (issue 52)
    "test_under_a_mean_loss_one_row_moves_the_sum_by_one_contribution": ("two_pass-autocast_bf16",),
    "test_padding_free_equals_brute_force_over_the_unpacked_sequences": (
        "bookkeeping", "output_passes", "per_example", "user_output_passes", "user_chunked_head",
    ),
    "test_form_equals_the_golden_run": (
        "two_pass_per_example", "output_passes_checkpointed_reentrant", "bookkeeping", "ghost_bookkeeping",
        "chunked_head_two_pass", "flat_opacus", "per_example", "ghost_fsdp",
    ),
    "test_mode_behaves_as_without_opacus_rc": ("flat-hooks", "flat-ghost"),
    "test_hf_llama_checkpointing_equals_brute_force": (
        "llama-none-two_pass", "llama-hf_default-bookkeeping", "llama-hf_reentrant-ghost_bookkeeping",
        "llama-hf_non_reentrant-hooks_object", "peft_lora-none-bookkeeping_hooks_object",
        "peft_lora-hf_default-per_example", "peft_lora-hf_reentrant-per_example_hooks_object",
        "peft_lora-hf_non_reentrant-two_pass",
    ),
    "test_sketched_update_unchanged_by_checkpointing": (
        "hf_reentrant-two_pass-shared", "hf_non_reentrant-bookkeeping-per_example",
        "hf_reentrant-ghost_bookkeeping-per_example", "hf_non_reentrant-hooks_object-shared",
        "hf_reentrant-bookkeeping_hooks_object-per_example",
    ),
    "test_exact_update_equals_brute_force": (
        "1-two-pass", "3-book-keeping", "100-ghost-bookkeeping", "3-two-pass-hooks", "1-book-keeping-hooks",
    ),
    "test_sketched_update_equals_unchunked": (
        "8-two-pass", "40-two-pass-shared", "8-two-pass-hutchpp", "40-book-keeping", "8-book-keeping-shared",
    ),
    "test_exact_update_with_shifted_labels": ("two-pass-hooks", "book-keeping"),
    "test_peft_lora_with_frozen_head_equals_unchunked": ("hooks",),
    "test_frozen_head_gives_the_body_gradient_only": ("two-pass", "book-keeping"),
    "test_private_trainer_accumulation_draws_fresh_sketches": ("reentrant",),
    "test_shared_sketches_fresh_per_step_and_shared_within_it": (
        "make_private_ghost-True", "hand_hooks-False",
    ),
    "test_accountant_record_after_one_step": ("ghost-1", "hooks-3", "wrap_model_false-1", "epsilon-1", "bmm_hooks-1"),
    "test_privacy_engine_secure_mode_end_to_end_without_torchcsprng": ("hooks",),
    "test_epsilon_is_bit_identical": (
        "mixed", "det_m3", "det_stepped", "dict_records", "per_example32_m3", "shared32_m3", "hutchpp8_per_example",
        "3tuple_kwargs_hutchpp32_per_example", "mixed_eps_error_delta",
    ),
    "test_virtual_steps_over_independent_batches_are_charged_as_accumulation": ("hooks", "bookkeeping=True"),
    "test_batch_memory_manager_splits_stay_one_micro_batch": ("ghost", "bookkeeping=True"),
    "test_host_synchronisations_per_step": ("True-hooks", "False-ghost"),
    "test_fused_and_unfused_optimizers_take_the_same_clean_steps": ("hooks",),
    "test_equals_brute_force_per_example_clipping": ("batch1-auto", "checkpointed-reentrant"),
    "test_honest_audit_stays_below_accountant": ("hutchinson-4", "hutchpp-32"),
    "test_group_epsilon_matches_dp_accounting_mixture": ("2-1",),
    "test_audit_catches_broken_variants": (
        "hutchinson-4-biased_low-120", "hutchpp-32-biased_low-60", "hutchinson-32-data_dependent_sketch-10",
        "hutchpp-4-data_dependent_sketch-10",
    ),
}


TESTS = pathlib.Path(__file__).resolve().parent


def tests_path(path: pathlib.Path) -> str:
    """A test file's path relative to tests/, with ``/`` (as SLOW_FILES names it)."""
    path = pathlib.Path(path).resolve()
    return path.relative_to(TESTS).as_posix() if path.is_relative_to(TESTS) else path.name


def slow_case(item) -> bool:
    """A case of a FAST_CASES sweep that is not kept in the fast suite."""
    spec = getattr(item, "callspec", None)
    kept = FAST_CASES.get(getattr(item, "originalname", item.name))
    return kept is not None and spec is not None and spec.id not in kept


def check_fast_cases(items) -> None:
    """Each kept case of FAST_CASES names a collected case of its sweep (a typo would move
    the whole sweep to the slow suite unnoticed)."""
    ids = {}
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is not None:
            ids.setdefault(item.originalname, set()).add(spec.id)
    missing = {name: sorted(set(kept) - ids[name]) for name, kept in FAST_CASES.items() if name in ids}
    missing = {name: ids_ for name, ids_ in missing.items() if ids_}
    if missing:
        raise pytest.UsageError(f"tests/conftest.py FAST_CASES names cases that were not collected: {missing}")


# --- loops as they run on a GPU (issue 52) ----------------------------------------------------

#: how a loop sees the plugin loaders' batches: as delivered, every tensor a new copy (what
#: ``batch.to("cuda")`` does), or a dict batch as transformers' ``BatchEncoding`` (copied too)
GPU_LOOP_VARIANTS = ("as_delivered", "device_copy", "batch_encoding")


def as_a_gpu_loop_sees_it(batch, variant: str):
    """``batch`` as the loop of ``variant`` gets it (containers kept; other values as they are)."""
    from transformers import BatchEncoding

    if variant == "as_delivered":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, dict) or isinstance(batch, BatchEncoding):
        copied = {k: as_a_gpu_loop_sees_it(v, variant) for k, v in batch.items()}
        return BatchEncoding(copied) if variant == "batch_encoding" or isinstance(batch, BatchEncoding) else copied
    if isinstance(batch, (list, tuple)):
        return type(batch)(as_a_gpu_loop_sees_it(v, variant) for v in batch)
    return batch


def _loops_see(request, monkeypatch, variant: str) -> str:
    """Every plugin loader (``DrawLoader`` and its subclasses, the private Trainer's) yields its
    batches as ``variant`` (after delivering the originals, as a loop that copies them would).
    Spawned ranks (tests named gloo or ddp) do not see the patch: their variants are skipped."""
    name = request.node.name.lower()
    if variant != "as_delivered" and ("gloo" in name or "ddp" in name):
        pytest.skip("a spawned rank does not see the variant")
    from opacus_rc.draws import DrawLoader
    from opacus_rc.hf.data import UserPoissonLoader

    for cls in (DrawLoader, UserPoissonLoader):
        original = cls.__iter__

        def __iter__(self, _original=original):
            for batch in _original(self):
                yield as_a_gpu_loop_sees_it(batch, variant)

        monkeypatch.setattr(cls, "__iter__", __iter__)
    return variant


@pytest.fixture(params=GPU_LOOP_VARIANTS[:2])
def batches_as_on_a_device(request, monkeypatch):
    """The module's loop-path tests as delivered and with every batch copied (both fast)."""
    return _loops_see(request, monkeypatch, request.param)


@pytest.fixture(params=GPU_LOOP_VARIANTS)
def dict_batches_as_on_a_device(request, monkeypatch):
    """The module's dict-batch loop tests as delivered, copied, and as BatchEncoding (the latter
    two in the slow suite)."""
    return _loops_see(request, monkeypatch, request.param)


def gpu_variant_is_slow(item) -> bool:
    spec = getattr(item, "callspec", None)
    return spec is not None and spec.params.get("dict_batches_as_on_a_device", "as_delivered") != "as_delivered"


def pytest_collection_modifyitems(config, items):
    check_fast_cases(items)
    for item in items:
        name = item.name.lower()
        if tests_path(item.path) in SLOW_FILES or any(s in name for s in SLOW_TESTS) or slow_case(item) \
                or gpu_variant_is_slow(item):
            item.add_marker(pytest.mark.slow)


#: Each test file's recorded seconds and test count (the fast suite's), by which the progress
#: line weights a test; ``OPACUS_RC_RECORD_DURATIONS=1 bash scripts/test.sh`` records it again.
DURATIONS = TESTS / "durations.json"


def test_file(nodeid: str) -> str:
    """The file part of a test id, relative to tests/ (``tests/a/b.py::t[x]`` -> ``a/b.py``)."""
    path = nodeid.split("::", 1)[0]
    return path[len("tests/"):] if path.startswith("tests/") else path


class Progress:
    """Every ``every`` seconds: tests done of those selected and, once a tenth of the expected
    work is done, the time left at the pace so far. The expected work of a test is its file's
    recorded seconds per test (:data:`DURATIONS`; the mean of the recorded files for another
    file, 1 for each test without a table): by the count of tests alone the estimate was 7 to
    78 times the time left early on (issue 48), the files' tests differing in length."""

    def __init__(self, reporter, every: float = 30.0, table: Optional[dict] = None,
                 record: Optional[pathlib.Path] = None) -> None:
        self.reporter, self.every, self.record = reporter, every, record
        if table is None:
            table = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
        self.per_test = {f: r["seconds"] / r["tests"] for f, r in table.items() if r["tests"]}
        self.default = sum(self.per_test.values()) / len(self.per_test) if self.per_test else 1.0
        self.weights: Dict[str, float] = {}
        self.total = self.done = 0
        self.work = self.work_done = 0.0
        self.seconds: Dict[str, float] = {}
        self.start = self.last = time.monotonic()

    def select(self, nodeids) -> None:
        self.weights = {n: self.per_test.get(test_file(n), self.default) for n in nodeids}
        self.total, self.work = len(self.weights), sum(self.weights.values())
        self.start = self.last = time.monotonic()  # the clock starts once the tests are known

    def pytest_collection_finish(self, session) -> None:
        self.select(item.nodeid for item in session.items)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        """Under pytest-xdist (``-n``): the controller learns the selection from a worker."""
        if not self.total:
            self.select(ids)

    def pytest_runtest_logreport(self, report) -> None:
        if self.record is not None:
            self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def pytest_runtest_logfinish(self, nodeid, location) -> None:
        self.done += 1
        self.work_done += self.weights.get(nodeid, self.default)
        now = time.monotonic()
        if now - self.last < self.every or not self.total or self.done >= self.total:
            return
        self.last = now
        elapsed = now - self.start
        line = f"\n  {self.done}/{self.total} tests in {elapsed:.0f} s"  # own line, after -q's dots
        if self.work_done >= 0.1 * self.work:
            line += f", about {elapsed / self.work_done * max(self.work - self.work_done, 0.0):.0f} s left"
        self.reporter.write_line(line)

    def pytest_sessionfinish(self, session) -> None:
        """With ``OPACUS_RC_RECORD_DURATIONS=1``: the files run are recorded again in :data:`DURATIONS`."""
        if self.record is None or not self.seconds:
            return
        table = json.loads(self.record.read_text()) if self.record.exists() else {}
        files: Dict[str, dict] = {}
        for nodeid, seconds in self.seconds.items():
            entry = files.setdefault(test_file(nodeid), {"tests": 0, "seconds": 0.0})
            entry["tests"] += 1
            entry["seconds"] += seconds
        table.update({f: {"tests": r["tests"], "seconds": round(r["seconds"], 2)} for f, r in files.items()})
        self.record.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")


@pytest.hookimpl(trylast=True)  # after the terminal reporter's own pytest_configure registers it
def pytest_configure(config):
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    worker = hasattr(config, "workerinput")  # a pytest-xdist worker: the controller reports
    if reporter is not None and not config.option.collectonly and not worker:
        record = DURATIONS if os.environ.get("OPACUS_RC_RECORD_DURATIONS") == "1" else None
        config.pluginmanager.register(Progress(reporter, record=record), "opacus_rc_progress")


@pytest.fixture
def one_blas_thread():
    """One BLAS thread (numpy's OpenBLAS, via threadpoolctl) and one intra-op torch thread:
    the last bits of a float reduction depend on the thread count, and the golden tests
    compare results bit for bit (recorded with one thread)."""
    from threadpoolctl import threadpool_limits

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with threadpool_limits(limits=1):
        yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """One intra-op thread for a test module of tiny-tensor loops (the audits, small SVDs), where
    threads only contend on a loaded machine. The library leaves the thread count alone; like an
    entry point, the test process sets it (``pytestmark = pytest.mark.usefixtures(...)``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def model_factory():
    def make(seed: int = 0, **kwargs):
        torch.manual_seed(seed)
        return SequenceClassifier(**kwargs)

    return make


def distinct(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Independent draws: at most ``2 + n / 10^4`` of the n entries coincide.

    For independent a, b ~ N(0, s^2) an entry is within isclose's tolerance (relative
    1e-5) with probability p = 2e-5 E|b| / (2 s sqrt(pi)) ~ 4.5e-6; the count is
    Bin(n, p), and P(count > 2 + n / 10^4) < 1e-8 for every n here (n = 96: C(96, 3) p^3
    ~ 1e-11). A reused sketch has all n entries equal. (A bound of 1% of the entries,
    used before, fails once in ~2,000 secure-mode runs at n = 96: one chance coincidence.)
    """
    return a.shape == b.shape and int(torch.isclose(a, b).sum()) <= 2 + a.numel() // 10_000


def mode_options(mode: str) -> dict:
    """make_private keywords of a test mode: a grad_sample_mode, or "bookkeeping=True" (a
    ghost script run by book-keeping)."""
    if mode == "bookkeeping=True":
        return {"grad_sample_mode": "ghost", "bookkeeping": True}
    return {"grad_sample_mode": mode}
