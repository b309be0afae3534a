"""The installed package is the runtime only: benchmarks/, examples/ and tools/ stay outside it,
and library code leaves the process-wide thread count to its caller. tests/ mirrors the
package's folders, and the tests build their models from tests/models.py, not examples/."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"

#: the tests of examples/ and notebooks/ themselves: the only ones that may import examples
EXAMPLE_TESTS = ("test_notebooks.py", "test_readme.py", "test_utility_report.py")


def test_package_holds_the_runtime_only():
    from setuptools import find_packages

    packages = find_packages(str(ROOT), include=["opacus_rc*"])  # pyproject.toml's packages.find
    assert "opacus_rc" in packages
    assert all(p == "opacus_rc" or p.startswith("opacus_rc.") for p in packages), packages
    for gone in ("bench", "models", "datasets.py", "profiling.py"):
        assert not (ROOT / "opacus_rc" / gone).exists(), gone
    assert 'include = ["opacus_rc*"]' in (ROOT / "pyproject.toml").read_text()


def test_each_clipping_form_is_one_module_under_forms():
    """opacus_rc/forms/ holds the table of forms and one module per form; no module of a
    form stays at the package's top level (grad_sample.py, the base of the sketched forms,
    does)."""
    forms = ROOT / "opacus_rc" / "forms"
    for name in ("__init__.py", "two_pass.py", "bookkeeping.py", "output_passes.py", "fsdp.py", "per_example.py"):
        assert (forms / name).is_file(), name
    for gone in ("bookkeeping.py", "output_passes.py", "fsdp.py", "loss.py", "per_example.py", "two_pass.py"):
        assert not (ROOT / "opacus_rc" / gone).exists(), gone
    assert (ROOT / "opacus_rc" / "grad_sample.py").is_file()


def test_no_thread_count_changes_in_library_code():
    """Only an entry point's ``if __name__ == "__main__"`` block may call set_num_threads."""
    for path in (ROOT / "opacus_rc").rglob("*.py"):
        text = path.read_text()
        calls = [m.start() for m in re.finditer(r"torch\.set_num_threads\(", text)]
        main = text.find('if __name__ == "__main__":')
        lib_calls = [c for c in calls if main < 0 or c < main]
        # a comment naming the call is fine; code is not
        code = [c for c in lib_calls if not text[text.rfind("\n", 0, c) + 1:c].lstrip().startswith("#")]
        assert not code, f"{path.relative_to(ROOT)} changes the thread count in library code"


def test_code_size_counts_code_lines_only():
    """tools.code_size: docstrings (module, class, function), comments and blank lines are
    not code; a string expression that is not a docstring is."""
    from tools.code_size import code_lines

    source = '''"""Module docstring,
on two lines."""

import os  # a comment on a code line


class A:
    """Class docstring."""

    # a comment line
    def f(self):
        """Function docstring."""
        x = 1
        "not a docstring"
        return x
'''
    assert code_lines(source) == 6  # import, class, def, x = 1, the string, return


def mirror_problems(tests: pathlib.Path, package: pathlib.Path) -> list:
    """What breaks the mirror of ``package`` by ``tests``: a sub-folder of tests/ that is no
    sub-package (a folder with ``__init__.py``) at the same path under the package, one
    without its own ``__init__.py``, or two test files of one name."""
    problems, seen = [], {}
    for folder in sorted(p for p in tests.rglob("*") if p.is_dir()):
        rel = folder.relative_to(tests)
        if "__pycache__" in rel.parts or any(part.startswith(".") for part in rel.parts):
            continue
        if not (package / rel / "__init__.py").is_file():
            problems.append(f"tests/{rel.as_posix()}/ mirrors no package {package.name}/{rel.as_posix()}/")
        if not (folder / "__init__.py").is_file():
            problems.append(f"tests/{rel.as_posix()}/ has no __init__.py")
    for path in sorted(tests.rglob("test_*.py")):
        rel = path.relative_to(tests).as_posix()
        if path.name in seen:
            problems.append(f"tests/{rel} has the name of tests/{seen[path.name]}")
        seen.setdefault(path.name, rel)
    return problems


