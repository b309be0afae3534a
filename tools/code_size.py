"""How many lines, and code lines, commits add to a package (a size figure for issues).

A code line is a non-blank line that is neither a comment nor part of a docstring.

Run: ``python -m tools.code_size COMMIT [COMMIT ...] [--under opacus_rc]``: per commit and
in total, the change in lines and in code lines of the ``.py`` files under ``--under``
(each commit against its first parent).
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from typing import Optional, Sequence, Tuple


def code_lines(source: str) -> int:
    """Non-blank lines outside comments and docstrings."""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    return sum(
        1 for number, line in enumerate(source.splitlines(), 1)
        if number not in docstrings and line.strip() and not line.strip().startswith("#")
    )


def _show(revision: str, path: str) -> Optional[str]:
    done = subprocess.run(["git", "show", f"{revision}:{path}"], capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


def commit_change(commit: str, under: str) -> Tuple[int, int]:
    """(lines, code lines) that ``commit`` adds to the ``.py`` files under ``under``."""
    names = subprocess.run(
        ["git", "show", "--name-only", "--format=", commit, "--", under], capture_output=True, text=True, check=True
    ).stdout.split()
    lines = code = 0
    for path in (n for n in names if n.endswith(".py")):
        before, after = _show(f"{commit}^", path) or "", _show(commit, path) or ""
        lines += len(after.splitlines()) - len(before.splitlines())
        code += (code_lines(after) if after else 0) - (code_lines(before) if before else 0)
    return lines, code


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("commits", nargs="+")
    parser.add_argument("--under", default="opacus_rc")
    args = parser.parse_args(argv)
    total = [0, 0]
    for commit in args.commits:
        lines, code = commit_change(commit, args.under)
        total[0] += lines
        total[1] += code
        print(f"{commit}  lines {lines:+d}  code lines {code:+d}")
    print(f"total    lines {total[0]:+d}  code lines {total[1]:+d}")


if __name__ == "__main__":
    main()
