"""The installed package is the runtime only: benchmarks/, examples/ and tools/ stay outside it,
and library code leaves the process-wide thread count to its caller."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


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