def imports_of_examples(source: str) -> list:
    """Lines of ``source`` that import from examples/: ``import examples...``, ``from
    examples... import``, ``importlib.import_module`` / ``pytest.importorskip`` /
    ``__import__`` of an ``examples`` module, or examples/ put on ``sys.path``."""

    def is_examples(name) -> bool:
        return isinstance(name, str) and (name == "examples" or name.startswith("examples."))

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found = any(is_examples(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found = node.level == 0 and is_examples(node.module)
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0] if node.args else None
            found = (name in ("import_module", "importorskip", "__import__") and isinstance(first, ast.Constant)
                     and is_examples(first.value))
            if name in ("insert", "append") and ast.unparse(func).startswith("sys.path."):
                found = any(isinstance(c, ast.Constant) and c.value == "examples" for c in ast.walk(node))
        else:
            continue
        if found:
            lines.append(node.lineno)
    return sorted(lines)


def test_tests_mirror_the_package_folders():
    """Every sub-folder of tests/ is the path of a sub-package of opacus_rc (tests/forms/ for
    opacus_rc/forms/, ...), a package itself, and no two test files share a name; tests of
    top-level modules and cross-cutting tests stay at tests/ itself."""
    assert mirror_problems(TESTS, ROOT / "opacus_rc") == []
    assert {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"} >= {"accounting", "audit", "forms", "hf"}


def test_the_mirror_check_reports_what_breaks_it(tmp_path):
    package, tests = tmp_path / "pkg", tmp_path / "tests"
    for folder in (package / "forms", package / "hf", tests / "forms", tests / "old", tests / "hf"):
        folder.mkdir(parents=True)
    for path in (package / "forms" / "__init__.py", package / "hf" / "__init__.py", tests / "forms" / "__init__.py",
                 tests / "old" / "__init__.py", tests / "test_a.py", tests / "forms" / "test_a.py"):
        path.write_text("")
    assert mirror_problems(tests, package) == [
        "tests/hf/ has no __init__.py",
        "tests/old/ mirrors no package pkg/old/",
        "tests/test_a.py has the name of tests/forms/test_a.py",
    ]


def test_tests_build_no_model_from_examples():
    """The tests of the plugin take their models and data from tests/models.py; only the
    tests of examples/ and notebooks/ themselves (EXAMPLE_TESTS) import examples."""
    found = {}
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS).as_posix()
        lines = imports_of_examples(path.read_text())
        if lines and rel not in EXAMPLE_TESTS:
            found[rel] = lines
    assert found == {}, f"import examples/ (build the model in tests/models.py instead): {found}"
    assert all((TESTS / name).is_file() for name in EXAMPLE_TESTS)


def test_the_examples_check_sees_every_form_of_import():
    assert imports_of_examples("import os\nfrom tests.models import Decoder\nfrom .examples import x\n") == []
    source = (
        "from examples.models import TinyDecoder\n"
        "import examples.profiling as p\n"
        "def f():\n"
        "    sys.path.insert(0, str(ROOT / 'examples'))\n"
        "    pytest.importorskip('examples.models.llama')\n"
    )
    assert imports_of_examples(source) == [1, 2, 4, 5]


def test_slow_files_name_existing_test_files():
    """conftest.SLOW_FILES names files by their path under tests/: a moved file must be
    renamed there too, or its tests would join the fast suite."""
    from tests.conftest import SLOW_FILES

    assert [name for name in SLOW_FILES if not (TESTS / name).is_file()] == []


def test_no_import_runs_upward():
    """tools.import_graph: no intra-package import (module level or inside a function) closes
    a cycle, and the graph sees relative imports from packages and modules, and cycles."""
    from tools.import_graph import edges, upward

    sources = {
        "pkg": "from .low import f\n",
        "pkg.low": "import math\n",
        "pkg.sub": "from ..low import f\n",
        "pkg.sub.mod": "from . import other\n\ndef g():\n    from pkg.high import h\n",
        "pkg.sub.other": "",
        "pkg.high": "from .sub.mod import g\n",
    }
    found = edges(sources, packages={"pkg", "pkg.sub"})
    assert ("pkg.sub", "pkg.low", False) in found and ("pkg.sub.mod", "pkg.sub.other", False) in found
    assert sorted(upward(found)) == [("pkg.high", "pkg.sub.mod", False), ("pkg.sub.mod", "pkg.high", True)]

    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "tools.import_graph"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert out.splitlines()[0].endswith("upward: 0"), out


def test_import_graph_sizes_count_by_kind():
    """tools.import_graph --sizes on a module counted by hand: 2 docstring lines (module and
    function), 1 comment, 2 blanks, 3 code lines; code tokens: ``def f ( x ) :`` (6),
    ``return x + 1`` (4), ``y = f ( 2 )`` (6); the layout of a call does not change them."""
    from tools.import_graph import sizes

    text = '"""Module."""\n\n# a comment\ndef f(x):\n    """Doc."""\n    return x + 1\n\ny = f(2)\n'
    assert sizes({"m": text}) == dict(docstring=2, comment=1, blank=2, code=3, code_tokens=16)
    spread = text.replace("y = f(2)", "y = f(\n    2\n)")
    assert sizes({"m": spread})["code_tokens"] == 16 and sizes({"m": spread})["code"] == 5


def test_hf_and_accountant_files_stay_small():
    """The issue-31 limits: no file of opacus_rc/hf/ over 400 lines, accountant.py at most 400."""
    files = [*(ROOT / "opacus_rc" / "hf").glob("*.py"), ROOT / "opacus_rc" / "accounting" / "accountant.py"]
    long = {f.relative_to(ROOT).as_posix(): n for f in files if (n := len(f.read_text().splitlines())) > 400}
    assert long == {}


def _case(name: str, case_id: str):
    from types import SimpleNamespace

    return SimpleNamespace(originalname=name, name=f"{name}[{case_id}]", callspec=SimpleNamespace(id=case_id))


def test_fast_cases_keep_named_cases_and_refuse_a_name_never_collected(monkeypatch):
    """A sweep of conftest.FAST_CASES keeps its named cases fast and the rest slow; a kept
    name that matches no collected case (a typo, a renamed parameter) stops the collection."""
    import pytest

    from tests import conftest

    monkeypatch.setattr(conftest, "FAST_CASES", {"test_sweep": ("a",)})
    items = [_case("test_sweep", "a"), _case("test_sweep", "b"), _case("test_other", "b")]
    conftest.check_fast_cases(items)
    assert [conftest.slow_case(item) for item in items] == [False, True, False]
    monkeypatch.setattr(conftest, "FAST_CASES", {"test_sweep": ("c", "b")})
    with pytest.raises(pytest.UsageError, match=r"\{'test_sweep': \['c'\]\}"):
        conftest.check_fast_cases([_case("test_sweep", "b")])


def _progress(monkeypatch, ids, table, ends, **kwargs):
    """The lines a progress plugin over the tests ``ids`` (a table of recorded durations) prints
    when test i ends ``ends[i]`` seconds after the start."""
    from types import SimpleNamespace

    from tests import conftest

    now = [100.0]
    monkeypatch.setattr(conftest.time, "monotonic", lambda: now[0])
    lines = []
    progress = conftest.Progress(SimpleNamespace(write_line=lines.append), every=30.0, table=table, **kwargs)
    progress.pytest_collection_finish(SimpleNamespace(items=[SimpleNamespace(nodeid=i) for i in ids]))
    for nodeid, t in zip(ids, ends):
        now[0] = 100.0 + t
        progress.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=t))
        progress.pytest_runtest_logfinish(nodeid, None)
    progress.pytest_sessionfinish(None)
    return lines


