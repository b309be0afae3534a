import pathlib
import warnings

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
#: single slow tests of otherwise fast files: multi-process runs (names with "gloo" or "ddp")
#: and long sweeps (each has a faster sibling in the fast suite)
SLOW_TESTS = (
    "gloo", "ddp",
    "test_randomized_accumulation_matches_independent_pld_on_the_same_bins",  # fast: ..._quadrature_...
    "test_large_epsilon_and_100k_steps",
    "test_unchanged_opacus_loop_learns_with_noise[hutchpp]",  # fast: [hutchinson]
    "test_make_private_with_epsilon_parses_once[flat]",
)


TESTS = pathlib.Path(__file__).resolve().parent


def tests_path(path: pathlib.Path) -> str:
    """A test file's path relative to tests/, with ``/`` (as SLOW_FILES names it)."""
    path = pathlib.Path(path).resolve()
    return path.relative_to(TESTS).as_posix() if path.is_relative_to(TESTS) else path.name


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.name.lower()
        if tests_path(item.path) in SLOW_FILES or any(s in name for s in SLOW_TESTS):
            item.add_marker(pytest.mark.slow)


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
