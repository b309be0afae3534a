"""Lines, code lines and guard lines of a package (size figures for issues).

A *code line* is a non-blank line that is neither a comment nor part of a docstring.

A *guard line* is a code line that belongs to a guard or a refusal, that is, a code line
inside any of:

* a guard module: one whose file name says it guards (by the word rule below:
  ``clip_guard.py``, ``checks.py``) or whose docstring opens with "Refusing"
  (``finite.py``, ``forward_changes.py``): all its code lines;
* a function or class whose name says it guards: one of its words (split at ``_`` and
  at CamelCase) is ``check``, ``checks``, ``guard``, ``refuse``, ``refused``, ``refusal``
  or ``validate`` (``check_noise``, ``_refuse``, ``ClipGuard``, ``deferred_refusal``;
  not ``checkpoint``);
* a ``raise`` statement;
* a statement that calls such a function (``check_positive(x, "x")``,
  ``self._refuse(why)``, ``guard.check(model)``) or ``warnings.warn``;
* the test of an ``if``/``elif`` whose body holds one of the above (at any depth).

At e8eb7d9 this gives 14,930 lines, 9,378 code lines and 2,051 guard lines for
``opacus_rc``, and 12,838 lines, 8,030 code lines and 1,933 guard lines without
``opacus_rc/audit`` (``--exclude opacus_rc/audit``). The figures an issue quoted for that
commit, 14,930 lines and 1,848 guard lines of 8,030 code lines, match the lines with the
audit and the code lines without it; no simple definition found reproduces 1,848 exactly.

Run:

* ``python -m tools.code_size COMMIT [COMMIT ...] [--under opacus_rc]``: per commit and
  in total, the change in lines and in code lines of the ``.py`` files under ``--under``
  (each commit against its first parent);
* ``python -m tools.code_size --tree [REV] [--under opacus_rc] [--exclude opacus_rc/audit]``:
  lines, code lines and guard lines of the ``.py`` files under ``--under``, per
  sub-package and in total, in the work tree (``--tree`` alone) or in revision ``REV``
  (files read with ``git show REV:path``); ``--exclude`` (repeatable) leaves a folder out.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import re
import subprocess
from dataclasses import asdict, dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

GUARD_WORDS = frozenset({"check", "checks", "guard", "refuse", "refused", "refusal", "validate"})
WORKTREE = "WORKTREE"


def _docstring_lines(tree: ast.AST) -> Set[int]:
    lines: Set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def _code_line_numbers(source: str, tree: ast.AST) -> Set[int]:
    docstrings = _docstring_lines(tree)
    return {
        number for number, line in enumerate(source.splitlines(), 1)
        if number not in docstrings and line.strip() and not line.strip().startswith("#")
    }


def code_lines(source: str) -> int:
    """Non-blank lines outside comments and docstrings."""
    return len(_code_line_numbers(source, ast.parse(source)))


def _words(name: str) -> List[str]:
    """``_check_noise`` -> [check, noise]; ``NonFiniteGuard`` -> [non, finite, guard]."""
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name)
    return [w.lower() for w in spaced.split("_") if w]


def is_guard_name(name: str) -> bool:
    """Whether a function or class name says it guards (see the module docstring)."""
    return any(w in GUARD_WORDS for w in _words(name))


def _called_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""


def _is_guard_statement(node: ast.AST) -> bool:
    """A ``raise``, or a statement whose value is a call of a guard function or of ``warn``."""
    if isinstance(node, ast.Raise):
        return True
    if isinstance(node, (ast.Expr, ast.Return, ast.Assign)) and isinstance(node.value, ast.Call):
        name = _called_name(node.value)
        return name == "warn" or is_guard_name(name)
    return False


def _span(node: ast.AST) -> Iterable[int]:
    return range(node.lineno, node.end_lineno + 1)


def _guard_line_numbers(tree: ast.AST) -> Set[int]:
    """Lines of guards (before keeping only code lines)."""
    lines: Set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and is_guard_name(node.name):
            lines.update(_span(node))
        elif _is_guard_statement(node):
            lines.update(_span(node))
        elif isinstance(node, ast.If) and any(_is_guard_statement(n) for s in node.body for n in ast.walk(s)):
            lines.update(range(node.lineno, node.test.end_lineno + 1))
    return lines


def is_guard_module(path: str, tree: ast.Module) -> bool:
    """Whether a module exists to guard: its file name says so, or its docstring opens with
    "Refusing"."""
    docstring = ast.get_docstring(tree) or ""
    return is_guard_name(pathlib.PurePosixPath(path).stem) or docstring.startswith("Refusing")


def guard_lines(source: str, path: str = "") -> int:
    """Code lines of ``source`` (the file ``path``) that belong to guards and refusals (see
    the module docstring)."""
    return source_size(source, path).guard_lines


@dataclass
class Size:
    """Size of a set of files."""

    files: int = 0
    lines: int = 0
    code_lines: int = 0
    guard_lines: int = 0

    def add(self, other: "Size") -> None:
        self.files += other.files
        self.lines += other.lines
        self.code_lines += other.code_lines
        self.guard_lines += other.guard_lines


def source_size(source: str, path: str = "") -> Size:
    """Size of one file's source (``path``: its file name, for the guard-module rule)."""
    tree = ast.parse(source)
    code = _code_line_numbers(source, tree)
    guards = code if is_guard_module(path, tree) else _guard_line_numbers(tree) & code
    return Size(files=1, lines=len(source.splitlines()), code_lines=len(code), guard_lines=len(guards))