def test_progress_line_estimates_the_time_left_by_count_without_a_table(monkeypatch):
    """Without recorded durations: tests done of those selected at most every ``every``
    seconds, the time left at the pace so far once a tenth of the tests is done, never after
    the last test."""
    ids = [f"tests/test_a.py::t{i}" for i in range(20)]
    lines = _progress(monkeypatch, ids, {}, [5.0, 40.0, 45.0, 80.0] + [90.0] * 16)
    # at 40 s: 2 of 20 done, 10%: 18 left at 20 s a test; at 80 s: 4 of 20, 16 left at 20 s
    assert lines == ["\n  2/20 tests in 40 s, about 360 s left", "\n  4/20 tests in 80 s, about 320 s left"]
    early = _progress(monkeypatch, ids, {}, [40.0] + [60.0] * 19)
    assert early == ["\n  1/20 tests in 40 s"]  # 1 of 20 done: no estimate yet


def test_progress_line_weights_each_test_by_its_files_recorded_duration(monkeypatch):
    """Issue 48: a slow file first (10 s a test recorded) and a fast one after (1 s a test; an
    unrecorded file counts as the recorded mean, 5.5 s): the time left is the work left at the
    pace so far, not the count of tests left at the first file's pace."""
    table = {"test_slow.py": {"tests": 2, "seconds": 20.0}, "test_fast.py": {"tests": 10, "seconds": 10.0}}
    ids = ["tests/test_slow.py::a", "tests/test_slow.py::b"] + [f"tests/test_fast.py::t{i}" for i in range(8)]
    ids += ["tests/test_new.py::t"]  # work: 20 + 8 + 5.5 = 33.5 recorded seconds
    lines = _progress(monkeypatch, ids, table, [15.0, 31.0] + [31.0 + i for i in range(1, 9)] + [60.0])
    # at 31 s: 20 of 33.5 done at 1.55 s a second: 13.5 * 1.55 = 21 s left (by count: 139 s)
    assert lines == ["\n  2/11 tests in 31 s, about 21 s left"]


def test_progress_records_the_files_durations(monkeypatch, tmp_path):
    """``OPACUS_RC_RECORD_DURATIONS=1``: each file run gets its tests' seconds and count, the
    other files of the table are kept."""
    import json

    record = tmp_path / "durations.json"
    record.write_text(json.dumps({"test_other.py": {"tests": 1, "seconds": 3.0}}))
    _progress(monkeypatch, ["tests/forms/test_a.py::x", "tests/forms/test_a.py::y"], {}, [1.0, 2.5], record=record)
    assert json.loads(record.read_text()) == {
        "forms/test_a.py": {"tests": 2, "seconds": 3.5}, "test_other.py": {"tests": 1, "seconds": 3.0},
    }