def _show(revision: str, path: str) -> Optional[str]:
    done = subprocess.run(["git", "show", f"{revision}:{path}"], capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


def tree_sources(revision: Optional[str], under: str) -> Dict[str, str]:
    """Path -> source of the ``.py`` files under ``under``, in the work tree (``revision``
    None) or in ``revision``."""
    if revision is None:
        return {str(p): p.read_text() for p in sorted(pathlib.Path(under).rglob("*.py"))}
    listing = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", revision, "--", under], capture_output=True, text=True, check=True
    ).stdout.split()
    return {p: _show(revision, p) or "" for p in listing if p.endswith(".py")}


def _part(path: str, under: str) -> str:
    """The sub-package a file belongs to (``opacus_rc/hf``), or ``under`` for top-level modules."""
    rest = pathlib.PurePosixPath(path).relative_to(under).parts
    return f"{under}/{rest[0]}" if len(rest) > 1 else under


def tree_size(revision: Optional[str], under: str, exclude: Sequence[str] = ()) -> Tuple[Size, Dict[str, Size]]:
    """Total and per-part :class:`Size` of the ``.py`` files under ``under``, leaving out
    the folders in ``exclude``."""
    total, parts = Size(), {}
    for path, source in tree_sources(revision, under).items():
        if any(pathlib.PurePosixPath(path).is_relative_to(e) for e in exclude):
            continue
        size = source_size(source, path)
        total.add(size)
        parts.setdefault(_part(path, under), Size()).add(size)
    return total, dict(sorted(parts.items()))


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


def _row(name: str, size: Size) -> str:
    share = size.guard_lines / size.code_lines if size.code_lines else 0.0
    return (f"{name:<28} {size.files:>5} {size.lines:>8,} {size.code_lines:>8,} "
            f"{size.guard_lines:>8,} {share:>7.1%}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("commits", nargs="*", help="commits whose changes to count (commit-diff mode)")
    parser.add_argument("--tree", nargs="?", const=WORKTREE, metavar="REV",
                        help="size of a tree: the work tree (no REV) or revision REV")
    parser.add_argument("--under", default="opacus_rc")
    parser.add_argument("--exclude", action="append", default=[], metavar="FOLDER",
                        help="(--tree) leave out the files under FOLDER; repeatable")
    parser.add_argument("--json", metavar="PATH", help="(--tree) also write the figures as JSON")
    args = parser.parse_args(argv)
    if args.tree is None and not args.commits:
        parser.error("give COMMIT ... or --tree [REV]")
    if args.tree is not None and args.commits:
        parser.error("COMMIT ... and --tree are separate modes")
    if args.tree is None:
        total = [0, 0]
        for commit in args.commits:
            lines, code = commit_change(commit, args.under)
            total[0] += lines
            total[1] += code
            print(f"{commit}  lines {lines:+d}  code lines {code:+d}")
        print(f"total    lines {total[0]:+d}  code lines {total[1]:+d}")
        return
    revision = None if args.tree == WORKTREE else args.tree
    total, parts = tree_size(revision, args.under, args.exclude)
    label = "work tree" if revision is None else revision
    excluded = f", without {', '.join(args.exclude)}" if args.exclude else ""
    print(f"{args.under} at {label}{excluded}")
    print(f"{'part':<28} {'files':>5} {'lines':>8} {'code':>8} {'guard':>8} {'guard %':>7}")
    for name, size in parts.items():
        print(_row(name, size))
    print(_row("total", total))
    if args.json:
        record = {"revision": label, "under": args.under, "exclude": args.exclude,
                  "total": asdict(total), "parts": {k: asdict(v) for k, v in parts.items()}}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
